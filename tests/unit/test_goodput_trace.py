"""bench/goodput.py's trace: the same calls at every rate, so loads and runs whose measured
capacity differs send the same prompts, deadlines, lengths and priorities."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from goodput import build_trace


class WordTokenizer:
    """One token per word: enough for the trace's length arithmetic."""

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> str:
        return f"<user> {messages[0]['content']} <assistant>"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return text.split()

    def decode(self, ids: list[str]) -> str:
        return " ".join(ids)


def trace_args() -> argparse.Namespace:
    return argparse.Namespace(
        tokenizer=WordTokenizer(),
        burst_share=0.1,
        burst_size=5,
        high_share=0.2,
        no_deadline_share=0.15,
        max_model_len=2048,
    )


def test_the_ith_call_is_the_same_at_every_rate() -> None:
    args = trace_args()
    slow = build_trace(4, 4.41, 30.0, args)
    fast = build_trace(4, 4.58 * 2, 30.0, args)
    assert 100 < len(slow) < len(fast)
    for a, b in zip(slow, fast[: len(slow)], strict=True):
        assert (a.prompt, a.max_tokens, a.deadline_s) == (b.prompt, b.max_tokens, b.deadline_s)
    # Priorities agree except where one rate made the call part of a burst (always high).
    differing = [
        i
        for i, (a, b) in enumerate(zip(slow, fast[: len(slow)], strict=True))
        if a.priority != b.priority
    ]
    assert len(differing) < len(slow) // 4
    assert all(slow[i].priority != fast[i].priority for i in differing)
    assert all(1 in (slow[i].priority, fast[i].priority) for i in differing)


def test_the_trace_still_varies_with_the_seed_and_keeps_its_mix() -> None:
    args = trace_args()
    calls = build_trace(5, 8.8, 30.0, args)
    assert [c.prompt for c in calls] != [c.prompt for c in build_trace(4, 8.8, 30.0, args)]
    high = sum(c.priority for c in calls) / len(calls)
    no_deadline = sum(c.deadline_s is None for c in calls) / len(calls)
    assert 0.15 < high < 0.45, high  # 20 % drawn plus the bursts
    assert 0.05 < no_deadline < 0.3, no_deadline
    assert all(16 <= c.max_tokens <= 512 for c in calls)
    assert all(c.at_s < 30.0 for c in calls)
