# SPDX-License-Identifier: Apache-2.0
"""The trained pair: measured acceptance against context length, and where speculation stops paying.

Runs ``vllm-dspark accept --context-sweep`` on the committed pair (``tests/data/pair``) with prompts
padded with the package's corpus, greedy, under the default step-cost model (the tokenspeed#1132
prior). The pair was trained on 128-token sequences and its target holds 4096 positions, so the sweep
runs from 32 to 2048 tokens. Writes ``benchmarks/results/context_sweep/`` (the tool's report and
plot) and ``benchmarks/results/context_sweep.{json,md}``:

    python -m benchmarks context-sweep
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from benchmarks.common import RESULTS_DIR, write_result

PAIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "pair"
LENGTHS = ("32", "64", "128", "256", "512", "1024", "2048")


def main(argv: list[str] | None = None) -> int:
    from vllm_dspark.tools.cli import main as cli

    parser = argparse.ArgumentParser(prog="python -m benchmarks context-sweep", description=__doc__)
    parser.add_argument("--pair", type=Path, default=PAIR, help="a train-pair output directory")
    parser.add_argument("--lengths", nargs="+", default=list(LENGTHS))
    parser.add_argument("--prompts", type=int, default=8, help="prompts per length")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens decoded per prompt")
    parser.add_argument("--variants", nargs="+", default=["bf16", "fp8"])
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (the pair is tiny: 1 is fastest)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    # Paths relative to the working directory: results record where the pair is, not this machine.
    pair, out = Path(os.path.relpath(args.pair)), Path(os.path.relpath(args.out / "context_sweep"))
    argv_ = ["accept", "--target", str(pair / "target"), "--drafter", str(pair / "drafter")]
    argv_ += ["--context-sweep", *args.lengths, "--num-prompts", str(args.prompts)]
    argv_ += ["--max-tokens", str(args.max_tokens), "--variants", *args.variants]
    argv_ += ["--no-progress", "--out", str(out)]
    if cli(argv_) != 0:
        return 1
    report = json.loads((out / "context_sweep.json").read_text())
    table = (out / "context_sweep.md").read_text().split("\n", 2)[2].strip()
    seconds = report["timing"]["total_s"]
    note = (
        f"\n\n`accept {' '.join(argv_[1:])}`: {seconds:.0f} s on {args.threads} thread(s)."
        "\n\n![τ against context length](../benchmarks/results/context_sweep/tau_vs_context.png)"
    )
    payload = {
        "pair": str(pair),
        "config": report["config"],
        "cells": report["cells"],
        "break_even": report["break_even"],
        "seconds": seconds,
    }
    write_result("context_sweep", payload, table + note, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
