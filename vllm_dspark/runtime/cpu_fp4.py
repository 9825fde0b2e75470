# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU kernels for FP4 linears: NVFP4 (W4A16 and W4A4) and MXFP4 weight-only.

vLLM picks NVFP4 kernels by CUDA capability (weight-only ones are forced to Marlin) and has none
for MXFP4 on CPU. :func:`install` offers these, which ``K3DSparkForCausalLM`` calls before building a
quantized drafter's layers. Each dequantizes the weight once, after loading, as vLLM's emulation does
(:mod:`vllm_dspark.ops.fp4`), into the model dtype; W4A4 quantizes its input per 16-block under the
stored global scale first (:mod:`vllm_dspark.ops.act_quant`, shared with the reference drafter).
"""

from __future__ import annotations

import torch
from vllm.model_executor.kernels.linear.mxfp4.base import MxFp4LinearKernel, MxFp4LinearLayerConfig
from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearKernel, NvFp4LinearLayerConfig
from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp4Dynamic
from vllm.platforms import current_platform

from vllm_dspark.compat import add_cpu_fp4_kernels
from vllm_dspark.ops.act_quant import ActScheme
from vllm_dspark.ops.fp4 import dequantize_mxfp4, dequantize_nvfp4
from vllm_dspark.runtime.cpu_fp8 import as_unquantized, cpu_only, dequantized_gemm

# What the FP4 schemes leave on a layer besides the weight, all folded into it at load.
_SCALES = (
    "weight_scale",
    "weight_global_scale",
    "input_global_scale",
    "input_global_scale_inv",
    "alpha",
)


class CPUDequantNvFp4LinearKernel(NvFp4LinearKernel):
    """NVFP4 on CPU: the weight dequantized at load; W4A4 inputs quantized per call as on a GPU."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        return cpu_only()

    @classmethod
    def can_implement(cls, config: NvFp4LinearLayerConfig) -> tuple[bool, str | None]:
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # The scheme leaves the global scale as a multiplier, and W4A4's input global scale as
        # input_global_scale_inv (what vLLM's quantizer takes).
        scale = getattr(layer, "input_global_scale_inv", None)
        layer.dspark_input_quant = (
            None if scale is None else (ActScheme("nvfp4"), scale.detach().float().reshape(()))
        )
        weight = dequantize_nvfp4(layer.weight, layer.weight_scale, layer.weight_global_scale)
        # The model dtype: the loader's default while it finalises layers.
        as_unquantized(layer, weight.to(torch.get_default_dtype()), _SCALES)

    def apply_weights(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return dequantized_gemm(layer, x, bias)


class CPUDequantMxFp4LinearKernel(MxFp4LinearKernel):
    """MXFP4 weight-only on CPU: the weight dequantized at load, then an unquantized GEMM."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        return cpu_only()

    @classmethod
    def can_implement(cls, config: MxFp4LinearLayerConfig) -> tuple[bool, str | None]:
        # vLLM asks for MXFP4 inputs even for weight-only (MXFP4A16) checkpoints; like its Marlin
        # kernel, this one leaves them unquantized.
        if config.activation_quant_key not in (None, kMxfp4Dynamic):
            return False, f"weight-only, not {config.activation_quant_key}"
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weight = dequantize_mxfp4(layer.weight, layer.weight_scale)
        as_unquantized(layer, weight.to(torch.get_default_dtype()), _SCALES)

    def apply_weights(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return dequantized_gemm(layer, x, bias)


def install() -> None:
    """Make vLLM choose these kernels for FP4 linears on CPU. Idempotent; other platforms keep their own."""
    if current_platform.is_cpu():
        add_cpu_fp4_kernels(CPUDequantNvFp4LinearKernel, CPUDequantMxFp4LinearKernel)
