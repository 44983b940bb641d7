"""What one engine step costs: the fixed part and the part per prompt token, eager or compiled.

Builds the engine in this process (the server's own build path), warms it up, then times
single-prompt prefill steps over a range of prompt lengths and decode steps at a full batch,
and fits prefill step time = fixed + per_token x prompt tokens by least squares. The scheduler's
choices rest on this split (docs/benchmarks.md, "Scheduling under overload"): when the fixed
part dominates, urgent prompts should share a step rather than take one each.

  python bench/step_cost.py [--compiled] [--repeats 5]

Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process

from pyserver.engine import EngineOptions, build_engine
from pyserver.model import pull_default_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compiled", action="store_true", help="torch.compile (not eager)")
    parser.add_argument("--max-num-seqs", type=int, default=11)
    parser.add_argument("--repeats", type=int, default=5, help="prefill steps per length")
    args = parser.parse_args()
    from vllm import SamplingParams

    started = time.perf_counter()
    engine = build_engine(
        EngineOptions(
            model=str(pull_default_model()),
            max_num_seqs=args.max_num_seqs,
            enforce_eager=not args.compiled,
        )
    ).llm  # vLLM's LLMEngine itself: this bench times raw engine steps
    build_s = time.perf_counter() - started
    print(f"engine built in {build_s:.1f} s", file=sys.stderr)
    next_id = 0

    def run(prompts: int, prompt_len: int, max_tokens: int) -> list[float]:
        nonlocal next_id
        for _ in range(prompts):
            next_id += 1
            # Distinct prompts, so the prefix cache never shortens a prefill.
            ids = [100 + (next_id * 7 + i) % 20000 for i in range(prompt_len)]
            engine.add_request(
                str(next_id),
                {"prompt_token_ids": ids},
                SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            )
        times = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - t) * 1e3)
        return times

    run(2, 32, 8)  # the first steps carry one-time costs
    by_length = {
        n: [run(1, n, 1)[0] for _ in range(args.repeats)] for n in (10, 40, 70, 100, 130, 160)
    }
    per_token, fixed = np.polyfit(
        [n for n, ms in by_length.items() for _ in ms],
        [m for ms in by_length.values() for m in ms],
        1,
    )
    decode = run(args.max_num_seqs, 32, 32)[2:]  # after the prefill steps
    result = {
        "mode": "compiled" if args.compiled else "eager",
        "engine_build_s": round(build_s, 1),
        "prefill_fixed_ms": round(float(fixed), 1),
        "prefill_ms_per_token": round(float(per_token), 3),
        "prefill_ms_by_length": {
            str(n): round(float(np.median(ms)), 1) for n, ms in by_length.items()
        },
        "decode_step_ms_p50": round(float(np.median(decode)), 1),
        "decode_batch": args.max_num_seqs,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
