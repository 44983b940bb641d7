"""Closed-loop gRPC load against a streambatch server: output tokens/s, TTFT, ITL, latency.

Each of `--concurrency` workers sends a request, reads its whole stream, and sends the next,
until `--requests` are done; the first `--warmup` requests are not counted. Prompts are seeded,
chat-templated and of mixed lengths; outputs have a fixed length (ignore_eos) for fairness.
Last stdout line: one JSON object.

Token accounting (`TokenClock`), shared by every client in bench/compare.py: a message (gRPC
response, SSE chunk) carrying n tokens counts n tokens; each of them gets one inter-token gap,
the time since the previous message divided by n; the first message's extra tokens arrived with
the first token and get gaps of 0. So every request contributes tokens - 1 gaps, however its
server groups tokens into messages.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
import numpy as np
from streambatch.v1 import generation_pb2 as pb
from streambatch.v1 import generation_pb2_grpc as pb_grpc
from tqdm import tqdm

_WORDS = [
    "river", "mountain", "engine", "signal", "harbor", "lantern", "orbit", "garden", "copper",
    "violet", "thunder", "meadow", "crystal", "falcon", "cipher", "ember", "glacier", "canyon",
]  # fmt: skip


def prompts(n: int, seed: int, min_words: int = 8, max_words: int = 120) -> list[str]:
    rng = random.Random(seed)
    return [
        "Write about: "
        + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words)))
        for _ in range(n)
    ]


@dataclass
class Sample:
    ttft_s: float
    e2e_s: float
    tokens: int
    gaps_s: list[float]
    priority: int = 0
    sent_s: float = 0.0  # perf_counter() when the request was sent
    turn: int = 0  # closed loop with conversations: the turn's place in its conversation


class TokenClock:
    """Times one request's stream: call `add(n)` as each message with n new tokens arrives."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first = self.last = 0.0
        self.tokens = 0
        self.gaps: list[float] = []

    def add(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if not self.tokens:
            self.first = now
            self.gaps.extend([0.0] * (n - 1))
        else:
            self.gaps.extend([(now - self.last) / n] * n)
        self.last = now
        self.tokens += n

    def sample(self, priority: int = 0) -> Sample:
        if not self.tokens:  # nothing streamed: first and last token are at the end
            self.first = self.last = time.perf_counter()
        return Sample(
            self.first - self.start,
            self.last - self.start,
            self.tokens,
            self.gaps,
            priority,
            self.start,
        )


@dataclass
class Report:
    samples: list[Sample] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    client_cpu_s: float = 0.0  # this load generator's own CPU time during the run
    streaming: bool = True  # False: the whole answer comes at once, there are no token gaps
    first_done_s: float = 0.0  # closed loop: perf_counter() when its first request ended
    conversations_s: list[float] = field(default_factory=list)  # each multi-turn chain's span

    def summary(self) -> dict[str, object]:
        ok = self.samples
        if not ok:
            return {"errors": self.errors}

        def pct(values: list[float], q: float) -> float:
            return round(float(np.percentile(values, q)) * 1e3, 1) if values else 0.0

        ttft = [s.ttft_s for s in ok]
        # A closed loop sends its first wave at once: their TTFT is the cost of that burst.
        # The later calls go out as earlier ones end (failed ones included); with few waves
        # per run the all-calls p99 can be the burst's alone.
        later = [s.ttft_s for s in ok if self.first_done_s and s.sent_s >= self.first_done_s]
        e2e = [s.e2e_s for s in ok]
        itl = [g for s in ok for g in s.gaps_s]
        tokens = sum(s.tokens for s in ok)
        itl_pct: Callable[[float], float | None] = (
            (lambda q: pct(itl, q)) if self.streaming else (lambda q: None)
        )
        return {
            "requests": len(ok),
            "output_tokens": tokens,
            "output_tok_s": round(tokens / self.wall_s, 1),
            "requests_s": round(len(ok) / self.wall_s, 2),
            "ttft_p50_ms": pct(ttft, 50),
            "ttft_p90_ms": pct(ttft, 90),
            "ttft_p99_ms": pct(ttft, 99),
            "ttft_p99_after_first_wave_ms": pct(later, 99) if later else None,
            "itl_p50_ms": itl_pct(50),
            "itl_p90_ms": itl_pct(90),
            "itl_p99_ms": itl_pct(99),
            "e2e_p50_ms": pct(e2e, 50),
            "e2e_p90_ms": pct(e2e, 90),
            "e2e_p99_ms": pct(e2e, 99),
            **self._conversations(pct),
            # The client shares the machine with the server: its CPU is the server's loss.
            "client_cpu_pct": round(100 * self.client_cpu_s / self.wall_s, 1),
            "errors": self.errors,
        }

    def _conversations(self, pct: Callable[[list[float], float], float]) -> dict[str, object]:
        """Multi-turn runs: TTFT of the openings and of the later turns apart (the order a
        server picks can favour one over the other), and each conversation's first send to
        last answer."""
        if not self.conversations_s:
            return {}
        openings = [s.ttft_s for s in self.samples if s.turn == 0]
        follow_ups = [s.ttft_s for s in self.samples if s.turn > 0]
        return {
            "ttft_openings_p50_p90_p99_ms": [pct(openings, q) for q in (50, 90, 99)],
            "ttft_follow_ups_p50_p90_p99_ms": [pct(follow_ups, q) for q in (50, 90, 99)],
            "conversation_p50_p90_p99_ms": [pct(self.conversations_s, q) for q in (50, 90, 99)],
        }


def generate_request(
    text: str, max_tokens: int, priority: int = 0, *, chat: bool = True
) -> pb.GenerateRequest:
    if chat:
        req = pb.GenerateRequest(
            chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content=text)])
        )
    else:
        req = pb.GenerateRequest(text=text)
    req.priority = priority
    req.sampling.max_tokens = max_tokens
    req.sampling.ignore_eos = True
    req.sampling.temperature = 0.0
    return req


