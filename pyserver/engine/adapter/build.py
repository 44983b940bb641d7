"""Building the engine: streambatch's engine options as vLLM's EngineArgs, the scheduler
subclass and a stats tap attached, on a thread that is gone when the engine is built."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pyserver.engine.adapter.engine import Engine, VllmStats

_T = TypeVar("_T")


@dataclass(slots=True)
class EngineOptions:
    """Engine arguments passed through to vLLM's EngineArgs, plus what the scheduler subclass
    needs to know of streambatch."""

    model: str
    dtype: str = "auto"  # auto: bfloat16 where the CPU computes it natively, else float32
    max_model_len: int = 2048
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None
    step_tokens: int = 0  # normal steps' token budget (vLLM's max_num_scheduled_tokens); 0: all
    enable_prefix_caching: bool = True
    enforce_eager: bool = True
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    seed: int = 0
    top_priority: int = 1  # streambatch's top priority level (vLLM gets -priority)
    # The engine core in its own process (vLLM's multiprocess mode) rather than in this one.
    # vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=1 also gives that; in-process needs it at 0.
    separate_process: bool = False
    # LoRA adapters a request may name: name -> a PEFT adapter folder (adapter_config.json).
    lora_adapters: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def resolve_dtype(dtype: str) -> str:
    """On a CPU without native bf16 (AVX512_BF16 or AMX) bf16 is emulated and measured ~4x
    slower than fp32 here (AMD EPYC, AVX2 only), so "auto" picks float32 there. On a GPU
    "auto" is left to vLLM (the model's own dtype)."""
    if dtype != "auto":
        return dtype
    import torch

    if torch.cuda.is_available():
        return "auto"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "float32"
    return "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"


def _engine_args(options: EngineOptions) -> dict[str, Any]:
    from pyserver.engine.adapter.scheduler import CONFIG_KEY, QUALNAME

    kwargs: dict[str, Any] = dict(
        model=options.model,
        dtype=resolve_dtype(options.dtype),
        max_model_len=options.max_model_len,
        max_num_seqs=options.max_num_seqs,
        enable_prefix_caching=options.enable_prefix_caching,
        enforce_eager=options.enforce_eager,
        tensor_parallel_size=options.tensor_parallel_size,
        pipeline_parallel_size=options.pipeline_parallel_size,
        gpu_memory_utilization=options.gpu_memory_utilization,
        scheduling_policy="priority",
        scheduler_cls=QUALNAME,
        # Stable values only: vLLM hashes additional_config into its compile-cache key.
        additional_config={CONFIG_KEY: {"top_priority": -options.top_priority}},
        seed=options.seed,
    )
    if options.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = options.max_num_batched_tokens
    if options.step_tokens:
        kwargs["max_num_scheduled_tokens"] = options.step_tokens
    if options.kv_cache_memory_bytes:
        kwargs["kv_cache_memory_bytes"] = options.kv_cache_memory_bytes
    if options.lora_adapters:
        # Unless given as vLLM flags: room for every adapter's rank, and for all of them in
        # one step (a step mixes base and adapter requests either way).
        kwargs["enable_lora"] = True
        rank = max(lora_rank(p) for p in options.lora_adapters.values())
        kwargs["max_lora_rank"] = next(r for r in _VLLM_LORA_RANKS if r >= rank)
        kwargs["max_loras"] = len(options.lora_adapters)
    kwargs.update(options.extra)
    return kwargs


# The ranks vLLM sizes its LoRA buffers for (its max_lora_rank accepts only these).
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank(folder: str) -> int:
    """A PEFT adapter's largest rank (its adapter_config.json "r", and any per-module
    "rank_pattern"); ValueError naming what is wrong."""
    config = Path(folder) / "adapter_config.json"
    try:
        fields = json.loads(config.read_text())
        ranks = [fields["r"], *(fields.get("rank_pattern") or {}).values()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{config}: not a PEFT LoRA adapter config ({exc})") from exc
    if not all(isinstance(r, int) and r >= 1 for r in ranks):
        raise ValueError(f"{config}: ranks must be positive integers, got {ranks}")
    if max(ranks) > _VLLM_LORA_RANKS[-1]:
        raise ValueError(f"{config}: rank {max(ranks)} is above vLLM's {_VLLM_LORA_RANKS[-1]}")
    return int(max(ranks))


class EngineConfigError(ValueError):
    """vLLM rejected the engine configuration; the message is vLLM's reason, on one line."""


def _one_line(exc: BaseException) -> str:
    """vLLM's reason: pydantic's messages without its framing (input dump, docs link)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):  # pydantic.ValidationError
        text = "; ".join(str(e.get("msg", "")).removeprefix("Value error, ") for e in errors())
    else:
        text = str(exc)
    return " ".join(text.split()) or type(exc).__name__


# Set by streambatch itself: its scheduling depends on them, and its metrics on vLLM's stats.
_RESERVED_VLLM_FLAGS = frozenset(
    {"scheduler_cls", "scheduling_policy", "additional_config", "disable_log_stats"}
)
# EngineArgs fields streambatch sets from its own flags (spelled the same): given again in
# vLLM's spelling (--max_num_seqs, --no-enforce-eager) they would bypass streambatch's checks.
_OWN_VLLM_FLAGS = frozenset(
    {
        "model", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
        "max_num_scheduled_tokens", "enable_prefix_caching", "enforce_eager",
        "tensor_parallel_size", "pipeline_parallel_size", "gpu_memory_utilization",
    }
)  # fmt: skip


def parse_vllm_flags(argv: list[str]) -> dict[str, Any]:
    """vLLM's own engine flags, in vLLM's spellings (its EngineArgs CLI definitions, bare
    booleans included), as EngineArgs keyword arguments: only those given. An unknown or bad
    flag exits with argparse's usage error (status 2)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(  # type: ignore[no-untyped-call]
        prog="streambatch serve",
        usage="streambatch serve [flags] [vLLM engine flags]",
        add_help=False,
    )
    EngineArgs.add_cli_args(parser)
    # Every destination pre-set to a marker, which argparse leaves alone unless the flag is
    # given: what is not the marker afterwards was given, a value equal to vLLM's default
    # included (--no-enforce-eager).
    unset = object()
    given = argparse.Namespace(**{name: unset for name in vars(parser.parse_args([]))})
    parser.parse_args(argv, namespace=given)
    flags: dict[str, Any] = {k: v for k, v in vars(given).items() if v is not unset}
    for name in sorted(flags.keys() & _RESERVED_VLLM_FLAGS):
        parser.error(f"--{name.replace('_', '-')} is set by streambatch itself")
    for name in sorted(flags.keys() & _OWN_VLLM_FLAGS):
        parser.error(f"give --{name.replace('_', '-')} in streambatch's spelling (see --help)")
    return flags


def _construct_engine(options: EngineOptions) -> Engine:
    from vllm import EngineArgs, LLMEngine
    from vllm.v1.metrics.loggers import StatLoggerBase

    from pyserver.engine.adapter.scheduler import ASYNC_QUALNAME

    stats = VllmStats()

    class _StatsTap(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            stats.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    kwargs = _engine_args(options)
    try:
        # vLLM checks the configuration as a whole (model against parallelism, memory, ...)
        # when it builds it; built once here, a rejection is the operator's to fix, not a crash.
        config = EngineArgs(**kwargs).create_engine_config()
    except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
        raise EngineConfigError(_one_line(exc)) from exc
    budget = config.scheduler_config.max_num_batched_tokens
    if options.step_tokens > budget:
        raise EngineConfigError(
            f"--step-tokens {options.step_tokens} is above the engine's per-step maximum "
            f"{budget} (--max-num-batched-tokens)"
        )
    if config.scheduler_config.async_scheduling:  # the platform's choice (off on the CPU)
        kwargs["scheduler_cls"] = ASYNC_QUALNAME
    args = EngineArgs(**kwargs)
    try:
        llm = LLMEngine.from_engine_args(
            args, stat_loggers=[_StatsTap], enable_multiprocessing=options.separate_process
        )
    except ValueError as exc:  # e.g. max_model_len beyond what the KV cache holds
        raise EngineConfigError(_one_line(exc)) from exc
    except RuntimeError as exc:  # a separate engine core that failed to start says only so
        if "initialization failed" not in str(exc):
            raise
        raise EngineConfigError(
            f"{_one_line(exc)} (the engine core's own reason is logged above)"
        ) from exc
    engine = Engine(llm, stats, options.lora_adapters)
    try:
        engine.load_adapters()  # a bad adapter fails the start, not the first call naming it
    except Exception as exc:
        engine.shutdown()
        raise EngineConfigError(f"--lora: {_one_line(exc)}") from exc
    return engine


def build_engine(options: EngineOptions) -> Engine:
    """The engine, built on a thread that exits once it is built (blocking: call it off the
    event loop). Building runs torch ops, and OpenMP keeps a thread team for every thread that
    ran one, until that thread exits. A team left on a pool thread while the engine steps on its
    own thread puts more OpenMP threads in the process than there are cores, and then libgomp
    cuts its workers' spin-wait to almost nothing: every parallel region of every step wakes
    its workers from sleep. Measured on 2 cores (docs/benchmarks.md): offline generation on a
    second thread ran at the speed of one thread until the building thread was gone."""
    return on_passing_thread(_construct_engine, options)


def on_passing_thread(fn: Callable[..., _T], *args: Any) -> _T:
    """fn(*args) on a new thread that has exited when this returns, so whatever OpenMP team
    fn's torch ops left is gone with it (see build_engine)."""
    with ThreadPoolExecutor(1, thread_name_prefix="torch-setup") as pool:
        return pool.submit(fn, *args).result()
