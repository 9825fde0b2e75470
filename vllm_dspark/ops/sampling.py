# SPDX-License-Identifier: Apache-2.0
"""The DSpark Markov rollout and seeded draft sampling, as pure functions.

Used by the reference drafter and the drift harness; the tests drive the served model's hooks with
it. The Markov head makes drafting sequential: position ``i``'s logits are the block's base logits
plus a low-rank bias of the token drafted at ``i - 1`` (the anchor for ``i = 0``),

    logits_i = U_i + s * W2 W1[y_{i-1}],    y_i ~ softmax(logits_i / T)    (argmax when T == 0)

as ``DSparkSpeculator._sample_sequential`` does. Sampling is Gumbel-max seeded per (request,
position), so a request's draft never depends on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


@dataclass
class RolloutResult:
    """A Markov rollout over one block (B requests, N positions, vocabulary V, Markov rank r)."""

    tokens: torch.Tensor  # [B, N] int64 drafted tokens
    logits: torch.Tensor  # [B, N, V] fp32 pre-temperature logits, Markov bias included
    markov_embeds: torch.Tensor  # [B, N, r] W1[y_{i-1}], the confidence head's Markov input


def stream_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed for (request seed, position): splitmix64 of their combination.

    Mixing keeps nearby (seed, position) pairs from producing correlated streams.
    """
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def gumbel_noise(
    seed: int, position: int, vocab_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """fp64 ``[vocab_size]`` standard Gumbel noise, a pure function of (seed, position)."""
    generator = torch.Generator(device="cpu").manual_seed(stream_seed(seed, position))
    # fp64 uniforms keep -log(-log(u)) finite in the tail that decides rare tokens.
    u = torch.rand(vocab_size, generator=generator, dtype=torch.float64).clamp_(
        min=torch.finfo(torch.float64).tiny
    )
    return (-torch.log(-torch.log(u))).to(device)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor | None,
    positions: torch.Tensor,
) -> torch.Tensor:
    """One token per row of ``logits [B, V]``: argmax where ``temperature[b] == 0``, else Gumbel-max
    of ``logits / T`` with noise keyed by ``(seeds[b], positions[b])``."""
    tokens = logits.argmax(dim=-1)
    sampled_rows = (temperature > 0).nonzero().flatten().tolist()
    if not sampled_rows:
        return tokens
    if seeds is None:
        raise ValueError(
            "temperature > 0 needs per-request seeds; pass seeds [B] int64 (any values, e.g. 0..B-1)."
        )
    for b in sampled_rows:
        noise = gumbel_noise(int(seeds[b]), int(positions[b]), logits.shape[-1], logits.device)
        tokens[b] = (logits[b].double() / float(temperature[b]) + noise).argmax()
    return tokens


def markov_rollout(
    base_logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    markov_embed: Callable[[torch.Tensor], torch.Tensor],
    markov_bias: Callable[[torch.Tensor], torch.Tensor],
    *,
    temperature: float | torch.Tensor = 0.0,
    seeds: torch.Tensor | None = None,
    forced_prev: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> RolloutResult:
    """Roll the Markov head over a block, left to right.

    Args:
        base_logits: ``[B, N, V]`` the block's base logits ``U = s * lm_head(h)``.
        anchor_ids: ``[B]`` the anchor (last verified) token of each request: ``y_{-1}``.
        markov_embed: ``[B] token ids -> [B, r]`` (``W1[y]``).
        markov_bias: ``[B, r] -> [B, V]`` (``s * m @ W2^T``).
        temperature: a float for the whole batch or ``[B]``; 0 means greedy for that request.
        seeds: ``[B]`` int64 per-request seeds, required when any temperature is > 0.
        forced_prev: ``[B, N]`` teacher forcing: position ``i`` conditions on ``forced_prev[:, i]``
            instead of the token drafted at ``i - 1`` (``forced_prev[:, 0]`` is the anchor).
        positions: ``[B, N]`` positions keying each request's random draws; vLLM keys them by the
            query position (context end + 1 + i). Defaults to the block index ``i``.
    """
    if base_logits.dim() != 3:
        raise ValueError(f"base_logits must be [B, N, V], got shape {tuple(base_logits.shape)}.")
    batch, block, _ = base_logits.shape
    if anchor_ids.shape != (batch,):
        raise ValueError(
            f"anchor_ids must be [B] = [{batch}], got shape {tuple(anchor_ids.shape)}."
        )
    if forced_prev is not None and forced_prev.shape != (batch, block):
        raise ValueError(
            f"forced_prev must be [B, N] = [{batch}, {block}], got shape {tuple(forced_prev.shape)}."
        )
    temperature = torch.as_tensor(temperature, dtype=torch.float32).flatten().cpu()
    if temperature.numel() == 1:
        temperature = temperature.expand(batch)
    if (
        temperature.shape != (batch,)
        or bool((temperature < 0).any())
        or not bool(temperature.isfinite().all())
    ):
        raise ValueError(
            f"temperature must be a finite float >= 0 or [B] = [{batch}] of them, "
            f"got {temperature.tolist()}."
        )
    if positions is None:
        positions = torch.arange(block).expand(batch, block)
    seeds_cpu = seeds.cpu() if seeds is not None else None
    if seeds_cpu is not None and seeds_cpu.shape != (batch,):
        raise ValueError(f"seeds must be [B] = [{batch}], got shape {tuple(seeds_cpu.shape)}.")
    positions_cpu = positions.cpu()

    tokens, logits, embeds = [], [], []
    prev = anchor_ids
    for i in range(block):
        if forced_prev is not None:
            prev = forced_prev[:, i]
        m = markov_embed(prev)
        logits_i = base_logits[:, i].float() + markov_bias(m).float()
        y = sample_tokens(logits_i, temperature, seeds_cpu, positions_cpu[:, i])
        tokens.append(y)
        logits.append(logits_i)
        embeds.append(m)
        prev = y
    return RolloutResult(torch.stack(tokens, 1), torch.stack(logits, 1), torch.stack(embeds, 1))
