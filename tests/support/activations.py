# SPDX-License-Identifier: Apache-2.0
"""The activations the input-quantization tests and their ModelOpt fixture (tests/data/modelopt) use."""

from __future__ import annotations

import torch


def activations(dtype: torch.dtype) -> torch.Tensor:
    """[37, 384]: rows over five decades, an all-zero row (FP8's floored scale), and a row so small
    that its NVFP4 block scales underflow E4M3 to zero (vLLM's get_reciprocal 1e8 case)."""
    x = torch.randn(37, 384, generator=torch.Generator().manual_seed(0))
    x = x * torch.logspace(-3, 2, 37)[:, None]
    x[3] = 0
    x[5] *= 1e-2
    return x.to(dtype)
