"""What batch formation in the queue buys on a continuous-batching engine, measured.

The C++ queue can hold arrivals to form batches: a batch window (hold the first arrival this
long), a max wait (release when the oldest has waited this long; the seed's 50 ms) and prompt
length buckets (admit similar lengths together). The seed designed these for a static-batching
engine, where a batch runs to completion and padding costs compute. vLLM batches per iteration
with paged attention and chunked prefill: there is no padding and a request can join at any
step. This benchmark runs the same open-loop workload (Poisson arrivals at `--load` x the
measured capacity, prompts of 8-120 words, fixed output length) against one fresh server per
configuration and reports throughput, TTFT and ITL for each.

  python bench/batching.py [--duration 40] [--load 0.9]

Writes bench/results/batching.json; last stdout line: one JSON object {"configs": {...}}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from compare import Server, free_port, grpc_serving, wait_until  # noqa: E402
from priority import Call, open_loop  # noqa: E402
from soak import capacity  # noqa: E402

RESULTS = HERE / "results"

CONFIGS: dict[str, list[str]] = {
    "release on arrival": [],
    "window 20 ms": ["--batch-window-ms", "20"],
    # The seed's rule: gather until the batch is full or the oldest has waited 50 ms.
    "max wait 50 ms (seed)": ["--batch-window-ms", "1000", "--max-wait-ms", "50"],
    "length buckets 48/96/192": ["--bucket-bounds", "48,96,192"],
}


def pct_ms(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)) * 1e3, 1) if values else float("nan")


def summarize(calls: list[Call], wall_s: float) -> dict[str, object]:
    done = [c for c in calls if c.code == "OK"]
    gaps = [g for c in done for g in c.gaps_s]
    ttft = [c.ttft_s for c in done]
    return {
        "sent": len(calls),
        "ok": len(done),
        "output_tok_s": round(sum(c.tokens for c in done) / wall_s, 1),
        "ttft_p50_ms": pct_ms(ttft, 50),
        "ttft_p99_ms": pct_ms(ttft, 99),
        "itl_p50_ms": pct_ms(gaps, 50),
        "itl_p99_ms": pct_ms(gaps, 99),
    }


def serve(args: argparse.Namespace, extra: list[str], log: str) -> tuple[Server, str]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "pyserver.cli", "serve", "--port", str(port),
        "--max-num-seqs", str(args.max_num_seqs), "--queue-capacity", "1024",
        "--max-num-batched-tokens", str(args.step_tokens),
        "--metrics-port", "-1", "--log-level", "WARNING", *extra,
    ]  # fmt: skip
    server = Server(cmd, RESULTS / log)
    target = f"127.0.0.1:{port}"
    wait_until(lambda: grpc_serving(target), server.proc, "streambatch")
    return server, target


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--load", type=float, default=0.9, help="arrival rate / capacity")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--step-tokens", type=int, default=256)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    args = parser.parse_args()
    # open_loop's knobs: every call normal priority, a deadline no run comes near.
    args.high_share, args.deadline_s = 0.0, 120.0
    RESULTS.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, object]] = {}
    for i, name in enumerate(args.configs.split(",")):
        server, target = serve(args, CONFIGS[name], f"batching-{i}.log")
        try:
            if i == 0:
                cap = asyncio.run(capacity(target, args.max_num_seqs, args.max_tokens, 15.0))
                args.rate = cap * args.load
                print(f"capacity {cap:.2f} req/s; arrivals at {args.rate:.2f}/s", file=sys.stderr)
            calls, wall = asyncio.run(open_loop(target, args, name, seed=7))
        finally:
            server.stop()
        results[name] = {"flags": " ".join(CONFIGS[name]), **summarize(calls, wall)}
        print(f"{name}: {json.dumps(results[name])}", file=sys.stderr, flush=True)
    (RESULTS / "batching.json").write_text(
        json.dumps({"rate_req_s": args.rate, "configs": results}, indent=2)
    )
    print(json.dumps({"rate_req_s": round(args.rate, 3), "configs": results}))


if __name__ == "__main__":
    main()