async def one(stub: pb_grpc.GenerationStub, req: pb.GenerateRequest, timeout: float) -> Sample:
    clock = TokenClock()
    async for msg in stub.Generate(req, timeout=timeout):
        clock.add(len(msg.token_ids))
    return clock.sample(req.priority)


T = TypeVar("T")
Send = Callable[[str], Awaitable[Sample]]


async def closed_loop(
    send: Callable[[T], Awaitable[Sample]],
    texts: list[T],
    concurrency: int,
    warmup: int,
    label: str = "",
    continues: Callable[[T], bool] | None = None,
) -> Report:
    """`concurrency` workers each send the next prompt as soon as their last one finished.
    `continues(text)`: the text is the next turn of the one before it in `texts` (a multi-turn
    conversation), so the worker that sent that one sends it, right after that one finished,
    and takes the next conversation once its turns are done."""
    report = Report()
    for text in texts[:warmup]:
        await send(text)
    chains: list[list[T]] = []
    for text in texts[warmup:]:
        if chains and continues is not None and continues(text):
            chains[-1].append(text)
        else:
            chains.append([text])
    pending = list(reversed(chains))
    bar = tqdm(
        total=len(texts) - warmup, desc=label or f"c={concurrency}", file=sys.stderr, leave=False
    )

    async def worker() -> None:
        while pending:
            chain = pending.pop()
            began = time.perf_counter()
            for turn, text in enumerate(chain):
                try:
                    sample = await send(text)
                    sample.turn = turn
                    report.samples.append(sample)
                except grpc.aio.AioRpcError as err:
                    report.errors[err.code().name] = report.errors.get(err.code().name, 0) + 1
                except Exception as err:  # an HTTP peer's failure, counted by its type
                    name = type(err).__name__
                    report.errors[name] = report.errors.get(name, 0) + 1
                if not report.first_done_s:  # the first wave is what was sent before this
                    report.first_done_s = time.perf_counter()
                bar.update()
            if len(chain) > 1:  # a conversation: single calls have their e2e already
                report.conversations_s.append(time.perf_counter() - began)

    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    report.wall_s = time.perf_counter() - start
    report.client_cpu_s = time.process_time() - cpu
    bar.close()
    return report


async def run_closed_loop(
    target: str,
    concurrency: int,
    requests: int,
    warmup: int,
    max_tokens: int,
    seed: int,
    timeout: float = 600.0,
) -> Report:
    texts = prompts(requests + warmup, seed)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def send(text: str) -> Sample:
            return await one(stub, generate_request(text, max_tokens), timeout)

        return await closed_loop(send, texts, concurrency, warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    report = asyncio.run(
        run_closed_loop(
            args.target, args.concurrency, args.requests, args.warmup, args.max_tokens, args.seed
        )
    )
    print(json.dumps(report.summary()))


if __name__ == "__main__":
    main()
