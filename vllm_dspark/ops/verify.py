# SPDX-License-Identifier: Apache-2.0
"""Speculative verification of one drafted block per request, as pure functions.

Greedy: accept the drafted prefix equal to the target's argmax, then emit the target's argmax at the
first mismatch (or the bonus token). Temperature > 0: block verification (Sun et al. 2024,
arXiv 2403.10444) exactly as vLLM 0.33 runs it: ``vllm/v1/worker/gpu/spec_decode/
rejection_sampler_utils.py`` (``_compute_cumulative_log_p_kernel``,
``_compute_local_residual_mass_kernel``, ``_rejection_kernel``, ``_resample_kernel``). Randomness is
an input (uniforms and Gumbel noise), so the functions are deterministic and testable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Verified:
    """The verdict on a batch of blocks (B requests, N drafted tokens each)."""

    num_accepted: torch.Tensor  # [B] int64 in [0, N]: drafted tokens kept
    next_token: torch.Tensor  # [B] int64: the correction (num_accepted < N) or bonus token


def greedy_verify(target_logits: torch.Tensor, drafts: torch.Tensor) -> Verified:
    """``target_logits [B, N + 1, V]`` (row i predicts draft i; row N the bonus), ``drafts [B, N]``."""
    _check(target_logits, drafts)
    argmax = target_logits.argmax(-1)
    match = (argmax[:, :-1] == drafts).long()
    accepted = match.cumprod(-1).sum(-1)
    return Verified(accepted, argmax.gather(1, accepted[:, None])[:, 0])


def block_verify(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    drafts: torch.Tensor,
    uniforms: torch.Tensor,
    gumbel: torch.Tensor,
) -> Verified:
    """Block verification of ``drafts [B, N]`` drawn from ``draft_probs [B, N, V]`` against
    ``target_probs [B, N + 1, V]``; ``uniforms [B, N]`` in (0, 1], ``gumbel [B, V]`` for the resample.

    With ``p_0 = 1``, ``p_i = min(p_{i-1} M_b(x_i) / M_s(x_i), 1)`` and the residual mass
    ``R_i = Σ_x max(p_i M_b(x | x_≤i) − M_s(x | x_≤i), 0)``, position ``i`` passes with probability
    ``h_i = R_i / (R_i + 1 − p_i)`` (``h_N = p_N``); the kept length is the *last* passing position,
    and the next token is drawn from ``max(p_τ M_b − M_s, 0)`` (the target itself after a full block).
    """
    _check(target_probs, drafts)
    if draft_probs.shape != drafts.shape + target_probs.shape[-1:]:
        raise ValueError(
            f"draft_probs must be [B, N, V] = {[*drafts.shape, target_probs.shape[-1]]}, "
            f"got {list(draft_probs.shape)}"
        )
    target, draft = target_probs.double(), draft_probs.double()
    batch, num = drafts.shape
    if num == 0:  # nothing drafted (an adaptive budget of 0): sample the target
        return Verified(drafts.new_zeros(batch), (target[:, 0].log() + gumbel.double()).argmax(-1))
    rows = torch.arange(batch)
    ratio = target[:, :-1].gather(-1, drafts[..., None])[..., 0] / draft.gather(
        -1, drafts[..., None]
    )[..., 0].clamp_min(torch.finfo(torch.float64).tiny)
    # p[:, i] = p_i for i = 0..N (cumulative_log_p, kept in linear space).
    p = torch.ones(batch, num + 1, dtype=torch.float64)
    for i in range(num):
        p[:, i + 1] = torch.clamp(p[:, i] * ratio[:, i], max=1.0)
    # residual[:, i] = R_i for i = 1..N-1: the mass at the next position scaled by p_i.
    residual = (p[:, 1:num, None] * target[:, 1:num] - draft[:, 1:num]).clamp_min(0).sum(-1)
    denom = residual + 1.0 - p[:, 1:num]
    h = torch.cat(
        [torch.where(denom > 0, residual / denom.clamp_min(1e-300), 1.0), p[:, num:]], dim=1
    )  # [B, N]: h_1 .. h_N
    passed = uniforms.double() <= h
    positions = torch.arange(1, num + 1).expand(batch, num)
    accepted = torch.where(passed, positions, 0).max(-1).values
    # The resample at tau: max(p_tau M_b - M_s, 0), or M_b itself after a full block.
    full = accepted == num
    at = accepted.clamp(max=num - 1)
    mix = p[rows, accepted][:, None] * target[rows, accepted] - draft[rows, at]
    dist = torch.where(full[:, None], target[rows, accepted], mix.clamp_min(0))
    # An empty residual is reachable only through rounding (exactly, h would have passed): use M_b.
    empty = dist.sum(-1, keepdim=True) <= 0
    dist = torch.where(empty, target[rows, accepted], dist)
    next_token = (dist.log() + gumbel.double()).argmax(-1)
    return Verified(accepted, next_token)


def _check(target: torch.Tensor, drafts: torch.Tensor) -> None:
    rows = (drafts.shape[0], drafts.shape[1] + 1) if drafts.dim() == 2 else None
    if rows is None or target.dim() != 3 or tuple(target.shape[:2]) != rows:
        raise ValueError(
            f"target rows must be [B, N + 1, V] for drafts [B, N] = {list(drafts.shape)}, "
            f"got {list(target.shape)}"
        )


def adaptive_budget(confidences: torch.Tensor, token_cost: float) -> int:
    """How many of a block's drafts to verify, from the confidence head's ``[N]`` probabilities.

    vLLM 0.33's adaptive verification (``vllm/v1/worker/gpu/spec_decode/adaptive_verification.py``,
    ``AdaptiveVerificationManager.get_num_tokens``) for one request: the survival products
    ``S_k = Π_{j≤k} c_j`` rank the drafts, and the budget ``B`` maximizes expected accepted tokens
    ``1 + Σ_{k<B} S_k`` over the step's cost, here ``1 + token_cost * (1 + B)`` (a fixed cost per
    step plus ``token_cost`` per token the target verifies) in place of vLLM's profiled tables.
    """
    survival = torch.cumprod(confidences.double().flatten(), 0)
    expected = 1.0 + torch.cat([survival.new_zeros(1), survival.cumsum(0)])
    cost = 1.0 + token_cost * (1.0 + torch.arange(len(expected), dtype=torch.float64))
    return int((expected / cost).argmax())
