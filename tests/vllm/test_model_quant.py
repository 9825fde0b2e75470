# SPDX-License-Identifier: Apache-2.0
"""The FP8 compressed-tensors drafter in vLLM on CPU: per-layer quant methods, numerics, refusals.

The FP8 checkpoint is made by this project's quantizer (``vllm-dspark quantize --quant-format fp8``,
the published recipe: gate/up/down, o_proj, q_b_proj, context_proj) from the random ``tiny`` drafter,
and loaded through vLLM's dspark loader as in ``test_model.py`` (same CPU stand-in attention). FP8
weight-only linears run on :mod:`vllm_dspark.runtime.cpu_fp8`, the plugin's CPU kernel: vLLM has none.

Refusals happen while the model is built, before any weight is read, so the refusal variants
only edit config.json next to the FP8 shards.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import variant
from tests.support.vllm_drafter import (
    BF16_HOOK_BOUNDS,
    Served,
    assert_hooks_match_reference,
    load_drafter,
)
from vllm_dspark.checkpoint.layout import FP8_RECIPE, kind_regex

FP32_TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Path:
    from vllm_dspark.checkpoint_tools.quantize import quantize_checkpoint

    out = tmp_path_factory.mktemp("fp8") / "tiny-fp8"
    quantize_checkpoint(tiny_checkpoint, out, "fp8", progress=False)
    return out


@pytest.fixture(scope="module")
def served_fp8(tiny_mla_target: Path, fp8_checkpoint: Path) -> Served:
    return load_drafter(tiny_mla_target, fp8_checkpoint)


# The runtime linears that hold the six FP8 kinds: gate_proj and up_proj are fused into gate_up_proj.
FP8_RUNTIME_SUFFIXES = (
    "context_proj",
    "self_attn.q_b_proj",
    "self_attn.o_proj",
    "mlp.gate_up_proj",
    "mlp.down_proj",
)


def _linear_quant_methods(model) -> dict[str, object]:
    from vllm.model_executor.layers.linear import LinearBase

    return {name: m.quant_method for name, m in model.named_modules() if isinstance(m, LinearBase)}


def test_fp8_weight_only_on_exactly_the_six_kinds_with_one_shared_quant_config(
    served_fp8: Served,
) -> None:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
        CompressedTensorsLinearMethod,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsW8A16Fp8,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from vllm_dspark.runtime.cpu_fp8 import CPUDequantFP8W8A16LinearKernel

    model = served_fp8.model
    assert set(FP8_RECIPE) == {
        "context_proj",
        "self_attn.q_b_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    }
    quant_config = model.quant_config
    assert isinstance(quant_config, CompressedTensorsConfig)
    assert quant_config.packed_modules_mapping == {
        "gate_up_proj": ["gate_proj", "up_proj"],
        "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"],
    }

    methods = _linear_quant_methods(model)
    quantized = {name for name in methods if name.endswith(FP8_RUNTIME_SUFFIXES)}
    # context_proj + 4 per layer, in every layer.
    assert len(quantized) == 1 + 4 * model.config.num_hidden_layers
    for name, method in methods.items():
        module = model.get_submodule(name)
        if name in quantized:
            assert isinstance(method, CompressedTensorsLinearMethod), name
            assert method.quantization_config is quant_config, (
                f"{name} uses another quant-config instance"
            )
            assert isinstance(module.scheme, CompressedTensorsW8A16Fp8), name
            assert isinstance(module.scheme.linear_kernel, CPUDequantFP8W8A16LinearKernel), name
        else:
            # fused_qkv_a_proj, kv_b_proj, context_kv_proj, the confidence head.
            assert isinstance(method, UnquantizedLinearMethod), f"{name} is {type(method).__name__}"
    assert isinstance(model.model.markov_head.markov_w2.quant_method, UnquantizedEmbeddingMethod)
    assert model.model.confidence_head.proj.weight.dtype == torch.float32


def test_fp8_hooks_match_the_fp32_reference_of_the_same_checkpoint(
    served_fp8: Served, fp8_checkpoint: Path
) -> None:
    """The reference dequantizes the FP8 tensors once in FP32; the CPU kernel dequantizes into the
    model dtype (FP32 here), so both compute with identical weights."""
    from vllm_dspark.reference.drafter import ReferenceDrafter

    reference = ReferenceDrafter.from_pretrained(fp8_checkpoint)
    assert_hooks_match_reference(served_fp8, reference, **FP32_TOL)


def test_fp8_served_in_bf16_stays_close_to_the_fp32_reference(
    tiny_mla_target: Path, fp8_checkpoint: Path
) -> None:
    """The serving dtype: FP8 weights dequantized to BF16, BF16 activations, per-hook bounds above."""
    from vllm_dspark.reference.drafter import ReferenceDrafter

    served = load_drafter(tiny_mla_target, fp8_checkpoint, dtype="bfloat16")
    assert next(served.model.model.final_norm.parameters()).dtype == torch.bfloat16
    assert_hooks_match_reference(
        served, ReferenceDrafter.from_pretrained(fp8_checkpoint), norm_rtol=BF16_HOOK_BOUNDS
    )


def test_cpu_kernel_is_registered_and_refuses_block_scales(served_fp8: Served) -> None:
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
        FP8ScaledMMLinearLayerConfig,
    )
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kFp8DynamicTensorSym,
        kFp8Static128BlockSym,
    )
    from vllm.platforms import PlatformEnum

    from vllm_dspark import compat
    from vllm_dspark.runtime.cpu_fp8 import CPUDequantFP8W8A16LinearKernel, install

    install()  # idempotent
    assert (
        compat.WFP8A16_KERNELS.resolve()[PlatformEnum.CPU].count(CPUDequantFP8W8A16LinearKernel)
        == 1
    )
    block = FP8ScaledMMLinearLayerConfig(
        weight_quant_key=kFp8Static128BlockSym,
        activation_quant_key=kFp8DynamicTensorSym,
        weight_shape=(256, 256),
        input_dtype=torch.bfloat16,
        out_dtype=torch.bfloat16,
    )
    ok, reason = CPUDequantFP8W8A16LinearKernel.can_implement(block)
    assert not ok and "per-channel and per-tensor" in reason


def test_literal_checkpoint_names_quantize_the_same_modules(
    tmp_path: Path, tiny_mla_target: Path, fp8_checkpoint: Path, served_fp8: Served
) -> None:
    """Targets/ignore written as checkpoint names (``layers.0.mlp.gate_proj``) name the modules vLLM
    serves as ``model.layers.8...``; the normalized config names them so, and quantizes the same ones."""
    from vllm_dspark.checkpoint.layout import checkpoint_modules
    from vllm_dspark.config import K3DSparkConfig

    def literal_names(config: dict) -> None:
        specs = checkpoint_modules(
            K3DSparkConfig(**{k: v for k, v in config.items() if k != "quantization_config"})
        )
        qc = config["quantization_config"]
        qc["config_groups"]["group_0"]["targets"] = [s.name for s in specs if s.kind in FP8_RECIPE]
        qc["ignore"] = [s.name for s in specs if s.kind not in FP8_RECIPE]

    served = load_drafter(
        tiny_mla_target, variant(fp8_checkpoint, tmp_path / "literal", literal_names)
    )
    literal = {name: type(m).__name__ for name, m in _linear_quant_methods(served.model).items()}
    regex = {name: type(m).__name__ for name, m in _linear_quant_methods(served_fp8.model).items()}
    assert literal == regex
    assert "model.layers.9.mlp.gate_proj" in served.model.quant_config.target_scheme_map


def _edit_fp8(change):
    """A config.json edit of the FP8 build's quantization_config: ``change(targets, ignore)``."""

    def edit(config: dict) -> None:
        qc = config["quantization_config"]
        change(qc["config_groups"]["group_0"]["targets"], qc["ignore"])

    return edit


