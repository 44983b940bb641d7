"""build_engine builds on a thread that is gone when it returns (its OpenMP team with it)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from pyserver.engine import EngineOptions, build_engine
from pyserver.engine.adapter import build as build_module


def test_the_building_thread_has_exited_when_the_engine_is_returned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    builders: list[threading.Thread] = []

    def construct(options: EngineOptions) -> Any:
        builders.append(threading.current_thread())
        return ("engine", options.model)

    monkeypatch.setattr(build_module, "_construct_engine", construct)
    assert build_engine(EngineOptions(model="m")) == ("engine", "m")
    (builder,) = builders
    assert builder is not threading.current_thread()
    assert not builder.is_alive()


def test_a_failed_build_raises_in_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    def construct(options: EngineOptions) -> Any:
        raise RuntimeError("no such model")

    monkeypatch.setattr(build_module, "_construct_engine", construct)
    with pytest.raises(RuntimeError, match="no such model"):
        build_engine(EngineOptions(model="m"))
