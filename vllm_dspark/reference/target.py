# SPDX-License-Identifier: Apache-2.0
"""The target a drafter serves, in transformers (FP32): its logits and the aux states vLLM hands over."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


def load_target(path: str | Path, layer_ids: Sequence[int], hidden: int, vocab: int):
    """The target model (transformers, FP32) a drafter with these aux ``layer_ids`` serves."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"target {path} has no config.json. Fix: pass the target model directory.")
    config = AutoConfig.from_pretrained(str(path))
    layers = getattr(config, "num_hidden_layers", None)
    if layers is None or config.hidden_size != hidden or config.vocab_size != vocab:
        raise ValueError(
            f"target {path} (hidden {getattr(config, 'hidden_size', None)}, vocab "
            f"{getattr(config, 'vocab_size', None)}) is not the drafter's full target (target_hidden_size "
            f"{hidden}, vocab {vocab}). Fix: pass the target model the drafter was trained for."
        )
    if max(layer_ids) + 1 >= layers:
        raise ValueError(
            f"the drafter taps target layers {list(layer_ids)}, but vLLM collects aux states only "
            f"entering layers 1 .. {layers - 1} of this {layers}-layer target. Fix: pass the target "
            "the drafter was trained for."
        )
    model, info = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, output_loading_info=True
    )
    if info["missing_keys"]:
        # transformers would fill them with random weights: a drafter's target/ holds only the heads.
        raise ValueError(
            f"{path} lacks {len(info['missing_keys'])} of the target's weights (e.g. "
            f"{sorted(info['missing_keys'])[0]}); it holds only the shared heads, not the model. Fix: "
            "pass the full target model directory as --target."
        )
    return model.eval()


@torch.no_grad()
def target_states(
    model,
    token_ids: torch.Tensor,
    layer_ids: Sequence[int],
    cache=None,
    *,
    aux_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [B, T, V] fp32, aux [B, T, W])`` of the target over ``token_ids [B, T]``
    (after ``cache``'s tokens): aux is the residual stream entering layers ``layer_ids + 1``, where
    vLLM collects it (``hidden_states[i + 1]`` in transformers' numbering), in vLLM's BF16 by default."""
    out = model(
        token_ids, past_key_values=cache, use_cache=cache is not None, output_hidden_states=True
    )
    aux = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return out.logits.float(), aux.to(aux_dtype)