def _quantize_kind(kind: str):
    def change(targets: list[str], ignore: list[str]) -> None:
        ignore.remove(kind_regex(kind))
        targets.append(kind_regex(kind))

    return change


def _split_fused_group(targets: list[str], ignore: list[str]) -> None:
    targets.remove(kind_regex("mlp.up_proj"))
    ignore.append(kind_regex("mlp.up_proj"))


def _kv_a_in_one_layer(targets: list[str], ignore: list[str]) -> None:
    for kind in ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"):
        ignore.remove(kind_regex(kind))
        ignore.append(f"layers.1.{kind}")
        targets.append(f"layers.0.{kind}")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            _split_fused_group,
            "layers.0.mlp.up_proj is stored as fp8, but quantization_config leaves it unquantized",
        ),
        (
            _quantize_kind("markov_head.markov_w2"),
            "markov_head.markov_w2: quantization_config quantizes it as fp8 (target ",
        ),
        (
            _quantize_kind("markov_head.markov_w1"),
            "markov_head.markov_w1: quantization_config quantizes it as fp8",
        ),
        (
            _quantize_kind("confidence_head.proj"),
            "confidence_head.proj: quantization_config quantizes it as fp8",
        ),
        (
            _quantize_kind("self_attn.kv_a_layernorm"),
            "layers.0.self_attn.kv_a_layernorm: quantization_config quantizes",
        ),
        (_quantize_kind("embed_tokens"), "embed_tokens: quantization_config quantizes it as fp8"),
        (
            _kv_a_in_one_layer,
            "layers.0.self_attn.q_a_proj is stored BF16, but quantization_config quantizes it",
        ),
    ],
    ids=[
        "fused-split",
        "markov-w2",
        "markov-w1",
        "confidence",
        "norm",
        "embedding",
        "kv-a-per-layer",
    ],
)
def test_unservable_quantization_is_refused_with_module_and_fix(
    tmp_path: Path, tiny_mla_target: Path, fp8_checkpoint: Path, change, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        load_drafter(
            tiny_mla_target, variant(fp8_checkpoint, tmp_path / "variant", _edit_fp8(change))
        )
    assert "Fix:" in str(refused.value)


def test_one_info_line_names_each_quantized_linears_kernel(
    tiny_mla_target: Path, fp8_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_dspark.runtime import model as model_module

    lines: list[str] = []
    monkeypatch.setattr(model_module.logger, "info", lambda fmt, *args: lines.append(fmt % args))
    load_drafter(tiny_mla_target, fp8_checkpoint)
    (line,) = [line for line in lines if "quantized linears" in line]
    kernel, _, names = line.partition(
        "CompressedTensorsW8A16Fp8 via CPUDequantFP8W8A16LinearKernel: "
    )
    assert kernel == "K3 DSpark drafter quantized linears: " and "Marlin" not in line
    assert len(names.split(", ")) == 1 + 4 * 2 and "model.layers.1.mlp.gate_up_proj" in names


def test_quantization_other_than_compressed_tensors_is_refused(
    tiny_mla_target: Path, tiny_checkpoint: Path
) -> None:
    with pytest.raises(
        ValueError,
        match=r"serves BF16, compressed-tensors or ModelOpt checkpoints, but its quantization is ",
    ):
        load_drafter(tiny_mla_target, tiny_checkpoint, dtype="bfloat16", quantization="fp8")
