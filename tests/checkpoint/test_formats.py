# SPDX-License-Identifier: Apache-2.0
"""The weight formats and quantization_config semantics, against real compressed-tensors and vLLM."""

from __future__ import annotations

import json
import math

import pytest
import torch
from compressed_tensors.compressors.mx_utils import decompress_mx_scale

from vllm_dspark.checkpoint import formats, quant_config
from vllm_dspark.checkpoint.layout import FP8_RECIPE, checkpoint_modules, fused_module_groups
from vllm_dspark.checkpoint.presets import preset_config
from vllm_dspark.checkpoint.quant_plan import declared
from vllm_dspark.checkpoint_tools.make_random import random_tensor

PACKED_MODULES_MAPPING = {
    "gate_up_proj": ["gate_proj", "up_proj"],
    "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"],
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _weight(shape: tuple[int, int] = (256, 512)) -> torch.Tensor:
    # make-random's linears: lognormal channel scales and outlier input channels, as trained ones have.
    return random_tensor("layers.0.mlp.up_proj.weight", shape, "linear", seed=0)


def _error_bound(q: dict[str, torch.Tensor], fmt: str, weight: torch.Tensor) -> torch.Tensor:
    """Largest |W - dequant(Q)| each element may have, from the format's rounding step."""
    x = weight.float().abs()
    if q.get("weight", torch.empty(0)).dtype == torch.float8_e4m3fn:
        # E4M3: 3 mantissa bits -> half-ulp relative error 2^-4; subnormals step 2^-9 of the scale
        # (per row, per tensor, or per 128x128 block).
        scale = q["weight_scale"].float()
        if formats.get(fmt).block:
            r, c = formats.get(fmt).block
            scale = scale.repeat_interleave(r, dim=0).repeat_interleave(c, dim=1)
        return x * 2**-4 + scale * 2**-10
    if fmt == "mxfp4":
        step = decompress_mx_scale(q["weight_scale"]).float().repeat_interleave(32, dim=1)
    else:
        step = (q["weight_scale"].float() / q["weight_global_scale"]).repeat_interleave(16, dim=1)
    # E2M1's widest gap (4 -> 6) is 2 steps, so rounding is off by at most one step; the
    # decompressor works in bf16, which adds 2^-8 relative.
    return step + x * 2**-8


@pytest.mark.parametrize("fmt", formats.names())
def test_round_trip_through_compressed_tensors_decompression(fmt: str) -> None:
    weight = _weight()
    q = formats.quantize_weight(weight, fmt)
    specs = formats.get(fmt).tensor_specs(tuple(weight.shape))
    assert {k: (v.dtype, tuple(v.shape)) for k, v in q.items()} == {
        k: (s.dtype, s.shape) for k, s in specs.items()
    }
    restored = formats.dequantize_weight(q, fmt, tuple(weight.shape))
    assert restored.dtype == torch.float32
    ratio = (restored - weight.float()).abs() / _error_bound(q, fmt, weight)
    assert ratio.max() <= 1.0, f"{fmt}: error {ratio.max():.3f}x the format's rounding bound"


def test_fp8_snr_beats_both_4bit_formats_by_a_wide_margin() -> None:
    weight = _weight()
    snr = {
        fmt: formats.weight_snr_db(weight, formats.quantize_weight(weight, fmt), fmt)
        for fmt in formats.names()
    }
    fp8, fp4 = [snr[f] for f in snr if f.startswith("fp8")], [snr[f] for f in snr if "fp4" in f]
    assert len(fp8) == 4 and len(fp4) == 3 and min(fp8) > 28 and 14 < min(fp4) <= max(fp4) < 24
    assert min(fp8) - max(fp4) > 8, snr


def test_row_chunking_matches_a_single_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = _weight((64, 256))
    whole = formats.quantize_weight(weight, "nvfp4")
    monkeypatch.setattr(formats, "_CHUNK_ELEMENTS", 5 * 256)  # 5 rows per chunk, a ragged last one
    chunked = formats.quantize_weight(weight, "nvfp4")
    assert all(
        torch.equal(whole[k].view(torch.uint8), chunked[k].view(torch.uint8))
        for k in whole
        if k != "weight_global_scale"
    )


