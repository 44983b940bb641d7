"""Paired comparison of bench/priority.py settings on this noisy host: the controller-off half
(calibration, unloaded TTFT, open loop; fresh server each time), settings alternating round by
round, so a slow spell of the host falls on both. One JSON line per round, then per setting
the median of each figure; last stdout line one JSON object.

  bench/priority_ab.py --rounds 4 --setting s128="--step-tokens 128" \\
      --setting s64="--step-tokens 64"
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from priority import RESULTS, build_parser, controller_off_half

FIGURES = (
    "capacity",
    "unloaded",
    "high",
    "ratio",
    "queue_p99",
    "prefill_p99",
    "low",
    "itl",
    "tok_s",
    "preemptions",
    "missed",
)


def one_round(args: argparse.Namespace, name: str) -> dict[str, float]:
    unloaded_ttft, _, off = controller_off_half(args, f"priority-ab-{name}.log")
    high = float(off["high_ttft_p99_ms"])  # type: ignore[arg-type]
    return {
        "capacity": round(args.capacity, 2),
        "unloaded": unloaded_ttft,
        "high": high,
        "ratio": round(high / unloaded_ttft, 3),
        "queue_p99": off["high_queue_ms_p50_p90_p99"][-1],  # type: ignore[index]
        "prefill_p99": off["high_prefill_ms_p50_p90_p99"][-1],  # type: ignore[index]
        "low": off["low_ttft_p99_ms"],  # type: ignore[dict-item]
        "itl": off["itl_p99_ms"],  # type: ignore[dict-item]
        "tok_s": off["output_tok_s"],  # type: ignore[dict-item]
        "preemptions": off.get("preemptions_priority", 0.0),  # type: ignore[dict-item]
        "missed": off["admitted_then_missed_deadline"],  # type: ignore[dict-item]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--setting",
        action="append",
        required=True,
        metavar='NAME="ARGS"',
        help="a name and bench/priority.py arguments (repeat: at least two)",
    )
    opts = parser.parse_args()
    settings: dict[str, str] = {}
    for setting in opts.setting:
        name, sep, argv = setting.partition("=")
        if not sep or not name or name in settings:
            parser.error(f"--setting {setting!r}: give NAME=ARGS with a name used once")
        settings[name] = argv
    if len(settings) < 2:
        parser.error("give at least two --setting NAME=ARGS")
    for argv in settings.values():  # bad arguments fail now, not rounds later
        build_parser().parse_args(shlex.split(argv))
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in settings}
    for r in range(opts.rounds):
        for name, argv in settings.items():
            row = one_round(build_parser().parse_args(shlex.split(argv)), name)
            rows[name].append(row)
            print(json.dumps({"round": r, "setting": name, **row}), flush=True)
    medians = {
        name: {f: round(float(np.median([row[f] for row in got])), 3) for f in FIGURES}
        for name, got in rows.items()
    }
    print(json.dumps({"rounds": opts.rounds, "medians": medians}))


if __name__ == "__main__":
    main()
