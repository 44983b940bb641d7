"""bench/goodput.py's trace: the same calls at every rate, so loads and runs whose measured
capacity differs send the same prompts, deadlines, lengths and priorities; and the helpers
around it (the control's priorities, the occupancy sampler)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from goodput import OccupancySampler, Target, build_trace, vllm_priority


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
    for seed in (4, 5, 11):
        slow = build_trace(seed, 4.41, 30.0, args)
        fast = build_trace(seed, 4.58 * 2, 30.0, args)
        assert 100 < len(slow) < len(fast)
        for a, b in zip(slow, fast[: len(slow)], strict=True):
            assert (a.priority, a.prompt, a.max_tokens, a.deadline_s) == (
                b.priority,
                b.prompt,
                b.max_tokens,
                b.deadline_s,
            )
            # The same place in the sequence, compressed by the rate (bursts 10 ms apart).
            assert abs(a.at_s * 4.41 - b.at_s * 9.16) < 0.05 * 9.16


def test_the_trace_still_varies_with_the_seed_and_keeps_its_mix() -> None:
    args = trace_args()
    calls = build_trace(5, 8.8, 30.0, args)
    assert [c.prompt for c in calls] != [c.prompt for c in build_trace(4, 8.8, 30.0, args)]
    assert 8.8 * 30 * 0.7 < len(calls) < 8.8 * 30 * 1.3
    high = sum(c.priority for c in calls) / len(calls)
    no_deadline = sum(c.deadline_s is None for c in calls) / len(calls)
    assert 0.15 < high < 0.45, high  # 20 % drawn plus the bursts
    assert 0.05 < no_deadline < 0.3, no_deadline
    assert all(16 <= c.max_tokens <= 512 for c in calls)
    assert [c.at_s for c in calls] == sorted(c.at_s for c in calls)
    # A burst that starts just before the end runs past it by its 10 ms spacing at most.
    assert calls[-1].at_s < 30.0 + 0.01 * (args.burst_size - 1) + 1e-9


def test_the_newest_first_control_orders_vllm_by_class_then_newest() -> None:
    calls = build_trace(4, 3.0, 60.0, trace_args())
    assert {c.priority for c in calls} == {0, 1}
    # vLLM runs the lowest value first (ties in arrival order).
    plain = sorted(calls, key=lambda c: (vllm_priority(c, newest_first=False), c.index))
    assert [c.index for c in plain] == [c.index for c in calls if c.priority] + [
        c.index for c in calls if not c.priority
    ]
    newest = sorted(calls, key=lambda c: vllm_priority(c, newest_first=True))
    assert [c.index for c in newest] == [c.index for c in reversed(calls) if c.priority] + [
        c.index for c in reversed(calls) if not c.priority
    ]
    assert min(vllm_priority(c, newest_first=True) for c in calls) >= 0


class AlternatingTarget:
    """Full with calls waiting, then a third full with none, in turn."""

    def __init__(self) -> None:
        self.reads = 0

    def occupancy(self) -> tuple[float, float]:
        self.reads += 1
        return (32.0, 7.0) if self.reads % 2 else (10.0, 0.0)


def test_the_occupancy_sampler_reports_fullness_while_calls_wait() -> None:
    target = AlternatingTarget()
    sampler = OccupancySampler(target, window_s=0.2, interval_s=0.01)  # type: ignore[arg-type]
    sampler.start()
    got = sampler.result()
    assert got["samples"] == target.reads >= 4 and got["errors"] == 0
    assert got["series"][:2] == [[32, 7], [10, 0]]
    # Only the samples with calls waiting count for the engine's fullness under the load.
    assert got["running_mean_while_waiting"] == 32.0
    assert got["running_mean"] is not None and 10.0 < got["running_mean"] < 32.0
    assert got["waiting_mean"] is not None and 0.0 < got["waiting_mean"] < 7.0


_STREAMBATCH_METRICS = """# TYPE streambatch_running_requests gauge
streambatch_running_requests 31.0
# TYPE streambatch_waiting_requests gauge
streambatch_waiting_requests 5.0
# TYPE streambatch_generated_tokens_total counter
streambatch_generated_tokens_total 900.0
"""

_VLLM_METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 30.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 12.0
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 12.0
"""


def test_occupancy_reads_each_servers_own_gauges(monkeypatch: Any) -> None:
    """Running from the running gauge, waiting from the waiting one, nothing counted twice."""
    for text, want in ((_STREAMBATCH_METRICS, (31.0, 5.0)), (_VLLM_METRICS, (30.0, 12.0))):
        target = Target.__new__(Target)
        monkeypatch.setattr(target, "_metrics", lambda text=text: metric_families_of(text))
        assert target.occupancy() == want


def metric_families_of(text: str) -> Any:
    from prometheus_client.parser import text_string_to_metric_families

    return text_string_to_metric_families(text)
