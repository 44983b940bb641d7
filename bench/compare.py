"""streambatch against the servers a user would otherwise pick: same engine, same engine
arguments, same prompts, every peer at its best documented set-up for the machine.

Targets (one at a time: two engines on two cores fight over core 0), each started by this
script on loopback in a process group of its own and torn down as one (bench/harness.py; a
survivor fails the run):
  streambatch           `streambatch serve`, its defaults plus the shared engine arguments;
                        streaming gRPC Generate on the templated text
  vllm_openai           vLLM's OpenAI server (python -m vllm.entrypoints.openai.api_server),
                        streaming /v1/completions, VLLM_CPU_OMP_THREADS_BIND over every core
                        this process may use (vLLM's documented CPU knob; by default it keeps
                        a core for the API process and computes on the other) and TCMalloc and
                        Intel OpenMP in LD_PRELOAD (its CPU guide; see --peer-preload)
  vllm_grpc             vLLM's gRPC launcher (python -m vllm.entrypoints.launchers.grpc_server),
                        token ids in and out, the same binding and preload, warm-up and KV
                        events off
  *_autobind            the two vLLM servers with vLLM's default set-up: its own binding, no
                        preload (extra rows, one round)
  seed_fastapi          the seed article's design (bench/peers/seed_fastapi.py; one round)
  offline               vllm.LLM.generate over the fixed64 prompts, engine in-process, the same
                        preload (one round)
  streambatch+FLAG+...  streambatch with extra `serve` flags, e.g.
                        streambatch+--engine-process=separate (for experiments)

Workloads (seeded; chat-templated once with the model's tokenizer; closed loop; the first
--warmup requests of each run are sequential and not counted):
  fixed64        mixed-length prompts, exactly 64 output tokens (ignore_eos)
  chat           long-tailed (log-normal) prompt and output lengths, EOS allowed
  shared_prefix  one ~1.5k-token document as the system prompt, short questions, 64 tokens
  many_docs, many_docs_grouped (opt-in, one per invocation)  --docs documents of
                 --doc-tokens as system prompts, one picked uniformly per call; the same calls
                 in arrival order, and reordered by document with all of them known in
                 advance (an oracle order: what a prefix-aware admission could at best do for
                 throughput); headline level only
  conversations (opt-in)  --turns-turn chats replayed from a script: an opening with pasted
                 text, short follow-ups, each turn's prompt the whole history so far (the
                 earlier replies scripted), the next turn sent by the same caller when the
                 last one ended; 64 tokens per turn; headline level only
Prefix caching is on for every target (the same flag), as are --max-num-seqs and
--max-num-batched-tokens (explicit: vLLM's defaults differ between its entry points).

Rounds: every target once per round, the order shuffled per round (seeded); each start serves
all workloads at the headline concurrency (--concurrency) and the sweep levels (fewer requests
per level, fresh prompts so no level hits another's cache; every round unless --sweep-rounds
says fewer). Reported for every level: the median over rounds with min-max, and the median of
the per-round streambatch/target ratios with their min-max.

Prefix-cache hit % per level (`prefix_hit_pct`): of the prompt tokens the server admitted
during the level, warm-up included, the share its prefix cache served, from its own
Prometheus counters read before and after (streambatch's and the OpenAI server's; the gRPC
launcher has no endpoint). streambatch counts a prompt again when a preempted request is
re-admitted, vLLM once: alike here, where one priority class runs and nothing is cancelled.

Token accounting is bench/load.py's TokenClock for every client (tokens per message from the
message's own token ids; one gap per token after the first). The OpenAI client asks for
`return_token_ids` so each SSE chunk says how many tokens it carries.

Writes bench/results/compare.json, compare.md and compare.png; the last stdout line is one
JSON object {"rounds": R, "workloads": {...}}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from streambatch.v1 import generation_pb2_grpc as pb_grpc
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import (  # noqa: E402
    PEER_PRELOAD_HELP,
    PRELOAD_ENV,
    Group,
    SurvivorError,
    cpu_list,
    metric_families,
    peer_preload,
)
from load import (  # noqa: E402
    Report,
    Sample,
    TokenClock,
    closed_loop,
    generate_request,
    one,
    prompts,
)

RESULTS = HERE / "results"
WORKLOADS = ("fixed64", "chat", "shared_prefix")
# Opt-in (--workloads, one per invocation: in one server start the second would inherit the
# first's prefix cache): many documents in rotation, the same calls in arrival order and
# grouped by document (an oracle order, every call known in advance); multi-turn
# conversations, each turn's prompt the whole history before it.
EXTRA_WORKLOADS = ("many_docs", "many_docs_grouped", "conversations")
# Environment variables that change how a target computes; each target's `setup` lists them.
RELEVANT_ENV = (
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_HOST_IP",
    "OMP_NUM_THREADS",
    "SMG_VLLM_SERVICER_WARMUP",
    "SMG_VLLM_SERVICER_KV_EVENTS",
    "HF_HUB_OFFLINE",
    *PRELOAD_ENV,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def peer_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    # Each target runs vLLM's process model and CPU binding its own way unless told.
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    for var in PRELOAD_ENV:
        env.pop(var, None)
    return env


def wait_until(
    ready: Callable[[], bool], proc: subprocess.Popen[bytes], what: str, timeout: float = 600
) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
        try:
            if ready():
                return
        except Exception:  # not listening yet
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} was not ready within {timeout} s")


def grpc_serving(target: str) -> bool:
    with grpc.insecure_channel(target) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


def http_ok(url: str) -> bool:
    return httpx.get(url, timeout=2).status_code == 200


class Server(Group):
    """A target process in its own process group (bench/harness.py): `stop()` ends the whole
    group and raises if any of it survives. `env` overrides peer_env(); a value of None
    removes the variable."""

    def __init__(
        self, cmd: list[str], log: Path, extra_env: dict[str, str | None] | None = None
    ) -> None:
        env = peer_env()
        for k, v in (extra_env or {}).items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        self.env = env
        super().__init__(cmd, log, env)

    def setup(self) -> dict[str, Any]:
        """The flags and the relevant environment this target ran with."""
        return {
            "argv": [a for a in self.cmd if a != sys.executable],
            "env": {k: self.env.get(k, "(unset)") for k in RELEVANT_ENV},
        }


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine arguments every target gets, identically."""
    flags = [
        "--dtype",
        args.dtype,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-model-len",
        str(args.max_model_len),
    ]
    if args.max_num_batched_tokens:
        flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return flags


