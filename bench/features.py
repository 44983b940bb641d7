"""What the API features cost: JSON-schema-constrained output against free output, and top-5
logprobs against none, on one `streambatch serve` with its defaults, same prompts.

Each variant runs the same closed-loop load (chat prompts asking for a JSON description, EOS
allowed, `--max-tokens` at most); variants interleave over `--rounds` rounds in a shuffled
order; medians per variant and the ratio to free output measured in the same round. Output
tok/s is per generated token, so it is fair across variants that stop at different lengths.
Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from streambatch.v1 import generation_pb2 as pb
from streambatch.v1 import generation_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Group
from load import Sample, TokenClock, closed_loop, prompts
from tracing_overhead import free_port, wait_serving

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}


def variant_request(variant: str, text: str, max_tokens: int) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        chat=pb.ChatPrompt(
            messages=[pb.ChatMessage(role="user", content=f"Describe, as JSON, a person: {text}")]
        )
    )
    req.sampling.max_tokens = max_tokens
    req.sampling.temperature = 0.0
    if variant == "json_schema":
        req.sampling.structured.json_schema = json.dumps(PERSON)
    elif variant == "logprobs5":
        req.sampling.logprobs = 5
    return req


async def run_variant(
    target: str, variant: str, texts: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def send(text: str) -> Sample:
            clock = TokenClock()
            async for msg in stub.Generate(variant_request(variant, text, args.max_tokens)):
                clock.add(len(msg.token_ids))
            return clock.sample()

        report = await closed_loop(send, texts, args.concurrency, 2, label=variant)
    return report.summary()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=48, help="per variant and round")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    variants = ["free", "json_schema", "logprobs5"]
    rng = random.Random(args.seed)
    port = free_port()
    target = f"127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pyserver.cli", "serve", "--port", str(port),
           "--metrics-port", "-1", "--log-level", "WARNING"]  # fmt: skip
    rounds: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        group = Group(cmd, Path(tmp) / "server.log", dict(os.environ))
        try:
            wait_serving(target, group.proc)
            for r in range(args.rounds):
                texts = prompts(args.requests + 2, args.seed * 1000 + r, max_words=40)
                order = variants[:]
                rng.shuffle(order)
                got = {v: asyncio.run(run_variant(target, v, texts, args)) for v in order}
                rounds.append(got)
                print(f"round {r + 1}: {json.dumps(got)}", file=sys.stderr)
        finally:
            group.stop()
    out: dict[str, Any] = {"setup": {"cmd": cmd[2:], "concurrency": args.concurrency,
                                     "requests": args.requests, "max_tokens": args.max_tokens,
                                     "rounds": args.rounds}}  # fmt: skip
    for v in variants:
        tok_s = [rd[v]["output_tok_s"] for rd in rounds]
        ratio = [rd[v]["output_tok_s"] / rd["free"]["output_tok_s"] for rd in rounds]
        out[v] = {
            "output_tok_s": round(float(np.median(tok_s)), 1),
            "output_tok_s_min": min(tok_s),
            "output_tok_s_max": max(tok_s),
            "tok_s_vs_free": round(float(np.median(ratio)), 3),
            "ttft_p50_ms": float(np.median([rd[v]["ttft_p50_ms"] for rd in rounds])),
            "itl_p50_ms": float(np.median([rd[v]["itl_p50_ms"] for rd in rounds])),
            "output_tokens": int(np.median([rd[v]["output_tokens"] for rd in rounds])),
            "errors": [rd[v]["errors"] for rd in rounds],
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
