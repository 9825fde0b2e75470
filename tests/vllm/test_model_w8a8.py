# SPDX-License-Identifier: Apache-2.0
"""W8A8 FP8 drafters in vLLM on CPU: compressed-tensors' FP8_DYNAMIC, FP8 (static) and FP8_BLOCK builds,
made by this project's quantizer, load with vLLM's W8A8 scheme on exactly the recipe's modules, run on
the plugin's CPU kernels (:mod:`vllm_dspark.runtime.cpu_fp8`), and match the FP32 reference drafter under
the same activation quantization (:mod:`vllm_dspark.ops.act_quant`).

ModelOpt builds (its tensors, quant_algo and excludes by checkpoint name), full and partial, load with
vLLM's ModelOpt linear method on exactly the stored-quantized modules (excludes renumbered to the
runtime layers). vLLM serves ModelOpt in BF16 only, so each is checked weight for weight against the
compressed-tensors build of the same modules and numerics, which is checked in FP32 against the
reference drafter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.vllm_drafter import (
    BF16_HOOK_BOUNDS,
    Served,
    assert_hooks_match_reference,
    load_drafter,
)

# An input that lands on another side of an FP8 rounding boundary moves one element by one E4M3 step
# (2^-4 relative): whole-output relative errors, not elementwise ones (measured ~1e-6 to 1e-4).
W8A8_HOOK_BOUNDS = {
    "combine_hidden_states": 1e-3,
    "context_latent": 1e-3,
    "forward": 5e-3,
    "compute_draft_logits": 5e-3,
    "markov_embed": 0.0,
    "markov_bias": 5e-3,
    "compute_confidence": 5e-3,
}


# Weight-only FP4 in FP32: the same dequantized weights, so rounding only (measured <= 4.8e-6).
FP32_HOOK_BOUNDS = dict.fromkeys(W8A8_HOOK_BOUNDS, 2e-5)
# W4A4: an input on an E2M1 rounding boundary moves by a whole step (up to a third of its value);
# measured 7.7e-2 over the five layers.
W4A4_HOOK_BOUNDS = {**W8A8_HOOK_BOUNDS, "forward": 2e-1}


@pytest.fixture(scope="module")
def small_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_dspark.checkpoint.presets import preset_config
    from vllm_dspark.checkpoint.save import write_target_config

    return write_target_config(preset_config("small"), tmp_path_factory.mktemp("small_mla_target"))


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_dspark.checkpoint_tools.make_random import make_random

    return make_random(tmp_path_factory.mktemp("small") / "bf16", "small", seed=0, progress=False)


def _quantized(source: Path, fmt: str, root: Path) -> Path:
    from vllm_dspark.checkpoint_tools.quantize import quantize_checkpoint

    out = root / fmt
    quantize_checkpoint(source, out, fmt, progress=False)
    return out


@pytest.mark.parametrize(
    ("fmt", "kernel"),
    [
        ("fp8-dynamic", "CPUDequantFP8W8A8LinearKernel"),
        ("fp8-static", "CPUDequantFP8W8A8LinearKernel"),
        ("fp8-block", "CPUDequantFP8BlockLinearKernel"),
    ],
)
def test_w8a8_build_serves_on_the_recipe_and_matches_the_reference(
    fmt: str,
    kernel: str,
    small_target: Path,
    small_checkpoint: Path,
    tmp_path: Path,
) -> None:
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsW8A8Fp8,
    )

    from vllm_dspark.reference.drafter import ReferenceDrafter

    build = _quantized(small_checkpoint, fmt, tmp_path)
    served: Served = load_drafter(small_target, build)
    quantized = {}
    for name, module in served.model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        if isinstance(module.quant_method, UnquantizedLinearMethod):
            continue
        assert isinstance(module.scheme, CompressedTensorsW8A8Fp8), name
        quantized[name.split(".", 3)[-1] if ".layers." in name else name.split(".")[-1]] = type(
            module.scheme.fp8_linear
        ).__name__
    # The recipe's kinds, as vLLM fuses them (gate/up); q_a, kv_a, kv_b and the heads stay BF16.
    assert set(quantized) == {
        "context_proj",
        "self_attn.q_b_proj",
        "self_attn.o_proj",
        "mlp.gate_up_proj",
        "mlp.down_proj",
    }
    assert set(quantized.values()) == {kernel}
    reference = ReferenceDrafter.from_pretrained(build)
    assert reference.layers[0].mlp.down_proj.input_quant is not None
    assert reference.layers[0].self_attn.kv_b_proj.input_quant is None
    assert_hooks_match_reference(served, reference, norm_rtol=W8A8_HOOK_BOUNDS)


@pytest.mark.parametrize(
    ("fmt", "scheme", "bounds"),
    [
        ("mxfp4", "CompressedTensorsW4A4Mxfp4", FP32_HOOK_BOUNDS),
        ("nvfp4", "CompressedTensorsW4A4Fp4", FP32_HOOK_BOUNDS),
        ("nvfp4-w4a4", "CompressedTensorsW4A4Fp4", W4A4_HOOK_BOUNDS),
    ],
)
def test_fp4_builds_serve_on_cpu_and_match_the_reference(
    fmt: str,
    scheme: str,
    bounds: dict[str, float],
    small_target: Path,
    small_checkpoint: Path,
    tmp_path: Path,
) -> None:
    """vLLM has no CPU FP4 kernel: the plugin's dequantizes once (as vLLM's emulation) and, for W4A4,
    quantizes inputs per 16-block as the GPU does. Weight-only builds match the FP32 reference to
    rounding; W4A4 within the E2M1 steps that FP32 summation order tips."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    from vllm_dspark.reference.drafter import ReferenceDrafter

    build = _quantized(small_checkpoint, fmt, tmp_path)
    served = load_drafter(small_target, build)
    kernels = {
        (type(m.scheme).__name__, type(m.scheme.kernel).__name__)
        for m in served.model.modules()
        if isinstance(m, LinearBase) and not isinstance(m.quant_method, UnquantizedLinearMethod)
    }
    kernel = "CPUDequantMxFp4LinearKernel" if fmt == "mxfp4" else "CPUDequantNvFp4LinearKernel"
    assert kernels == {(scheme, kernel)}
    assert_hooks_match_reference(served, ReferenceDrafter.from_pretrained(build), norm_rtol=bounds)


