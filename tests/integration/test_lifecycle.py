"""Process lifecycle of `streambatch serve`: health while starting, SIGTERM drain, exit code."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from integration.helpers import (
    POLLING,
    free_port,
    health_status,
    refusal_line,
    request,
    run_stream,
    spawn_server,
    stop,
    stub,
    wait_serving,
)

pytestmark = pytest.mark.engine


def drain_quietly(call: Any) -> None:
    """Read a stream to its end; its cancellation is expected."""
    with contextlib.suppress(grpc.RpcError):
        for _ in call:
            pass


def test_sigterm_drains_in_flight_streams_and_exits_zero(live_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # live_server is idle during this test; the second engine gets the CPU to itself.
    port = free_port()
    target = f"127.0.0.1:{port}"
    log = tmp_path / "server.log"
    # vLLM's own spellings: a bare boolean, and an engine flag streambatch does not define.
    # A 3 s quiet period: the first late call below arrives well inside it on a loaded machine.
    # One slot more than the 3 streams, the held call and a late call need.
    proc = spawn_server(port, log, "--enforce-eager", "--long-prefill-token-threshold", "512",
                        "--drain-quiet-s", "3", "--max-num-seqs", "6")  # fmt: skip
    try:
        channel = grpc.insecure_channel(target, options=POLLING)
        seen_not_serving = wait_serving(channel, proc, log)
        assert seen_not_serving, "health should be NOT_SERVING while the engine loads"

        s = stub(target)
        results = []
        streams = [
            threading.Thread(
                target=lambda i=i: results.append(
                    run_stream(s, request(f"Story {i}", max_tokens=300, ignore_eos=True))
                )
            )
            for i in range(3)
        ]
        # A call near the context limit holds the drain open through the checks below at any
        # engine speed; cancelled once they are done.
        held = s.Generate(request("Hold the port", max_tokens=1900, ignore_eos=True), timeout=300)
        holder = threading.Thread(target=drain_quietly, args=(held,), daemon=True)
        holder.start()
        for t in streams:
            t.start()
        time.sleep(1.0)  # the streams are in flight
        proc.send_signal(signal.SIGTERM)
        # Within a bounded time, not a fixed sleep: with the engine spinning on every core the
        # loop may take longer than a few hundred ms to run the signal handler.
        flipped_by = time.monotonic() + 10
        while health_status(channel) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < flipped_by, "health never turned NOT_SERVING on SIGTERM"
            time.sleep(0.05)
        # The accept window: a balancer still sends calls until its checks see NOT_SERVING,
        # and those are served; once none has come for the quiet period, new calls are refused.
        late = run_stream(s, request("call while balancers notice", max_tokens=4))
        assert late.code == grpc.StatusCode.OK, late.details
        time.sleep(3 + 1.5)
        assert holder.is_alive(), "the held call ended: the port may be closed"
        refused = run_stream(s, request("call after the window", max_tokens=4))
        assert refused.code == grpc.StatusCode.UNAVAILABLE, refused.details
        assert "draining" in refused.details
        held.cancel()
        for t in streams:
            t.join(120)
        assert [r.code for r in results] == [grpc.StatusCode.OK] * 3, [r.details for r in results]
        assert all(r.last.usage.completion_tokens == 300 for r in results)
        assert proc.wait(120) == 0
    finally:
        stop(proc)


def test_an_engine_configuration_vllm_rejects_ends_serve_with_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """SmolLM2-135M has 9 attention heads, which 2 does not divide."""
    log = tmp_path / "server.log"
    last = refusal_line(log, "--tensor-parallel-size", "2")
    lines = log.read_text(errors="replace").splitlines()
    assert last.startswith("streambatch serve: error: vLLM rejected the engine configuration")
    assert "tensor parallel size (2)" in last, last
    assert not [line for line in lines if "Traceback" in line or "Event loop is closed" in line]


def test_sigterm_while_the_engine_loads_stops_without_ever_serving(live_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An orchestrator may stop a replica it just started: the engine that finishes loading
    after the signal is shut down instead of serving, and serve exits 0. (Health cannot turn
    SERVING after the drain began, whatever start() does: the log says what it did.)"""
    # live_server: the session's engine has loaded and idles, so this one loads alone.
    port = free_port()
    log = tmp_path / "server.log"
    proc = spawn_server(port, log, "--log-level", "INFO")
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=POLLING)
        # The port opens before the engine loads (health NOT_SERVING), which takes seconds.
        opens_by = time.monotonic() + 120
        while health_status(channel) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
            assert time.monotonic() < opens_by, "the port never opened"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(300)  # the load finishes, then the engine stops
        except subprocess.TimeoutExpired:
            raise AssertionError("serve did not exit after SIGTERM during load") from None
        text = log.read_text(errors="replace")
        assert code == 0, text[-4000:]
        assert "a signal came while the engine loaded" in text, text[-4000:]
        assert "pyserver.service.server: serving " not in text and "Traceback" not in text, text[
            -4000:
        ]
    finally:
        stop(proc)