def start_streambatch(
    args: argparse.Namespace, log: str, extra: list[str] | tuple[str, ...] = ()
) -> tuple[Server, str]:
    """`streambatch serve` on a free loopback port with the engine arguments every target
    gets; returns once it reports SERVING."""
    port = free_port()
    target = f"127.0.0.1:{port}"
    prefix = ["--enable-prefix-caching", "true"] if getattr(args, "prefix_caching", False) else []
    server = Server(
        [
            sys.executable, "-m", "pyserver.cli", "serve", "--model", args.model,
            "--port", str(port), *engine_flags(args), *prefix, "--metrics-port", "-1",
            "--queue-capacity", "4096", "--log-level", "WARNING", *extra,
        ],
        RESULTS / log,
    )  # fmt: skip
    try:
        wait_until(lambda: grpc_serving(target), server.proc, "streambatch")
        server.note_children()
    except BaseException:
        server.stop()
        raise
    return server, target


# ---------------------------------------------------------------------------------------------
# Workloads


@dataclass(frozen=True)
class Item:
    text: str  # chat-templated prompt, sent as raw text
    ids: tuple[int, ...]  # its token ids (vllm_grpc takes ids only; lengths for the report)
    max_tokens: int
    ignore_eos: bool
    continues: bool = False  # the next turn of the item before it (sent after that one ends)


@dataclass
class Workload:
    name: str
    headline: list[Item]  # warm-up + measured, the same in every round
    sweep: dict[int, list[Item]] = field(default_factory=dict)  # level -> warm-up + measured
    describe: str = ""


_TOPICS = [
    "river", "mountain", "engine", "signal", "harbor", "lantern", "orbit", "garden", "copper",
    "violet", "thunder", "meadow", "crystal", "falcon", "cipher", "ember", "glacier", "canyon",
    "market", "library", "bridge", "comet", "forest", "compass", "island", "archive", "tower",
]  # fmt: skip
_ASKS = [
    "Write a short story about",
    "Explain in simple terms how these relate:",
    "List facts about",
    "Summarize what you know about",
    "Write a poem about",
    "Give advice about",
]


def build_workloads(args: argparse.Namespace, tok: Any) -> dict[str, Workload]:
    def template(user: str, system: str | None = None) -> str:
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}
        ]
        return str(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))

    def item(text: str, max_tokens: int, ignore_eos: bool) -> Item:
        ids = tuple(tok(text, add_special_tokens=False)["input_ids"])
        # Leave room in the context for the answer (chat's tail can reach the limit).
        max_tokens = max(1, min(max_tokens, args.max_model_len - len(ids) - 1))
        return Item(text, ids, max_tokens, ignore_eos)

    levels = [c for c in args.sweep if c != args.concurrency]
    n_head = args.warmup + args.requests
    per_level = {
        c: args.warmup + max(math.ceil(args.sweep_waves * c), args.sweep_min_requests)
        for c in levels
    }
    total = n_head + sum(per_level.values())

    def split(items: list[Item]) -> tuple[list[Item], dict[int, list[Item]]]:
        head, rest = items[:n_head], items[n_head:]
        sweep = {}
        for c in levels:
            sweep[c], rest = rest[: per_level[c]], rest[per_level[c] :]
        return head, sweep

    out: dict[str, Workload] = {}
    fixed = [item(template(t), 64, True) for t in prompts(total, args.seed)]
    out["fixed64"] = Workload("fixed64", *split(fixed), "8-120 topic words, 64 tokens, ignore_eos")

    rng = np.random.default_rng(args.seed + 1)
    pick = random.Random(args.seed + 1)
    chat = []
    for _ in range(total):
        # Log-normal lengths: most prompts and answers short, a long tail (as chat traffic).
        words = int(np.clip(rng.lognormal(np.log(30), 1.0), 3, 900))
        out_len = int(np.clip(rng.lognormal(np.log(64), 0.9), 4, 768))
        user = f"{pick.choice(_ASKS)} " + " ".join(pick.choice(_TOPICS) for _ in range(words))
        chat.append(item(template(user), out_len, False))
    out["chat"] = Workload(
        "chat", *split(chat), "log-normal prompt (median 30 words) and max_tokens (median 64), EOS"
    )

    def document(rng: random.Random, tokens: int, title: str = "this document") -> str:
        sentences: list[str] = []
        text = ""
        while len(tok(text)["input_ids"]) < tokens:
            sentences.append(f"Section {len(sentences) + 1}: {fact(rng)}.")
            text = f"Answer questions about {title}.\n\n" + " ".join(sentences)
        return text

    system = document(random.Random(args.seed + 2), args.prefix_tokens)
    shared = []
    for i in range(total):
        a, b = pick.choice(_TOPICS), pick.choice(_TOPICS)
        user = f"Question {i}: what does the document say about the {a} and the {b}?"
        shared.append(item(template(user, system), 64, True))
    out["shared_prefix"] = Workload(
        "shared_prefix",
        *split(shared),
        f"one {len(tok(system)['input_ids'])}-token system document, short questions, 64 tokens",
    )
    wanted = set(args.workloads.split(","))
    if "conversations" in wanted:
        out["conversations"] = conversations(args, tok)
    if not {"many_docs", "many_docs_grouped"} & wanted:
        return out
    doc_rng = random.Random(args.seed + 3)
    docs = [document(doc_rng, args.doc_tokens, f"document {d}") for d in range(args.docs)]
    picked = [doc_rng.randrange(args.docs) for _ in range(total)]
    many = []
    for i, d in enumerate(picked):
        a, b = pick.choice(_TOPICS), pick.choice(_TOPICS)
        user = f"Question {i}: what does the document say about the {a} and the {b}?"
        many.append(item(template(user, docs[d]), 64, True))
    what = f"{args.docs} documents of ~{args.doc_tokens} tokens as system prompts, 64 tokens"
    # Headline level only: a sweep level would find the headline's documents still cached.
    head, _ = split(many)
    out["many_docs"] = Workload("many_docs", head, {}, f"{what}, documents picked uniformly")
    warm = args.warmup
    head = out["many_docs"].headline
    order = sorted(range(warm, len(head)), key=lambda i: picked[i])
    out["many_docs_grouped"] = Workload(
        "many_docs_grouped",
        head[:warm] + [head[i] for i in order],
        {},  # the sweep's calls are in arrival order: no grouped sweep
        f"{what}, the same calls sent grouped by document",
    )
    return out


