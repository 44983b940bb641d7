"""Overload soak: a real `streambatch serve` process under open-loop load at about 3x its
capacity with a bounded queue, then thousands of hostile requests, then a normal call.

Phases: (1) calibrate: closed-loop at the engine's concurrency measures capacity in requests/s;
(2) warm-up: open-loop at the soak rate, then the server's RSS is read; (3) soak: open-loop
Poisson arrivals at `--overload` x capacity for `--duration` s while health is probed every
0.25 s; (4) RSS again; (5) `--fuzz` hostile cases (bench/hostile.py); (6) one normal call.

Every call must end with a complete stream (final message, all requested tokens) or a precise
refusal (RESOURCE_EXHAUSTED / DEADLINE_EXCEEDED); "hung" counts calls still open 30 s past
their own deadline, "lost" calls that ended without an error but without their final message
or with missing tokens. Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc
from streambatch.v1 import generation_pb2_grpc as pb_grpc
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from compare import Server, free_port, grpc_serving, wait_until  # noqa: E402
from hostile import fuzz  # noqa: E402
from load import generate_request, prompts  # noqa: E402

REFUSALS = {"RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    unexpected: Counter[str] = field(default_factory=Counter)
    hung: int = 0
    lost: int = 0
    refusals_without_hint: int = 0


async def one_call(
    stub: pb_grpc.GenerationStub, text: str, max_tokens: int, timeout: float, tally: Tally
) -> None:
    tally.sent += 1
    req = generate_request(text, max_tokens, priority=int(random.random() < 0.2))
    call = stub.Generate(req, timeout=timeout)
    tokens, final = 0, False

    async def consume() -> None:
        nonlocal tokens, final
        async for msg in call:
            tokens += len(msg.token_ids)
            final = final or bool(msg.finish_reason)

    try:
        await asyncio.wait_for(consume(), timeout + 30)
        if final and tokens == max_tokens:
            tally.completed += 1
        else:
            tally.lost += 1
    except asyncio.TimeoutError:
        tally.hung += 1
        call.cancel()
    except grpc.aio.AioRpcError as err:
        name = err.code().name
        if name in REFUSALS:
            tally.rejected[name] += 1
            trailers = dict(err.trailing_metadata() or ())
            if name == "RESOURCE_EXHAUSTED" and "retry-after-ms" not in trailers:
                tally.refusals_without_hint += 1
        else:
            tally.unexpected[name] += 1


async def open_loop(
    target: str, rate: float, duration: float, max_tokens: int, timeout: float, label: str
) -> tuple[Tally, list[int | None]]:
    """Poisson arrivals at `rate`/s for `duration` s; health probed throughout."""
    tally = Tally()
    health: list[int | None] = []
    texts = prompts(int(rate * duration * 2) + 16, seed=int(rate * 1000) + int(duration))
    rng = random.Random(5)
    async with grpc.aio.insecure_channel(target) as ch, grpc.aio.insecure_channel(target) as hch:
        stub = pb_grpc.GenerationStub(ch)
        hstub = health_pb2_grpc.HealthStub(hch)
        stop = asyncio.Event()

        async def probe() -> None:
            while not stop.is_set():
                try:
                    r = await hstub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    health.append(r.status)
                except grpc.aio.AioRpcError:
                    health.append(None)
                await asyncio.sleep(0.25)

        prober = asyncio.create_task(probe())
        calls: list[asyncio.Task[None]] = []
        start = time.monotonic()
        bar = tqdm(total=round(duration), desc=label, unit="s", file=sys.stderr, leave=False)
        i = 0
        next_at = start
        while next_at - start < duration:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            calls.append(
                asyncio.create_task(
                    one_call(stub, texts[i % len(texts)], max_tokens, timeout, tally)
                )
            )
            i += 1
            next_at += rng.expovariate(rate)
            elapsed = min(int(time.monotonic() - start), round(duration))
            if elapsed > bar.n:
                bar.update(elapsed - bar.n)
        bar.close()
        await asyncio.gather(*calls)
        stop.set()
        await prober
    return tally, health


async def capacity(
    target: str, concurrency: int, max_tokens: int, seconds: float, high_streams: int = 0
) -> float:
    """Completed requests per second with `concurrency` closed-loop clients, the first
    `high_streams` of them at priority 1 (so reserved top-priority slots are used too)."""
    texts = prompts(1000, seed=3)
    done = 0
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.GenerationStub(ch)
        end = time.monotonic() + seconds

        async def worker(w: int) -> None:
            nonlocal done
            k = w
            while time.monotonic() < end:
                req = generate_request(texts[k % 1000], max_tokens, int(w < high_streams))
                async for _ in stub.Generate(req):
                    pass
                done += 1
                k += concurrency

        start = time.monotonic()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        return done / (time.monotonic() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=60.0, help="soak seconds")
    parser.add_argument("--warmup", type=float, default=15.0, help="warm-up seconds")
    parser.add_argument("--overload", type=float, default=3.0, help="arrival rate / capacity")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--timeout", type=float, default=30.0, help="each call's gRPC deadline")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--queue-capacity", type=int, default=32)
    parser.add_argument("--fuzz", type=int, default=2000, help="hostile cases after the soak")
    parser.add_argument("--log", type=Path, default=HERE / "results" / "soak-server.log")
    args = parser.parse_args()

    port = free_port()
    target = f"127.0.0.1:{port}"
    args.log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pyserver.cli", "serve", "--port", str(port),
        "--max-num-seqs", str(args.max_num_seqs), "--queue-capacity", str(args.queue_capacity),
        "--metrics-port", "-1", "--log-level", "WARNING",
    ]  # fmt: skip
    server = Server(cmd, args.log)
    try:
        wait_until(lambda: grpc_serving(target), server.proc, "streambatch")
        proc = psutil.Process(server.proc.pid)
        cap = asyncio.run(capacity(target, args.max_num_seqs, args.max_tokens, 15.0))
        rate = cap * args.overload
        print(f"capacity {cap:.2f} req/s; soaking at {rate:.2f} req/s", file=sys.stderr)
        asyncio.run(open_loop(target, rate, args.warmup, args.max_tokens, args.timeout, "warm-up"))
        rss_warm = proc.memory_info().rss
        tally, health = asyncio.run(
            open_loop(target, rate, args.duration, args.max_tokens, args.timeout, "soak")
        )
        rss_after = proc.memory_info().rss
        with grpc.insecure_channel(target) as ch:
            report = fuzz(ch, args.fuzz)
            after = pb_grpc.GenerationStub(ch).Complete(generate_request("Say hi.", 4), timeout=60)
        served_after = after.usage.completion_tokens == 4
        alive = server.proc.poll() is None
    finally:
        server.stop()
    not_serving = sum(1 for h in health if h != health_pb2.HealthCheckResponse.SERVING)
    result = {
        "capacity_req_s": round(cap, 3),
        "rate_req_s": round(rate, 3),
        "duration_s": args.duration,
        "sent": tally.sent,
        "completed": tally.completed,
        "rejected": dict(tally.rejected),
        "unexpected": dict(tally.unexpected),
        "refusals_without_retry_hint": tally.refusals_without_hint,
        "hung": tally.hung,
        "lost": tally.lost,
        "health_probes": len(health),
        "health_not_serving": not_serving,
        "rss_warm_mib": round(rss_warm / 2**20, 1),
        "rss_after_mib": round(rss_after / 2**20, 1),
        "rss_growth_pct": round((rss_after - rss_warm) / rss_warm * 100, 2),
        "fuzz_seed": report.seed,
        "fuzz_cases": report.cases,
        "fuzz_codes": dict(report.codes),
        "fuzz_internal_errors": report.internal_errors,
        "served_after": served_after and alive,
    }
    if report.bad:
        print(
            f"fuzz failures (first 5; seed {report.seed}, {args.fuzz} examples): {report.bad[:5]}",
            file=sys.stderr,
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
