# SPDX-License-Identifier: Apache-2.0
"""Rotary position embedding of the K3 DSpark drafter, as pure functions.

As vLLM's ``MultiHeadLatentAttention(use_rope=True)``: DeepSeek-YaRN inverse frequencies (a linear
ramp between the ``beta_fast`` / ``beta_slow`` correction dims) with cos/sin scaled by
``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``; GPT-J style pairs ``(2i, 2i+1)``; and
the softmax scale ``qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2``. Cos/sin come from the
positions directly, not from a table: the same fp32 product, without a 256 MiB table at 1M positions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(
    num_rotations: float, dim: int, base: float, original_max_position: int
) -> float:
    # The rotary dim whose wavelength completes ``num_rotations`` turns over the original context.
    return (dim * math.log(original_max_position / (num_rotations * 2 * math.pi))) / (
        2 * math.log(base)
    )


def yarn_correction_range(
    beta_fast: float, beta_slow: float, dim: int, base: float, original_max_position: int
) -> tuple[int, int]:
    """The ``[low, high]`` rotary-pair range over which YaRN ramps from extrapolation to interpolation."""
    low = math.floor(_correction_dim(beta_fast, dim, base, original_max_position))
    high = math.ceil(_correction_dim(beta_slow, dim, base, original_max_position))
    return max(low, 0), min(high, dim - 1)


def _is_yarn(rope_parameters: Mapping[str, Any]) -> bool:
    return rope_parameters.get("rope_type", "default") != "default"


def inverse_frequencies(rope_parameters: Mapping[str, Any], rotary_dim: int) -> torch.Tensor:
    """fp32 ``[rotary_dim // 2]`` inverse frequencies (plain RoPE, or DeepSeek-YaRN when scaled)."""
    base = float(rope_parameters["rope_theta"])
    # Explicitly on the CPU: callers may build models under a meta-device context.
    pos_freqs = base ** (
        torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim
    )
    if not _is_yarn(rope_parameters):
        return 1.0 / pos_freqs
    factor = float(rope_parameters["factor"])
    low, high = yarn_correction_range(
        rope_parameters.get("beta_fast", 32),
        rope_parameters.get("beta_slow", 1),
        rotary_dim,
        base,
        int(rope_parameters["original_max_position_embeddings"]),
    )
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = (
        (torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)
    ).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight


def cos_sin_scale(rope_parameters: Mapping[str, Any]) -> float:
    """The factor DeepSeek-YaRN applies to cos and sin: ``mscale(f, mscale) / mscale(f, mscale_all_dim)``."""
    if not _is_yarn(rope_parameters):
        return 1.0
    factor = float(rope_parameters["factor"])
    return yarn_mscale(factor, float(rope_parameters.get("mscale", 1))) / yarn_mscale(
        factor, float(rope_parameters.get("mscale_all_dim", 0))
    )


def softmax_scale(qk_head_dim: int, rope_parameters: Mapping[str, Any]) -> float:
    """Attention softmax scale: ``qk_head_dim^-0.5``, times ``mscale(factor, mscale_all_dim)^2`` for YaRN.

    vLLM treats a scaled rope with ``attention_factor == 1.0`` as DeepSeek llama-scaling, which
    keeps the plain scale.
    """
    scale = qk_head_dim**-0.5
    if _is_yarn(rope_parameters) and rope_parameters.get("attention_factor") != 1.0:
        mscale = yarn_mscale(
            float(rope_parameters["factor"]), float(rope_parameters.get("mscale_all_dim", 0))
        )
        scale *= mscale * mscale
    return scale


def rotary_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin`` of shape ``positions.shape + (rotary_dim // 2,)``, times ``scale``."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(positions.device)
    return freqs.cos() * scale, freqs.sin() * scale


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J rotation: pair ``(x[2i], x[2i+1])`` rotates by the angle of ``cos[i], sin[i]``.

    ``cos``/``sin`` broadcast against ``x[..., ::2]``. The math runs in at least fp32 (as vLLM's
    fused epilogues do) and the result comes back in ``x.dtype``.
    """
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    cos, sin = cos.to(xf.dtype), sin.to(xf.dtype)
    even, odd = xf[..., 0::2], xf[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


@dataclass(frozen=True)
class RotaryEmbedding:
    """The drafter's rotary embedding, built once from ``config.rope_parameters``."""

    inv_freq: torch.Tensor  # fp32 [rotary_dim // 2]
    scale: float  # applied to cos and sin

    @classmethod
    def from_rope_parameters(
        cls, rope_parameters: Mapping[str, Any], rotary_dim: int
    ) -> RotaryEmbedding:
        return cls(inverse_frequencies(rope_parameters, rotary_dim), cos_sin_scale(rope_parameters))

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape ``positions.shape + (heads..., rotary_dim)`` at ``positions``."""
        cos, sin = rotary_cos_sin(positions, self.inv_freq, self.scale)
        # Broadcast over any head dims between the positions' dims and the rotary dim.
        extra = x.dim() - positions.dim() - 1
        shape = tuple(positions.shape) + (1,) * extra + (cos.shape[-1],)
        return apply_rotary_interleaved(x, cos.view(shape), sin.view(shape))


def rotate_pe(
    rotary_emb: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """GPT-J-rotate ``x [T, heads, rope_dim]`` at ``positions [T]`` with the layer's fp32 cos/sin table.

    The table is the one the GPU layer's fused epilogues read, so context latents written here and
    query-block latents written by those kernels carry the same rotation.
    """
    assert not rotary_emb.is_neox_style, "Kimi-K3 MLA rotates GPT-J style"
    cos, sin = rotary_emb.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    return apply_rotary_interleaved(x, cos.unsqueeze(-2), sin.unsqueeze(-2))
