# SPDX-License-Identifier: Apache-2.0
"""Which keys a draft block's queries attend to: the whole block (non-causal DSpark) or a causal
staircase (Block5, the K3.1-Pro preview). Shared by the reference and every attention path."""

from __future__ import annotations

import torch


def block_key_mask(block: int, causal: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[N, N]`` bool: which block slots each slot attends to (all, or itself and the earlier ones)."""
    ones = torch.ones(block, block, dtype=torch.bool, device=device)
    return ones.tril() if causal else ones


def paged_key_mask(
    num_queries: int, seq_len: int, causal: bool, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``[Q, S]`` bool over a request's ``seq_len`` cached positions, its ``Q`` query rows being the
    last ``Q`` of them: every key for a non-causal block, keys up to the row's own position otherwise."""
    keys = torch.arange(seq_len, device=device)
    if not causal:
        return torch.ones(num_queries, seq_len, dtype=torch.bool, device=device)
    rows = torch.arange(seq_len - num_queries, seq_len, device=device)
    return keys <= rows[:, None]
