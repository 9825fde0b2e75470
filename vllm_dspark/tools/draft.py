# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark draft``: draft one block per request with the reference drafter.

The input and output tensors (``aux_hidden_states``, ``context_positions``, ``anchor_ids``, optional
``context_mask`` / ``seeds`` / ``temperature``; ``draft_tokens``, ``logits``, ``confidences``,
``block_positions``) are tabled once, in the README's "Random checkpoints and the reference drafter";
:data:`INPUT_TENSORS` and :data:`OUTPUT_TENSORS` are their definitions in code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vllm_dspark.checkpoint.st_io import read_tensors, save_tensors
from vllm_dspark.findings import Finding, FindingError
from vllm_dspark.safety import check_output, require_finite
from vllm_dspark.tools.cli import ArgumentParser

if TYPE_CHECKING:
    from vllm_dspark.config import K3DSparkConfig
    from vllm_dspark.reference.drafter import ReferenceDrafter

# name -> (required, description) for --help and error messages.
INPUT_TENSORS: dict[str, tuple[bool, str]] = {
    "aux_hidden_states": (
        True,
        "[B, T, num_target_layers*target_hidden_size] float: target aux hidden states",
    ),
    "context_positions": (True, "[B, T] int64: positions of the context tokens"),
    "anchor_ids": (True, "[B] int64: last verified token per request"),
    "context_mask": (False, "[B, T] bool: False marks padding (default all True)"),
    "seeds": (False, "[B] int64: sampling seeds (needed when temperature > 0)"),
    "temperature": (False, "[B] float: 0 = greedy (default)"),
}
OUTPUT_TENSORS: dict[str, str] = {
    "draft_tokens": "[B, N] int64",
    "logits": "[B, N, V] fp32, pre-temperature, Markov bias included",
    "confidences": "[B, N] fp32 in (0, 1) (drafters with a confidence head)",
    "block_positions": "[B, N] int64",
}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def example_inputs(
    config: K3DSparkConfig,
    *,
    batch: int = 2,
    context_len: int = 16,
    seed: int = 0,
    temperature: float = 0.0,
) -> dict[str, torch.Tensor]:
    """Random inputs for ``config``: contexts of unequal length (the last request padded), as a user
    would hand them to ``draft``."""
    generator = torch.Generator().manual_seed(seed)
    width = config.num_target_layers * config.target_hidden_size
    lengths = [context_len - (b * context_len // (2 * batch)) for b in range(batch)]
    mask = torch.arange(context_len)[None, :] < torch.tensor(lengths)[:, None]
    starts = torch.randint(0, 4096, (batch, 1), generator=generator)
    return {
        "aux_hidden_states": torch.randn(batch, context_len, width, generator=generator),
        "context_positions": starts + torch.arange(context_len)[None, :],
        "anchor_ids": torch.randint(0, config.vocab_size, (batch,), generator=generator),
        "context_mask": mask,
        "seeds": torch.arange(batch, dtype=torch.int64) + seed,
        "temperature": torch.full((batch,), float(temperature)),
    }


def read_inputs(path: str | Path) -> dict[str, torch.Tensor]:
    """Read and check the names in an inputs file; shapes and values are checked by the drafter."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise FindingError(
            Finding(
                f"inputs file {path} {what}",
                "pass a .safetensors file (`--example-inputs FILE` writes a valid one)",
            )
        )
    tensors = read_tensors(path)
    missing = [
        name for name, (required, _) in INPUT_TENSORS.items() if required and name not in tensors
    ]
    if missing:
        raise ValueError(
            f"{path} lacks required tensor(s) {', '.join(missing)}: "
            + "; ".join(f"{n} {INPUT_TENSORS[n][1]}" for n in missing)
            + "."
        )
    unknown = sorted(set(tensors) - set(INPUT_TENSORS))
    if unknown:
        raise ValueError(
            f"{path} has unknown tensor(s) {', '.join(unknown)}; expected names: "
            f"{', '.join(INPUT_TENSORS)}."
        )
    return tensors


def run_draft(
    drafter: ReferenceDrafter, inputs: dict[str, torch.Tensor], *, absorbed: bool = False
) -> dict[str, torch.Tensor]:
    """Run ``drafter.draft`` on an inputs dict; returns the output tensors by name."""
    out = drafter.draft(
        inputs["aux_hidden_states"],
        inputs["context_positions"],
        inputs["anchor_ids"],
        temperature=inputs.get("temperature", 0.0),
        seeds=inputs.get("seeds"),
        context_mask=inputs.get("context_mask"),
        absorbed=absorbed,
    )
    result = {
        "draft_tokens": out.tokens,
        "logits": out.logits,
        "block_positions": out.block_positions,
    }
    if out.confidences is not None:
        result["confidences"] = out.confidences.float()
    return result


def _parser() -> argparse.ArgumentParser:
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
    parser.add_argument("--model", required=True, type=Path, help="drafter checkpoint directory")
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
    parser.add_argument("--out", type=Path, help="output tensors (.safetensors), names below")
    parser.add_argument(
        "--dtype",
        choices=list(_DTYPES),
        default="fp32",
        help="compute dtype: fp32 (the reference) or bf16 (what ships); default fp32",
    )
    parser.add_argument(
        "--absorbed",
        action="store_true",
        help="attend in the absorbed MLA form the GPU kernels use (default: naive kv_b_proj form)",
    )
    return parser


def _write(
    tensors: dict[str, torch.Tensor], out: Path, flag: str, inputs: list[Path | None]
) -> None:
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
    parser = _parser()
    args = parser.parse_args(argv)
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
        args.model, target_dir=args.target, compute_dtype=_DTYPES[args.dtype]
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
