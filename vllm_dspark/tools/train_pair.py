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
    parser.add_argument(
        "--target",
        choices=["deepseek-v3", "kimi-k3"],
        default="deepseek-v3",
        help="deepseek-v3: train both on the stdlib (default); kimi-k3: a random Kimi-K3 target and a "
        "drafter distilled on the aux states and logits vLLM computes for it on CPU, its τ then "
        "measured through vLLM's dspark speculator (tests/data/pair-k3; the size flags below are "
        "the DeepSeek-V3 run's)",
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
    command = "vllm-dspark train-pair " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.target == "kimi-k3":
        return _kimi_k3(args, command.strip())
    sizes = PairSizes(**{f.name: getattr(args, f.name) for f in fields(PairSizes)})
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


def _kimi_k3(args, command: str) -> int:
    from vllm_dspark.pair.k3 import K3PairSizes, train_k3_pair

    log = train_k3_pair(
        args.out,
        K3PairSizes(),
        seed=args.seed,
        progress=not args.no_progress,
        overwrite=args.overwrite,
        command=command,
    )
    m = log["measured"]
    tau = "-" if m["tau"] is None else f"{m['tau']:.2f}"
    print(
        f"wrote {args.out} in {log['train_seconds'] / 60:.1f} min: drafter "
        f"{log['drafter']['steps_run']} steps; τ through vLLM {tau} over {m['drafts']} drafts "
        f"(greedy text: {', '.join(m['greedy'])})"
    )
    return 0


if __name__ == "__main__":
    from vllm_dspark.tools.cli import main as cli_main

    sys.exit(cli_main(["train-pair", *sys.argv[1:]]))
