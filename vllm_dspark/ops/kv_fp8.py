# SPDX-License-Identifier: Apache-2.0
"""The FP8 (E4M3) latent KV cache as vLLM's MLA layers keep it, as pure functions.

vLLM's fp8 MLA insert (``concat_and_cache_mla``) stores each 576-wide latent ``[kv_c_normed ; k_pe]``
as E4M3 of ``x / k_scale`` (in fp32, saturated to E4M3's finite range); attention reads
``e4m3 * k_scale``. One scale per layer; a checkpoint without one gets 1.0. Calibration is the
static per-tensor rule of compressed-tensors' KV-cache scheme: ``amax / 448`` over the latents seen.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448


def quantize_latent(latent: torch.Tensor, k_scale: torch.Tensor | float) -> torch.Tensor:
    """``latent`` as the fp8 cache stores it: E4M3 of ``latent / k_scale`` in fp32, saturated."""
    scale = torch.as_tensor(k_scale, dtype=torch.float32, device=latent.device)
    return (latent.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def dequantize_latent(
    stored: torch.Tensor, k_scale: torch.Tensor | float, dtype: torch.dtype
) -> torch.Tensor:
    """What attention reads from an fp8 page: ``stored * k_scale`` in ``dtype``."""
    scale = torch.as_tensor(k_scale, dtype=torch.float32, device=stored.device)
    return (stored.view(E4M3).float() * scale).to(dtype)


def latent_round_trip(latent: torch.Tensor, k_scale: torch.Tensor | float) -> torch.Tensor:
    """``latent`` stored in an fp8 page with ``k_scale`` and read back, in its own dtype."""
    return dequantize_latent(quantize_latent(latent, k_scale), k_scale, latent.dtype)


def latent_amax(latent: torch.Tensor) -> torch.Tensor:
    """``[L, ..., D]`` per-layer latents -> ``[L]`` fp32 absolute maxima (what calibration keeps)."""
    return latent.detach().float().abs().flatten(1).amax(dim=1)


def calibrated_scale(amax: torch.Tensor) -> torch.Tensor:
    """Per-layer ``k_scale = amax / 448``: the largest latent lands on E4M3's largest value.

    An all-zero layer keeps 1.0 (any positive scale stores zeros exactly; 0 would divide by zero).
    """
    amax = amax.float()
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
