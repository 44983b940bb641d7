"""Scale-out by replicas: a client channel with round_robin over two local replicas uses both,
and a draining replica (health NOT_SERVING) stops receiving new calls."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import urllib.request

import grpc
import pytest
from streambatch.v1 import generation_pb2_grpc as pb_grpc

from integration.helpers import (
    StreamResult,
    free_port,
    health_status,
    request,
    run_stream,
    spawn_server,
    stop,
)

pytestmark = pytest.mark.engine

SERVICE_CONFIG = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": "streambatch.v1.Generation"},
    }
)


def served(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(v)
        for v in re.findall(
            r'^streambatch_requests_total\{code="OK",method="Complete"\} (\S+)', text, re.M
        )
    )


def test_round_robin_over_two_replicas_and_drain(live_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    replicas = []
    for _ in range(2):
        port, metrics = free_port(), free_port()
        proc = spawn_server(port, tmp_path / f"replica-{port}.log", "--metrics-port", str(metrics))
        replicas.append((port, metrics, proc))
    try:
        deadline = time.monotonic() + 400
        for port, _, proc in replicas:
            while health_status(grpc.insecure_channel(f"127.0.0.1:{port}")) != 1:  # SERVING
                assert proc.poll() is None and time.monotonic() < deadline, "replica did not start"
                time.sleep(0.5)
        target = "ipv4:" + ",".join(f"127.0.0.1:{p}" for p, _, _ in replicas)
        channel = grpc.insecure_channel(target, options=[("grpc.service_config", SERVICE_CONFIG)])
        s = pb_grpc.GenerationStub(channel)
        for i in range(6):
            s.Complete(request(f"Hi {i}", max_tokens=2), timeout=120)
        first = [served(m) for _, m, _ in replicas]
        assert all(n >= 1 for n in first), f"round_robin did not use both replicas: {first}"

        # Drain replica 0 while a stream holds it open: its health turns NOT_SERVING.
        (port0, metrics0, proc0), (_, metrics1, _) = replicas
        # Long enough to outlast the checks below at any engine speed (60 tokens took under
        # 2 s once the engine used both cores, and the replica had exited before them).
        held: list[StreamResult] = []
        holder = threading.Thread(
            target=lambda: held.append(
                run_stream(
                    pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port0}")),
                    request("A long story", max_tokens=400, ignore_eos=True),
                )
            )
        )
        holder.start()
        time.sleep(1.0)
        proc0.send_signal(signal.SIGTERM)
        channel0 = grpc.insecure_channel(f"127.0.0.1:{port0}")
        while health_status(channel0) == 1:
            time.sleep(0.1)
        time.sleep(1.0)  # the channel's health watch sees NOT_SERVING
        before0, before1 = served(metrics0), served(metrics1)
        for i in range(4):
            s.Complete(request(f"After drain {i}", max_tokens=2), timeout=120)
        assert served(metrics0) == before0, "a draining replica received new calls"
        assert served(metrics1) == before1 + 4
        holder.join(120)
        (stream,) = held
        assert stream.code == grpc.StatusCode.OK, (
            f"the draining replica cut its stream: {stream.details}"
        )
        assert stream.last.usage.completion_tokens == 400
        assert proc0.wait(120) == 0
    finally:
        for _, _, proc in replicas:
            stop(proc)
