# SPDX-License-Identifier: Apache-2.0
"""NaN or Inf in weights, scales or inputs is refused by name, never computed on."""

from __future__ import annotations

import torch

from vllm_dspark.findings import Finding, FindingError


def require_finite(tensor: torch.Tensor, name: str, fix: str) -> None:
    """Raise ``ValueError`` naming ``name`` if ``tensor`` holds NaN or Inf."""
    if tensor.is_floating_point():
        bad = tensor.numel() - int(torch.isfinite(tensor).sum())
        if bad:
            raise FindingError(
                Finding(f"{bad} of {tensor.numel()} values are NaN or infinite", fix, name)
            )


def invalid_scale_count(scale: torch.Tensor) -> int:
    """How many entries of a quantization scale tensor cannot dequantize a weight.

    The dtype says the kind: ``uint8`` is MXFP4's E8M0 exponent (255 encodes NaN); FP8 is NVFP4's
    per-group scale (zero is valid for an all-zero group); any other float scale (FP8 channel,
    NVFP4 global) must be finite and positive.
    """
    if scale.dtype == torch.uint8:
        return int((scale == 255).sum())
    values = scale.float()
    positive = (
        values >= 0 if scale.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else values > 0
    )
    return int((~torch.isfinite(values) | ~positive).sum())
