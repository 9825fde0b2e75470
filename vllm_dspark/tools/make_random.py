# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark make-random``: a random drafter checkpoint in the real on-disk layout."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from vllm_dspark.checkpoint.presets import PRESETS
from vllm_dspark.tools.cli import ArgumentParser, add_out, add_shared


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="vllm-dspark make-random",
        description="Write a random K3 DSpark drafter checkpoint in the real on-disk layout: config.json, "
        "BF16 safetensors shards with HF key names and their index, plus the target's shared "
        "embedding and lm_head in OUT/target/. Deterministic for a given --seed.",
    )
    shape = parser.add_mutually_exclusive_group(required=True)
    shape.add_argument(
        "--preset",
        choices=list(PRESETS),
        help="tiny / small: CPU-test sizes; k3: the published shapes (6.6 GiB drafter + 2.3 GiB lm_head)",
    )
    shape.add_argument(
        "--like",
        type=Path,
        metavar="TARGET_DIR",
        help="an MLA target model directory: the drafter takes its hidden size, depth, vocabulary and "
        "MLA latent (aux layers spread over its depth), and its embedding and lm_head as target/ heads",
    )
    parser.add_argument(
        "--num-layers", type=int, default=5, help="draft decoder layers with --like (default 5)"
    )
    add_out(parser, "output directory (created; built beside it and renamed into place)")
    add_shared(parser, seed=True, overwrite=True, progress=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from vllm_dspark.checkpoint_tools.make_random import make_random, make_random_like

    start = time.perf_counter()
    if args.like is not None:
        make_random_like(
            args.out,
            args.like,
            num_layers=args.num_layers,
            seed=args.seed,
            progress=not args.no_progress,
            overwrite=args.overwrite,
        )
    else:
        make_random(
            args.out,
            args.preset,
            seed=args.seed,
            progress=not args.no_progress,
            overwrite=args.overwrite,
        )
    size = sum(p.stat().st_size for p in args.out.rglob("*.safetensors"))
    print(
        f"wrote {args.out} ({args.preset or f'like {args.like}'}, seed {args.seed}): {size / 2**30:.2f} GiB "
        f"in {time.perf_counter() - start:.1f} s; target heads in {args.out / 'target'}"
    )
    return 0


if __name__ == "__main__":
    from vllm_dspark.tools.cli import main as cli_main

    sys.exit(cli_main(["make-random", *sys.argv[1:]]))
