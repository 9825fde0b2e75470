# SPDX-License-Identifier: Apache-2.0
"""Per-tensor scales stored as ``[]`` or ``[1]``, and scales stored in BF16, served through vLLM on CPU
exactly as the build as written (issue 39).

vLLM's ``PerTensorScaleParameter`` loads either shape ("AutoFP8 scales do not have a shape") and copies
any float dtype into its float32 parameter; the plugin's loader (``load_weights``, the quantization
plan) must not stand in the way. Each build is this project's quantizer's, ModelOpt's encoding byte for
byte ModelOpt 0.47's (tests/checkpoint/test_modelopt.py), copied with its scales rewritten
(:mod:`tests.support.scales`; check-level tests in tests/checkpoint/test_scale_shapes.py). Loaded in
BF16 (vLLM serves ModelOpt in BF16 only) through vLLM's dspark loader, the copy must hold the same dequantized weight and input quantizer
in every quantized linear, fused ones included (gate_up_proj, fused_qkv_a_proj, context_kv_proj), and
compute the same hooks bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.scales import build, other_shape, rewrite_scales, with_legacy_input_scales
from tests.support.vllm_drafter import Served, bind_caches, load_drafter, make_batch, run_block
from vllm_dspark.tools.vllm_load import load_with_vllm

# FP8 per tensor in both encodings; NVFP4 W4A4 in both (ModelOpt 0.47 writes its per-tensor scales [],
# compressed-tensors [1]).
BUILDS = [
    ("modelopt", "fp8-static"),
    ("compressed-tensors", "fp8-static"),
    ("modelopt", "nvfp4-w4a4"),
    ("compressed-tensors", "nvfp4-w4a4"),
]
BF16 = "bfloat16"


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("scale-builds")


def serve(target: Path, draft: Path) -> Served:
    """``draft`` loaded as ``vllm serve`` loads it: the plugin's serve-time doctor on, which runs
    ``vllm-dspark check`` on the drafter before the target loads (and refused these copies once)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("VLLM_DSPARK_DOCTOR", raising=False)
        return load_with_vllm(draft, target_dir=target, dtype=BF16)


def _quantized_linears(served: Served) -> dict[str, torch.nn.Module]:
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    return {
        name: module
        for name, module in served.model.named_modules()
        if isinstance(module, LinearBase)
        and not isinstance(module.quant_method, UnquantizedLinearMethod)
    }


def _hooks(served: Served) -> dict[str, torch.Tensor]:
    """What the speculator's hooks compute on one fixed batch."""
    model, dtype = served.model, served.vllm_config.model_config.dtype
    batch = make_batch(model.config)
    context = model.combine_hidden_states(batch.aux.to(dtype))
    caches = bind_caches(model, batch, dtype)
    model.precompute_and_store_context_kv(context, batch.context_positions, batch.context_slots)
    hidden = run_block(served, batch)
    return {
        "combine_hidden_states": context,
        "context_latents": torch.stack(caches),
        "forward": hidden,
        "compute_draft_logits": model.compute_draft_logits(hidden),
    }


def assert_served_the_same(ours: Served, theirs: Served) -> None:
    """The same quantized linears, computing the same outputs (weights and input quantization alike),
    and the same hook outputs."""
    mine, other = _quantized_linears(ours), _quantized_linears(theirs)
    assert mine.keys() == other.keys() and mine
    assert any(name.endswith("context_kv_proj") for name in mine)  # every layer's kv_a, stacked
    generator = torch.Generator().manual_seed(0)
    for name, module in mine.items():
        twin = other[name]
        assert type(module.quant_method) is type(twin.quant_method), name
        # The CPU kernels dequantize at load and keep the weight packed for the GEMM: compare what
        # the two layers compute, and the input quantizer each holds.
        x = torch.randn(3, module.input_size, generator=generator).bfloat16()
        assert torch.equal(
            module.quant_method.apply(module, x), twin.quant_method.apply(twin, x)
        ), name
        quant, twin_quant = (getattr(m, "dspark_input_quant", None) for m in (module, twin))
        assert (quant is None) == (twin_quant is None), name
        if quant is not None:
            assert quant[0] == twin_quant[0], name
            assert (quant[1] is None and twin_quant[1] is None) or torch.equal(
                quant[1], twin_quant[1]
            ), name
    hooks, twin_hooks = _hooks(ours), _hooks(theirs)
    for hook, out in hooks.items():
        assert torch.equal(out, twin_hooks[hook]), hook


@pytest.mark.parametrize(("export", "fmt"), BUILDS, ids=[f"{e}-{f}" for e, f in BUILDS])
def test_per_tensor_scales_in_either_shape_serve_identically(
    export: str,
    fmt: str,
    builds: Path,
    tiny_checkpoint: Path,
    tiny_mla_target: Path,
    tmp_path: Path,
) -> None:
    written = build(tiny_checkpoint, builds, export, fmt)
    shape = other_shape(written)
    rewritten = tmp_path / "rewritten"
    rewrite_scales(written, rewritten, lambda t: t.reshape(shape))
    assert_served_the_same(
        serve(tiny_mla_target, rewritten),
        load_drafter(tiny_mla_target, written, dtype=BF16),
    )


def test_bf16_scales_serve_as_their_float32_values(
    builds: Path, tiny_checkpoint: Path, tiny_mla_target: Path, tmp_path: Path
) -> None:
    """ModelOpt FP8 with BF16 scales: vLLM copies them into its float32 parameters, so the build serves
    as the one whose float32 scales hold the same (BF16-rounded) values."""
    written = build(tiny_checkpoint, builds, "modelopt", "fp8-static")

    def scale(key: str, _) -> bool:
        return key.endswith("scale")

    narrow, rounded = tmp_path / "narrow", tmp_path / "rounded"
    rewrite_scales(written, narrow, lambda t: t.to(torch.bfloat16).reshape(()), which=scale)
    rewrite_scales(written, rounded, lambda t: t.to(torch.bfloat16).float(), which=scale)
    assert_served_the_same(
        serve(tiny_mla_target, narrow),
        load_drafter(tiny_mla_target, rounded, dtype=BF16),
    )


def test_modelopt_w4a16_nvfp4_with_legacy_input_scales_serves_as_without(
    builds: Path, tiny_checkpoint: Path, tiny_mla_target: Path, tmp_path: Path
) -> None:
    """Older ModelOpt W4A16 NVFP4 exports store an ``input_scale`` vLLM loads and drops: served (doctor
    on) exactly as the build without them."""
    written = build(tiny_checkpoint, builds, "modelopt", "nvfp4")
    legacy = tmp_path / "legacy"
    with_legacy_input_scales(written, legacy)
    served = serve(tiny_mla_target, legacy)
    assert not any(hasattr(m, "input_scale") for m in _quantized_linears(served).values())
    assert_served_the_same(served, load_drafter(tiny_mla_target, written, dtype=BF16))
