# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU kernels for FP8 linears: weight-only (W8A16), W8A8 per token or per tensor, and W8A8 128-blocks.

vLLM has no CPU kernel for FP8 weight-only linears, and its W8A8 ones need AMX (else
``torch._scaled_mm`` per call, or nothing for blocks); it requantizes per-tensor FP8 weights at load
with a CUDA-only op. :func:`install` offers these kernels and that op's static case, which
``K3DSparkForCausalLM`` calls before building a quantized drafter's layers. Each dequantizes the
weight once, after loading, into the model dtype; from then on the layer is an unquantized linear on
vLLM's CPU GEMM dispatch. The W8A8 ones first quantize and dequantize the input as the GPU kernels
do (:mod:`vllm_dspark.ops.act_quant`, shared with the reference drafter). Dequantizing per call
would cost far more than the GEMV; the price is BF16 weight memory, which a CPU can afford.
"""

from __future__ import annotations

import torch
from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
    FP8ScaledMMLinearKernel,
    FP8ScaledMMLinearLayerConfig,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    kFp8DynamicTokenSym,
    kFp8StaticChannelSym,
    kFp8StaticTensorSym,
    kFp8StaticTokenSym,
)
from vllm.model_executor.layers.utils import cpu_unquantized_gemm, dispatch_cpu_unquantized_gemm
from vllm.model_executor.utils import replace_parameter
from vllm.platforms import current_platform

from vllm_dspark.compat import add_cpu_fp8_kernels, add_cpu_static_fp8_quant
from vllm_dspark.ops.act_quant import ActScheme, fp8_quantize

# Per-tensor scales reach a kernel already expanded per channel by the scheme; ModelOpt's per-channel
# weights are keyed per token (GroupShape(1, -1)).
_WEIGHT_KEYS = (kFp8StaticChannelSym, kFp8StaticTensorSym, kFp8StaticTokenSym)
_INPUT_SCHEMES = {
    kFp8DynamicTokenSym: ActScheme("fp8_token"),
    kFp8StaticTensorSym: ActScheme("fp8_tensor"),
}


def cpu_only() -> tuple[bool, str | None]:
    """A CPU kernel's ``is_supported``: the CPU platform only."""
    return (True, None) if current_platform.is_cpu() else (False, "requires the CPU platform")


def as_unquantized(layer: torch.nn.Module, weight: torch.Tensor, drop: tuple[str, ...]) -> None:
    """``weight`` (dequantized, in the model dtype) on vLLM's CPU GEMM dispatch, the ``drop`` scales gone."""
    replace_parameter(layer, "weight", weight.contiguous())
    for name in drop:
        if hasattr(layer, name):
            delattr(layer, name)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)


def dequantized_gemm(
    layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The GEMM on the dequantized weight, the input first quantized as ``layer.dspark_input_quant`` says."""
    quant = getattr(layer, "dspark_input_quant", None)
    if quant is not None:
        scheme, scale = quant
        x = scheme(x, scale)
    return cpu_unquantized_gemm(layer, x, layer.weight, bias)


class CPUDequantFP8W8A16LinearKernel(FP8ScaledMMLinearKernel):
    """FP8 weight-only linear on CPU: dequantize at load, then an unquantized GEMM."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        return cpu_only()

    @classmethod
    def can_implement(cls, c: FP8ScaledMMLinearLayerConfig) -> tuple[bool, str | None]:
        if c.weight_quant_key not in _WEIGHT_KEYS:
            return (
                False,
                f"supports per-channel and per-tensor FP8 weights, not {c.weight_quant_key}",
            )
        return True, None

    def _dequantized(self, layer: torch.nn.Module) -> torch.Tensor:
        # The scheme hands over the weight as (K, N) and a per-output-channel scale [N, 1].
        return layer.weight.t().to(torch.float32) * layer.weight_scale.view(-1, 1).to(torch.float32)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weight = self._dequantized(layer).to(self.config.out_dtype)
        as_unquantized(layer, weight, ("weight_scale", "input_scale", "input_scale_ub"))

    def apply_weights(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return dequantized_gemm(layer, x, bias)

    def apply_scaled_mm(self, **kwargs) -> torch.Tensor:
        raise NotImplementedError(
            "the weight is dequantized at load; apply_weights runs an unquantized GEMM"
        )


class CPUDequantFP8W8A8LinearKernel(CPUDequantFP8W8A16LinearKernel):
    """FP8 W8A8 linear on CPU: the weight dequantized at load, the input quantized per call as on a GPU."""

    @classmethod
    def can_implement(cls, c: FP8ScaledMMLinearLayerConfig) -> tuple[bool, str | None]:
        if c.activation_quant_key not in _INPUT_SCHEMES:
            return False, f"quantizes inputs per token or per tensor, not {c.activation_quant_key}"
        return super().can_implement(c)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # A static scale is one value by now: the scheme took the max over fused shards, as on a GPU.
        scale = getattr(layer, "input_scale", None)
        layer.dspark_input_quant = (
            _INPUT_SCHEMES[self.config.activation_quant_key],
            None if scale is None else scale.detach().float().reshape(()).clone(),
        )
        super().process_weights_after_loading(layer)


class CPUDequantFP8BlockLinearKernel(CPUDequantFP8W8A8LinearKernel):
    """FP8 128x128-block W8A8 on CPU: the weight dequantized at load, inputs quantized per 128-group."""

    @classmethod
    def can_implement(cls, c: FP8ScaledMMLinearLayerConfig) -> tuple[bool, str | None]:
        group = c.activation_quant_key.scale.group_shape
        if not group.is_per_group() or group.col != 128:
            return False, f"quantizes inputs in groups of 128, not {c.activation_quant_key}"
        return True, None

    def _dequantized(self, layer: torch.nn.Module) -> torch.Tensor:
        # Block schemes hand over the weight as stored, (N, K), with one scale per 128x128 block.
        n, k = layer.weight.shape
        scale = layer.weight_scale.float().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
        return layer.weight.to(torch.float32) * scale[:, :k]

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.dspark_input_quant = (ActScheme("fp8_group", 128), None)
        CPUDequantFP8W8A16LinearKernel.process_weights_after_loading(self, layer)


def install() -> None:
    """Make vLLM choose these kernels for FP8 linears on CPU. Idempotent; other platforms keep their own."""
    if current_platform.is_cpu():
        add_cpu_fp8_kernels(
            CPUDequantFP8W8A16LinearKernel,
            CPUDequantFP8W8A8LinearKernel,
            CPUDequantFP8BlockLinearKernel,
        )
        # Per-tensor FP8 weights are requantized to their fused layer's largest scale at load.
        add_cpu_static_fp8_quant(fp8_quantize)
