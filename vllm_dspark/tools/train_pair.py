# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark train-pair``: train a small MLA target and its K3 DSpark drafter from scratch on CPU."""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

from vllm_dspark.pair import PairSizes
from vllm_dspark.tools.cli import ArgumentParser, add_out, add_shared


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="vllm-dspark train-pair",
        description="Train, from scratch on CPU and reproducibly, a small DeepSeek-V3 MLA target (Kimi-K3's "
        "512 + 64 latent) and its K3 DSpark drafter on the Python standard library's source; write both "
        "(BF16), the tokenizer, held-out prompts, a JSON log, loss curves and a manifest to --out.",
    )
    add_out(parser, "output directory (built beside it)")
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="wall-clock cap: training stops early when reached (recorded; steps run are logged)",
    )
    parser.add_argument(
        "--causal",
        action="store_true",
        help="train a causal-block drafter (is_causal: true, as Block5 and the K3.1-Pro preview)",
    )
    parser.add_argument(
        "--target-pair",
        type=Path,
        default=None,
        help="a pair this command wrote: reuse its target and tokenizer (OUT/target links to it) "
        "and train only a drafter",
    )
    add_shared(parser, seed=True, overwrite=True, progress=True)
    defaults = PairSizes()
    for field in fields(PairSizes):
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            type=type(getattr(defaults, field.name)),
            default=getattr(defaults, field.name),
            help=f"default {getattr(defaults, field.name)}",
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from vllm_dspark.pair.train import train_pair

    if args.minutes is not None and args.minutes <= 0:
        raise ValueError(f"--minutes must be > 0, got {args.minutes}. Fix: pass a positive number.")
    sizes = PairSizes(**{f.name: getattr(args, f.name) for f in fields(PairSizes)})
    command = "vllm-dspark train-pair " + " ".join(argv if argv is not None else sys.argv[1:])
    log = train_pair(
        args.out,
        sizes,
        seed=args.seed,
        minutes=args.minutes,
        progress=not args.no_progress,
        overwrite=args.overwrite,
        command=command.strip(),
        causal=args.causal,
        target_pair=args.target_pair,
    )
    check = log["greedy_check"]
    curve = log["target"]["curve"]
    target = (
        f"target {len(curve)} steps (final loss {curve[-1]['loss']:.3f})"
        if curve
        else f"target from {args.target_pair}"
    )
    print(
        f"wrote {args.out} in {log['train_seconds'] / 60:.1f} min: {target}, drafter "
        f"{log['drafter']['steps_run']} steps; held-out greedy tau {check['tau']:.2f} over "
        f"{check['steps']} blocks"
    )
    return 0


if __name__ == "__main__":
    from vllm_dspark.tools.cli import main as cli_main

    sys.exit(cli_main(["train-pair", *sys.argv[1:]]))
