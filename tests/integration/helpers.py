"""Client helpers for the integration tests."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from streambatch.v1 import generation_pb2 as pb
from streambatch.v1 import generation_pb2_grpc as pb_grpc


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
    s: pb_grpc.GenerationStub, req: pb.GenerateRequest, timeout: float = 120.0
) -> StreamResult:
    result = StreamResult(sent_at=time.monotonic())
    call = s.Generate(req, timeout=timeout)
    try:
        for msg in call:
            result.messages.append(msg)
            result.text += msg.text
    except grpc.RpcError as err:
        result.code, result.details = err.code(), err.details() or ""
        result.trailers = {k: v for k, v in (err.trailing_metadata() or ()) if isinstance(v, str)}
    return result


def spawn_server(port: int, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    """`streambatch serve` in its own process (small engine, long drain grace), output to `log`."""
    cmd = [
        sys.executable,
        "-m",
        "pyserver.cli",
        "serve",
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
