"""bench/compare.py's report: medians per level and streambatch ÷ target paired by round."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import compare
from compare import (
    aggregate,
    conversations,
    prefix_hit_pct,
    prompt_counters,
    summarize,
    sweep_tables,
)
from load import Report, Sample, TokenClock, closed_loop


def run(round_: int, tok_s: float, ttft_p99_ms: float = 100.0) -> dict[str, Any]:
    return {
        "round": round_,
        "output_tok_s": tok_s,
        "ttft_p99_ms": ttft_p99_ms,
        "output_tokens": 6400,
        "errors": {},
    }


def test_ratios_pair_the_rounds_both_ran_even_when_a_peer_failed_one() -> None:
    raw = {
        "streambatch": {
            "32": [run(0, 100.0), run(1, 110.0), run(2, 120.0)],
            "4": [run(0, 40.0), run(1, 44.0), run(2, 42.0)],
        },
        # Round 0 failed at start: a headline error entry and no sweep levels for that round.
        "vllm_openai": {
            "32": [{"round": 0, "error": "RuntimeError: boom"}, run(1, 100.0), run(2, 100.0)],
            "4": [run(1, 40.0), run(2, 40.0)],
        },
        "offline": {"32": [run(0, 150.0)]},
    }
    targets, sweep = summarize(raw, "32", {"vllm_openai": {"argv": ["x"]}})
    head = targets["vllm_openai"]
    assert head["rounds"] == 2 and head["output_tok_s"] == 100.0
    assert head["errors"] == {"RuntimeError: boom": 1}
    assert head["streambatch_ratio"] == pytest.approx(1.15)
    assert (head["streambatch_ratio_min"], head["streambatch_ratio_max"]) == (1.1, 1.2)
    assert head["streambatch_ratio_pairs"] == 2
    assert head["setup"] == {"argv": ["x"]}
    assert head["per_round_output_tokens"] == [None, 6400, 6400]
    # Rounds 1 and 2 paired (44/40, 42/40); by position it would be 40/40 and 44/40.
    level4 = sweep["vllm_openai"]["4"]
    assert level4["streambatch_ratio"] == pytest.approx((1.1 + 1.05) / 2)
    assert "setup" not in sweep["vllm_openai"]["32"]  # the headline's extras stay off the sweep
    assert "offline" in targets and "offline" not in sweep  # one level: no sweep line
    assert targets["offline"]["streambatch_ratio"] == 0.667  # round 0 only (rounded)


def test_the_sweep_tables_show_medians_with_their_round_count_and_the_ratio_spread() -> None:
    raw = {
        "streambatch": {"1": [run(0, 40.0), run(1, 42.0)], "4": [run(0, 120.0), run(1, 130.0)]},
        "vllm_grpc": {"1": [run(0, 35.0), run(1, 35.0)], "4": [run(0, 120.0), run(1, 100.0)]},
    }
    _, sweep = summarize(raw, "4", {})
    text = "\n".join(sweep_tables(sweep))
    assert "| streambatch | 41.0 / 100.0 (2) | 125.0 / 100.0 (2) |" in text
    assert "| vllm_grpc | 1.17 (1.14-1.20) | 1.15 (1.00-1.30) |" in text


def test_the_later_calls_tail_leaves_out_the_closed_loops_first_burst() -> None:
    # Two calls sent at once (the burst) wait long; the first ends at 9 s; the four sent from
    # then on as slots free do not wait.
    burst = [Sample(9.0, 10.0, 4, [], sent_s=0.0), Sample(8.0, 9.0, 4, [], sent_s=0.001)]
    later = [Sample(1.0 + i / 10, 2.0, 4, [], sent_s=9.0 + i) for i in range(4)]
    report = Report(samples=[*later, *burst], wall_s=20.0, first_done_s=9.0)
    summary = report.summary()
    assert summary["ttft_p99_ms"] > 8000
    assert 1000 < summary["ttft_p99_after_first_wave_ms"] < 1400  # type: ignore[operator]
    # A report that never marked its first wave's end has no later calls to tell apart.
    assert Report(samples=later, wall_s=20.0).summary()["ttft_p99_after_first_wave_ms"] is None


def test_the_closed_loop_marks_its_first_wave_even_when_a_call_fails() -> None:
    async def send(n: int) -> Sample:
        clock = TokenClock()
        if n == 0:  # a call of the first wave fails first: its end ends the wave
            await asyncio.sleep(0.01)
            raise RuntimeError("refused")
        await asyncio.sleep(0.4 if n < 3 else 0.2)  # the first wave waits longest
        clock.add(1)
        return clock.sample()

    report = asyncio.run(closed_loop(send, list(range(9)), 3, 0))
    assert report.errors == {"RuntimeError": 1} and len(report.samples) == 8
    start = min(s.sent_s for s in report.samples)
    assert 0 < report.first_done_s - start < 0.15  # the failure's end, not a success's
    summary = report.summary()
    assert summary["ttft_p99_after_first_wave_ms"] < 300  # type: ignore[operator]
    assert summary["ttft_p99_ms"] > 350  # type: ignore[operator]


def test_the_vllm_peers_get_the_preload_and_their_default_rows_do_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import compare

    monkeypatch.setattr(compare, "cpu_list", lambda: "0-1")
    names = "streambatch,vllm_openai,vllm_grpc,vllm_openai_autobind,vllm_grpc_autobind,offline"
    args = argparse.Namespace(targets=names, peer_preload="/x/libtcmalloc.so:/x/libiomp5.so")
    env = {s.name: s.env for s in compare.target_specs(args)}
    for peer in ("vllm_openai", "vllm_grpc", "offline"):
        assert env[peer]["LD_PRELOAD"] == "/x/libtcmalloc.so:/x/libiomp5.so"
        assert env[peer]["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert "LD_PRELOAD" not in env["streambatch"]
    assert "LD_PRELOAD" not in env["vllm_openai_autobind"]
    assert "LD_PRELOAD" not in env["vllm_grpc_autobind"]
    # What the bench's own shell had preloaded reaches no target unless a spec gives it.
    monkeypatch.setenv("LD_PRELOAD", "/elsewhere/libjemalloc.so")
    monkeypatch.setenv("KMP_BLOCKTIME", "200")
    assert "LD_PRELOAD" not in compare.peer_env()
    assert "KMP_BLOCKTIME" not in compare.peer_env()


def test_the_preload_names_what_it_could_not_find(monkeypatch: pytest.MonkeyPatch) -> None:
    import harness

    monkeypatch.setattr(harness, "_find_library", lambda name: None)
    preload, missing = harness.vllm_cpu_preload()
    assert preload == ""
    assert any("libtcmalloc-minimal4" in m for m in missing)
    assert any("intel-openmp" in m for m in missing)
    monkeypatch.setattr(harness, "_find_library", lambda name: f"/lib/lib{name}.so")
    assert harness.vllm_cpu_preload() == ("/lib/libtcmalloc_minimal.so:/lib/libiomp5.so", [])


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("auto", "/found/libtcmalloc.so"),
        ("none", ""),
        ("/mine/libjemalloc.so", "/mine/libjemalloc.so"),
    ],
)
def test_peer_preload_resolves_auto_none_or_a_given_value(
    monkeypatch: pytest.MonkeyPatch, given: str, expected: str
) -> None:
    import compare
    import harness

    monkeypatch.setattr(harness, "vllm_cpu_preload", lambda: ("/found/libtcmalloc.so", []))
    args = compare.parser().parse_args(["--model", "m", "--dtype", "float32"])
    args.peer_preload = given
    assert compare.resolve(args).peer_preload == expected


def test_the_closed_loop_sends_a_conversations_turns_in_order_each_after_the_last_ended() -> None:
    # Calls are (conversation, turn); turn > 0 continues the call before it.
    calls = [(c, t) for c in range(4) for t in range(3)]
    events: list[tuple[str, tuple[int, int], float]] = []
    loop_time = time.perf_counter

    async def send(call: tuple[int, int]) -> Sample:
        events.append(("start", call, loop_time()))
        # Openings take longer than follow-ups, so the report cannot mix them up unnoticed.
        await asyncio.sleep((0.05 if call[0] % 2 else 0.02) + (0.03 if call[1] == 0 else 0.0))
        events.append(("end", call, loop_time()))
        clock = TokenClock()
        clock.add(1)
        return clock.sample()

    report = asyncio.run(closed_loop(send, calls, 2, 0, continues=lambda call: call[1] > 0))
    assert len(report.samples) == 12 and not report.errors
    assert sorted(s.turn for s in report.samples) == [0] * 4 + [1] * 4 + [2] * 4
    assert len(report.conversations_s) == 4  # one span per conversation
    summary = report.summary()
    openings = [s.ttft_s for s in report.samples if s.turn == 0]
    assert summary["ttft_openings_p50_p90_p99_ms"][2] == round(  # type: ignore[index]
        float(np.percentile(openings, 99)) * 1e3, 1
    )
    assert summary["conversation_p50_p90_p99_ms"]
    # Single calls are no conversations: no such fields in their report.
    single = asyncio.run(closed_loop(send, calls, 2, 0, continues=lambda call: False))
    assert not single.conversations_s and "ttft_openings_p50_p90_p99_ms" not in single.summary()
    assert min(report.conversations_s) >= 3 * 0.02  # three turns one after another
    for c in range(4):
        for t in (1, 2):
            ended = next(at for e, call, at in events if e == "end" and call == (c, t - 1))
            started = next(at for e, call, at in events if e == "start" and call == (c, t))
            assert started >= ended  # a turn goes out only after the one before it came back
    # Two callers: never more than two calls in flight, so conversations 2 and 3 wait for
    # 0 and 1 to finish all their turns.
    in_flight = peak = 0
    for e, _, _ in sorted(events, key=lambda ev: ev[2]):
        in_flight += 1 if e == "start" else -1
        peak = max(peak, in_flight)
    assert peak == 2
    first_of_2 = next(at for e, call, at in events if e == "start" and call == (2, 0))
    assert first_of_2 >= next(at for e, call, at in events if e == "end" and call == (0, 2))


class _WordTokenizer:
    """A stand-in for the model's tokenizer: one id per word, a template that joins turns."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [len(w) for w in text.split()]}

    def apply_chat_template(self, msgs: list[dict[str, str]], **_: object) -> str:
        return " ".join(f"<{m['role']}> {m['content']}" for m in msgs) + " <assistant>"


