"""Shared fixtures: the real server with the real vLLM engine on the default model, once per
test session, in a background thread with its own event loop, reached over gRPC on loopback."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

# vLLM reads these at import time.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

ENGINE_SEQS = 8
QUEUE_CAPACITY = 24


@dataclass
class LiveServer:
    server: Any  # StreambatchServer
    loop: asyncio.AbstractEventLoop
    target: str

    @property
    def worker(self) -> Any:
        return self.server.worker

    def engine_idle(self) -> bool:
        return not self.worker._running and not self.worker._engine.has_unfinished_requests()


@pytest.fixture(scope="session")
def live_server() -> Iterator[LiveServer]:
    from pyserver.engine import EngineOptions
    from pyserver.model import pull_default_model
    from pyserver.service.server import ServerSettings, StreambatchServer

    settings = ServerSettings(
        engine=EngineOptions(model=str(pull_default_model()), max_num_seqs=ENGINE_SEQS),
        port=0,
        queue_capacity=QUEUE_CAPACITY,
        aging_interval_s=60.0,
    )
    server = StreambatchServer(settings)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(loop)

        async def main() -> None:
            try:
                await server.start()
            except BaseException as exc:
                failure.append(exc)
                raise
            finally:
                started.set()
            await server.wait()

        loop.run_until_complete(main())

    thread = threading.Thread(target=run, name="test-server", daemon=True)
    thread.start()
    assert started.wait(600), "the server did not start within 10 minutes"
    if failure:
        raise failure[0]
    yield LiveServer(server, loop, f"127.0.0.1:{server.port}")
    asyncio.run_coroutine_threadsafe(server.drain(), loop).result(60)
    thread.join(30)
