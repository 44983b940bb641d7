"""The drain's accept window: after SIGTERM new calls are still served while they keep coming
(a balancer sends them until its health checks see NOT_SERVING), until none has arrived for
drain_quiet_s, and never longer than drain_accept_s."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from pyserver.engine import EngineOptions
from pyserver.service.server import ServerSettings, StreambatchServer

QUIET_S, ACCEPT_S = 0.3, 1.2


def window_s(arrivals_every_s: float | None, arrivals_for_s: float) -> float:
    """How long the accept window stays open while calls arrive every `arrivals_every_s`
    seconds (None: none arrives) for `arrivals_for_s` seconds after the drain begins."""
    server = StreambatchServer(
        ServerSettings(
            EngineOptions(model="unused"), drain_accept_s=ACCEPT_S, drain_quiet_s=QUIET_S
        )
    )
    servicer = SimpleNamespace(last_call_s=time.monotonic() - 5.0)  # the last call long ago

    async def arrivals() -> None:
        if arrivals_every_s is None:
            return
        end = time.monotonic() + arrivals_for_s
        while time.monotonic() < end:
            servicer.last_call_s = time.monotonic()
            await asyncio.sleep(arrivals_every_s)

    async def main() -> float:
        began = time.monotonic()
        feeder = asyncio.ensure_future(arrivals())
        await server._accept_until_quiet(servicer)  # type: ignore[arg-type]
        closed = time.monotonic() - began
        feeder.cancel()
        return closed

    return asyncio.run(main())


def test_no_calls_close_it_after_the_quiet_period() -> None:
    assert QUIET_S <= window_s(None, 0) < QUIET_S + 0.2


def test_calls_keep_it_open_until_they_stop() -> None:
    # Calls every 50 ms for 0.5 s: the window closes one quiet period after the last of them.
    closed = window_s(0.05, 0.5)
    assert 0.5 + QUIET_S - 0.06 <= closed < 0.5 + QUIET_S + 0.2, closed


def test_calls_that_never_stop_are_cut_at_the_limit() -> None:
    closed = window_s(0.05, 10.0)
    assert ACCEPT_S <= closed < ACCEPT_S + 0.2, closed
