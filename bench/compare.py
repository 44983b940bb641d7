"""streambatch against the peers a user would otherwise pick, one run, same engine arguments.

Targets run one at a time (two engines on two cores fight over core 0), each started and
stopped by this script on loopback:
  streambatch   `streambatch serve`, streaming gRPC Generate
  vllm_openai   vLLM's OpenAI server (python -m vllm.entrypoints.openai.api_server), streaming
                /v1/completions
  vllm_grpc     vLLM's own gRPC launcher (python -m vllm.entrypoints.launchers.grpc_server,
                smg-grpc-servicer), streaming Generate on token ids
  seed_fastapi  the seed article's design (bench/peers/seed_fastapi.py), blocking generate
  offline       vllm.LLM.generate over the whole workload (bench/peers/offline.py) with the
                engine core in-process and stepped on its own thread, as streambatch runs
                it: the ceiling
  offline_main  the same on the main thread, as a script usually runs it (slower here)
  offline_mp    the same with vLLM's default process model (engine core in a child process)
Same prompts for all (seeded, chat-templated once with the model's tokenizer, sent as raw
text; token ids for vllm_grpc), fixed output length (ignore_eos), closed-loop concurrency,
warm-up excluded.

Writes bench/results/compare.json and compare.md; last stdout line: one JSON object
{"targets": {...}}.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from streambatch.v1 import generation_pb2_grpc as pb_grpc

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from load import Report, Sample, closed_loop, generate_request, one, prompts  # noqa: E402

RESULTS = HERE / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def peer_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    # Each target runs vLLM's process model its own way (streambatch: in-process by default).
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
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


class Server:
    def __init__(self, cmd: list[str], log: Path, extra_env: dict[str, str] | None = None) -> None:
        self._log = open(log, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**peer_env(), **(extra_env or {})}
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


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
    args: argparse.Namespace, log: str, extra: Sequence[str] = ()
) -> tuple[Server, str]:
    """`streambatch serve` on a free loopback port with the engine arguments every target
    gets; returns once it reports SERVING."""
    port = free_port()
    target = f"127.0.0.1:{port}"
    server = Server(
        [
            sys.executable, "-m", "pyserver.cli", "serve", "--model", args.model,
            "--port", str(port), *engine_flags(args), "--metrics-port", "-1",
            "--queue-capacity", "4096", "--log-level", "WARNING", *extra,
        ],
        RESULTS / log,
    )  # fmt: skip
    try:
        wait_until(lambda: grpc_serving(target), server.proc, "streambatch")
    except BaseException:
        server.stop()
        raise
    return server, target


def run_streambatch(args: argparse.Namespace, texts: list[str]) -> Sweep:
    server, target = start_streambatch(args, "streambatch.log")
    try:

        async def go() -> Sweep:
            async with grpc.aio.insecure_channel(target) as channel:
                stub = pb_grpc.GenerationStub(channel)

                async def send(text: str) -> Sample:
                    return await one(stub, generate_request(text, args.max_tokens, chat=False), 600)

                return await sweep(send, texts, args, "streambatch")

        return asyncio.run(go())
    finally:
        server.stop()


def run_vllm_openai(args: argparse.Namespace, texts: list[str]) -> Sweep:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = Server(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            args.model,
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            *engine_flags(args),
            "--enforce-eager",
            "--served-model-name",
            "m",
            "--no-enable-log-requests",
        ],
        RESULTS / "vllm_openai.log",
    )
    try:
        wait_until(lambda: http_ok(f"{base}/health"), server.proc, "vllm_openai")

        async def go() -> Sweep:
            limits = httpx.Limits(max_connections=args.concurrency + 4)
            async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:

                async def send(text: str) -> Sample:
                    body = {
                        "model": "m",
                        "prompt": text,
                        "max_tokens": args.max_tokens,
                        "temperature": 0.0,
                        "ignore_eos": True,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    }
                    start = time.perf_counter()
                    first = last = 0.0
                    tokens = 0
                    gaps: list[float] = []
                    async with client.stream("POST", "/v1/completions", json=body) as resp:
                        resp.raise_for_status()
                        async for line in resp.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            chunk = json.loads(line[6:])
                            now = time.perf_counter()
                            if chunk.get("choices") and chunk["choices"][0].get("text"):
                                if not first:
                                    first = now
                                else:
                                    gaps.append(now - last)
                                last = now
                            if chunk.get("usage"):
                                tokens = chunk["usage"]["completion_tokens"]
                    return Sample(first - start, last - start, tokens, gaps)

                return await sweep(send, texts, args, "vllm_openai")

        return asyncio.run(go())
    finally:
        server.stop()


def run_vllm_grpc(args: argparse.Namespace, texts: list[str]) -> Sweep:
    """vLLM's own gRPC launcher (smg-grpc-servicer). Its API takes and returns token ids only:
    the client tokenizes (once, before timing) and counts tokens; detokenization is the
    caller's job there, so it is left out of this target's timing, which favours it."""
    from smg_grpc_proto import vllm_engine_pb2 as vpb
    from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(args.model)
    ids = {t: tok(t, add_special_tokens=False)["input_ids"] for t in texts}
    port = free_port()
    target = f"127.0.0.1:{port}"
    env = {
        # Its warm-up holds health NOT_SERVING ~45 s and KV events cost ~10 %: both off, as a
        # user tuning it for throughput would.
        "SMG_VLLM_SERVICER_WARMUP": "off",
        "SMG_VLLM_SERVICER_KV_EVENTS": "0",
    }
    server = Server(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.launchers.grpc_server",
            "--model",
            args.model,
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            *engine_flags(args),
            "--enforce-eager",
        ],
        RESULTS / "vllm_grpc.log",
        extra_env=env,
    )
    try:
        wait_until(lambda: grpc_serving(target), server.proc, "vllm_grpc")

        async def go() -> Sweep:
            async with grpc.aio.insecure_channel(target) as channel:
                stub = vpb_grpc.VllmEngineStub(channel)
                counter = iter(range(1 << 30))

                async def send(text: str) -> Sample:
                    req = vpb.GenerateRequest(
                        request_id=f"r{next(counter)}",
                        tokenized=vpb.TokenizedInput(input_ids=ids[text]),
                        sampling_params=vpb.SamplingParams(
                            temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True
                        ),
                        stream=True,
                    )
                    start = time.perf_counter()
                    first = last = 0.0
                    tokens = 0
                    gaps: list[float] = []
                    async for msg in stub.Generate(req, timeout=600):
                        n = len(msg.chunk.token_ids) if msg.HasField("chunk") else 0
                        if not n:
                            continue
                        now = time.perf_counter()
                        if not first:
                            first = now
                        else:
                            gaps.extend([(now - last) / n] * n)
                        last = now
                        tokens += n
                    return Sample(first - start, last - start, tokens, gaps)

                return await sweep(send, texts, args, "vllm_grpc")

        return asyncio.run(go())
    finally:
        server.stop()


def run_seed(args: argparse.Namespace, texts: list[str]) -> Sweep:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = Server(
        [
            sys.executable,
            str(HERE / "peers" / "seed_fastapi.py"),
            "--model",
            args.model,
            "--port",
            str(port),
            *engine_flags(args),
        ],
        RESULTS / "seed_fastapi.log",
    )
    try:
        wait_until(lambda: http_ok(f"{base}/health"), server.proc, "seed_fastapi")

        async def go() -> Sweep:
            limits = httpx.Limits(max_connections=args.concurrency + 4)
            async with httpx.AsyncClient(base_url=base, timeout=3600, limits=limits) as client:

                async def send(text: str) -> Sample:
                    start = time.perf_counter()
                    resp = await client.post(
                        "/generate",
                        json={
                            "prompt": text,
                            "max_tokens": args.max_tokens,
                            "temperature": 0.0,
                            "top_p": 1.0,
                            "ignore_eos": True,
                        },
                    )
                    resp.raise_for_status()
                    took = time.perf_counter() - start
                    # No streaming: the first token reaches the client with the last.
                    return Sample(took, took, int(resp.json()["tokens"]), [])

                # The seed design serves one request at a time; fewer requests keep the run short
                # and measure the same rate.
                subset = texts[: args.warmup + args.seed_requests]
                report = await closed_loop(
                    send, subset, args.concurrency, args.warmup, "seed_fastapi"
                )
                return {args.concurrency: report}

        return asyncio.run(go())
    finally:
        server.stop()


Sweep = dict[int, Report]  # concurrency -> report


async def sweep(send: Any, texts: list[str], args: argparse.Namespace, label: str) -> Sweep:
    """Closed loop at each concurrency of --sweep, on one server start; fewer requests at lower
    concurrency (the same number of waves), the first --warmup of each level not counted."""
    out: Sweep = {}
    for c in args.sweep:
        n = max(2 * c, args.requests * c // args.concurrency)
        out[c] = await closed_loop(send, texts[: n + args.warmup], c, args.warmup, f"{label} c={c}")
    return out


def run_offline(
    args: argparse.Namespace, texts: list[str], inproc: bool = True, thread: str = "engine"
) -> dict[str, Any]:
    """inproc: the engine core in the calling process, streambatch's process model, so this is
    the ceiling streambatch can reach; otherwise vLLM's default (engine core in a child).
    thread: "engine" steps it on a thread of its own, as streambatch does; "main" on the main
    thread (bench/peers/offline.py says why they differ)."""
    path = RESULTS / "prompts.json"
    path.write_text(json.dumps(texts[args.warmup :]))
    out = subprocess.run(
        [
            sys.executable,
            str(HERE / "peers" / "offline.py"),
            "--model",
            args.model,
            "--prompts",
            str(path),
            "--max-tokens",
            str(args.max_tokens),
            "--thread",
            thread,
            *engine_flags(args),
        ],
        capture_output=True,
        text=True,
        env={**peer_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if inproc else "1"},
        check=True,
    )
    # vLLM logs to stdout too; the result is the line the script marks.
    line = next(x for x in reversed(out.stdout.splitlines()) if x.startswith("RESULT "))
    return dict(json.loads(line.removeprefix("RESULT ")))


def templated(texts: list[str], model: str) -> list[str]:
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(model)
    return [
        str(
            tok.apply_chat_template(
                [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
            )
        )
        for t in texts
    ]


def table(results: dict[str, dict[str, Any]]) -> str:
    sb = results.get("streambatch", {})
    rows = [
        "| target | output tok/s | req/s | TTFT p50/p99 ms | ITL p50/p99 ms | e2e p50/p99 ms "
        "| streambatch ÷ target (tok/s) | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        ratio = (sb.get("output_tok_s", 0) / r["output_tok_s"]) if r.get("output_tok_s") else 0
        rows.append(
            f"| {name} | {r.get('output_tok_s', '')} | {r.get('requests_s', '')} "
            f"| {r.get('ttft_p50_ms', '-')} / {r.get('ttft_p99_ms', '-')} "
            f"| {r.get('itl_p50_ms', '-')} / {r.get('itl_p99_ms', '-')} "
            f"| {r.get('e2e_p50_ms', '-')} / {r.get('e2e_p99_ms', '-')} | {ratio:.2f} "
            f"| {r.get('errors', {}) or ''} |"
        )
    return "\n".join(rows)


def plot(results: dict[str, dict[str, Any]], folder: Path) -> None:
    """Output tokens/s and p99 TTFT against closed-loop concurrency, one line per target; the
    offline ceilings as horizontal lines on the throughput plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, r in results.items():
        if "sweep" in r:
            levels = sorted(int(c) for c in r["sweep"])
            pts = [r["sweep"][c] for c in levels]
            tput.plot(levels, [p.get("output_tok_s", 0) for p in pts], marker="o", label=name)
            ttft.plot(levels, [p.get("ttft_p99_ms", 0) for p in pts], marker="o", label=name)
        elif "output_tok_s" in r:
            tput.axhline(r["output_tok_s"], linestyle="--", linewidth=1, label=f"{name} (ceiling)")
    tput.set(xlabel="concurrent streams", ylabel="output tokens/s", title="Throughput")
    ttft.set(xlabel="concurrent streams", ylabel="ms", title="p99 time to first token")
    ttft.set_yscale("log")
    for ax in (tput, ttft):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "compare.png", dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", type=int, default=32, help="the headline level")
    p.add_argument(
        "--sweep",
        type=lambda t: sorted({int(x) for x in t.split(",")}),
        default=[4, 16, 32],
        help="closed-loop concurrency levels per server target (plots); must include --concurrency",
    )
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--seed-requests", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=0, help="per-step token budget (0: vLLM's)"
    )
    p.add_argument(
        "--targets", default="streambatch,vllm_openai,vllm_grpc,seed_fastapi,offline,offline_main"
    )
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    if args.concurrency not in args.sweep:
        p.error("--sweep must include --concurrency")
    if not args.model:
        from pyserver.model import pull_default_model

        args.model = str(pull_default_model())
    if args.dtype == "auto":
        from pyserver.engine.worker import resolve_dtype

        args.dtype = resolve_dtype("auto").replace("auto", "bfloat16")
    RESULTS.mkdir(exist_ok=True)
    texts = templated(prompts(args.requests + args.warmup, args.seed), args.model)
    runners: dict[str, Callable[[argparse.Namespace, list[str]], Any]] = {
        "streambatch": run_streambatch,
        "vllm_openai": run_vllm_openai,
        "vllm_grpc": run_vllm_grpc,
        "seed_fastapi": run_seed,
        "offline": run_offline,
        "offline_main": functools.partial(run_offline, thread="main"),
        "offline_mp": functools.partial(run_offline, inproc=False),
    }
    results: dict[str, dict[str, Any]] = {}
    for name in args.targets.split(","):
        started = time.monotonic()
        print(f"== {name}", file=sys.stderr, flush=True)
        try:
            out = runners[name](args, texts)
            if isinstance(out, dict) and all(isinstance(r, Report) for r in out.values()):
                levels = {c: r.summary() for c, r in sorted(out.items())}
                # The headline is the run at --concurrency; the sweep feeds the plots.
                results[name] = {**levels[args.concurrency], "sweep": levels}
            else:
                results[name] = out
        except Exception as err:  # a peer that cannot run is reported, not hidden
            results[name] = {"error": f"{type(err).__name__}: {err}"}
        print(
            f"   {results[name]} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True
        )
    config = {k: v for k, v in vars(args).items() if k != "targets"}
    (RESULTS / "compare.json").write_text(
        json.dumps({"config": config, "targets": results}, indent=2)
    )
    (RESULTS / "compare.md").write_text(table(results) + "\n")
    plot(results, RESULTS)
    print(table(results), file=sys.stderr)
    print(json.dumps({"targets": results}))


if __name__ == "__main__":
    main()
