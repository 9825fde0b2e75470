# SPDX-License-Identifier: Apache-2.0
"""The reference's CPU GEMMs: narrow weights upcast in reused slabs, BF16 as FP32 where torch's BF16 is slow."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# Narrow weights are upcast a slab of rows at a time into one reused, cache-sized scratch buffer (a
# fresh FP32 copy per call costs more than the matmul); a floor on rows keeps wide weights' GEMMs fed.
_UPCAST_CHUNK_ELEMENTS = 1 << 22
_MIN_SLAB_ROWS = 256
_scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _scratch_buffer(dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
    buffer = _scratch.get((dtype, device))
    if buffer is None or buffer.numel() < numel:
        # A normal tensor, even when first needed under inference_mode, so later calls outside it may write it.
        with torch.inference_mode(False):
            buffer = _scratch[(dtype, device)] = torch.empty(numel, dtype=dtype, device=device)
    return buffer


@functools.cache
def native_bf16_gemm() -> bool:
    """Whether this CPU runs BF16 GEMMs in oneDNN (AVX-512 or better), not torch's slow generic loop."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # an op torch may drop: judge by the vector ISA instead
        return torch.backends.cpu.get_cpu_capability() != "AVX2"


# Up to this many rows torch's generic BF16 loop keeps pace (a GEMV-like path) and upcasting the weight
# costs more than it saves: 8 x 7168 x 4096 took 77 ms natively and 500 ms as FP32 here (AVX2).
_NATIVE_BF16_MAX_ROWS = 16


def _bf16_via_fp32(x: torch.Tensor) -> bool:
    """Whether a BF16 product with ``x`` runs as an FP32 one of the same values, rounded once after.

    BF16 products are exact in FP32 and BF16 GEMMs accumulate in FP32: the same sums, at FP32's
    speed rather than the ~6x slower generic BF16 loop of CPUs without AVX-512.
    """
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and not native_bf16_gemm()


def einsum(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.einsum`` of two operands in ``a.dtype``."""
    if _bf16_via_fp32(a):
        return torch.einsum(equation, a.float(), b.float()).to(a.dtype)
    return torch.einsum(equation, a, b)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` computed in ``x.dtype`` whatever the weight's storage dtype."""
    if x.numel() > _NATIVE_BF16_MAX_ROWS * x.shape[-1] and _bf16_via_fp32(x):
        return linear(x.float(), weight, bias).to(x.dtype)
    if bias is not None:
        bias = bias.to(x.dtype)
    if weight.dtype == x.dtype:
        return F.linear(x, weight, bias)
    rows = max(_MIN_SLAB_ROWS, _UPCAST_CHUNK_ELEMENTS // weight.shape[1])
    scratch = _scratch_buffer(x.dtype, x.device, min(rows, weight.shape[0]) * weight.shape[1])
    outs = []
    for slab in weight.split(rows):
        upcast = scratch[: slab.numel()].view(slab.shape)
        upcast.copy_(slab)
        outs.append(F.linear(x, upcast))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    return out if bias is None else out + bias
