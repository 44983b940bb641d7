"""The seed article's design, rebuilt as the naive baseline: a FastAPI app around vllm.LLM whose
async endpoint calls the blocking `llm.generate` once per request, so concurrent requests are
served one at a time. Request {prompt, max_tokens, temperature, top_p, priority}; response
{text, tokens, latency_ms}, as in the article.

Run: python bench/peers/seed_fastapi.py --model DIR --port 8100 [--max-num-seqs 32 ...]
"""

from __future__ import annotations

import argparse
import time

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from vllm import LLM, SamplingParams


class GenerateRequest(BaseModel):
    prompt: str
    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 0.9
    priority: int = 0  # 0 normal, 1 high: accepted and, as in the article, not acted on
    ignore_eos: bool = False


class GenerateResponse(BaseModel):
    text: str
    tokens: int
    latency_ms: float


def build_app(llm: LLM) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/generate")
    async def generate(req: GenerateRequest) -> GenerateResponse:
        start = time.perf_counter()
        params = SamplingParams(
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            ignore_eos=req.ignore_eos,
        )
        out = llm.generate([req.prompt], params, use_tqdm=False)[0].outputs[0]  # blocks the loop
        return GenerateResponse(
            text=out.text, tokens=len(out.token_ids), latency_ms=(time.perf_counter() - start) * 1e3
        )

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: vLLM's default")
    args = p.parse_args()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or None,
    )
    uvicorn.run(build_app(llm), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
