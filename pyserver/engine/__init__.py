"""The engine worker: the only package that imports vllm."""

from __future__ import annotations

from pyserver.engine.worker import (
    EngineOptions,
    EngineStats,
    EngineWorker,
    build_engine,
    on_passing_thread,
    step_token_budget,
)

__all__ = [
    "EngineOptions",
    "EngineStats",
    "EngineWorker",
    "build_engine",
    "on_passing_thread",
    "step_token_budget",
]
