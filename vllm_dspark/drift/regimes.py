# SPDX-License-Identifier: Apache-2.0
"""Aux-hidden-state regimes: the one input every variant shares and nobody can observe.

``gauss`` (iid N(0, 1)); ``heavy`` (times a lognormal per-channel scale shared by the 5 aux layers,
like massive activations); ``boot`` (the drafter's own layers run causally over real token streams);
``real`` (the target's own aux states over real text: needs the trained target the drafter serves).
Each block's aux states are a pure function of (seed, regime, block index), rounded to BF16 as vLLM
hands them over, so every variant sees bit-identical inputs however blocks are batched.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

HEAVY_SIGMA = 1.5
_CODES = {"gauss": 1, "heavy": 2, "boot": 3, "real": 4}


def _generator(seed: int, *key: int) -> torch.Generator:
    state = np.random.SeedSequence([seed, *key]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state >> np.uint64(1)))


def heavy_channel_scales(hidden: int, seed: int, sigma: float = HEAVY_SIGMA) -> torch.Tensor:
    """fp32 ``[hidden]`` lognormal channel scales ``exp(sigma * z)``, one draw per run."""
    return torch.exp(
        sigma * torch.randn(hidden, generator=_generator(seed, _CODES["heavy"], 0xCA1E))
    )


def synthetic_aux(
    regime: str,
    block_ids: Sequence[int],
    context_len: int,
    num_layers: int,
    hidden: int,
    seed: int,
    *,
    heavy_sigma: float = HEAVY_SIGMA,
) -> torch.Tensor:
    """BF16 ``[B, context_len, num_layers * hidden]`` aux states of the ``gauss`` or ``heavy`` regime."""
    if regime not in ("gauss", "heavy"):
        raise ValueError(f"synthetic_aux makes 'gauss' or 'heavy', not {regime!r}")
    width = num_layers * hidden
    blocks = [
        torch.randn(context_len, width, generator=_generator(seed, _CODES[regime], int(b) + 1))
        for b in block_ids
    ]
    aux = torch.stack(blocks)
    if regime == "heavy":
        aux = aux * heavy_channel_scales(hidden, seed, heavy_sigma).repeat(num_layers)
    return aux.to(torch.bfloat16)


def pick_layers(num_states: int, wanted: int) -> list[int]:
    """Indices of ``wanted`` states among ``num_states`` (embedding output, then each layer's),
    evenly spaced and ending at the last layer, as the target's aux layers span its depth.

    With fewer drafter layers than aux inputs (the ``tiny`` preset) some states repeat.
    """
    return [int(round(x)) for x in np.linspace(num_states - 1, 0, wanted, endpoint=False)[::-1]]


@torch.inference_mode()
def boot_aux(drafter, token_ids: torch.Tensor, num_target_layers: int) -> torch.Tensor:
    """BF16 ``[B, T, num_target_layers * H]``: the drafter's own layers run causally over ``token_ids [B, T]``.

    Each picked state is a layer's output (the residual stream, as the target hands over
    ``hidden + residual``) at every token, from :meth:`ReferenceDrafter.causal_states`. Runs in BF16, as
    the target computes the states it hands over; precision is irrelevant here because every variant
    receives the same states.
    """
    if drafter.config.target_hidden_size != drafter.config.hidden_size:
        raise ValueError(
            f"the boot regime feeds the drafter's own hidden states (width {drafter.config.hidden_size}) as aux "
            f"states of width target_hidden_size {drafter.config.target_hidden_size}; they must be equal"
        )
    states = drafter.causal_states(token_ids, torch.bfloat16)
    picked = [states[i] for i in pick_layers(len(states), num_target_layers)]
    return torch.cat(picked, dim=-1).to(torch.bfloat16)


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
