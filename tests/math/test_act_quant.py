# SPDX-License-Identifier: Apache-2.0
"""Activation quantization (ops.act_quant) bit for bit against vLLM's own torch paths for FP8 and NVFP4
inputs (``QuantFP8.forward_native``, ``ref_nvfp4_quant_dequant``, ``cast_to_fp4``), and where it differs
from compressed-tensors' and ModelOpt's own quantizers, only as their division by the scale does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.activations import activations
from vllm_dspark.ops import act_quant


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

    x = activations(dtype)
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

    x = activations(dtype)
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


@pytest.mark.parametrize("fmt", ["fp8-dynamic", "fp8-static", "fp8-block", "nvfp4-w4a4"])
def test_inputs_agree_with_compressed_tensors_own_fake_quantize(fmt: str) -> None:
    """compressed-tensors' fake_quantize of each format's own input scheme, on float32 inputs (vLLM's
    kernels quantize in float32): NVFP4 equal everywhere. FP8 equal but where it divides by the scale
    (vLLM multiplies by the reciprocal: rarely, one E4M3 step) and below vLLM's scale floor."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import (
        calculate_qparams,
        compute_dynamic_scales_and_zp,
        generate_gparam,
    )

    from vllm_dspark.checkpoint import formats

    f = formats.get(fmt)
    args = f.scheme.input_activations
    x = activations(torch.bfloat16)
    v = x.float().unsqueeze(0)  # compressed-tensors' activations are (batch, tokens, hidden)
    global_scale = None
    if fmt == "nvfp4-w4a4":
        global_scale = generate_gparam(v.amin(), v.amax())
        scale, zero_point = compute_dynamic_scales_and_zp(v, args, None, global_scale)
        ours = f.activation(x, global_scale)
    elif args.dynamic:
        scale, zero_point = compute_dynamic_scales_and_zp(v, args, None)
        ours = f.activation(x)
    else:
        scale, zero_point = calculate_qparams(v.amin().reshape(1), v.amax().reshape(1), args)
        ours = f.activation(x, scale)
    theirs = fake_quantize(v, scale, zero_point, args, global_scale=global_scale)[0].bfloat16()
    if fmt == "nvfp4-w4a4":
        assert torch.equal(ours, theirs)
    else:
        _assert_fp8_agrees_but_for_division(ours, theirs, x, f.activation.kind)


def test_inputs_agree_with_modelopts_own_quantizers() -> None:
    """ModelOpt 0.47's own quantize-dequantize of activations on CPU (tests/data/modelopt/make.py), with
    the input_scale its export stores: FP8 per tensor and per token agree as compressed-tensors' do;
    NVFP4 is equal but in blocks whose E4M3 scale underflows, which vLLM's kernels zero and ModelOpt
    clamps to 2^-9."""
    from safetensors.torch import load_file

    from vllm_dspark.checkpoint import modelopt

    theirs = load_file(Path(__file__).parents[1] / "data" / "modelopt" / "inputs.safetensors")
    x = theirs["x"]
    static = modelopt.input_scale("fp8-static", {"input_scale": theirs["fp8_input_scale"]})
    ours = act_quant.fp8_static(x, static)
    _assert_fp8_agrees_but_for_division(ours, theirs["fp8"], x, "fp8_tensor")
    ours = act_quant.fp8_per_token(x)
    _assert_fp8_agrees_but_for_division(ours, theirs["fp8_pc_pt"], x, "fp8_token")

    global_scale = modelopt.input_scale("nvfp4-w4a4", {"input_scale": theirs["nvfp4_input_scale"]})
    ours = act_quant.nvfp4(x, global_scale)
    blocks = x.float().unflatten(-1, (-1, act_quant.NVFP4_BLOCK)).abs().amax(-1, keepdim=True)
    scale = (global_scale * (blocks * (1 / act_quant.FP4_MAX))).to(torch.float8_e4m3fn).float()
    underflow = (scale == 0).expand(-1, -1, act_quant.NVFP4_BLOCK).flatten(-2) & (x != 0)
    assert underflow.any()  # the inputs have such blocks, and there the two differ
    assert torch.equal(ours[~underflow], theirs["nvfp4"][~underflow])
    assert not ours[underflow].any() and theirs["nvfp4"][underflow].any()


def _assert_fp8_agrees_but_for_division(
    ours: torch.Tensor, theirs: torch.Tensor, x: torch.Tensor, kind: str
) -> None:
    """FP8 inputs from a library that divides by the scale, where vLLM multiplies by its reciprocal:
    equal but rarely one E4M3 step, and but in scale groups below vLLM's scale floor."""
    # Each value's scale group (a token, 128 values, or the tensor) and whether vLLM floors it.
    group = {"fp8_token": x.shape[-1], "fp8_group": 128, "fp8_tensor": x.numel()}[kind]
    amax = x.float().reshape(-1, group).abs().amax(-1, keepdim=True).expand(-1, group)
    scale = amax.reshape(x.shape) / act_quant.FP8_MAX
    floored = scale < act_quant.FP8_MIN_SCALE
    assert floored.any() == (kind != "fp8_tensor")  # the inputs have rows below the floor
    differ = (ours != theirs) & ~floored
    assert differ.sum() <= 5e-3 * x.numel()  # rare: a quotient rounded the other way
    # One E4M3 step: 2^-3 of the value (three mantissa bits), 2^-9 of the scale below the normals;
    # 1 % for the BF16 the values end in.
    step = torch.maximum(2.0**-3 * ours.float().abs(), 2.0**-9 * scale) * 1.01
    assert torch.all((ours - theirs).float().abs()[differ] <= step[differ])
