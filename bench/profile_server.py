"""Profile a running streambatch server at a given load with py-spy, and say where the time goes.

Starts `streambatch serve` (same engine arguments as `make bench`), warms it up, attaches
`py-spy record --nonblocking` to it for the measured part of a closed-loop run, and prints per
concurrency level: output tokens/s, TTFT/ITL p50, and the share of sampled CPU time per thread and
per function (self time, and inclusive time of the functions that matter for serving overhead).
Raw collapsed stacks go to bench/results/profile-c{N}.txt (flamegraph.pl or speedscope read them).

  python bench/profile_server.py --concurrency 4,32 [--server-arg=--engine-process=separate]

Last stdout line: one JSON object {"levels": {N: {...}}}.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
from streambatch.v1 import generation_pb2_grpc as pb_grpc

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from compare import RESULTS, start_streambatch, templated  # noqa: E402
from load import Sample, closed_loop, generate_request, one, prompts  # noqa: E402

# Inclusive shares reported for these frames (function name as py-spy prints it, file suffix).
WATCH = {
    "engine.step": ("step", "v1/engine/llm_engine.py"),
    "scheduler.schedule": ("schedule", "core/sched/scheduler.py"),
    "execute_model (runner)": ("execute_model", "gpu_model_runner.py"),
    "model forward": ("_model_forward", "gpu_model_runner.py"),
    "sampling": ("sample_tokens", "gpu_model_runner.py"),
    "update_from_output": ("update_from_output", "core/sched/scheduler.py"),
    "output processing (detokenize)": ("process_outputs", "v1/engine/output_processor.py"),
    "worker _step (ours)": ("_step", "pyserver/engine/worker.py"),
    "worker _admit (ours)": ("_admit", "pyserver/engine/worker.py"),
    "step outputs (ours)": ("collect", "pyserver/engine/outputs.py"),
    "publish to loop (ours)": ("_publish", "pyserver/engine/worker.py"),
    "servicer Generate (ours)": ("Generate", "pyserver/service/servicer.py"),
    "servicer _deltas (ours)": ("_deltas", "pyserver/service/servicer.py"),
    "to protobuf (ours)": ("stream_message", "pyserver/service/convert.py"),
}
_FRAME = re.compile(r"^(?P<func>.+?) \((?P<file>[^():]+)(?::\d+)?\)$")


def summarize(raw: Path, top: int = 15) -> dict[str, Any]:
    """Per-thread and per-function shares of all samples in py-spy's raw (collapsed) output."""
    total = 0
    threads: collections.Counter[str] = collections.Counter()
    self_time: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        thread = next((f for f in frames if f.startswith("thread ")), "thread ?")
        threads[re.sub(r"\(0x[0-9a-f]+\)", "", thread).strip()] += n
        leaf = frames[-1]
        self_time[re.sub(r":\d+\)$", ")", leaf)] += n
        seen = set()
        for f in frames:
            m = _FRAME.match(f)
            if not m:
                continue
            name = m["func"].rpartition(".")[2]
            for label, (func, suffix) in WATCH.items():
                if label not in seen and name == func and m["file"].endswith(suffix):
                    inclusive[label] += n
                    seen.add(label)
    if not total:
        return {"samples": 0}

    def share(counter: collections.Counter[str], k: int | None = None) -> dict[str, float]:
        return {name: round(100 * n / total, 1) for name, n in counter.most_common(k)}

    return {
        "samples": total,
        "threads_pct": share(threads, 6),
        "inclusive_pct": share(inclusive),
        "self_top_pct": share(self_time, top),
    }


def profile_level(args: argparse.Namespace, texts: list[str], concurrency: int) -> dict[str, Any]:
    server, target = start_streambatch(args, f"profile-c{concurrency}.log", args.server_arg)
    raw = RESULTS / f"profile-c{concurrency}.txt"
    try:

        async def go() -> Any:
            async with grpc.aio.insecure_channel(target) as channel:
                stub = pb_grpc.GenerationStub(channel)

                async def send(text: str) -> Sample:
                    return await one(stub, generate_request(text, args.max_tokens, chat=False), 600)

                # Warm-up outside the profile, then the measured run under py-spy.
                await closed_loop(send, texts[: args.warmup], 1, 0, "warm-up")
                spy = subprocess.Popen(
                    [
                        args.py_spy,
                        "record",
                        "--pid",
                        str(server.proc.pid),
                        "--format",
                        "raw",
                        "--rate",
                        str(args.rate),
                        "--nonblocking",
                        "--threads",
                        "--subprocesses",
                        "--output",
                        str(raw),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                try:
                    report = await closed_loop(
                        send, texts[args.warmup :], concurrency, 0, f"c={concurrency}"
                    )
                finally:
                    spy.send_signal(signal.SIGINT)
                    spy.wait(60)
                return report

        report = asyncio.run(go())
    finally:
        server.stop()
    return {**report.summary(), "profile": summarize(raw)}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--concurrency", default="4,32", help="comma-separated closed-loop levels")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", default="")
    p.add_argument("--dtype", default="auto")
    # The engine arguments `make bench` gives every target (bench/compare.py).
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=0)
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument(
        "--server-arg", action="append", default=[], help="extra `streambatch serve` argument"
    )
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    args.py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not args.model:
        from pyserver.model import pull_default_model

        args.model = str(pull_default_model())
    if args.dtype == "auto":
        from pyserver.engine.adapter import resolve_dtype

        args.dtype = resolve_dtype("auto").replace("auto", "bfloat16")
    RESULTS.mkdir(exist_ok=True)
    texts = templated(prompts(args.requests + args.warmup, args.seed), args.model)
    levels: dict[int, Any] = {}
    for c in (int(x) for x in args.concurrency.split(",")):
        levels[c] = profile_level(args, texts, c)
        print(json.dumps({c: levels[c]}, indent=1), file=sys.stderr, flush=True)
    print(json.dumps({"levels": levels}))


if __name__ == "__main__":
    main()