def test_the_conversations_workload_is_whole_chats_each_turn_extending_the_last() -> None:
    args = argparse.Namespace(
        seed=3, warmup=2, requests=30, turns=3, paste_words=40, reply_words=60, max_model_len=260
    )
    w = conversations(args, _WordTokenizer())
    items = w.headline
    assert not w.sweep and len(items) == 2 + 30
    assert not any(i.continues for i in items[:3])  # two one-turn warm-ups, then an opening
    chats = [items[k : k + 3] for k in range(2, len(items), 3)]
    assert len(chats) == 10
    for chat in chats:
        assert [i.continues for i in chat] == [False, True, True]
        for before, after in itertools.pairwise(chat):
            assert after.text.startswith(before.text.removesuffix(" <assistant>"))
            assert len(after.ids) > len(before.ids)
    # A chat whose last turn would not leave room for its answer was drawn again.
    assert max(len(i.ids) for i in items) <= args.max_model_len - 65
    with pytest.raises(SystemExit, match="multiple of --turns"):
        conversations(argparse.Namespace(**{**vars(args), "requests": 31}), _WordTokenizer())


def test_a_multi_turn_runs_percentile_lists_are_medians_per_position_over_rounds() -> None:
    rounds = [
        {**run(0, 100.0), "ttft_openings_p50_p90_p99_ms": [1.0, 5.0, 9.0]},
        {**run(1, 110.0), "ttft_openings_p50_p90_p99_ms": [3.0, 4.0, 20.0]},
        {**run(2, 120.0), "ttft_openings_p50_p90_p99_ms": [2.0, 6.0, 10.0]},
    ]
    assert aggregate(rounds)["ttft_openings_p50_p90_p99_ms"] == [2.0, 5.0, 10.0]
    assert "conversation_p50_p90_p99_ms" not in aggregate(rounds)  # single-turn runs: absent


