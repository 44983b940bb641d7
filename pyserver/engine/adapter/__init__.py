"""The one place streambatch touches vLLM: building the engine (build.py), driving it and reading
its public stats (engine.py), and the Scheduler subclass vLLM itself loads (scheduler.py).
Everything else in pyserver.engine is policy and plumbing that runs without vLLM. vllm is
imported lazily: importing this package is cheap."""

from __future__ import annotations

from pyserver.engine.adapter.build import (
    EngineConfigError,
    EngineOptions,
    build_engine,
    on_passing_thread,
    parse_vllm_flags,
    resolve_dtype,
)
from pyserver.engine.adapter.engine import Engine, StepOutput, VllmStats

__all__ = [
    "Engine",
    "EngineConfigError",
    "EngineOptions",
    "StepOutput",
    "VllmStats",
    "build_engine",
    "on_passing_thread",
    "parse_vllm_flags",
    "resolve_dtype",
]
