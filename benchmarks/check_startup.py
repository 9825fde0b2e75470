# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark check`` on the trained pair's drafter, timed as a whole process, as a user runs it.

Each round runs, in turn, the check (``vllm-dspark check tests/data/pair/drafter``), ``python -c
"import torch"`` (for scale: what the check would pay for torch alone) and a bare interpreter start
(``python -c pass``, the baseline). Goal: the check under 2 s in the worst round. That the check
imports none of torch, transformers, compressed-tensors or vLLM for a BF16 or FP8 drafter (it reads
headers with the standard library, scales with numpy) is asserted by tests/tools/test_cli_startup.py,
not timed here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.common import (
    MIN_PAIRS,
    add_pairing_arguments,
    format_table,
    rounds,
    spread_text,
    whole_process,
    write_result,
)

GOAL_S = 2.0
ROOT = Path(__file__).resolve().parents[1]
PAIR_DRAFTER = Path("tests/data/pair/drafter")
CHECK = "vllm-dspark check"
TORCH = "python -c 'import torch'"
BASELINE = "python -c pass"


def run(model: Path = PAIR_DRAFTER, pairs: int = MIN_PAIRS, warmup: int = 1) -> dict:
    script = Path(sys.executable).with_name("vllm-dspark")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "vllm_dspark.tools.cli"]
    path = model if model.is_absolute() else ROOT / model
    steps = {
        CHECK: whole_process([*command, "check", str(path)]),
        TORCH: whole_process([sys.executable, "-c", "import torch"]),
        BASELINE: whole_process([sys.executable, "-c", "pass"]),
    }
    result = rounds(
        lambda: {name: step() for name, step in steps.items()},
        BASELINE,
        pairs=pairs,
        warmup=warmup,
        progress="check",
    )
    worst = result["seconds"][CHECK]["max"]
    return {
        "model": str(model),
        "goal_s": GOAL_S,
        "worst_s": worst,
        "meets_goal": worst < GOAL_S,
        **result,
    }


def table(result: dict) -> str:
    rows = [
        {
            "command": f"`{name}`",
            "seconds: median (min–max)": spread_text(seconds, ".3f"),
            "worst s": f"{seconds['max']:.3f}",
            f"vs `{BASELINE}`": spread_text(result["ratio"][name], ".1f", "×")
            if name in result["ratio"]
            else "baseline",
        }
        for name, seconds in result["seconds"].items()
    ]
    met = "met" if result["meets_goal"] else "MISSED"
    return "\n".join(
        [
            format_table(rows, list(rows[0])),
            "",
            f"`{CHECK} {result['model']}`, whole process: worst {result['worst_s']:.3f} s; "
            f"goal < {result['goal_s']:.0f} s (worst round): {met}. {result['pairs']} rounds after "
            f"{result['warmup']} warm-up round, the three commands in turn within each round.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=PAIR_DRAFTER,
        help=f"the drafter to check (default {PAIR_DRAFTER})",
    )
    add_pairing_arguments(parser, unit="rounds")
    args = parser.parse_args(argv)
    result = run(args.model, args.pairs, args.warmup)
    write_result("check_startup", result, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