def fact(rng: random.Random) -> str:
    """One sentence of filler text (three topic words drawn in turn), as documents and
    scripted replies are made of."""
    a, b, c = (rng.choice(_TOPICS) for _ in range(3))
    return f"the {a} near the {b} holds the {c}"


def conversations(args: argparse.Namespace, tok: Any) -> Workload:
    """--requests ÷ --turns multi-turn chats (headline level only): an opening message with
    pasted text (log-normal, median --paste-words words), then short follow-ups; each turn's
    prompt is the whole history before it, the assistant's earlier replies scripted
    (log-normal, median --reply-words) so every target is sent the same prompts, as a replayed
    chat log would be. 64 tokens per turn. A conversation's next turn goes out when its last one
    ended, from the same caller; what a prefix cache can reuse is the previous turn's prompt.
    The warm-up calls are openings of conversations of their own."""
    if args.requests % args.turns:
        raise SystemExit(f"--requests ({args.requests}) must be a multiple of --turns")
    rng = np.random.default_rng(args.seed + 4)
    pick = random.Random(args.seed + 4)
    # A turn's prompt leaves room for its 64-token answer and a token to spare.
    limit = args.max_model_len - 65

    def words(median: float, low: int, high: int) -> str:
        n = int(np.clip(rng.lognormal(np.log(median), 0.6), low, high))
        return " ".join(pick.choice(_TOPICS) for _ in range(n))

    def reply() -> str:
        n = int(np.clip(rng.lognormal(np.log(args.reply_words / 8), 0.5), 2, 60))
        return " ".join(f"{fact(pick).capitalize()}." for _ in range(n))

    def conversation(turns: int) -> list[Item]:
        """One chat of `turns` turns, drawn again until its last turn fits the context."""
        for _ in range(1000):
            opening = f"{pick.choice(_ASKS)} the text below.\n\n" + words(
                args.paste_words, 20, 4 * args.paste_words
            )
            history = [{"role": "user", "content": opening}]
            out: list[Item] = []
            for t in range(turns):
                if t:
                    history += [
                        {"role": "assistant", "content": reply()},
                        {"role": "user", "content": f"{pick.choice(_ASKS)} " + words(12, 3, 80)},
                    ]
                text = str(
                    tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
                )
                ids = tuple(tok(text, add_special_tokens=False)["input_ids"])
                if len(ids) > limit:
                    break
                out.append(Item(text, ids, 64, True, continues=t > 0))
            if len(out) == turns:
                return out
        raise SystemExit(
            f"no {turns}-turn chat of --paste-words {args.paste_words} / --reply-words "
            f"{args.reply_words} fits --max-model-len {args.max_model_len}: use fewer or shorter"
        )

    items = [turn for _ in range(args.warmup) for turn in conversation(1)]
    for _ in range(args.requests // args.turns):
        items += conversation(args.turns)
    return Workload(
        "conversations",
        items,
        {},  # no sweep: its slices would cut conversations apart
        f"{args.requests // args.turns} {args.turns}-turn chats: an opening with "
        f"~{args.paste_words} pasted words, scripted replies (~{args.reply_words} words), short "
        "follow-ups; each turn the whole history, 64 tokens",
    )


# ---------------------------------------------------------------------------------------------
# Targets: how each is started and how a client sends one Item

Send = Callable[[Item], Awaitable[Sample]]


@dataclass
class TargetSpec:
    name: str
    kind: str  # streambatch | vllm_openai | vllm_grpc | seed_fastapi | offline
    env: dict[str, str | None] = field(default_factory=dict)
    extra: list[str] = field(default_factory=list)
    every_round: bool = True
    workloads: tuple[str, ...] = WORKLOADS + EXTRA_WORKLOADS
    headline_only: bool = False


def target_specs(args: argparse.Namespace) -> list[TargetSpec]:
    # vLLM at its best on the CPU: OpenMP bound over every usable core, TCMalloc and Intel
    # OpenMP preloaded (its CPU guide); its default set-up stays as the *_autobind rows.
    best = {"VLLM_CPU_OMP_THREADS_BIND": cpu_list()}
    if args.peer_preload:
        best["LD_PRELOAD"] = args.peer_preload
    smg = {"SMG_VLLM_SERVICER_WARMUP": "off", "SMG_VLLM_SERVICER_KV_EVENTS": "0"}
    known = {
        "streambatch": TargetSpec("streambatch", "streambatch"),
        "vllm_openai": TargetSpec("vllm_openai", "vllm_openai", env=dict(best)),
        "vllm_grpc": TargetSpec("vllm_grpc", "vllm_grpc", env={**best, **smg}),
        "vllm_openai_autobind": TargetSpec(
            "vllm_openai_autobind",
            "vllm_openai",
            every_round=False,
            workloads=("fixed64",),
            headline_only=True,
        ),
        "vllm_grpc_autobind": TargetSpec(
            "vllm_grpc_autobind",
            "vllm_grpc",
            env=dict(smg),
            every_round=False,
            workloads=("fixed64",),
            headline_only=True,
        ),
        "seed_fastapi": TargetSpec(
            "seed_fastapi",
            "seed_fastapi",
            every_round=False,
            workloads=("fixed64",),
            headline_only=True,
        ),
        "offline": TargetSpec(
            "offline",
            "offline",
            env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **best},
            every_round=False,
            workloads=("fixed64",),
            headline_only=True,
        ),
    }
    out = []
    for name in args.targets.split(","):
        if name in known:
            out.append(known[name])
        elif name.startswith("streambatch+"):
            flags = [f for part in name.split("+")[1:] for f in part.split("=", 1)]
            out.append(TargetSpec(name, "streambatch", extra=flags))
        else:
            raise SystemExit(f"unknown target {name!r}")
    return out


