# SPDX-License-Identifier: Apache-2.0
"""Activation quantization as vLLM's W8A8 / W4A4 kernels compute it, as quantize-dequantize in float.

One implementation for the plugin's CPU kernels and the reference drafter alike. The FP8 paths are
vLLM's ``QuantFP8.forward_native`` (``layers/quantization/input_quant_fp8.py``): scale = amax / 448,
floored at 1 / (448 * 512), and x * (1 / scale) saturated to E4M3. NVFP4 is its
``ref_nvfp4_quant_dequant`` (``quantization/utils/nvfp4_emulation_utils.py``): an E4M3 scale per 16
values under one global scale, and E2M1 codes rounded to nearest, ties to even. The tests check
each against those functions, bit for bit (a zero from NVFP4 may carry the other sign).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
FP8_MIN_SCALE = 1.0 / (
    FP8_MAX * 512.0
)  # vLLM's _FP8_MIN_SCALING_FACTOR: an all-zero row stays finite
FP4_MAX = 6.0
NVFP4_BLOCK = 16


@dataclass(frozen=True)
class ActScheme:
    """How a linear's input is quantized: ``kind`` is one of :data:`KINDS`; ``group_size`` for groups."""

    kind: str
    group_size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown activation scheme {self.kind!r}; one of {', '.join(KINDS)}")

    @property
    def static(self) -> bool:
        """Whether it reads a stored scale (the input_scale of static FP8, the global scale of NVFP4)."""
        return self.kind in ("fp8_tensor", "nvfp4")

    def __call__(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` quantized and dequantized, in ``x.dtype``; ``scale`` is the stored input scale when static."""
        if self.static != (scale is not None):
            raise ValueError(
                f"the {self.kind} activation scheme {'needs' if self.static else 'takes no'} input scale"
            )
        if self.kind == "fp8_token":
            return fp8_per_token(x)
        if self.kind == "fp8_tensor":
            return fp8_static(x, scale)
        if self.kind == "fp8_group":
            return fp8_per_group(x, self.group_size or 128)
        return nvfp4(x, scale)


KINDS = ("fp8_token", "fp8_tensor", "fp8_group", "nvfp4")


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor, *, divide: bool = False) -> torch.Tensor:
    """E4M3 codes of x * (1 / scale) (or x / scale), saturated.

    vLLM's per-token and per-tensor paths (and its CUDA static quant op) multiply by the reciprocal,
    its group path divides: the two round differently, so each is mirrored.
    """
    scaled = x.float() / scale if divide else x.float() * scale.reciprocal()
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _fp8_qdq(x: torch.Tensor, scale: torch.Tensor, *, divide: bool = False) -> torch.Tensor:
    """:func:`fp8_quantize`, times scale, in ``x.dtype``."""
    return (fp8_quantize(x, scale, divide=divide).float() * scale).to(x.dtype)


def requantize_fp8_shards(
    weight: torch.Tensor, scales: torch.Tensor, widths: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused per-tensor FP8 weight under its shards' largest scale, as vLLM makes it at load.

    vLLM's ``requantize_with_max_scale``: each shard of E4M3 ``weight`` [N, K] dequantized in float16
    with its own scale, then quantized with the largest. Returns ``(codes, largest scale)``.
    """
    top = scales.float().max()
    out = torch.empty_like(weight)
    start = 0
    for width, scale in zip(widths, scales.float()):
        shard = weight[start : start + width].to(torch.float16) * scale  # float16, as vLLM's
        out[start : start + width] = fp8_quantize(shard, top)
        start += width
    return out, top


def fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token FP8: one scale per row (last dim), from that row's absolute maximum."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    return _fp8_qdq(x, (amax / FP8_MAX).clamp_(min=FP8_MIN_SCALE))


def fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static per-tensor FP8 with the stored ``input_scale`` (one element)."""
    return _fp8_qdq(x, scale.float().reshape(()))


def fp8_per_group(x: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """Dynamic FP8 with one scale per ``group_size`` consecutive values of each row (zero-padded)."""
    k = x.shape[-1]
    pad = -k % group_size
    grouped = torch.nn.functional.pad(x, (0, pad)).unflatten(-1, (-1, group_size))
    amax = grouped.abs().amax(dim=-1, keepdim=True).float()
    out = _fp8_qdq(grouped, (amax / FP8_MAX).clamp_(min=FP8_MIN_SCALE), divide=True).flatten(-2)
    return out[..., :k]


# Adding 1.5 * 2^22 * 2^e to a float32 below 2^(e+1) leaves it in a binade whose steps are 2^(e-1),
# E2M1's spacing there (0.5 below 2, 1 below 4, 2 up to 6): the float add then rounds to the grid, to
# nearest, ties to even. 2^e is the magnitude (at least 1) with its mantissa bits cleared.
_EXPONENT_BITS = 0x7F800000
_MAGIC_FROM_POWER = (22 << 23) | 0x400000  # times 2^22, times 1.5


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` (within ±6) rounded to the E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to even.

    Equal in value to vLLM's ``cast_to_fp4``; a zero may differ from it in sign.
    """
    power = x.abs().clamp_min_(1.0).view(torch.int32).bitwise_and_(_EXPONENT_BITS)
    magic = power.add_(_MAGIC_FROM_POWER).view(torch.float32)
    return x.add(magic).sub_(magic)


def nvfp4(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4: E2M1 codes in blocks of 16, an E4M3 scale per block under the one ``global_scale``.

    ``global_scale`` is compressed-tensors' ``input_global_scale`` (448 * 6 / amax): ModelOpt stores
    its reciprocal as ``input_scale``.
    """
    k = x.shape[-1]
    if k % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 quantizes blocks of {NVFP4_BLOCK} values, but the input has {k}")
    gs = global_scale.float().reshape(())
    blocks = x.unflatten(-1, (-1, NVFP4_BLOCK))
    # ref_nvfp4_quant's operations in its order (the rounding is in the order), fewer of them: at one
    # token this runs on a few thousand values, where each torch call's overhead is the cost.
    amax = blocks.abs().amax(dim=-1, keepdim=True).float()
    scale = (gs * (amax * (1 / FP4_MAX))).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    # vLLM's get_reciprocal: 1 / (s + (s == 0) * 1e8), so a zero scale zeroes its block, not NaN.
    over = scale * gs.reciprocal()
    inv = over.masked_fill_(over == 0, 1e8).reciprocal_()
    codes = round_to_e2m1((blocks * inv).clamp_(-FP4_MAX, FP4_MAX))  # bf16 * float32 is float32
    return (codes * (scale / gs)).flatten(-2).to(x.dtype)