@pytest.mark.parametrize("fmt", formats.names())
def test_fake_quantize_equals_the_packed_round_trip_in_bf16(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(formats, "_CHUNK_ELEMENTS", 5 * 512)  # several chunks, a ragged last one
    weight = _weight()
    f = formats.get(fmt)
    shared = f.shared_global_scale([weight, 3 * weight])  # a fused group's, where it has one
    packed = f.quantize(weight, global_scale=shared)
    round_trip = f.served_weight(packed, tuple(weight.shape)).to(torch.bfloat16)
    fake = f.fake_quantize(weight, global_scale=shared)
    assert fake.dtype == torch.float32 and fake.shape == weight.shape
    assert torch.equal(fake.to(torch.bfloat16), round_trip)
    assert not torch.equal(fake.to(torch.bfloat16), weight)  # it did quantize


def test_fp8_static_fused_shards_share_the_largest_magnitude_weight_scale() -> None:
    small, large = _weight((32, 64)), 4 * _weight((32, 64))
    f = formats.get("fp8-static")
    shared = f.shared_global_scale([small, large])
    assert torch.equal(shared, f.quantize(large)["weight_scale"])
    q = f.quantize(small, global_scale=shared)
    assert torch.equal(q["weight_scale"], shared) and torch.equal(
        q["input_scale"], torch.tensor([1.0])
    )
    assert f.snr_db(small, q) > 20


def test_nvfp4_fused_shards_share_the_largest_magnitude_global_scale() -> None:
    small, large = _weight((32, 64)), 4 * _weight((32, 64))
    shared = formats.get("nvfp4").shared_global_scale([small, large])
    assert torch.equal(shared, formats.get("nvfp4").shared_global_scale([large]))
    q = formats.quantize_weight(small, "nvfp4", global_scale=shared)
    assert torch.equal(q["weight_global_scale"], shared)
    assert formats.weight_snr_db(small, q, "nvfp4") > 15
    with pytest.raises(ValueError, match="only nvfp4 and nvfp4-w4a4 have a global scale"):
        formats.quantize_weight(small, "fp8", global_scale=shared)


def test_fused_module_groups_span_layers_for_q_a_and_kv_a() -> None:
    names = [s.name for s in checkpoint_modules(preset_config("k3"))]
    groups = fused_module_groups(names)
    assert groups["layers.3.mlp.gate_up_proj"] == ["layers.3.mlp.gate_proj", "layers.3.mlp.up_proj"]
    # context_kv_proj stacks every layer's kv_a_proj_with_mqa: one group over all 5 layers.
    assert len(groups["self_attn.fused_qkv_a_proj"]) == 10
    assert len(groups) == 5 + 1


def test_k3_fp8_recipe_matches_the_published_build() -> None:
    config = preset_config("k3")
    specs = checkpoint_modules(config)
    qc = quant_config.quantization_config("fp8", FP8_RECIPE, config)
    quantized = declared(config, qc)
    assert (
        len(specs) - len(quantized) == 41
    )  # the model card's ignore count: 7 per layer x 5 + 6 global modules
    params = sum(math.prod(s.shape) for s in specs if s.name in quantized)
    total = sum(math.prod(s.shape) + (s.shape[0] if s.bias else 0) for s in specs)
    assert round(params / 1e9, 2) == 2.19 and round(total / 1e9, 2) == 3.56
    assert (
        len(qc["config_groups"]) == 1 and len(qc["ignore"]) == 13
    )  # index-agnostic: one pattern per kind
    assert all(
        t.startswith("re:") for t in qc["config_groups"]["group_0"]["targets"] + qc["ignore"]
    )
    assert quant_config.format_of(qc) == "fp8"
    json.dumps(qc)  # goes into config.json as is


@pytest.mark.parametrize(
    ("fmt", "format_string"),
    [
        ("fp8", "naive-quantized"),
        ("mxfp4", "mxfp4-pack-quantized"),
        ("nvfp4", "nvfp4-pack-quantized"),
        ("fp8-dynamic", "float-quantized"),
        ("fp8-static", "float-quantized"),
        ("fp8-block", "float-quantized"),
        ("nvfp4-w4a4", "nvfp4-pack-quantized"),
    ],
)
def test_quantization_config_format_strings(fmt: str, format_string: str) -> None:
    qc = quant_config.quantization_config(fmt, FP8_RECIPE, preset_config("small"))
    assert qc["format"] == qc["config_groups"]["group_0"]["format"] == format_string
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    inputs = qc["config_groups"]["group_0"]["input_activations"]
    assert (inputs is None) == (formats.get(fmt).activation is None)
    assert quant_config.format_of(qc) == fmt


def test_format_of_accepts_float_quantized_fp8_and_refuses_pack_quantized() -> None:
    qc = quant_config.quantization_config("fp8", FP8_RECIPE, preset_config("tiny"))
    qc["format"] = qc["config_groups"]["group_0"]["format"] = "float-quantized"
    assert quant_config.format_of(qc) == "fp8"
    qc["format"] = qc["config_groups"]["group_0"]["format"] = "pack-quantized"
    with pytest.raises(
        ValueError, match="vLLM loads fp8 only as naive-quantized or float-quantized"
    ):
        quant_config.format_of(qc)


@pytest.mark.parametrize(
    ("kinds", "message"),
    [
        (
            ["mlp.gate_proj", "mlp.down_proj"],
            "mlp.gate_proj and mlp.up_proj are fused into mlp.gate_up_proj",
        ),
        (["self_attn.kv_a_proj_with_mqa"], "fused into self_attn.fused_qkv_a_proj"),
        (
            ["mlp.gate", "mlp.up_proj"],
            r"unknown layer name\(s\) in --include-layers: 'mlp.gate'.*valid ones: context_proj",
        ),
        (["input_layernorm"], "'input_layernorm' cannot be quantized.*is a norm"),
        (["embed_tokens"], "'embed_tokens' cannot be quantized.*embedding table"),
        (["markov_head.markov_w2"], "'markov_head.markov_w2' cannot be quantized.*Markov head"),
        (["confidence_head.proj"], "'confidence_head.proj' cannot be quantized.*confidence head"),
        ([], "--include-layers is empty"),
    ],
)
def test_include_layers_refusals(kinds: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        quant_config.validate_include_kinds(kinds, "fp8", preset_config("tiny"))


def test_group_formats_refuse_in_features_their_groups_do_not_divide() -> None:
    config = preset_config(
        "tiny", q_lora_rank=40
    )  # q_b_proj in_features 40: not a multiple of 32 or 16
    assert quant_config.validate_include_kinds(["self_attn.q_b_proj"], "fp8", config) == (
        "self_attn.q_b_proj",
    )
    with pytest.raises(
        ValueError,
        match=r"self_attn.q_b_proj: mxfp4 quantizes groups of 32 input columns, which do not divide 40",
    ):
        quant_config.validate_include_kinds(["self_attn.q_b_proj"], "mxfp4", config)


@pytest.fixture(scope="module")
def vllm_config_of(tmp_path_factory: pytest.TempPathFactory):
    """vLLM's VllmConfig of a drafter dir whose config.json carries our quantization_config."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    from vllm_dspark.checkpoint.presets import preset_config_json
    from vllm_dspark.compat import configs_without_an_engine
    from vllm_dspark.config import register_config

    register_config()

    def build(fmt: str):
        model_dir = tmp_path_factory.mktemp(f"vllm-{fmt}")
        config_json = preset_config_json("tiny")
        config_json["quantization_config"] = quant_config.quantization_config(
            fmt, FP8_RECIPE, preset_config("tiny")
        )
        (model_dir / "config.json").write_text(json.dumps(config_json))
        # device "cpu": the CUDA wheel on a machine without a GPU cannot infer a device type.
        with configs_without_an_engine():
            vllm_config = VllmConfig(
                model_config=ModelConfig(
                    model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16"
                ),
                device_config=DeviceConfig(device="cpu"),
            )
        # What the plugin's model class does: the fused layers resolve through their shards.
        vllm_config.quant_config.packed_modules_mapping = PACKED_MODULES_MAPPING
        return vllm_config

    return build


INCLUDED_RUNTIME = [
    "model.layers.93.mlp.gate_up_proj",
    "model.layers.97.mlp.down_proj",
    "model.layers.95.self_attn.o_proj",
    "model.layers.94.self_attn.q_b_proj",
    "model.context_proj",
]
IGNORED_RUNTIME = [
    "model.layers.93.self_attn.fused_qkv_a_proj",
    "model.layers.96.self_attn.kv_b_proj",
    "model.markov_head.markov_w2",
    "model.confidence_head.proj",
    "model.embed_tokens",
]


@pytest.mark.vllm_api
def test_vllm_loads_the_fp8_config_as_w8a16_at_runtime_names(vllm_config_of) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsW8A16Fp8,
    )

    vllm_config = vllm_config_of("fp8")
    vllm_qc = vllm_config.quant_config
    assert isinstance(vllm_qc, CompressedTensorsConfig)
    layer = torch.nn.Linear(1, 1)  # get_scheme only reads the class name, for class-name targets
    with set_current_vllm_config(vllm_config):  # the W8A16 scheme reads the model dtype from it
        for name in INCLUDED_RUNTIME:
            scheme = vllm_qc.get_scheme(layer, layer_name=name)
            assert isinstance(scheme, CompressedTensorsW8A16Fp8), name
            assert scheme.weight_quant.strategy == "channel" and not scheme.is_static_input_scheme
        for name in IGNORED_RUNTIME:
            assert vllm_qc.get_scheme(layer, layer_name=name) is None, name


@pytest.mark.vllm_api
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_vllm_reads_the_4bit_configs_at_runtime_names(vllm_config_of, fmt: str) -> None:
    # The 4-bit schemes pick a GPU kernel when built, so this stops at the parsed weight args.
    vllm_qc = vllm_config_of(fmt).quant_config
    is_fmt = vllm_qc._is_mxfp4 if fmt == "mxfp4" else vllm_qc._is_nvfp4_format
    layer = torch.nn.Linear(1, 1)
    for name in INCLUDED_RUNTIME:
        scheme = vllm_qc.get_scheme_dict(layer, layer_name=name)
        assert is_fmt(scheme["weights"]) and scheme["input_activations"] is None, name
    for name in IGNORED_RUNTIME:
        assert vllm_qc.get_scheme_dict(layer, layer_name=name) is None, name
