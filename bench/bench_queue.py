"""Queue benchmark: the C++ core through its bindings against the pure-Python reference.

One op is a push plus its share of a batched pop. Last stdout line: one JSON object with
ops_per_s, python_ref_ops_per_s, ratio and pop_p99_us_at_10k.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

# numpy is here only for percentiles; its BLAS worker threads would compete for the two cores.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from queue_ref import ReferenceQueue

from pyserver.batching import BatchQueue, ManualClock, make_config

BUCKETS = [64, 256, 1024]
LEVELS = 2
BATCH = 64


def workload(n: int, seed: int) -> list[tuple[int, int, int, int]]:
    rng = random.Random(seed)
    return [
        (i, rng.randint(1, 2000), rng.randint(1, 256), int(rng.random() < 0.2)) for i in range(n)
    ]


def run_core(reqs: list[tuple[int, int, int, int]]) -> float:
    q = BatchQueue(
        make_config(
            priority_levels=LEVELS,
            capacity=len(reqs),
            bucket_bounds=BUCKETS,
            max_wait_s=0,
            release_on_urgent=False,
        )
    )
    push, pop = q.push, q.pop_batch
    start = time.perf_counter()
    for i, (rid, prompt, new, prio) in enumerate(reqs):
        push(rid, prompt, new, prio)
        if i % BATCH == BATCH - 1:
            pop(BATCH, 1 << 30)
    while len(pop(BATCH, 1 << 30).admitted):
        pass
    return len(reqs) / (time.perf_counter() - start)


def run_reference(reqs: list[tuple[int, int, int, int]]) -> float:
    q = ReferenceQueue(LEVELS, BUCKETS)
    start = time.perf_counter()
    for i, (rid, prompt, new, prio) in enumerate(reqs):
        q.push(rid, prompt, new, prio, 0)
        if i % BATCH == BATCH - 1:
            q.pop_batch(BATCH, 1 << 30, 0)
    while q.pop_batch(BATCH, 1 << 30, 0):
        pass
    return len(reqs) / (time.perf_counter() - start)


def pop_latency_at(depth: int, rounds: int, seed: int) -> float:
    """p99 microseconds of one pop_batch(64) with `depth` requests queued (kept topped up)."""
    q = BatchQueue(
        make_config(
            priority_levels=LEVELS,
            capacity=depth + BATCH,
            bucket_bounds=BUCKETS,
            max_wait_s=0,
            release_on_urgent=False,
        ),
        ManualClock(),
    )
    reqs = workload(depth + rounds * BATCH, seed)
    for rid, prompt, new, prio in reqs[:depth]:
        q.push(rid, prompt, new, prio)
    samples = np.empty(rounds)
    nxt = depth
    for r in range(rounds):
        t0 = time.perf_counter_ns()
        got = q.pop_batch(BATCH, 1 << 30)
        samples[r] = (time.perf_counter_ns() - t0) / 1e3
        for rid, prompt, new, prio in reqs[nxt : nxt + len(got.admitted)]:
            q.push(rid, prompt, new, prio)
        nxt += len(got.admitted)
    return float(np.percentile(samples, 99))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5, help="median of this many runs")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--latency-rounds", type=int, default=3, help="p99 is the median of this many rounds"
    )
    args = parser.parse_args()
    reqs = workload(args.requests, args.seed)
    core, ref = [], []
    for r in range(args.repeats):
        core.append(run_core(reqs))
        ref.append(run_reference(reqs))
        print(
            f"run {r + 1}/{args.repeats}: core {core[-1]:,.0f} ops/s, "
            f"reference {ref[-1]:,.0f} ops/s",
            file=sys.stderr,
            flush=True,
        )
    gc.collect()
    gc.disable()  # a collector pause inside one timed pop is Python's latency, not the queue's
    try:
        p99s = [pop_latency_at(10_000, 5_000, args.seed + r) for r in range(args.latency_rounds)]
    finally:
        gc.enable()
    print(f"pop p99 per round (us): {[round(p, 2) for p in p99s]}", file=sys.stderr)
    p99 = float(np.median(p99s))
    core_ops, ref_ops = float(np.median(core)), float(np.median(ref))
    # Each run times the core and the reference back to back, so the ratio is paired per run.
    ratio = float(np.median([c / r for c, r in zip(core, ref, strict=True)]))
    print(
        json.dumps(
            {
                "ops_per_s": round(core_ops),
                "python_ref_ops_per_s": round(ref_ops),
                "ratio": round(ratio, 2),
                "pop_p99_us_at_10k": round(p99, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