def launch(spec: TargetSpec, args: argparse.Namespace) -> tuple[Server, str, str | None]:
    """Start one target and wait until it serves; returns it, its address and its Prometheus
    endpoint (None where it has none: the gRPC launcher, the seed peer)."""
    port = free_port()
    py = [sys.executable, "-m"]
    common = ["--model", args.model, "--port", str(port), *engine_flags(args)]
    log = RESULTS / f"{spec.name.replace('+', '_')}.log"
    metrics: str | None = None
    if spec.kind == "streambatch":
        metrics_port = free_port()
        metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        cmd = [
            *py, "pyserver.cli", "serve", *common, "--enable-prefix-caching", "true",
            "--kv-cache-gib", str(args.kv_cache_gib), "--metrics-port", str(metrics_port),
            "--queue-capacity", "4096", "--log-level", "WARNING", *spec.extra,
        ]  # fmt: skip
    elif spec.kind in ("vllm_openai", "vllm_grpc"):
        module = {
            "vllm_openai": "vllm.entrypoints.openai.api_server",
            "vllm_grpc": "vllm.entrypoints.launchers.grpc_server",
        }[spec.kind]
        cmd = [
            *py, module, *common, "--host", "127.0.0.1", "--enforce-eager",
            "--enable-prefix-caching", *spec.extra,
        ]  # fmt: skip
        if spec.kind == "vllm_openai":
            cmd += ["--served-model-name", "m", "--no-enable-log-requests"]
    elif spec.kind == "seed_fastapi":
        cmd = [sys.executable, str(HERE / "peers" / "seed_fastapi.py"), *common]
    else:
        raise ValueError(spec.kind)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib), **spec.env}
    server = Server(cmd, log, extra_env=env)
    try:
        if spec.kind in ("streambatch", "vllm_grpc"):
            addr = f"127.0.0.1:{port}"
            wait_until(lambda: grpc_serving(addr), server.proc, spec.name)
        else:
            addr = f"http://127.0.0.1:{port}"
            wait_until(lambda: http_ok(f"{addr}/health"), server.proc, spec.name)
            if spec.kind == "vllm_openai":
                metrics = f"{addr}/metrics"
        server.note_children()
    except BaseException:
        server.stop()
        raise
    return server, addr, metrics


# Prompt tokens admitted, and those the prefix cache served: the same two counters under each
# server's name (streambatch counts vLLM's num_cached_tokens per request, as vLLM's own do).
_PROMPT_COUNTERS = {
    "streambatch_prompt_tokens_total": "prompt",
    "streambatch_prompt_tokens_cached_total": "cached",
    "vllm:prompt_tokens_total": "prompt",
    "vllm:prompt_tokens_cached_total": "cached",
}


def prompt_counters(url: str | None) -> dict[str, float] | None:
    """A target's prompt-token counters now (None: no endpoint, or not both counters)."""
    if url is None:
        return None
    counts: dict[str, float] = {}
    for family in metric_families(url):
        for s in family.samples:
            if key := _PROMPT_COUNTERS.get(s.name):
                counts[key] = counts.get(key, 0.0) + s.value
    return counts if len(counts) == 2 else None


