# SPDX-License-Identifier: Apache-2.0
"""FP4 (E2M1) weights back to float, as vLLM's emulation dequantizes them: NVFP4 (an E4M3 scale per 16
values times one global multiplier) and MXFP4 (a power-of-two E8M0 scale per 32 values).

Two codes per byte, the even column in the low nibble; the sign is bit 3, so a stored 8 is -0.
"""

from __future__ import annotations

import torch

# E2M1 code -> value: sign bit 3, magnitude index bits 0-2.
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """float32 [N, 2 * K/2] values of uint8 ``packed`` [N, K/2] (low nibble first)."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    return torch.tensor(E2M1_VALUES, device=packed.device)[codes.long()]


def dequantize_nvfp4(
    packed: torch.Tensor, scale: torch.Tensor, multiplier: torch.Tensor
) -> torch.Tensor:
    """float32 [N, K]: E2M1 ``packed`` times its E4M3 block ``scale`` [N, K/16] times the global
    ``multiplier`` (ModelOpt's ``weight_scale_2``, compressed-tensors' 1 / global scale)."""
    values = e2m1_values(packed)
    n, k = values.shape
    blocks = scale.float() * multiplier.float().reshape(())  # vLLM's order: the scales first
    return (values.view(n, k // 16, 16) * blocks.unsqueeze(-1)).reshape(n, k)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: E2M1 ``packed`` times 2^(e - 127) per 32 values (``scale``: E8M0 bytes [N, K/32])."""
    values = e2m1_values(packed)
    n, k = values.shape
    powers = torch.exp2(scale.view(torch.uint8).float() - 127.0)
    return (values.view(n, k // 32, 32) * powers.unsqueeze(-1)).reshape(n, k)
