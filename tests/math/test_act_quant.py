# SPDX-License-Identifier: Apache-2.0
"""Activation quantization (ops.act_quant) bit for bit against vLLM's own torch paths for FP8 and NVFP4
inputs (``QuantFP8.forward_native``, ``ref_nvfp4_quant_dequant``, ``cast_to_fp4``)."""

from __future__ import annotations

import pytest
import torch

from vllm_dspark.ops import act_quant


def _inputs(dtype: torch.dtype) -> torch.Tensor:
    # Rows spanning five decades, an all-zero row (the floored scale) and a row so small that its
    # NVFP4 block scales underflow E4M3 to zero (get_reciprocal's 1e8 case).
    x = torch.randn(37, 384, generator=torch.Generator().manual_seed(0))
    x = x * torch.logspace(-3, 2, 37)[:, None]
    x[3] = 0
    x[5] *= 1e-2
    return x.to(dtype)


@pytest.fixture(scope="module")
def vllm_context():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):  # vLLM's custom ops read the config when built
        yield


def test_e2m1_rounding_is_vllms_on_a_dense_grid() -> None:
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import cast_to_fp4

    grid = torch.linspace(-6, 6, 240_001)  # steps of 5e-5 from -6 to 6
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    # Each tie exactly, with the floats either side of it, both signs, and zeros (equal as values).
    edges = torch.cat([ties, ties.nextafter(torch.tensor(0.0)), ties.nextafter(torch.tensor(9.0))])
    x = torch.cat([grid, edges, -edges, torch.tensor([0.0, -0.0, 6.0, -6.0])])
    assert torch.equal(act_quant.round_to_e2m1(x), cast_to_fp4(x.clone()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["fp8_token", "fp8_tensor", "fp8_group"])
def test_fp8_inputs_are_vllms_quant_fp8(vllm_context, kind: str, dtype: torch.dtype) -> None:
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    x = _inputs(dtype)
    static = kind == "fp8_tensor"
    shape = {"fp8_token": GroupShape.PER_TOKEN, "fp8_tensor": GroupShape.PER_TENSOR}.get(
        kind, GroupShape(1, 128)
    )
    scale = (x.abs().max().float() / 448).reshape(1) if static else None
    q, s = QuantFP8(static=static, group_shape=shape).forward_native(x, scale)
    if kind == "fp8_group":
        expected = (q.float().unflatten(-1, (-1, 128)) * s.unsqueeze(-1)).flatten(-2)
    else:
        expected = q.float() * s
    ours = act_quant.ActScheme(kind, 128 if kind == "fp8_group" else None)(x, scale)
    assert ours.dtype == dtype
    assert torch.equal(ours, expected.to(dtype))
    assert not torch.equal(ours, x)  # it did quantize


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_inputs_are_vllms_emulation(dtype: torch.dtype) -> None:
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        ref_nvfp4_quant_dequant,
    )

    x = _inputs(dtype)
    global_scale = (448 * 6 / x.abs().max().float()).reshape(1)
    ours = act_quant.ActScheme("nvfp4")(x, global_scale)
    assert torch.equal(ours, ref_nvfp4_quant_dequant(x, global_scale, 16))


@pytest.mark.parametrize(
    ("scheme", "scale"),
    [(act_quant.ActScheme("fp8_token"), 1.0), (act_quant.ActScheme("fp8_tensor"), None)],
)
def test_a_scale_where_the_scheme_takes_none_or_needs_one_is_refused(scheme, scale) -> None:
    with pytest.raises(ValueError, match="input scale"):
        scheme(torch.ones(2, 16), None if scale is None else torch.tensor(scale))


def test_unknown_scheme_and_ragged_nvfp4_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown activation scheme 'int8'"):
        act_quant.ActScheme("int8")
    with pytest.raises(ValueError, match="blocks of 16 values, but the input has 20"):
        act_quant.nvfp4(torch.ones(2, 20), torch.tensor(6.0))
