# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A CPU kernel for compressed-tensors FP8 weight-only (W8A16) linears.

vLLM lists no CPU kernel for this scheme (:data:`vllm_dspark.compat.WFP8A16_KERNELS` has no CPU
entry), so an FP8 drafter would not load on CPU; :func:`install` appends this one, and
``K3DSparkForCausalLM`` calls it before building a quantized drafter's layers. It dequantizes once, after loading, into the model
dtype; from then on the layer is an unquantized linear on vLLM's CPU GEMM dispatch. Dequantizing
per call would cost far more than the GEMV; the price is BF16 weight memory, which a CPU can afford.
"""

from __future__ import annotations

import torch
from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
    FP8ScaledMMLinearKernel,
    FP8ScaledMMLinearLayerConfig,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    kFp8StaticChannelSym,
    kFp8StaticTensorSym,
)
from vllm.model_executor.layers.utils import cpu_unquantized_gemm, dispatch_cpu_unquantized_gemm
from vllm.model_executor.utils import replace_parameter
from vllm.platforms import current_platform

from vllm_dspark.compat import add_cpu_wfp8a16_kernel


class CPUDequantFP8W8A16LinearKernel(FP8ScaledMMLinearKernel):
    """FP8 weight-only linear on CPU: dequantize at load, then an unquantized GEMM."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        if not current_platform.is_cpu():
            return False, "requires the CPU platform"
        return True, None

    @classmethod
    def can_implement(cls, c: FP8ScaledMMLinearLayerConfig) -> tuple[bool, str | None]:
        # Per-tensor scales reach the kernel already expanded per channel by the scheme.
        if c.weight_quant_key not in (kFp8StaticChannelSym, kFp8StaticTensorSym):
            return (
                False,
                f"supports per-channel and per-tensor FP8 weights, not {c.weight_quant_key}",
            )
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # The scheme hands over the weight as (K, N) and a per-output-channel scale [N, 1].
        weight = layer.weight.t().to(torch.float32) * layer.weight_scale.view(-1, 1).to(
            torch.float32
        )
        replace_parameter(layer, "weight", weight.to(self.config.out_dtype).contiguous())
        for name in ("weight_scale", "input_scale", "input_scale_ub"):
            if hasattr(layer, name):
                delattr(layer, name)
        dispatch_cpu_unquantized_gemm(layer, remove_weight=True)

    def apply_weights(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return cpu_unquantized_gemm(layer, x, layer.weight, bias)

    def apply_scaled_mm(self, **kwargs) -> torch.Tensor:
        raise NotImplementedError(
            "the weight is dequantized at load; apply_weights runs an unquantized GEMM"
        )


def install() -> None:
    """Make vLLM choose :class:`CPUDequantFP8W8A16LinearKernel` for FP8 W8A16 linears on CPU.

    Idempotent; does nothing on other platforms, whose own kernels stay in charge.
    """
    if current_platform.is_cpu():
        add_cpu_wfp8a16_kernel(CPUDequantFP8W8A16LinearKernel)
