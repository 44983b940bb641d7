"""Process lifecycle of `streambatch serve`: health while starting, SIGTERM drain, exit code."""

from __future__ import annotations

import signal
import socket
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from integration.helpers import request, run_stream, spawn_server, stub

pytestmark = pytest.mark.engine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def health_status(target: str) -> int | None:
    with grpc.insecure_channel(target) as ch:
        try:
            return (
                health_pb2_grpc.HealthStub(ch)
                .Check(health_pb2.HealthCheckRequest(), timeout=2)
                .status
            )
        except grpc.RpcError:
            return None


def test_sigterm_drains_in_flight_streams_and_exits_zero(live_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # live_server is idle during this test; the second engine gets the CPU to itself.
    port = free_port()
    target = f"127.0.0.1:{port}"
    log = tmp_path / "server.log"
    proc = spawn_server(port, log)
    try:
        seen_not_serving = False
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            status = health_status(target)
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                seen_not_serving = True
            if status == health_pb2.HealthCheckResponse.SERVING:
                break
            assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
            time.sleep(0.2)
        else:
            pytest.fail("the server never became SERVING")
        assert seen_not_serving, "health should be NOT_SERVING while the engine loads"

        s = stub(target)
        results = []
        streams = [
            threading.Thread(
                target=lambda i=i: results.append(
                    run_stream(s, request(f"Story {i}", max_tokens=40, ignore_eos=True))
                )
            )
            for i in range(3)
        ]
        for t in streams:
            t.start()
        time.sleep(1.0)  # the streams are in flight
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert health_status(target) == health_pb2.HealthCheckResponse.NOT_SERVING
        late = run_stream(s, request("new call during drain", max_tokens=4))
        assert late.code == grpc.StatusCode.UNAVAILABLE
        for t in streams:
            t.join(120)
        assert [r.code for r in results] == [grpc.StatusCode.OK] * 3, [r.details for r in results]
        assert all(r.last.usage.completion_tokens == 40 for r in results)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