# ----- ModelOpt -----
# With every linear W8A8, more inputs sit on an FP8 rounding boundary that FP32 summation order tips
# (each kind alone matches to ~1e-6); measured 2.6e-2 over the five layers of the full build.
ALL_W8A8_HOOK_BOUNDS = {**W8A8_HOOK_BOUNDS, "forward": 5e-2}

_ATTN_A = ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")
_EVERY = (
    "context_proj",
    "self_attn.fused_qkv_a_proj",
    "self_attn.q_b_proj",
    "self_attn.kv_b_proj",
    "self_attn.o_proj",
    "mlp.gate_up_proj",
    "mlp.down_proj",
    "context_kv_proj",
)


def _modelopt_build(
    source: Path,
    fmt: str,
    root: Path,
    leave_out: tuple[str, ...] = (),
    export: str = "modelopt",
) -> Path:
    from vllm_dspark.checkpoint.layout import MODULE_SETS
    from vllm_dspark.checkpoint_tools.quantize import quantize_checkpoint

    out = root / f"{export}-{fmt}-{len(leave_out)}"
    kinds = [k for k in MODULE_SETS["modelopt"] if k not in leave_out]
    quantize_checkpoint(source, out, fmt, kinds, progress=False, export=export)
    return out


def _quantized_layers(served: Served) -> dict[str, object]:
    """``{runtime kind: ModelOpt linear method}`` of every quantized linear (layer index dropped)."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    out = {}
    for name, module in served.model.named_modules():
        if isinstance(module, LinearBase) and not isinstance(
            module.quant_method, UnquantizedLinearMethod
        ):
            out[name.split(".", 3)[-1] if ".layers." in name else name.split(".")[-1]] = (
                module.quant_method
            )
    return out


# ModelOpt's full builds, and partial ones excluding modules by checkpoint name: (left out, BF16 at runtime).
_PARTIAL = pytest.mark.parametrize(
    ("leave_out", "bf16"),
    [
        ((), ()),
        (_ATTN_A, ("self_attn.fused_qkv_a_proj", "context_kv_proj")),
        (("context_proj",), ("context_proj",)),
    ],
    ids=["full", "without-q_a-kv_a", "without-context_proj"],
)


@_PARTIAL
@pytest.mark.parametrize(
    ("fmt", "algo", "keys"),
    [
        ("fp8-dynamic", "FP8_PER_CHANNEL_PER_TOKEN", ("kFp8StaticTokenSym", "kFp8DynamicTokenSym")),
        ("fp8-static", "FP8", ("kFp8StaticTensorSym", "kFp8StaticTensorSym")),
    ],
)
def test_modelopt_fp8_serves_exactly_its_quantized_modules(
    fmt: str,
    algo: str,
    keys: tuple[str, str],
    leave_out: tuple[str, ...],
    bf16: tuple[str, ...],
    small_target: Path,
    small_checkpoint: Path,
    tmp_path: Path,
) -> None:
    import json

    from vllm.model_executor.layers.quantization.utils import quant_utils

    from vllm_dspark.reference.drafter import ReferenceDrafter

    build = _modelopt_build(small_checkpoint, fmt, tmp_path, leave_out)
    twin = _modelopt_build(small_checkpoint, fmt, tmp_path, leave_out, export="compressed-tensors")
    qc = json.loads((build / "config.json").read_text())["quantization_config"]
    assert qc["quant_algo"] == algo and qc["quant_method"] == "modelopt"
    # ModelOpt's spelling: checkpoint layer numbers, which vLLM's own matching never sees at runtime.
    assert all(f"*layers.0.{k}" in qc["exclude_modules"] for k in leave_out if k != "context_proj")
    served = load_drafter(small_target, build, dtype="bfloat16")
    quantized = _quantized_layers(served)
    assert set(quantized) == set(_EVERY) - set(bf16)
    for method in quantized.values():
        assert type(method).__name__ == "ModelOptLinearMethod"
        assert (method.spec.weight, method.spec.activation) == tuple(
            getattr(quant_utils, key) for key in keys
        )
        assert type(method.kernel).__name__ == "CPUDequantFP8W8A8LinearKernel"
    # The compressed-tensors twin runs the same dequantized weights and input quantization ...
    twin_served = load_drafter(small_target, twin, dtype="bfloat16")
    twin_layers = dict(twin_served.model.named_modules())
    generator = torch.Generator().manual_seed(0)
    for name, module in served.model.named_modules():
        if hasattr(module, "dspark_input_quant"):
            other = twin_layers[name]
            # The GEMM dispatch keeps the weight packed: compare what the two layers compute.
            x = torch.randn(3, module.input_size_per_partition, generator=generator).bfloat16()
            out = module.quant_method.apply(module, x)
            assert torch.equal(out, other.quant_method.apply(other, x)), name
            assert module.dspark_input_quant[0] == other.dspark_input_quant[0], name
    # ... and in FP32 it is the reference drafter under the same activation quantization.
    assert_hooks_match_reference(
        load_drafter(small_target, twin),
        ReferenceDrafter.from_pretrained(build),
        norm_rtol=ALL_W8A8_HOOK_BOUNDS,
    )


@_PARTIAL
@pytest.mark.parametrize("fmt", ["nvfp4-w4a4", "nvfp4"])
def test_modelopt_nvfp4_serves_on_cpu_with_modelopts_own_dequantization(
    fmt: str,
    leave_out: tuple[str, ...],
    bf16: tuple[str, ...],
    small_target: Path,
    small_checkpoint: Path,
    tmp_path: Path,
) -> None:
    """ModelOpt's NVFP4 builds on the plugin's CPU kernel: every quantized layer holds exactly the
    weight ModelOpt's math dequantizes (read back as vLLM's MLA would), and the model stays within
    BF16 serving's bounds of the FP32 reference."""
    from safetensors.torch import load_file

    from vllm_dspark.checkpoint import modelopt
    from vllm_dspark.compat import absorbed_weight
    from vllm_dspark.reference.drafter import ReferenceDrafter

    build = _modelopt_build(small_checkpoint, fmt, tmp_path, leave_out)
    served = load_drafter(small_target, build, dtype="bfloat16")
    quantized = _quantized_layers(served)
    assert set(quantized) == set(_EVERY) - set(bf16)
    assert {type(m.kernel).__name__ for m in quantized.values()} == {"CPUDequantNvFp4LinearKernel"}
    (shard,) = build.glob("*.safetensors")
    stored = load_file(shard)

    def dequantized(module: str) -> torch.Tensor:
        parts = {k.rsplit(".", 1)[1]: v for k, v in stored.items() if k.startswith(f"{module}.")}
        n, k = parts["weight"].shape[0], parts["weight"].shape[1] * 2
        return modelopt.dequantize(parts, fmt, (n, k))

    model = served.model.model
    layer = model.layers[1]
    for runtime, modules in [
        (model.context_proj, ["context_proj"]),
        (layer.mlp.gate_up_proj, ["layers.1.mlp.gate_proj", "layers.1.mlp.up_proj"]),
        (layer.self_attn.o_proj, ["layers.1.self_attn.o_proj"]),
    ]:
        if f"{modules[0]}.weight_scale" not in stored:
            continue  # left BF16
        expected = torch.cat([dequantized(m) for m in modules]).to(torch.bfloat16)
        assert torch.equal(absorbed_weight(runtime, torch.bfloat16), expected), modules
    reference = ReferenceDrafter.from_pretrained(build)
    if fmt == "nvfp4":
        assert_hooks_match_reference(served, reference, norm_rtol=BF16_HOOK_BOUNDS)
    else:  # W4A4 in BF16: its inputs are quantized as the reference's are (the same scheme and scale)
        for module in (model.context_proj, layer.mlp.down_proj):
            if not hasattr(module, "dspark_input_quant"):
                continue  # left BF16
            scheme, scale = module.dspark_input_quant
            ours = reference.get_submodule(
                "context_proj" if module is model.context_proj else "layers.1.mlp.down_proj"
            ).input_quant
            assert (scheme, float(scale)) == (ours[0], float(ours[1])) == (scheme, 6.0)


