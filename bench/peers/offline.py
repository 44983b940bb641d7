"""The engine's ceiling: offline vllm.LLM.generate over the whole workload at once.
Reads a JSON list of prompts; prints "RESULT {output_tok_s, requests, wall_s}" (JSON)."""

from __future__ import annotations

import argparse
import json
import time

from vllm import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: vLLM's default")
    args = p.parse_args()
    with open(args.prompts) as f:
        prompts = json.load(f)
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or None,
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up, as the servers get
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        "RESULT "
        + json.dumps(
            {
                "output_tok_s": round(tokens / wall, 1),
                "requests": len(outs),
                "wall_s": round(wall, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
