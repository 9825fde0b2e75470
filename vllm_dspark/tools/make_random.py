# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark make-random``: a random drafter checkpoint in the published on-disk layout."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from vllm_dspark.checkpoint.presets import PRESETS
from vllm_dspark.tools.cli import ArgumentParser, add_out, add_shared


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="vllm-dspark make-random",
        description="Write a random K3 DSpark drafter checkpoint in exactly the published on-disk layout "
        "(Inferact/Kimi-K3-DSpark): config.json (--preset k3: the published file byte for byte) and "
        "one BF16 model.safetensors, no index, as the safetensors library writes it (tensors sorted "
        'by name, metadata {"torchspec_version": "0.1.0"}), plus the target\'s shared embedding and '
        "lm_head in OUT/target/. --like writes shards and their index instead. Deterministic for a "
        "given --seed. --target kimi-k3 writes a random Kimi-K3 target model instead.",
    )
    shape = parser.add_mutually_exclusive_group(required=True)
    shape.add_argument(
        "--preset",
        choices=list(PRESETS),
        help="tiny / small: CPU-test sizes; block5-small, k31-small (no embed_tokens.weight), "
        "fc-norm-small: the published variants at small's sizes; k3: the published checkpoint's "
        "shapes (a 7,124,633,450-byte model.safetensors + 4.4 GiB of target heads)",
    )
    shape.add_argument(
        "--like",
        type=Path,
        metavar="TARGET_DIR",
        help="an MLA target model directory (DeepSeek-V3 style, or Kimi-K3: its nested text_config and "
        "language_model.* heads): the drafter takes its hidden size, depth, vocabulary and MLA latent "
        "(aux layers spread over its depth), and its embedding and lm_head as target/ heads",
    )
    shape.add_argument(
        "--target",
        choices=["kimi-k3"],
        help="kimi-k3: a tiny random-weight Kimi-K3 target instead of a drafter "
        "(KimiK3ForConditionalGeneration: KDA and NoPE-MLA layers, MoE with a shared expert, AttnRes; "
        "a one-block vision tower; hidden 256, 4 layers, vocab 4096; 14 MiB)",
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
    if args.target is not None:
        from vllm_dspark.checkpoint_tools.kimi_k3_target import make_kimi_k3_target

        make_kimi_k3_target(args.out, seed=args.seed, overwrite=args.overwrite)
        size = sum(p.stat().st_size for p in args.out.rglob("*.safetensors"))
        print(
            f"wrote {args.out} (a random {args.target} target, seed {args.seed}): "
            f"{size / 2**20:.1f} MiB in {time.perf_counter() - start:.1f} s"
        )
        return 0
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
