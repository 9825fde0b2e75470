# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark draft``: draft one block per request with the reference drafter.

The input and output tensors (``aux_hidden_states``, ``context_positions``, ``anchor_ids``, optional
``context_mask`` / ``seeds`` / ``temperature``; ``draft_tokens``, ``logits``, ``confidences``,
``block_positions``) are tabled once, in docs/tools/draft.md;
:data:`vllm_dspark.reference.INPUT_TENSORS` and ``OUTPUT_TENSORS`` are their definitions in code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_dspark.findings import Finding, FindingError
from vllm_dspark.reference import INPUT_TENSORS, OUTPUT_TENSORS
from vllm_dspark.safety import check_output
from vllm_dspark.tools.cli import ArgumentParser, add_model, add_out, add_shared

if TYPE_CHECKING:
    import torch


def build_parser() -> argparse.ArgumentParser:
    inputs = "\n".join(
        f"  {n:<18} {'' if req else '(optional) '}{desc}"
        for n, (req, desc) in INPUT_TENSORS.items()
    )
    outputs = "\n".join(f"  {n:<18} {desc}" for n, desc in OUTPUT_TENSORS.items())
    parser = ArgumentParser(
        prog="vllm-dspark draft",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Draft one block per request with the reference (plain PyTorch) K3 DSpark drafter.\n"
        "Each block sits at positions last+1..last+N after its request's context and reads\n"
        "[anchor, mask x (N-1)].",
        epilog=f"input tensors (--inputs):\n{inputs}\n\noutput tensors (--out):\n{outputs}",
    )
    add_model(parser, "drafter checkpoint directory")
    parser.add_argument(
        "--target",
        type=Path,
        default=None,
        help="target model directory (or .safetensors file) with model.embed_tokens.weight and "
        "lm_head.weight; default MODEL/target",
    )
    io = parser.add_mutually_exclusive_group(required=True)
    io.add_argument("--inputs", type=Path, help="input tensors (.safetensors), names below")
    io.add_argument(
        "--example-inputs",
        type=Path,
        metavar="FILE",
        help="write a random inputs file for this model to FILE and exit",
    )
    add_out(parser, "output tensors (.safetensors), names below", required=False)
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="compute dtype: fp32 (the reference) or bf16 (what ships); default fp32",
    )
    parser.add_argument(
        "--absorbed",
        action="store_true",
        help="attend in the absorbed MLA form the GPU kernels use (default: naive kv_b_proj form)",
    )
    add_shared(parser)
    return parser


def _write(
    tensors: dict[str, torch.Tensor], out: Path, flag: str, inputs: list[Path | None]
) -> None:
    from vllm_dspark.checkpoint.st_io import save_tensors

    """Save ``tensors`` to ``out`` atomically, never over an input or into a directory."""
    check_output(out, inputs, flag=flag)
    if out.is_dir():
        raise FindingError(
            Finding(
                f"{flag} {out} is a directory", f"pass a file path, e.g. {out / 'out.safetensors'}"
            )
        )
    save_tensors(out, tensors)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    import torch

    from vllm_dspark.finite import require_finite
    from vllm_dspark.reference.io import example_inputs, read_inputs, run_draft

    if args.inputs is not None and args.out is None:
        parser.error("--out is required with --inputs")
    sources = [args.inputs, args.target, args.model]
    if args.example_inputs is not None:
        from vllm_dspark.checkpoint.store import load_config

        _write(
            example_inputs(load_config(args.model)),
            args.example_inputs,
            "--example-inputs",
            sources,
        )
        print(f"wrote example inputs to {args.example_inputs}")
        return 0
    check_output(args.out, sources, flag="--out")  # before any work
    inputs = read_inputs(
        args.inputs
    )  # before the model import: a bad inputs file fails in a second
    from vllm_dspark.reference.drafter import ReferenceDrafter

    drafter = ReferenceDrafter.from_pretrained(
        args.model,
        target_dir=args.target,
        compute_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype],
    )
    outputs = run_draft(drafter, inputs, absorbed=args.absorbed)
    require_finite(
        outputs["logits"],
        "the drafted logits",
        "the drafter's weights or the target heads hold NaN or "
        "Inf values: run `vllm-dspark check` on the drafter and re-export it",
    )
    _write(outputs, args.out, "--out", sources)
    tokens = outputs["draft_tokens"]
    print(
        f"drafted {tokens.shape[0]} block(s) of {tokens.shape[1]} tokens ({args.dtype}) -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    from vllm_dspark.tools.cli import main as cli_main

    sys.exit(cli_main(["draft", *sys.argv[1:]]))
