"""The drain's accept window: after SIGTERM new calls are still served while they keep coming
(a balancer sends them until its health checks see NOT_SERVING), until none has arrived for
drain_quiet_s, never longer than drain_accept_s, and not at all once the engine has failed or
a second signal came."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from pyserver.engine import EngineOptions
from pyserver.service.server import ServerSettings, StreambatchServer

QUIET_S, ACCEPT_S = 0.3, 1.2
SLACK_S = 1.0  # a loaded 2-core machine may run the loop late


def server_with(quiet_s: float = QUIET_S, accept_s: float = ACCEPT_S) -> StreambatchServer:
    settings = ServerSettings(
        EngineOptions(model="unused"), drain_accept_s=accept_s, drain_quiet_s=quiet_s
    )
    return StreambatchServer(settings)


def window_s(arrivals_every_s: float | None, arrivals_for_s: float) -> tuple[float, float]:
    """How long the accept window stays open while calls arrive every `arrivals_every_s`
    seconds (None: none arrives) for `arrivals_for_s` seconds after the drain begins, and
    when (after the drain began) the last call arrived."""
    server = server_with()
    servicer = SimpleNamespace(last_call_s=time.monotonic() - 5.0)  # the last call long ago

    async def arrivals() -> None:
        if arrivals_every_s is None:
            return
        end = time.monotonic() + arrivals_for_s
        while time.monotonic() < end:
            servicer.last_call_s = time.monotonic()
            await asyncio.sleep(arrivals_every_s)

    async def main() -> tuple[float, float]:
        began = time.monotonic()
        feeder = asyncio.ensure_future(arrivals())
        await server._accept_until_quiet(servicer)  # type: ignore[arg-type]
        closed = time.monotonic() - began
        feeder.cancel()
        return closed, max(0.0, servicer.last_call_s - began)

    return asyncio.run(main())


def test_no_calls_close_it_after_the_quiet_period() -> None:
    closed, _ = window_s(None, 0)
    assert QUIET_S <= closed < QUIET_S + SLACK_S


def test_calls_keep_it_open_until_they_stop() -> None:
    # Calls every 50 ms for 0.5 s: the window closes one quiet period after the last of them.
    closed, last = window_s(0.05, 0.5)
    assert last > 0.3, last  # the feeder ran
    assert last + QUIET_S <= closed < last + QUIET_S + SLACK_S, (closed, last)


def test_calls_that_never_stop_are_cut_at_the_limit() -> None:
    closed, _ = window_s(0.05, 10.0)
    assert ACCEPT_S <= closed < ACCEPT_S + SLACK_S, closed


class _Stubs:
    """The servicer and worker as drain() sees them: no engine, no port."""

    def __init__(self) -> None:
        self.servicer = SimpleNamespace(
            serving=True, accepting=True, in_flight=0, last_call_s=0.0, idle=asyncio.Event()
        )
        self.servicer.idle.set()
        self.worker = SimpleNamespace(
            closed=False, close=self._close, join=lambda timeout: True, shutdown_engine=lambda: None
        )

    def _close(self) -> None:
        self.worker.closed = True


def drain_with(interrupt: Any) -> tuple[float, _Stubs, StreambatchServer]:
    """Start a drain with a long window, call interrupt(server) 0.2 s in; how long the drain
    took after the interrupt, and the stubs and server after it."""
    server = server_with(quiet_s=30.0, accept_s=60.0)

    async def main() -> tuple[float, _Stubs]:
        stubs = _Stubs()
        server.servicer, server.worker = stubs.servicer, stubs.worker  # type: ignore[assignment]
        server._start_drain()
        await asyncio.sleep(0.2)
        assert stubs.servicer.accepting and not stubs.servicer.serving, "window not open"
        interrupted = time.monotonic()
        interrupt(server)
        await asyncio.wait_for(server.wait(), 10)
        return time.monotonic() - interrupted, stubs

    took, stubs = asyncio.run(main())
    return took, stubs, server


def test_an_engine_failure_ends_an_open_window() -> None:
    took, stubs, server = drain_with(lambda s: s._on_engine_failure(RuntimeError("boom")))
    assert took < SLACK_S, took
    assert not stubs.servicer.accepting and stubs.worker.closed
    assert server.exit_code == 1


def test_a_second_signal_ends_an_open_window() -> None:
    took, stubs, server = drain_with(lambda s: s._start_drain())
    assert took < SLACK_S, took
    assert not stubs.servicer.accepting and stubs.worker.closed
    assert server.exit_code == 0


def test_sigint_drains_without_a_window() -> None:
    """SIGINT's handler is _start_drain(False): the drain refuses new calls at once."""
    server = server_with(quiet_s=30.0, accept_s=60.0)

    async def main() -> tuple[float, _Stubs]:
        stubs = _Stubs()
        server.servicer, server.worker = stubs.servicer, stubs.worker  # type: ignore[assignment]
        began = time.monotonic()
        server._start_drain(False)
        await asyncio.wait_for(server.wait(), 10)
        return time.monotonic() - began, stubs

    took, stubs = asyncio.run(main())
    assert took < SLACK_S, took
    assert not stubs.servicer.accepting and stubs.worker.closed
