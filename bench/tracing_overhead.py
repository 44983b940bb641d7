"""Throughput with tracing off and on, same machine, same workload, one run.

Starts `streambatch serve` once per setting (one engine at a time: two would fight over the
CPU), runs the closed-loop load from bench/load.py in this process, stops the server. "on" uses
the console exporter written to /dev/null: it serializes every span to JSON, an upper bound on
what the OTLP batch exporter costs. Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import run_closed_loop


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_serving(target: str, proc: subprocess.Popen[bytes], timeout: float = 600) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with grpc.insecure_channel(target) as ch:
            try:
                status = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=2
                )
                if status.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
        time.sleep(0.5)
    raise RuntimeError("server did not become SERVING")


def measure(tracing: str, args: argparse.Namespace) -> dict[str, object]:
    port = free_port()
    target = f"127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "pyserver.cli",
        "serve",
        "--port",
        str(port),
        "--tracing",
        tracing,
        "--max-num-seqs",
        str(args.concurrency),
        "--metrics-port",
        "-1",
        "--log-level",
        "WARNING",
    ]
    with open(os.devnull, "wb") as devnull:
        proc = subprocess.Popen(cmd, stdout=devnull, stderr=devnull)
        try:
            wait_serving(target, proc)
            report = asyncio.run(
                run_closed_loop(
                    target, args.concurrency, args.requests, 2, args.max_tokens, args.seed
                )
            )
            return report.summary()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    off = measure("off", args)
    print(f"tracing off: {off}", file=sys.stderr, flush=True)
    on = measure("console", args)
    print(f"tracing on:  {on}", file=sys.stderr, flush=True)
    ratio = float(on["output_tok_s"]) / float(off["output_tok_s"])  # type: ignore[arg-type]
    print(json.dumps({"off": off, "on": on, "throughput_ratio_on_vs_off": round(ratio, 3)}))


if __name__ == "__main__":
    main()
