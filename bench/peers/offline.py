"""The engine's ceiling: offline vllm.LLM.generate over the whole workload at once.
Reads a JSON list of prompts; prints "RESULT {output_tok_s, requests, wall_s}" (JSON).

--thread engine (the default) builds the LLM on a thread that then exits and generates on a
thread of its own, as `streambatch serve` runs its engine; --thread main does everything on
the main thread, as a script usually does. On the 2-core development host the first measured
~530 tok/s and the second ~470 (c=32 workload, medians of several runs; docs/benchmarks.md):
the ceiling is the faster one."""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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
    p.add_argument("--thread", choices=("engine", "main"), default="engine")
    args = p.parse_args()
    with open(args.prompts) as f:
        prompts = json.load(f)

    def build() -> LLM:
        return LLM(
            model=args.model,
            dtype=args.dtype,
            enforce_eager=True,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens or None,
        )

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    result: dict[str, Any] = {}

    def generate() -> None:
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up, as the servers get
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        result["wall"] = time.perf_counter() - start
        result["tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
        result["requests"] = len(outs)

    if args.thread == "main":
        llm = build()
        generate()
    else:
        with ThreadPoolExecutor(1) as pool:  # the building thread exits with the pool
            llm = pool.submit(build).result()
        worker = threading.Thread(target=generate)
        worker.start()
        worker.join()
    if "wall" not in result:
        raise SystemExit("generation failed (see above)")
    wall = result["wall"]
    print(
        "RESULT "
        + json.dumps(
            {
                "output_tok_s": round(result["tokens"] / wall, 1),
                "requests": result["requests"],
                "wall_s": round(wall, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
