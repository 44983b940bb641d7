"""Where a streambatch call's time to first token goes, call by call: the client's TTFT against
the server's own account (Timings on the last message: queue_ms = accepted -> handed to the
engine, ttft_ms = accepted -> first token), under `make bench`'s closed loop and prompts.

    .venv/bin/python bench/ttft_split.py --workload shared_prefix --concurrency 16

Prints one line per call (send time, client TTFT, server TTFT, queue time, cached prompt
tokens) and, last, one JSON object with the percentiles. Extra `streambatch serve` flags go
after `--`. Used to explain the shared_prefix TTFT tail in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from streambatch.v1 import generation_pb2_grpc as pb_grpc
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare
from load import generate_request


async def run(
    target: str, items: list[compare.Item], concurrency: int, warmup: int
) -> list[dict[str, float]]:
    rows: list[dict[str, float]] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def send(item: compare.Item, record: bool = True) -> None:
            req = generate_request(item.text, item.max_tokens, chat=False)
            req.sampling.ignore_eos = item.ignore_eos
            sent, first, last = time.perf_counter(), 0.0, None
            async for msg in stub.Generate(req, timeout=600):
                if not first and msg.token_ids:
                    first = time.perf_counter()
                last = msg
            if record and last is not None:
                rows.append({
                    "sent_s": sent,
                    "ttft_ms": (first - sent) * 1e3,
                    "server_ttft_ms": last.timings.ttft_ms,
                    "queue_ms": last.timings.queue_ms,
                    "cached_tokens": last.usage.cached_prompt_tokens,
                })  # fmt: skip

        for item in items[:warmup]:
            await send(item, record=False)
        pending = list(reversed(items[warmup:]))

        async def worker() -> None:
            while pending:
                await send(pending.pop())

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workload", default="shared_prefix", choices=compare.WORKLOADS)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--waves", type=int, default=4, help="measured calls = waves x concurrency")
    p.add_argument("serve_flags", nargs="*", help="extra `streambatch serve` flags (after --)")
    opts = p.parse_args()
    # The bench's own defaults (engine arguments, workloads), at this one level.
    args = compare.resolve(
        compare.parser().parse_args(
            ["--concurrency", str(opts.concurrency), "--sweep", str(opts.concurrency),
             "--requests", str(opts.waves * opts.concurrency), "--workloads", opts.workload]
        )
    )  # fmt: skip
    args.prefix_caching = True  # as every make bench target runs
    tok = AutoTokenizer.from_pretrained(args.model)
    items = compare.build_workloads(args, tok)[opts.workload].headline
    extra = ["--kv-cache-gib", str(args.kv_cache_gib), *opts.serve_flags]
    server, target = compare.start_streambatch(args, "ttft_split.log", extra)
    try:
        rows = asyncio.run(run(target, items, opts.concurrency, args.warmup))
    finally:
        server.stop()
    t0 = min(r["sent_s"] for r in rows)
    for r in sorted(rows, key=lambda r: r["sent_s"]):
        print(
            f"{(r['sent_s'] - t0) * 1e3:8.0f} ms  client TTFT {r['ttft_ms']:7.0f}  "
            f"server TTFT {r['server_ttft_ms']:7.0f}  queued {r['queue_ms']:6.0f}  "
            f"cached {r['cached_tokens']:.0f}"
        )

    def pct(key: str) -> list[float]:
        return [round(float(v), 1) for v in np.percentile([r[key] for r in rows], [50, 90, 99])]

    summary: dict[str, Any] = {
        "workload": opts.workload,
        "concurrency": opts.concurrency,
        "calls": len(rows),
        "client_ttft_ms_p50_p90_p99": pct("ttft_ms"),
        "server_ttft_ms_p50_p90_p99": pct("server_ttft_ms"),
        "queue_ms_p50_p90_p99": pct("queue_ms"),
        "serve_flags": opts.serve_flags,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