def test_modelopt_fp8_fused_shards_with_their_own_scales_are_requantized_as_vllm_does(
    small_target: Path, small_checkpoint: Path, tmp_path: Path
) -> None:
    """ModelOpt's drafter quantizer scales every module alone; vLLM requantizes a fused layer's shards
    to their largest scale: context_kv_proj stacks the five layers' kv_a, each with its own scale."""
    from safetensors.torch import load_file, save_file

    from vllm_dspark.checkpoint import modelopt
    from vllm_dspark.compat import absorbed_weight
    from vllm_dspark.ops.act_quant import requantize_fp8_shards

    build = _modelopt_build(small_checkpoint, "fp8-static", tmp_path)
    (shard,) = build.glob("*.safetensors")
    tensors, source = load_file(shard), load_file(next(small_checkpoint.glob("*.safetensors")))
    kv_a = sorted(k.removesuffix(".weight") for k in source if "kv_a_proj_with_mqa.weight" in k)
    for module in kv_a:  # each layer's kv_a under its own amax, as ModelOpt writes it
        own = modelopt.quantize(source[f"{module}.weight"], "fp8-static")
        tensors.update({f"{module}.{suffix}": t for suffix, t in own.items()})
    save_file(tensors, shard, metadata={"format": "pt"})
    scales = torch.cat([tensors[f"{m}.weight_scale"] for m in kv_a])
    assert len(kv_a) == 5 and len(set(scales.tolist())) == 5

    served = load_drafter(small_target, build, dtype="bfloat16")
    codes = torch.cat([tensors[f"{m}.weight"] for m in kv_a])
    widths = [tensors[f"{m}.weight"].shape[0] for m in kv_a]
    requantized, top = requantize_fp8_shards(codes, scales, widths)
    expected = (requantized.float() * top).to(torch.bfloat16)
    served_weight = absorbed_weight(served.model.model.context_kv_proj, torch.bfloat16)
    assert torch.equal(served_weight, expected)
    # Requantizing moves a code by at most one E4M3 step of the largest scale.
    stored = codes.float() * scales.repeat_interleave(torch.tensor(widths))[:, None]
    assert (expected.float() - stored).abs().max() <= top * 32
