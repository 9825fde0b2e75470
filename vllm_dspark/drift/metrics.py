# SPDX-License-Identifier: Apache-2.0
"""Drift metrics: pure functions from distributions and tokens to per-token and per-block figures.

Per token (torch): ``Σ min(p, q)`` (= 1 − TV), ``KL(p‖q)``, ``KL(q‖p)`` between the reference's ``p``
and a variant's ``q`` under the same Markov conditioning. Per block (numpy): aggregates with 95 %
bootstrap CIs over blocks, the independent unit. Acceptance ceilings count the bonus token, as vLLM's
mean acceptance length and the DSpark paper's τ do: ``τ = 1 + Σ_k Π_{i≤k} a_i``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

# ----- per-token divergences -----


@dataclass(frozen=True)
class TokenDivergence:
    """Per-token divergences of a variant ``q`` from the reference ``p``; every field ``[...]``."""

    overlap: torch.Tensor  # Σ_v min(p_v, q_v) = 1 − TV(p, q): the coupling (acceptance) probability
    kl: torch.Tensor  # KL(p ‖ q) in nats
    reverse_kl: torch.Tensor  # KL(q ‖ p) in nats


def token_divergence(ref_logits: torch.Tensor, var_logits: torch.Tensor) -> TokenDivergence:
    """Divergences between ``softmax(ref_logits)`` and ``softmax(var_logits)`` over the last dim.

    Computed in float64: the BF16 noise floor sits at KL ~ 1e-6 to 1e-4 nats, which float32
    cancellation over a 163840-entry vocabulary would blur. Tiny negative values from rounding are
    clamped to 0 so the tails can be drawn on a log axis.
    """
    if ref_logits.shape != var_logits.shape:
        raise ValueError(
            f"logit shapes differ: reference {tuple(ref_logits.shape)}, variant {tuple(var_logits.shape)}"
        )
    lp = torch.log_softmax(ref_logits.double(), dim=-1)
    lq = torch.log_softmax(var_logits.double(), dim=-1)
    p, q = lp.exp(), lq.exp()
    diff = lp - lq
    return TokenDivergence(
        overlap=torch.minimum(p, q).sum(-1).clamp(0.0, 1.0),
        kl=(p * diff).sum(-1).clamp_min(0.0),
        reverse_kl=(-q * diff).sum(-1).clamp_min(0.0),
    )


# ----- per-block figures -----


def flips_vs_block_median(ref_conf: np.ndarray, var_conf: np.ndarray) -> np.ndarray:
    """``[B, N]`` bool: where the variant's scheduling decision differs from the reference's.

    The decision is "confidence above the per-block median of the *reference's* confidences", one
    threshold per block shared by both, as a scheduler would compare both drafters' confidences
    against the same admission threshold. The median is a knife-edge threshold (half the positions
    sit near it by construction), so absolute flip rates are pessimistic; compare variants.
    """
    threshold = np.median(ref_conf, axis=-1, keepdims=True)
    return (ref_conf > threshold) != (var_conf > threshold)


def acceptance_ceiling(accept_per_position: np.ndarray) -> np.ndarray:
    """``τ = 1 + Σ_k Π_{i≤k} a_i`` over the last axis: expected accepted length, bonus token included.

    ``a_i`` is the probability that position ``i`` survives; the product composes positions
    because a block is accepted only up to its first mismatch.
    """
    return 1.0 + np.cumprod(np.asarray(accept_per_position, dtype=np.float64), axis=-1).sum(-1)


def prefix_run_length(agree: np.ndarray) -> np.ndarray:
    """1 + the leading positions (last axis) where the variant's token equals the reference's: the
    accepted length if the FP32 reference were the (greedy) target, i.e. the ceiling of 0/1 survival."""
    return acceptance_ceiling(agree)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve of ``scores`` for boolean ``labels`` (Mann-Whitney, ties count half);
    NaN when either class is empty."""
    scores = np.asarray(scores, dtype=np.float64).ravel()
    labels = np.asarray(labels, dtype=bool).ravel()
    pos, neg = int(labels.sum()), int((~labels).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    # Average ranks over ties: each run of equal scores gets the mean of its positions.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], len(scores)]
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return float((ranks[labels].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def pearson_r(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson correlation over the last axis; NaN where either side is constant."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    x = x - x.mean(-1, keepdims=True)
    y = y - y.mean(-1, keepdims=True)
    denom = np.sqrt((x * x).sum(-1) * (y * y).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denom > 0, (x * y).sum(-1) / denom, np.nan)


# ----- bootstrap -----


@dataclass(frozen=True)
class Estimate:
    """A point estimate over all blocks and its percentile-bootstrap interval."""

    value: float
    lo: float
    hi: float

    def as_dict(self) -> dict[str, float]:
        return {"value": self.value, "lo": self.lo, "hi": self.hi}


NO_ESTIMATE = Estimate(float("nan"), float("nan"), float("nan"))


def bootstrap_indices(num_blocks: int, resamples: int, seed: int) -> np.ndarray:
    """``[resamples, num_blocks]`` block indices drawn with replacement; shared by every statistic
    of one run so intervals of different metrics come from the same resamples."""
    if num_blocks < 1:
        raise ValueError("bootstrap needs at least one block")
    return np.random.default_rng(seed).integers(0, num_blocks, size=(resamples, num_blocks))


def bootstrap(
    statistic: Callable[..., np.ndarray],
    arrays: Sequence[np.ndarray],
    indices: np.ndarray,
    *,
    level: float = 0.95,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Point value and percentile interval of ``statistic`` over blocks.

    ``statistic`` maps arrays shaped ``[R, B, ...]`` (R block samples of B blocks each) to ``[R]``
    or ``[R, K]``; it is applied once to all blocks (R = 1) and once to every resample, the leading
    block axis of every array resampled together with each row of ``indices``.
    Returns ``(value, lo, hi)``, each ``[]`` or ``[K]``.
    """
    value = np.asarray(statistic(*(a[None] for a in arrays)), dtype=np.float64)[0]
    samples = np.asarray(statistic(*(a[indices] for a in arrays)), dtype=np.float64)
    alpha = (1.0 - level) / 2.0
    lo, hi = np.nanquantile(samples, [alpha, 1.0 - alpha], axis=0)
    return value, lo, hi


def estimate(
    statistic: Callable[..., np.ndarray], arrays: Sequence[np.ndarray], indices: np.ndarray
) -> Estimate:
    """:func:`bootstrap` of a scalar statistic as an :class:`Estimate`."""
    value, lo, hi = bootstrap(statistic, arrays, indices)
    return Estimate(float(value), float(lo), float(hi))


def estimates(
    statistic: Callable[..., np.ndarray], arrays: Sequence[np.ndarray], indices: np.ndarray
) -> list[Estimate]:
    """:func:`bootstrap` of a vector statistic (one value per position) as a list of :class:`Estimate`."""
    value, lo, hi = bootstrap(statistic, arrays, indices)
    return [Estimate(float(v), float(a), float(b)) for v, a, b in zip(value, lo, hi)]


# ----- the metric set of one (variant, regime, position) cell -----


@dataclass
class BlockRecords:
    """What one variant produced on ``B`` blocks of ``N`` positions, next to the reference.

    ``tf_*`` come from the teacher-forced pass (the variant's Markov bias fed the reference's
    tokens, so ``p`` and ``q`` share their conditioning); ``rollout_agree`` from the free-running
    greedy rollout; confidences from each drafter's own free-running rollout, as served.
    """

    tf_agree: np.ndarray  # [B, N] bool: argmax q == reference token
    rollout_agree: np.ndarray  # [B, N] bool: free-running variant token == reference token
    overlap: np.ndarray  # [B, N] Σ min(p, q)
    kl: np.ndarray  # [B, N] KL(p ‖ q)
    reverse_kl: np.ndarray  # [B, N] KL(q ‖ p)
    ref_conf: np.ndarray  # [B, N]
    var_conf: np.ndarray  # [B, N]

    @staticmethod
    def concat(parts: Sequence["BlockRecords"]) -> "BlockRecords":
        fields = BlockRecords.__dataclass_fields__
        return BlockRecords(**{f: np.concatenate([getattr(p, f) for p in parts]) for f in fields})


# Fractions of tokens whose KL exceeds the plotted value: the tail the KL-tail plot draws.
KL_TAIL_FRACTIONS: tuple[float, ...] = tuple(float(f) for f in np.logspace(0, -3, 31))


def summarize(rec: BlockRecords, indices: np.ndarray) -> dict:
    """Every metric of one cell with its 95 % block-bootstrap CI, as JSON-ready dicts."""

    # Each statistic maps [R, B, N] block samples to [R] (or [R, N]).
    def mean(a):
        return a.reshape(len(a), -1).mean(1)

    def per_pos(a):
        return a.mean(1)

    def p99(a):
        return np.quantile(a.reshape(len(a), -1), 0.99, axis=1)

    def corr(r, v):
        return pearson_r(r.reshape(len(r), -1), v.reshape(len(v), -1))

    def flip(r, v):
        return mean(flips_vs_block_median(r, v))

    def ceiling(a):
        return acceptance_ceiling(a.mean(1))

    def tv_ceiling(o):
        return acceptance_ceiling(o).mean(1)

    def prefix(a):
        return prefix_run_length(a).mean(1)

    tf = rec.tf_agree.astype(np.float64)
    ro = rec.rollout_agree.astype(np.float64)
    est = {
        "greedy_agreement": estimate(mean, [tf], indices),
        "rollout_agreement": estimate(mean, [ro], indices),
        "one_minus_tv": estimate(mean, [rec.overlap], indices),
        "kl_mean": estimate(mean, [rec.kl], indices),
        "kl_p99": estimate(p99, [rec.kl], indices),
        "reverse_kl_mean": estimate(mean, [rec.reverse_kl], indices),
        "confidence_r": NO_ESTIMATE,
        "sched_flip_rate": NO_ESTIMATE,
        "ceiling": estimate(ceiling, [ro], indices),
        "ceiling_tv": estimate(tv_ceiling, [rec.overlap], indices),
        "prefix_length": estimate(prefix, [ro], indices),
    }
    if not np.isnan(rec.ref_conf).any():  # NaN: the drafter has no confidence head
        est["confidence_r"] = estimate(corr, [rec.ref_conf, rec.var_conf], indices)
        est["sched_flip_rate"] = estimate(flip, [rec.ref_conf, rec.var_conf], indices)
    out: dict = {k: v.as_dict() for k, v in est.items()}
    out["per_position"] = {
        "greedy_agreement": [e.as_dict() for e in estimates(per_pos, [tf], indices)],
        "rollout_agreement": [e.as_dict() for e in estimates(per_pos, [ro], indices)],
        "one_minus_tv": [e.as_dict() for e in estimates(per_pos, [rec.overlap], indices)],
        "kl_mean": [e.as_dict() for e in estimates(per_pos, [rec.kl], indices)],
    }
    kl = rec.kl.ravel()
    out["kl_tail"] = {
        "fraction": list(KL_TAIL_FRACTIONS),
        "kl": [float(np.quantile(kl, 1.0 - f)) for f in KL_TAIL_FRACTIONS],
    }
    out["num_blocks"] = int(rec.tf_agree.shape[0])
    out["num_tokens"] = int(rec.tf_agree.size)
    return out
