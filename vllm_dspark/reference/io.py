# SPDX-License-Identifier: Apache-2.0
"""The reference drafter's tensors in and out, by name (:data:`~vllm_dspark.reference.INPUT_TENSORS`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vllm_dspark.checkpoint.st_io import read_tensors
from vllm_dspark.findings import Finding, FindingError
from vllm_dspark.reference import INPUT_TENSORS

if TYPE_CHECKING:
    from vllm_dspark.config import K3DSparkConfig
    from vllm_dspark.reference.drafter import ReferenceDrafter


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
