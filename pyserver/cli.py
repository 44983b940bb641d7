"""The `streambatch` command: serve, generate, info, model pull.

Every flag can also come from the environment as STREAMBATCH_<FLAG> (dashes as underscores),
e.g. STREAMBATCH_PORT=50052 or STREAMBATCH_MAX_NUM_SEQS=16; a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

DEFAULT_TARGET = "127.0.0.1:50051"


def _env_var(name: str) -> str:
    """The variable that overrides a flag's built-in default (STREAMBATCH_QUEUE_CAPACITY)."""
    return "STREAMBATCH_" + name.upper().replace("-", "_")


def usable_cpu_list() -> str:
    """The cores this process may run on, in the list syntax VLLM_CPU_OMP_THREADS_BIND takes
    ("0-1", "0,2-3"): the binding over every usable core."""
    runs: list[list[int]] = []
    for c in sorted(os.sched_getaffinity(0)):
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


class UsageError(Exception):
    """A serve configuration streambatch refuses before starting: one line, exit status 2."""


def rank_cpu_lists(ranks: int) -> str:
    """The usable cores split into `ranks` equal groups in VLLM_CPU_OMP_THREADS_BIND's per-rank
    syntax ("0|1", "0,1|2,3"; cores left over from an uneven split stay unused); UsageError
    when there are fewer cores than ranks."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise UsageError(
            f"{ranks} parallel ranks need at least {ranks} usable cores on the CPU, this "
            f"process has {len(cores)}"
        )
    per = len(cores) // ranks
    groups = [cores[i * per : (i + 1) * per] for i in range(ranks)]
    return "|".join(",".join(str(c) for c in g) for g in groups)


def has_cuda_device() -> bool:
    """An NVIDIA device node, checked without importing torch (the engine's environment must be
    set before torch loads)."""
    return Path("/dev/nvidiactl").exists() or any(Path("/dev").glob("nvidia[0-9]*"))


def _bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _count(text: str | int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a count >= 0, got {text!r}")
    return value


_MAX_MS = 1e12  # ~31 years: the queue keeps durations as int64 nanoseconds (up to ~292 years)


def _float_in(
    unit: str, low: float = 0.0, high: float = math.inf, note: str = ""
) -> Callable[[str | float], float]:
    """A parser for a number in [low, high); NaN and text that is no number are refused."""
    bounds = ([f">= {low:g}"] if low > -math.inf else []) + (
        [f"< {high:g}"] if high < math.inf else []
    )
    wanted = f"{unit} {' and '.join(bounds)}{note}"

    def parse(text: str | float) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not low <= value < high:  # also NaN
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return value

    return parse


_seconds = _float_in("seconds")
_turns = _float_in("a multiple", high=1e6)
_milliseconds = _float_in("milliseconds", high=_MAX_MS)
_signed_milliseconds = _float_in(  # every negative value means never
    "milliseconds", low=-math.inf, high=_MAX_MS, note=" (negative: never)"
)


def _ints(text: str | tuple[int, ...]) -> tuple[int, ...]:
    if isinstance(text, tuple):
        return text
    return tuple(int(x) for x in text.split(",") if x.strip())


def _lora(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    from pyserver.engine.adapter.build import lora_rank

    try:
        lora_rank(path)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return name, path


def _shown_default(default: Any) -> str:
    """A default as a user would type it ("" where there is nothing to show)."""
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, float):
        return f"{default:g}"
    if isinstance(default, (tuple, list)):
        return ",".join(str(x) for x in default)
    return "" if default is None else str(default)


def _one_of(choices: tuple[str, ...], var: str, type: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if text not in choices:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not one of {', '.join(choices)} (on the command line or in ${var})"
            )
        return type(text)

    return parse


def _add(
    p: argparse.ArgumentParser,
    flag: str,
    type: Callable[[str], Any],
    default: Any,
    help: str,
    choices: tuple[str, ...] | None = None,
) -> None:
    # --help says what a user gets; a value set in the environment is named, never printed
    # (STREAMBATCH_TOKEN is a secret).
    var = _env_var(flag.lstrip("-"))
    shown = _shown_default(default).replace("%", "%%")  # argparse %-formats help strings
    if "(default" not in help and var in os.environ:
        help = f"{help} (default: ${var}" + (f", else {shown})" if shown else ")")
    elif "(default" not in help and shown:
        help = f"{help} (default: {shown})"
    default = os.environ.get(var, default)
    if choices is not None:
        # argparse checks choices only on the command line, but passes a default given as
        # text through `type`: an unknown value in the variable is refused there too.
        type = _one_of(choices, var, type)
    if type is _bool:  # a bare flag means true, as vLLM spells its booleans (--enforce-eager)
        p.add_argument(flag, type=_bool, nargs="?", const=True, default=default, help=help)
    else:
        p.add_argument(flag, type=type, default=default, help=help, choices=choices)


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over gRPC",
        description="Besides the flags below, any of vLLM's engine flags, in vLLM's spelling "
        "(e.g. --swap-space 4, --enable-chunked-prefill), goes to the engine.",
        allow_abbrev=False,  # a prefix of one of ours must not swallow a vLLM flag
    )
    _add(p, "--model", str, "", "local Hugging Face folder or hub id (default: embedded SmolLM2)")
    _add(p, "--host", str, "127.0.0.1", "address to listen on")
    _add(p, "--port", int, 50051, "gRPC port")
    _add(
        p,
        "--dtype",
        str,
        "auto",
        "engine dtype (auto: bf16 where the CPU has it natively, else fp32)",
    )
    _add(p, "--max-model-len", int, 2048, "context length")
    _add(p, "--max-num-seqs", int, 32, "sequences the engine runs at once")
    _add(p, "--max-num-batched-tokens", int, 0, "engine token budget per step (0: vLLM default)")
    _add(p, "--enable-prefix-caching", _bool, True, "reuse KV of shared prompt prefixes")
    _add(
        p,
        "--kv-cache-gib",
        int,
        None,
        "KV cache size on the CPU; sets VLLM_CPU_KVCACHE_SPACE (default: that variable, else 1)",
    )
    _add(p, "--gpu-memory-utilization", float, 0.9, "fraction of GPU memory for vLLM (GPU only)")
    p.add_argument(
        "--lora",
        metavar="NAME=PATH",
        action="append",
        type=_lora,
        default=[],
        help="serve a LoRA adapter (a PEFT folder) to requests naming it; repeatable (default: "
        "none). vLLM's --max-loras and --max-lora-rank default to all adapters in one step and "
        "their rank",
    )
    _add(p, "--tensor-parallel-size", int, 1, "vLLM tensor parallelism")
    _add(p, "--pipeline-parallel-size", int, 1, "vLLM pipeline parallelism")
    _add(
        p,
        "--enforce-eager",
        _bool,
        None,
        "no torch.compile / CUDA graphs (default: on the CPU yes, measured faster to start and "
        "no slower here; on a GPU no, CUDA graphs cut every decode step's launch overhead)",
    )
    _add(
        p,
        "--engine-process",
        str,
        None,
        "inproc (engine core in this process) or separate (its own process); sets "
        "VLLM_ENABLE_V1_MULTIPROCESSING (default: that variable, else separate on a GPU, where "
        "the device keeps stepping while this process does gRPC and detokenization, and inproc "
        "on the CPU, where both would share the same cores: docs/deploy.md)",
        choices=("inproc", "separate"),
    )
    _add(
        p,
        "--engine-threads",
        int,
        0,
        "CPU threads for the model's torch ops (0: torch's default, every usable core; "
        "sets OMP_NUM_THREADS)",
    )
    _add(
        p,
        "--bind-cores",
        _bool,
        False,
        "in-process engine on the CPU: pin the engine's OpenMP threads one per usable core "
        "(vLLM's VLLM_CPU_OMP_THREADS_BIND over every core), instead of torch's unpinned threads",
    )
    _add(p, "--priority-levels", int, 2, "priority levels (0 normal .. N-1 most urgent)")
    _add(p, "--queue-capacity", int, 1024, "waiting requests before RESOURCE_EXHAUSTED")
    _add(p, "--level-capacity", _ints, (), "waiting requests per level, e.g. 48,16 (0: no own cap)")
    _add(
        p,
        "--level-queue-timeout-ms",
        _ints,
        (),
        "default queue timeout per level for requests that set none, e.g. 8000,0 (0: none)",
    )
    _add(
        p,
        "--preempt-after-ms",
        _signed_milliseconds,
        0.0,
        "stop the lowest-priority running request when a top-priority one has waited this long "
        "and the engine is full (negative: never)",
    )
    _add(
        p,
        "--preemption",
        str,
        "suspend",
        "how a preempted request makes room: suspend (it stays in the engine with its KV "
        "blocks and sampling state, computing nothing until resumed; needs the engine core in "
        "this process, else requeue) or requeue (aborted, its KV freed at once; resumed by "
        "prefilling its prompt and output again)",
        choices=("suspend", "requeue"),
    )
    _add(
        p,
        "--step-tokens",
        int,
        0,
        "token budget of a normal engine step, below --max-num-batched-tokens (0: the same); a "
        "top-priority prompt's prefill step may use the full --max-num-batched-tokens unless "
        "the controller governs step tokens (vLLM's max_num_scheduled_tokens; either engine "
        "process)",
    )
    _add(
        p,
        "--reserved-top-slots",
        int,
        0,
        "engine sequence slots kept for top-priority requests: lower levels fill at most "
        "max-num-seqs minus this, so a top-priority arrival starts at once without preempting",
    )
    _add(
        p,
        "--deadline-admission",
        str,
        "shadow",
        "refuse a call predicted to miss its deadline or queue timeout (on); only record the "
        "decision (Timings.refusal_predicted, streambatch_refusal_predictions_total) and serve "
        "it (shadow: refusing measured no goodput gain); never (off)",
        choices=("on", "shadow", "off"),
    )
    _add(
        p,
        "--refusal-confidence",
        float,
        0.95,
        "deadline admission refuses only when at least this sure the call would miss",
    )
    _add(p, "--bucket-bounds", _ints, (), "prompt-length bucket bounds, e.g. 64,256,1024")
    _add(
        p,
        "--batch-window-ms",
        _milliseconds,
        0.0,
        "hold the first arrival this long to gather a batch",
    )
    _add(
        p, "--max-wait-ms", _milliseconds, 0.0, "release when the oldest waited this long (0: off)"
    )
    _add(
        p,
        "--aging-interval-ms",
        _milliseconds,
        2000.0,
        "promote a waiting request one level per interval",
    )
    _add(
        p,
        "--lifo-after-ms",
        _milliseconds,
        1000.0,
        "overload: a priority level whose oldest waiting request has waited this long is "
        "served newest first (adaptive LIFO; 0: always oldest first)",
    )
    _add(
        p,
        "--lifo-backlog-ms",
        _milliseconds,
        5000.0,
        "newest first only while a level's backlog (its waiting requests and those above it) "
        "is more than the queue admitted in the last this long (idle time counts: after a lull "
        "a burst counts sooner): a backlog that arrival order clears that soon is served "
        "oldest first; set it near how long callers wait for a first token (0: any backlog; "
        "at most one hour)",
    )
    _add(
        p,
        "--prefix-affinity",
        _count,
        8,
        "queued requests whose prompt the prefix cache most likely still holds go first; the "
        "request next in line is passed over at most this many times (0: queue order only)",
    )
    _add(
        p,
        "--oldest-first-after-ms",
        _milliseconds,
        60000.0,
        "a waiting request that has waited this long (and its --oldest-first-turns) goes before "
        "the newer ones of its level: bounds how long newest-first order and --prefix-affinity "
        "pass a call over (0: no bound; else above --lifo-after-ms)",
    )
    _add(
        p,
        "--oldest-first-turns",
        _turns,
        2.0,
        "... and only once this many times as many calls as were waiting at its level and "
        "above when it arrived have left the queue (its arrival-order turn), so the bound stays "
        "above arrival order's wait on a slower engine (0: the time alone)",
    )
    _add(p, "--max-prompt-tokens", int, 0, "largest prompt accepted (0: max_model_len - 1)")
    _add(p, "--max-tokens-limit", int, 0, "largest max_tokens accepted (0: max_model_len - 1)")
    _add(p, "--max-message-bytes", int, 4 * 1024 * 1024, "largest gRPC message")
    _add(p, "--drain-grace-s", _seconds, 30.0, "on SIGTERM, how long in-flight calls may finish")
    _add(
        p,
        "--drain-accept-s",
        _seconds,
        10.0,
        "on SIGTERM, health turns NOT_SERVING at once but new calls are still served while "
        "they keep coming (a balancer sends them until its health checks notice), at most "
        "this long (0: refuse new calls at once; SIGINT never waits)",
    )
    _add(
        p,
        "--drain-quiet-s",
        _seconds,
        2.0,
        "the accept window ends once no new call has arrived for this long: at least the "
        "time a balancer takes to mark a replica down (0: no window)",
    )
    _add(p, "--reflection", _bool, True, "serve gRPC reflection (for grpcurl)")
    _add(p, "--max-concurrent-streams", int, 1024, "concurrent calls per client connection")
    _add(p, "--tls-cert", str, "", "PEM server certificate chain (with --tls-key: TLS)")
    _add(p, "--tls-key", str, "", "PEM private key of --tls-cert")
    _add(p, "--tls-client-ca", str, "", "PEM CA bundle: require client certificates (mTLS)")
    _add(
        p,
        "--auth-token-file",
        str,
        "",
        "bearer tokens, one per line (also $STREAMBATCH_AUTH_TOKENS, comma-separated); "
        "set: every call but health needs 'authorization: Bearer <token>'",
    )
    _add(p, "--latency-slo-ms", float, 0.0, "adaptive batch controller target p99 (0: off)")
    # Choices spelled here, not imported: importing the engine package would slow every
    # `--help` by half a second (tests/unit/test_cli.py checks they match).
    _add(
        p,
        "--controller-metric",
        str,
        "itl",
        "latency the controller watches: ttft, itl or e2e",
        choices=("ttft", "itl", "e2e"),
    )
    _add(
        p,
        "--controller-knob",
        str,
        "concurrency",
        "what the controller sets: concurrency (admitted requests, the seed's rule) or "
        "step_tokens (the engine's per-step token budget; in-process engine only)",
        choices=("concurrency", "step_tokens"),
    )
    _add(p, "--controller-shrink-above", float, 1.5, "shrink when p99 > this x SLO")
    _add(p, "--controller-grow-below", float, 0.5, "grow when p99 < this x SLO")
    _add(p, "--tracing", str, "off", "off, console or otlp (configured by the OTEL_* variables)")
    _add(p, "--record-content", _bool, False, "put prompts and completions in spans")
    _add(p, "--trace-engine-steps", float, 0.0, "fraction of engine steps traced (0: off)")
    _add(p, "--metrics-host", str, "127.0.0.1", "Prometheus endpoint address")
    _add(p, "--metrics-port", int, 9400, "Prometheus endpoint port (-1: off)")
    _add(p, "--log-level", str, "INFO", "logging level")


def _client_parser(sub: Any) -> None:
    g = sub.add_parser("generate", help="stream a completion to the terminal")
    g.add_argument("prompt", help="the user message (chat-templated unless --raw)")
    _add(g, "--target", str, DEFAULT_TARGET, "server address")
    _add(g, "--max-tokens", int, 128, "tokens to generate")
    _add(g, "--temperature", float, 0.7, "sampling temperature (0: greedy)")
    _add(g, "--top-p", float, 1.0, "nucleus sampling")
    _add(g, "--priority", int, 0, "0 normal, 1 high")
    _add(g, "--timeout", float, 60.0, "call deadline in seconds")
    g.add_argument(
        "--raw", action="store_true", help="send the prompt as raw text, no chat template"
    )
    i = sub.add_parser("info", help="print server info and load")
    _add(i, "--target", str, DEFAULT_TARGET, "server address")
    for client in (g, i):
        _add(client, "--tls-ca", str, "", "PEM CA that signed the server certificate (TLS)")
        _add(client, "--tls-cert", str, "", "PEM client certificate (mutual TLS)")
        _add(client, "--tls-key", str, "", "PEM private key of --tls-cert")
        _add(client, "--token", str, "", "bearer token (needs TLS)")
    m = sub.add_parser("model", help="manage the embedded default model")
    msub = m.add_subparsers(dest="model_cmd", required=True)
    pull = msub.add_parser("pull", help="download and convert the default model (idempotent)")
    _add(
        pull,
        "--cache-dir",
        str,
        "",
        "cache root (default: $STREAMBATCH_CACHE_DIR or ~/.cache/streambatch)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streambatch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    _serve_parser(sub)
    _client_parser(sub)
    return parser


def _prepare_engine_env(args: argparse.Namespace) -> None:
    """vLLM and the OpenMP runtime read these at import time, so they are set before anything
    imports torch or vllm."""
    # A flag (or its STREAMBATCH_ variable) beats vLLM's own variable; the variable, when set
    # (the Docker image sets VLLM_CPU_KVCACHE_SPACE), beats the default.
    if args.kv_cache_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(args.kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    if args.engine_process is not None:
        multiprocessing = "0" if args.engine_process == "inproc" else "1"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = multiprocessing
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if has_cuda_device() else "0")
    ranks = args.tensor_parallel_size * args.pipeline_parallel_size
    if not has_cuda_device() and args.pipeline_parallel_size > 1:
        # vLLM 0.32's CPU backend starts it, then the first request kills the engine (KeyError
        # in the scheduler's update_from_output on the batch-queue path); its own offline
        # LLM(pipeline_parallel_size=2) fails the same way here (docs/deploy.md).
        raise UsageError(
            "--pipeline-parallel-size > 1 fails in vLLM's CPU backend on the first request; "
            "use --tensor-parallel-size on the CPU"
        )
    if ranks > 1 and not has_cuda_device():
        # vLLM runs each rank as a process bound to its own group of cores ("0|1"), and
        # asserts (a traceback) when the groups do not match the ranks. The usable cores split
        # evenly unless the operator gave a binding, which must then have one group per rank.
        given = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        if given is None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = rank_cpu_lists(ranks)
        elif given not in ("auto", "all", "nobind") and given.count("|") + 1 != ranks:
            raise UsageError(
                f"VLLM_CPU_OMP_THREADS_BIND={given!r} has {given.count('|') + 1} core groups "
                f"for {ranks} parallel ranks: give one per rank, separated by '|'"
            )
    elif not has_cuda_device() and (
        args.bind_cores or os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    ):
        # A separate engine core on the CPU: vLLM's automatic binding keeps a core back for the
        # serving process, which measured 0.68x of in-process throughput on 2 cores; vLLM's
        # documented binding over every core is what its own servers are benchmarked with.
        # In-process, the same binding only when asked (--bind-cores; A/B in docs/benchmarks).
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", usable_cpu_list())
    # Read by the OpenMP runtime when torch loads. The default is every usable core: measured
    # on 2 cores, one thread for decode steps (leaving a core to gRPC, as vLLM's servers do for
    # their engine process) lost 28 % tokens/s at 4 streams and 21 % at 32 (docs/benchmarks.md).
    if args.engine_threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(args.engine_threads)


def _adapters(pairs: list[tuple[str, str]]) -> dict[str, str]:
    adapters: dict[str, str] = {}
    for name, path in pairs:
        if name in adapters:
            raise UsageError(f"--lora {name} given twice")
        adapters[name] = path
    return adapters


def _check_queue_order(args: argparse.Namespace) -> None:
    from pyserver.batching import MAX_LIFO_BACKLOG_S

    # The queue refuses these too, but only once the engine has loaded.
    # In seconds, as the server passes it on: no millisecond value just above the limit
    # rounds under it here and over it in the queue.
    if args.lifo_backlog_ms / 1e3 > MAX_LIFO_BACKLOG_S:
        raise UsageError(
            f"--lifo-backlog-ms ({args.lifo_backlog_ms:.12g}) must be at most "
            f"{MAX_LIFO_BACKLOG_S * 1e3:.12g} ({MAX_LIFO_BACKLOG_S / 3600:g} h)"
        )
    if 0 < args.oldest_first_after_ms <= args.lifo_after_ms:
        raise UsageError(
            f"--oldest-first-after-ms ({args.oldest_first_after_ms:g}) must be above "
            f"--lifo-after-ms ({args.lifo_after_ms:g}), or 0: at or below it, the bound would end "
            "newest-first order as soon as it begins"
        )


def _serve(args: argparse.Namespace, vllm_argv: list[str]) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    _check_queue_order(args)
    _prepare_engine_env(args)  # before anything (the model conversion) loads torch
    model = args.model
    if not model:
        from pyserver.engine import on_passing_thread
        from pyserver.model import default_model_dir, is_converted, pull_default_model

        # A first pull converts and test-runs the model with torch: off the main thread, so
        # no OpenMP team of its own outlives it in the serving process (see build_engine).
        model = str(
            default_model_dir()
            if is_converted(default_model_dir())
            else on_passing_thread(pull_default_model)
        )
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    elif Path(model).is_dir():
        os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from pyserver.engine import EngineConfigError, EngineOptions, parse_vllm_flags
    from pyserver.service.security import load_tokens

    vllm_flags = parse_vllm_flags(vllm_argv) if vllm_argv else {}
    from pyserver.service.server import ServerSettings, StreambatchServer

    settings = ServerSettings(
        engine=EngineOptions(
            model=model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens or None,
            enable_prefix_caching=args.enable_prefix_caching,
            enforce_eager=(
                not has_cuda_device() if args.enforce_eager is None else args.enforce_eager
            ),
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            separate_process=os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1",
            lora_adapters=_adapters(args.lora),
            extra=vllm_flags,
        ),
        host=args.host,
        port=args.port,
        priority_levels=args.priority_levels,
        queue_capacity=args.queue_capacity,
        bucket_bounds=args.bucket_bounds,
        batch_window_s=args.batch_window_ms / 1e3,
        max_wait_s=args.max_wait_ms / 1e3,
        aging_interval_s=args.aging_interval_ms / 1e3,
        lifo_after_s=args.lifo_after_ms / 1e3,
        prefix_affinity=args.prefix_affinity,
        oldest_first_after_s=args.oldest_first_after_ms / 1e3,
        oldest_first_turns=args.oldest_first_turns,
        lifo_backlog_s=args.lifo_backlog_ms / 1e3,
        level_capacity=args.level_capacity,
        level_queue_timeout_ms=args.level_queue_timeout_ms,
        reserved_top_slots=args.reserved_top_slots,
        step_tokens=args.step_tokens,
        deadline_admission=args.deadline_admission,
        refusal_confidence=args.refusal_confidence,
        preempt_after_s=None if args.preempt_after_ms < 0 else args.preempt_after_ms / 1e3,
        preemption=args.preemption,
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_limit=args.max_tokens_limit,
        max_message_bytes=args.max_message_bytes,
        drain_grace_s=args.drain_grace_s,
        drain_accept_s=args.drain_accept_s,
        drain_quiet_s=args.drain_quiet_s,
        tracing=args.tracing,
        record_content=args.record_content,
        trace_engine_steps=args.trace_engine_steps,
        latency_slo_ms=args.latency_slo_ms,
        controller_metric=args.controller_metric,
        controller_knob=args.controller_knob,
        controller_shrink_above=args.controller_shrink_above,
        controller_grow_below=args.controller_grow_below,
        metrics_host=args.metrics_host,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        reflection=args.reflection,
        max_concurrent_streams=args.max_concurrent_streams,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        auth_tokens=load_tokens(args.auth_token_file),
    )

    async def run() -> int:
        server = StreambatchServer(settings)
        server.install_signal_handlers()
        await server.start()
        return await server.wait()

    try:
        return asyncio.run(run())
    except EngineConfigError as exc:
        print(f"streambatch serve: error: vLLM rejected the engine configuration: {exc}",
              file=sys.stderr)  # fmt: skip
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.cmd == "serve":
        try:
            return _serve(args, unknown)
        except UsageError as exc:
            print(f"streambatch serve: error: {exc}", file=sys.stderr)
            return 2
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.cmd == "model":
        from pyserver.model import pull_default_model

        logging.basicConfig(level="INFO", format="%(message)s")
        print(pull_default_model(Path(args.cache_dir) if args.cache_dir else None))
        return 0
    from pyserver.service import client

    if args.cmd == "generate":
        return client.generate(args)
    return client.info(args)


if __name__ == "__main__":
    sys.exit(main())
