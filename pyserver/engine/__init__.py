"""The engine side: the worker thread, its pure policies, and the adapter that is the only code
touching vLLM (pyserver.engine.adapter)."""

from __future__ import annotations

from pyserver.engine.adapter import (
    Engine,
    EngineConfigError,
    EngineOptions,
    build_engine,
    on_passing_thread,
    parse_vllm_flags,
)
from pyserver.engine.worker import EngineStats, EngineWorker

__all__ = [
    "Engine",
    "EngineConfigError",
    "EngineOptions",
    "EngineStats",
    "EngineWorker",
    "build_engine",
    "on_passing_thread",
    "parse_vllm_flags",
]