_EXPOSITION = {
    "streambatch": (
        "# TYPE streambatch_prompt_tokens counter\n"
        "streambatch_prompt_tokens_total 4000.0\n"
        "# TYPE streambatch_prompt_tokens_cached counter\n"
        "streambatch_prompt_tokens_cached_total 1000.0\n"
        "# TYPE streambatch_generated_tokens counter\n"
        "streambatch_generated_tokens_total 640.0\n"
    ),
    # vLLM labels each counter per engine: the engines' samples are summed.
    "vllm": (
        "# TYPE vllm:prompt_tokens counter\n"
        'vllm:prompt_tokens_total{engine="0",model_name="m"} 3000.0\n'
        'vllm:prompt_tokens_total{engine="1",model_name="m"} 1000.0\n'
        "# TYPE vllm:prompt_tokens_cached counter\n"
        'vllm:prompt_tokens_cached_total{engine="0",model_name="m"} 500.0\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 9999.0\n'
    ),
    "neither": "# TYPE other counter\nother_total 1.0\n",
}


@pytest.mark.parametrize(
    ("server", "expected"),
    [
        ("streambatch", {"prompt": 4000.0, "cached": 1000.0}),
        ("vllm", {"prompt": 4000.0, "cached": 500.0}),
        ("neither", None),
    ],
)
def test_the_prompt_counters_read_both_servers_names_for_the_same_two_counts(
    monkeypatch: pytest.MonkeyPatch, server: str, expected: dict[str, float] | None
) -> None:
    class Response:
        text = _EXPOSITION[server]

    monkeypatch.setattr(compare.httpx, "get", lambda url, timeout: Response())
    assert prompt_counters("http://127.0.0.1:1/metrics") == expected
    assert prompt_counters(None) is None


def test_the_hit_rate_is_the_levels_share_of_cached_prompt_tokens() -> None:
    before = {"prompt": 1000.0, "cached": 100.0}
    assert prefix_hit_pct(before, {"prompt": 5000.0, "cached": 1100.0}) == 25.0
    # Nothing sent, or a counter missing on either side: no figure rather than a made-up one.
    assert prefix_hit_pct(before, before) is None
    assert prefix_hit_pct(None, before) is None
    assert prefix_hit_pct(before, None) is None
    assert prefix_hit_pct(before, {"prompt": 5000.0, "cached": 50.0}) is None  # a restart
