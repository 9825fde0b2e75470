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
