"""Client helpers for the integration tests."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from streambatch.v1 import generation_pb2 as pb
from streambatch.v1 import generation_pb2_grpc as pb_grpc


def seconds_until(cond: Callable[[], object], limit_s: float, poll_s: float = 0.01) -> float | None:
    """Seconds until cond() held, or None if it did not within limit_s."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if cond():
            return time.monotonic() - start
        time.sleep(poll_s)
    return None


def wait_until(cond: Callable[[], object], limit_s: float = 5.0, poll_s: float = 0.02) -> bool:
    return seconds_until(cond, limit_s, poll_s) is not None


def stub(target: str) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(grpc.insecure_channel(target))


def request(
    text: str = "Tell me a story about a dragon.",
    *,
    max_tokens: int = 16,
    temperature: float = 0.0,
    ignore_eos: bool = False,
    priority: int = 0,
    chat: bool = True,
) -> pb.GenerateRequest:
    req = pb.GenerateRequest(priority=priority)
    if chat:
        req.chat.messages.add(role="user", content=text)
    else:
        req.text = text
    req.sampling.max_tokens = max_tokens
    req.sampling.temperature = temperature
    req.sampling.ignore_eos = ignore_eos
    return req


@dataclass
class StreamResult:
    sent_at: float
    text: str = ""
    messages: list[pb.GenerateResponse] = field(default_factory=list)
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    trailers: dict[str, str] = field(default_factory=dict)

    @property
    def last(self) -> pb.GenerateResponse:
        return self.messages[-1]

    @property
    def admitted_at(self) -> float:
        return self.sent_at + self.last.timings.queue_ms / 1e3


def run_stream(
    s: pb_grpc.GenerationStub,
    req: pb.GenerateRequest,
    timeout: float = 120.0,
    first_message: threading.Event | None = None,
) -> StreamResult:
    """The whole stream; `first_message` is set when its first message arrives (for a test
    that must act while the call is known to run)."""
    result = StreamResult(sent_at=time.monotonic())
    call = s.Generate(req, timeout=timeout)
    try:
        for msg in call:
            result.messages.append(msg)
            result.text += msg.text
            if first_message is not None:
                first_message.set()
    except grpc.RpcError as err:
        result.code, result.details = err.code(), err.details() or ""
        result.trailers = {k: v for k, v in (err.trailing_metadata() or ()) if isinstance(v, str)}
    return result


def spawn_server(
    port: int, log: Path, *extra: str, fault_after_steps: int = 0
) -> subprocess.Popen[bytes]:
    """`streambatch serve` in its own process (small engine, long drain grace), output to `log`;
    with fault_after_steps, its engine step raises after that many (tests/.../fault_server.py)."""
    launcher = (
        [str(Path(__file__).with_name("fault_server.py")), str(fault_after_steps)]
        if fault_after_steps
        else ["-m", "pyserver.cli", "serve"]
    )
    cmd = [
        sys.executable,
        *launcher,
        "--port",
        str(port),
        "--max-num-seqs",
        "4",
        "--drain-grace-s",
        "60",
        "--log-level",
        "WARNING",
        *extra,
    ]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def refusal_line(log: Path, *flags: str, limit_s: float = 300) -> str:
    """`streambatch serve` with `flags`, which must exit 2 at start: its last output line."""
    proc = spawn_server(free_port(), log, *flags)
    try:
        assert proc.wait(limit_s) == 2, log.read_text(errors="replace")[-2000:]
    finally:
        stop(proc)
    return log.read_text(errors="replace").strip().splitlines()[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def health_status(channel: grpc.Channel) -> int | None:
    try:
        return (
            health_pb2_grpc.HealthStub(channel)
            .Check(health_pb2.HealthCheckRequest(), timeout=2)
            .status
        )
    except grpc.RpcError:
        return None


# A channel that polls a starting server: gRPC's reconnect backoff after a refused connection
# grows past a second, long enough to miss an engine that loads in under one.
POLLING = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 200),
)


def wait_serving(
    channel: grpc.Channel, proc: subprocess.Popen[bytes], log: Path, limit_s: float = 300
) -> bool:
    """Poll health until SERVING; True when NOT_SERVING was seen on the way (engine loading)."""
    seen_not_serving = False
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        status = health_status(channel)
        if status == health_pb2.HealthCheckResponse.NOT_SERVING:
            seen_not_serving = True
        if status == health_pb2.HealthCheckResponse.SERVING:
            return seen_not_serving
        assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
        time.sleep(0.2)
    raise AssertionError("the server never became SERVING")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