def prefix_hit_pct(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """Of the prompt tokens the server admitted during a level (its warm-up calls included),
    the share its prefix cache served, from its own counters: a measured figure, not a log
    line."""
    if before is None or after is None or after["prompt"] <= before["prompt"]:
        return None
    cached = after["cached"] - before["cached"]
    if cached < 0:  # a counter went back: the server restarted in between
        return None
    return round(100.0 * cached / (after["prompt"] - before["prompt"]), 1)


class Client:
    """One connection set to a started target; `send` runs one request to completion."""

    def __init__(self, kind: str, addr: str, max_conc: int) -> None:
        self.kind = kind
        self.addr = addr
        self.max_conc = max_conc
        self._n = 0

    async def __aenter__(self) -> Client:
        if self.kind in ("streambatch", "vllm_grpc"):
            self.channel = grpc.aio.insecure_channel(self.addr)
        else:
            limits = httpx.Limits(max_connections=self.max_conc + 8)
            self.http = httpx.AsyncClient(base_url=self.addr, timeout=3600, limits=limits)
        if self.kind == "vllm_grpc":
            from smg_grpc_proto import vllm_engine_pb2 as vpb
            from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc

            self.vpb: Any = vpb
            self.vstub: Any = vpb_grpc.VllmEngineStub(self.channel)
        elif self.kind == "streambatch":
            self.stub = pb_grpc.GenerationStub(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.kind in ("streambatch", "vllm_grpc"):
            await self.channel.close()
        else:
            await self.http.aclose()

    @property
    def streaming(self) -> bool:
        return self.kind != "seed_fastapi"

    async def send(self, item: Item) -> Sample:
        return await getattr(self, "_" + self.kind)(item)

    async def _streambatch(self, item: Item) -> Sample:
        req = generate_request(item.text, item.max_tokens, chat=False)
        req.sampling.ignore_eos = item.ignore_eos
        return await one(self.stub, req, 3600)

    async def _vllm_openai(self, item: Item) -> Sample:
        body = {
            "model": "m",
            "prompt": item.text,
            "max_tokens": item.max_tokens,
            "temperature": 0.0,
            "ignore_eos": item.ignore_eos,
            "stream": True,
            # Each chunk's own token ids: the token count per chunk, not per SSE event.
            "return_token_ids": True,
        }
        clock = TokenClock()
        async with self.http.stream("POST", "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices") or ():
                    clock.add(len(choice.get("token_ids") or ()))
        return clock.sample()

    async def _vllm_grpc(self, item: Item) -> Sample:
        # Token ids in and out: tokenizing and detokenizing are the caller's job there and are
        # left out of this target's timing, which favours it.
        vpb = self.vpb
        self._n += 1
        req = vpb.GenerateRequest(
            request_id=f"r{self._n}",
            tokenized=vpb.TokenizedInput(input_ids=list(item.ids)),
            sampling_params=vpb.SamplingParams(
                temperature=0.0, max_tokens=item.max_tokens, ignore_eos=item.ignore_eos
            ),
            stream=True,
        )
        clock = TokenClock()
        async for msg in self.vstub.Generate(req, timeout=3600):
            if msg.HasField("chunk"):
                clock.add(len(msg.chunk.token_ids))
        return clock.sample()

    async def _seed_fastapi(self, item: Item) -> Sample:
        clock = TokenClock()
        resp = await self.http.post(
            "/generate",
            json={
                "prompt": item.text,
                "max_tokens": item.max_tokens,
                "temperature": 0.0,
                "top_p": 1.0,
                "ignore_eos": item.ignore_eos,
            },
        )
        resp.raise_for_status()
        clock.add(int(resp.json()["tokens"]))  # no streaming: every token arrives at the end
        return clock.sample()


async def run_level(client: Client, items: list[Item], c: int, warmup: int, label: str) -> Report:
    report = await closed_loop(client.send, items, c, warmup, label, lambda i: i.continues)
    report.streaming = client.streaming
    return report


def run_target(
    spec: TargetSpec, args: argparse.Namespace, loads: dict[str, Workload], sweep: bool
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """One start of one target: every workload at the headline level (and the sweep levels if
    `sweep`). Returns {workload: {level: summary}} and the target's setup."""
    if spec.kind == "offline":
        return run_offline(spec, args, loads["fixed64"])
    server, addr, metrics = launch(spec, args)
    try:

        async def level(
            client: Client, items: list[Item], c: int, warmup: int, label: str
        ) -> dict[str, Any]:
            before = prompt_counters(metrics)
            summary = (await run_level(client, items, c, warmup, label)).summary()
            summary["prefix_hit_pct"] = prefix_hit_pct(before, prompt_counters(metrics))
            return summary

        async def go() -> dict[str, dict[str, Any]]:
            out: dict[str, dict[str, Any]] = {}
            async with Client(spec.kind, addr, max(args.sweep)) as client:
                for name in spec.workloads:
                    w = loads[name]
                    head = w.headline
                    if spec.kind == "seed_fastapi":  # one request at a time: a few suffice
                        head = head[: args.warmup + args.seed_requests]
                    levels = {
                        args.concurrency: await level(
                            client, head, args.concurrency, args.warmup,
                            f"{spec.name} {name} c={args.concurrency}",
                        )
                    }  # fmt: skip
                    if sweep and not spec.headline_only:
                        for c, items in w.sweep.items():
                            if c > args.sweep_cap and name not in args.sweep_full:
                                continue
                            # The headline just warmed this server (and cached the shared
                            # prefix): the sweep items' warm-up slots are not sent.
                            label = f"{spec.name} {name} c={c}"
                            levels[c] = await level(client, items[args.warmup :], c, 0, label)
                    out[name] = {str(c): summary for c, summary in sorted(levels.items())}
            return out

        result = asyncio.run(go())
    finally:
        server.stop()
    return result, server.setup()


def run_offline(
    spec: TargetSpec, args: argparse.Namespace, w: Workload
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """vllm.LLM.generate over the fixed64 headline prompts at once: the engine's ceiling (no
    TTFT: everything arrives together)."""
    path = RESULTS / "prompts.json"
    path.write_text(json.dumps([i.text for i in w.headline[args.warmup :]]))
    log = RESULTS / "offline.log"
    cmd = [
        sys.executable, str(HERE / "peers" / "offline.py"), "--model", args.model,
        "--prompts", str(path), "--max-tokens", "64", "--thread", "engine", *engine_flags(args),
    ]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib), **spec.env}
    server = Server(cmd, log, extra_env=env)
    try:
        rc = server.proc.wait(1800)
    finally:
        server.stop()
    text = log.read_text(errors="replace")
    lines = [x for x in text.splitlines() if x.startswith("RESULT ")]
    if rc or not lines:
        raise RuntimeError(f"offline exited {rc}; see {log}")
    summary = json.loads(lines[-1].removeprefix("RESULT "))
    return {"fixed64": {str(args.concurrency): summary}}, server.setup()


# ---------------------------------------------------------------------------------------------
# Aggregation and reports

_MEDIAN_KEYS = (
    "output_tok_s", "requests_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
    "ttft_p99_after_first_wave_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms",
    "client_cpu_pct", "output_tokens", "prefix_hit_pct",
)  # fmt: skip
# Multi-turn runs only (bench/load.py's Report): [p50, p90, p99] lists, medians per position.
_MEDIAN_LISTS = (
    "ttft_openings_p50_p90_p99_ms", "ttft_follow_ups_p50_p90_p99_ms",
    "conversation_p50_p90_p99_ms",
)  # fmt: skip


def aggregate(per_round: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds, with the spread of throughput and TTFT p99."""
    ok = [r for r in per_round if "output_tok_s" in r]
    out: dict[str, Any] = {"rounds": len(ok)}
    for k in _MEDIAN_KEYS:
        vals = [r[k] for r in ok if r.get(k) is not None]
        out[k] = round(float(np.median(vals)), 1) if vals else None
    for k in _MEDIAN_LISTS:
        if lists := [r[k] for r in ok if r.get(k)]:
            out[k] = [round(float(v), 1) for v in np.median(lists, axis=0)]
    for k in ("output_tok_s", "ttft_p99_ms"):
        vals = [r[k] for r in ok if r.get(k) is not None]
        if vals:
            out[f"{k}_min"], out[f"{k}_max"] = min(vals), max(vals)
    errors: dict[str, int] = {}
    for r in per_round:
        for k, v in (r.get("errors") or {}).items():
            errors[k] = errors.get(k, 0) + v
        if "error" in r:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    out["errors"] = errors
    return out


def paired_ratios(sb: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, Any]:
    """streambatch/target tok/s in each round both ran (same round: same noise): the median,
    and the lowest and highest round, so a lead is claimed only where every round shows it."""
    theirs = {x.get("round"): x for x in other}
    pairs = [
        a["output_tok_s"] / b["output_tok_s"]
        for a in sb
        if (b := theirs.get(a.get("round"))) is not None
        and a.get("output_tok_s")
        and b.get("output_tok_s")
    ]
    if not pairs:
        return {"streambatch_ratio": None}
    return {
        "streambatch_ratio": round(float(np.median(pairs)), 3),
        "streambatch_ratio_min": round(min(pairs), 3),
        "streambatch_ratio_max": round(max(pairs), 3),
        "streambatch_ratio_pairs": len(pairs),  # rounds both ran: "every round" means these
    }


def summarize(
    raw: dict[str, dict[str, list[dict[str, Any]]]], c_head: str, setups: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One workload's report from raw[target][level] = per-round summaries (each tagged with
    its "round"): per target the headline level's aggregate with its setup, and, for targets
    that ran more levels, every level's aggregate. Ratios pair rounds with streambatch's."""
    targets: dict[str, Any] = {}
    sweeps: dict[str, Any] = {}
    sb_levels = raw.get("streambatch", {})
    for name, levels in raw.items():
        if not levels:
            continue
        per_level = {}
        for c in sorted(levels, key=int):
            per_level[c] = aggregate(levels[c])
            per_level[c].update(paired_ratios(sb_levels.get(c, []), levels[c]))
        head = dict(per_level.get(c_head) or aggregate([]))
        head["setup"] = setups.get(name, {})
        head["per_round_output_tok_s"] = [x.get("output_tok_s") for x in levels.get(c_head, [])]
        # With EOS allowed the tokens generated differ between runs (bf16 results depend on
        # what shares the batch): a round's tok/s is read beside its token count.
        head["per_round_output_tokens"] = [x.get("output_tokens") for x in levels.get(c_head, [])]
        targets[name] = head
        if len(levels) > 1:
            sweeps[name] = per_level
    return targets, sweeps


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}" if v < 10000 else f"{v:,.0f}"
    return str(v)


def tables(result: dict[str, Any]) -> str:
    out = []
    for name, w in result["workloads"].items():
        out.append(f"### {name} — c={w['concurrency']} ({w['describe']})\n")
        out.append(
            "| target | rounds | output tok/s median (min-max) "
            "| streambatch ÷ target (rounds' min-max) "
            "| TTFT p50 / p99 ms (p99 after the first wave) | ITL p50 / p99 ms "
            "| e2e p50 / p99 ms | prefix hit % | client CPU % | errors |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for t, r in w["targets"].items():
            if "output_tok_s" not in r or r["output_tok_s"] is None:
                out.append(f"| {t} | 0 | failed: {r.get('errors')} | | | | | | | |")
                continue
            spread = (
                f"{fmt(r['output_tok_s'])} ({fmt(r.get('output_tok_s_min'))}-"
                f"{fmt(r.get('output_tok_s_max'))})"
            )
            ratio = r.get("streambatch_ratio")
            ratio_cell = (
                f"{ratio:.2f} ({r['streambatch_ratio_min']:.2f}-{r['streambatch_ratio_max']:.2f})"
                if ratio is not None
                else "-"
            )
            out.append(
                f"| {t} | {r['rounds']} | {spread} | {ratio_cell} "
                f"| {fmt(r.get('ttft_p50_ms'))} / {fmt(r.get('ttft_p99_ms'))} "
                f"({fmt(r.get('ttft_p99_after_first_wave_ms'))}) "
                f"| {fmt(r.get('itl_p50_ms'))} / {fmt(r.get('itl_p99_ms'))} "
                f"| {fmt(r.get('e2e_p50_ms'))} / {fmt(r.get('e2e_p99_ms'))} "
                f"| {fmt(r.get('prefix_hit_pct'))} "
                f"| {fmt(r.get('client_cpu_pct'))} | {r.get('errors') or ''} |"
            )
        if w.get("sweep"):
            out.extend(sweep_tables(w["sweep"]))
        out.append("")
    return "\n".join(out)


def sweep_tables(sweep: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """Per level: each target's medians over the rounds that ran it, and streambatch ÷ target
    as the median of per-round ratios (min-max)."""
    levels = sorted({int(c) for s in sweep.values() for c in s})
    head = [
        "| target | " + " | ".join(f"c={c}" for c in levels) + " |",
        "|---|" + "---|" * len(levels),
    ]
    out = ["\nSweep: output tok/s / TTFT p99 ms, medians over the rounds (count in brackets):\n"]
    out += head
    for t, s in sweep.items():
        cells = []
        for c in levels:
            p = s.get(str(c), {})
            ok = p.get("output_tok_s")
            cells.append(
                f"{fmt(ok)} / {fmt(p.get('ttft_p99_ms'))} ({p.get('rounds', 0)})" if ok else "-"
            )
        out.append(f"| {t} | " + " | ".join(cells) + " |")
    out += ["\nstreambatch ÷ target by level: median of per-round ratios (min-max):\n", *head]
    for t, s in sweep.items():
        if t == "streambatch":
            continue
        cells = []
        for c in levels:
            p = s.get(str(c), {})
            r = p.get("streambatch_ratio")
            cells.append(
                f"{r:.2f} ({p['streambatch_ratio_min']:.2f}-{p['streambatch_ratio_max']:.2f})"
                if r is not None
                else "-"
            )
        out.append(f"| {t} | " + " | ".join(cells) + " |")
    return out


def plot(result: dict[str, Any], folder: Path) -> None:
    """Per workload: output tokens/s and p99 TTFT against concurrency, one line per target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    fig, axes = plt.subplots(len(names), 2, figsize=(11, 3.6 * len(names)), squeeze=False)
    for row, name in zip(axes, names, strict=True):
        w = result["workloads"][name]
        tput, ttft = row
        for t, s in w.get("sweep", {}).items():
            levels = sorted(int(c) for c in s if s[c].get("output_tok_s"))
            if len(levels) < 2:
                continue
            tput.plot(levels, [s[str(c)]["output_tok_s"] for c in levels], marker="o", label=t)
            ttft.plot(levels, [s[str(c)]["ttft_p99_ms"] for c in levels], marker="o", label=t)
        for t, r in w["targets"].items():
            if t == "offline" and r.get("output_tok_s"):
                tput.axhline(r["output_tok_s"], linestyle="--", linewidth=1, label="offline")
        tput.set(xlabel="concurrent streams", ylabel="output tokens/s", title=f"{name}: throughput")
        ttft.set(xlabel="concurrent streams", ylabel="ms", title=f"{name}: p99 TTFT")
        for ax in (tput, ttft):
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        ttft.set_yscale("log")
    fig.tight_layout()
    fig.savefig(folder / "compare.png", dpi=100)
    plt.close(fig)


def host() -> dict[str, Any]:
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "usable_cores": cpu_list(),
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32, help="the headline level")
    p.add_argument(
        "--sweep",
        type=lambda t: sorted({int(x) for x in t.split(",")}),
        default=[1, 4, 16, 32, 64, 128],
        help="closed-loop levels for the plots and the sweep tables, besides the headline",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=96,
        help="measured requests at the headline (3 waves: a drain with fewer streams than the "
        "level weighs less than in 1.5)",
    )
    p.add_argument(
        "--sweep-waves",
        type=float,
        default=1.0,
        help="sweep: max(this x level, --sweep-min-requests) measured requests per level",
    )
    p.add_argument("--sweep-min-requests", type=int, default=8)
    p.add_argument(
        "--sweep-rounds",
        type=int,
        default=0,
        help="rounds that also run the sweep levels (0: every round; a level's ratio is then "
        "a median of paired rounds, like the headline's)",
    )
    p.add_argument(
        "--sweep-cap",
        type=int,
        default=64,
        help="sweep levels above this run only for --sweep-full workloads (bounds the runtime)",
    )
    p.add_argument("--sweep-full", default="fixed64", help="workloads swept at every level")
    p.add_argument("--seed-requests", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--prefix-tokens", type=int, default=1500, help="shared_prefix document size")
    p.add_argument("--docs", type=int, default=128, help="many_docs: documents in rotation")
    p.add_argument("--doc-tokens", type=int, default=1000, help="many_docs: document size")
    p.add_argument("--turns", type=int, default=3, help="conversations: turns per chat")
    p.add_argument(
        "--paste-words", type=int, default=300, help="conversations: opening's median length"
    )
    p.add_argument(
        "--reply-words", type=int, default=120, help="conversations: scripted replies' median"
    )
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="per-step token budget, explicit for all (vLLM's default differs per entry point)",
    )
    p.add_argument("--kv-cache-gib", type=int, default=2)
    p.add_argument(
        "--targets",
        default="streambatch,vllm_openai,vllm_grpc,vllm_openai_autobind,seed_fastapi,offline",
        help="also: vllm_grpc_autobind, streambatch+FLAG=VALUE+... (see above)",
    )
    p.add_argument(
        "--peer-preload",
        default="auto",
        help=PEER_PRELOAD_HELP + " (not the *_autobind rows)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=str(RESULTS), help="folder for compare.json/md/png")
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill what the defaults leave to the machine: the model folder and the dtype."""
    args.sweep_full = [w for w in args.sweep_full.split(",") if w]
    if len(set(EXTRA_WORKLOADS) & set(args.workloads.split(","))) > 1:
        raise SystemExit(
            f"run each of {', '.join(EXTRA_WORKLOADS)} in an invocation of its own: in one "
            "server start the second inherits the first's prefix cache"
        )
    if not 0 <= args.sweep_rounds <= args.rounds:
        raise SystemExit(
            f"--sweep-rounds must be 0 (every round) to --rounds, got {args.sweep_rounds}"
        )
    if args.concurrency not in args.sweep:
        args.sweep = sorted({*args.sweep, args.concurrency})
    args.peer_preload = peer_preload(args.peer_preload)
    if not args.model:
        from pyserver.model import pull_default_model

        args.model = str(pull_default_model())
    if args.dtype == "auto":
        from pyserver.engine.adapter import resolve_dtype

        args.dtype = resolve_dtype("auto").replace("auto", "bfloat16")
    return args


def main() -> None:
    args = resolve(parser().parse_args())
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(exist_ok=True)
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(args.model)
    wanted = [w for w in args.workloads.split(",") if w]
    loads = {k: v for k, v in build_workloads(args, tok).items() if k in wanted}
    specs = target_specs(args)
    for s in specs:
        s.workloads = tuple(w for w in s.workloads if w in loads)

    started = time.monotonic()
    sweep_rounds = args.sweep_rounds or args.rounds
    # raw[target][workload][level] = one summary per round that ran it (its "round" says which)
    raw: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
    setups: dict[str, Any] = {}
    plan = []
    for r in range(args.rounds):
        order = [s for s in specs if s.every_round or r == 0]
        random.Random(args.seed * 1000 + r).shuffle(order)
        plan.append(order)
    bar = tqdm(total=sum(len(o) for o in plan), desc="target starts", file=sys.stderr)
    for r, order in enumerate(plan):
        for spec in order:
            bar.set_postfix_str(f"round {r + 1} {spec.name}")
            t0 = time.monotonic()
            try:
                got, setups[spec.name] = run_target(spec, args, loads, sweep=r < sweep_rounds)
            except SurvivorError:
                # Not a peer failure: it ends the bench (the next target would share its cores).
                raise
            except Exception as err:  # a peer that cannot run is reported, not hidden
                got = {w: {str(args.concurrency): {"error": f"{type(err).__name__}: {err}"}}
                       for w in spec.workloads}  # fmt: skip
            for w, levels in got.items():
                for c, summary in levels.items():
                    raw.setdefault(spec.name, {}).setdefault(w, {}).setdefault(c, []).append(
                        {**summary, "round": r}
                    )
            head = {w: got[w].get(str(args.concurrency), {}).get("output_tok_s") for w in got}
            tqdm.write(
                f"round {r + 1} {spec.name}: tok/s {head} ({time.monotonic() - t0:.0f} s)",
                file=sys.stderr,
            )
            bar.update()
    bar.close()

    c_head = str(args.concurrency)
    result: dict[str, Any] = {"rounds": args.rounds, "workloads": {}}
    for w in loads:
        targets, sweeps = summarize(
            {s.name: raw[s.name][w] for s in specs if w in raw.get(s.name, {})}, c_head, setups
        )
        prompt_lens = [len(i.ids) for i in loads[w].headline]
        result["workloads"][w] = {
            "concurrency": args.concurrency,
            "describe": loads[w].describe,
            "prompt_tokens_p50_p99": [
                int(np.percentile(prompt_lens, 50)), int(np.percentile(prompt_lens, 99))
            ],
            "targets": targets,
            "sweep": sweeps,
        }  # fmt: skip
    result["elapsed_s"] = round(time.monotonic() - started)
    result["host"] = host()
    result["config"] = {k: v for k, v in vars(args).items() if k not in ("targets", "out")}
    result["order"] = [[s.name for s in o] for o in plan]
    (out_dir / "compare.json").write_text(json.dumps(result, indent=2) + "\n")
    md = tables(result)
    (out_dir / "compare.md").write_text(md)
    plot(result, out_dir)
    print(md, file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
