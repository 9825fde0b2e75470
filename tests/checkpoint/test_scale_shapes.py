# SPDX-License-Identifier: Apache-2.0
"""Scales stored as other producers store them: what vLLM's loaders take, ``check`` and the plugin's own
readers take (issue 39).

vLLM loads a per-tensor scale stored as ``[]`` (AutoFP8, some ModelOpt versions) or ``[1]``
(compressed-tensors, ModelOpt 0.47's FP8) alike ("AutoFP8 scales do not have a shape"), and copies a
BF16 or F16 scale into its float32 parameter. Each build here is written by this project's quantizer
(its ModelOpt export is ModelOpt 0.47's own, byte for byte: test_modelopt.py), then copied with its
scales rewritten (:mod:`tests.support.scales`). The vLLM side is tests/vllm/test_model_scales.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.support.scales import (
    build,
    copy_checkpoint,
    other_shape,
    rewrite_scales,
    with_legacy_input_scales,
)
from vllm_dspark.checkpoint.check import check_checkpoint
from vllm_dspark.checkpoint.formats import TensorSpec
from vllm_dspark.checkpoint.st_io import read_header, read_tensor
from vllm_dspark.checkpoint.store import input_quantizers, load_drafter_state_dict
from vllm_dspark.findings import FindingError

# (export, format): every format with a per-tensor scale, in both encodings. ModelOpt 0.47 writes FP8's
# per-tensor scales [1] and NVFP4's [] (weight_scale_2, input_scale); compressed-tensors writes [1].
BUILDS = [
    ("modelopt", "fp8-static"),
    ("compressed-tensors", "fp8-static"),
    ("modelopt", "nvfp4-w4a4"),
    ("compressed-tensors", "nvfp4-w4a4"),
    ("modelopt", "nvfp4"),
    ("compressed-tensors", "nvfp4"),
]
IDS = [f"{export}-{fmt}" for export, fmt in BUILDS]


def _quantizers(model_dir: Path) -> dict[str, tuple[object, float | None]]:
    return {
        module: (scheme, None if scale is None else float(scale))
        for module, (scheme, scale) in input_quantizers(model_dir).items()
    }


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Path:
    return tmp_path_factory.mktemp("scale-builds")


def test_one_value_specs_take_both_shapes() -> None:
    scale = TensorSpec("F32", (1,))
    assert scale.shapes == ((1,), ()) and scale.fits(()) and scale.fits([1])
    assert TensorSpec("F32", ()).shapes == ((), (1,))
    assert not scale.fits((2,)) and not scale.fits((1, 1))
    assert scale.conform(torch.tensor(2.0)).shape == (1,)
    assert TensorSpec("F32", ()).conform(torch.tensor([2.0])).shape == ()
    # Any other shape has no alias, and conform leaves what does not fit alone.
    channel = TensorSpec("F32", (4, 1))
    assert channel.shapes == ((4, 1),) and not channel.fits((4,))
    assert channel.conform(torch.ones(4)).shape == (4,)


@pytest.mark.parametrize(("export", "fmt"), BUILDS, ids=IDS)
def test_per_tensor_scales_in_the_other_shape_check_and_load_the_same(
    export: str, fmt: str, builds: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    written = build(tiny_checkpoint, builds, export, fmt)
    shape = other_shape(written)
    rewritten = tmp_path / "rewritten"
    changed = rewrite_scales(written, rewritten, lambda t: t.reshape(shape))
    assert {key.rpartition(".")[2] for key in changed} == {
        "modelopt": {"weight_scale", "input_scale"}
        if fmt == "fp8-static"
        else {"weight_scale_2", "input_scale"}
        if fmt == "nvfp4-w4a4"
        else {"weight_scale_2"},
        "compressed-tensors": {"weight_scale", "input_scale"}
        if fmt == "fp8-static"
        else {"weight_global_scale", "input_global_scale"}
        if fmt == "nvfp4-w4a4"
        else {"weight_global_scale"},
    }[export]
    headers = {
        k: t for shard in rewritten.glob("*.safetensors") for k, t in read_header(shard).items()
    }
    assert all(headers[key].shape == shape for key in changed)

    report = check_checkpoint(rewritten)
    assert report.ok, report.render()
    assert report.quantized_modules == check_checkpoint(written).quantized_modules
    # The same dequantized weights and input quantizers as the build as written.
    _, ours = load_drafter_state_dict(rewritten, dtype=None)
    _, theirs = load_drafter_state_dict(written, dtype=None)
    assert ours.keys() == theirs.keys()
    for key, tensor in theirs.items():
        assert torch.equal(ours[key], tensor), key
    assert _quantizers(rewritten) == _quantizers(written)


# A scale's dtype other than float32 for each kind of scale: per tensor, per channel, per block.
DTYPE_BUILDS = [
    ("modelopt", "fp8-static", torch.bfloat16),
    ("modelopt", "fp8-dynamic", torch.float16),
    ("modelopt", "nvfp4-w4a4", torch.bfloat16),
    ("compressed-tensors", "nvfp4-w4a4", torch.float16),
    ("compressed-tensors", "fp8-static", torch.float16),
    ("compressed-tensors", "fp8", torch.bfloat16),
]


@pytest.mark.parametrize(
    ("export", "fmt", "dtype"),
    DTYPE_BUILDS,
    ids=[f"{e}-{f}-{str(d).removeprefix('torch.')}" for e, f, d in DTYPE_BUILDS],
)
def test_float32_scales_stored_in_bf16_or_f16_check_and_load(
    export: str, fmt: str, dtype: torch.dtype, builds: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """vLLM copies the stored scale into its float32 parameter, so a BF16 or F16 scale is the float32
    scale of the same value: the copy loads as the build whose float32 scales hold those values."""
    written = build(tiny_checkpoint, builds, export, fmt)

    def float32_scale(key: str, stored) -> bool:
        return key.endswith(("scale", "scale_2")) and stored.dtype == "F32"

    narrow, rounded = tmp_path / "narrow", tmp_path / "rounded"
    changed = rewrite_scales(written, narrow, lambda t: t.to(dtype), which=float32_scale)
    rewrite_scales(written, rounded, lambda t: t.to(dtype).float(), which=float32_scale)
    assert all(key.endswith("scale") or key.endswith("scale_2") for key in changed)
    report = check_checkpoint(narrow)
    assert report.ok, report.render()
    _, ours = load_drafter_state_dict(narrow, dtype=None)
    _, theirs = load_drafter_state_dict(rounded, dtype=None)
    for key, tensor in theirs.items():
        assert torch.equal(ours[key], tensor), key
    assert _quantizers(narrow) == _quantizers(rounded)


def test_a_per_tensor_scale_of_another_shape_is_still_refused(
    builds: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    written = build(tiny_checkpoint, builds, "modelopt", "fp8-static")
    key = "layers.0.mlp.down_proj.weight_scale"
    bad = tmp_path / "bad"
    rewrite_scales(written, bad, lambda t: t.reshape(1).repeat(2), which=lambda k, _: k == key)
    problems = check_checkpoint(bad).render()
    assert (
        f"{key}: shape (2,), but the fp8-static module layers.0.mlp.down_proj needs (1,) or ()"
        in problems
    )
    with pytest.raises(
        FindingError, match=re.escape(f"tensor '{key}' has shape (2,), expected shape (1,) or ()")
    ):
        load_drafter_state_dict(bad)


def test_modelopt_w4a16_nvfp4_with_legacy_input_scales_checks_and_loads_as_without(
    builds: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """vLLM's ModelOpt linear method registers a W4A16 NVFP4 ``input_scale`` only to drop it after
    loading (older exports store one), so such a build is the W4A16 build it holds, not W4A4."""
    written = build(tiny_checkpoint, builds, "modelopt", "nvfp4")
    legacy = tmp_path / "legacy"
    added = with_legacy_input_scales(written, legacy)
    assert len(added) == len(check_checkpoint(written).quantized_modules)
    report = check_checkpoint(legacy)
    assert report.ok, report.render()
    assert set(report.quantized_modules.values()) == {"nvfp4"}
    _, ours = load_drafter_state_dict(legacy, dtype=None)
    _, theirs = load_drafter_state_dict(written, dtype=None)
    for key, tensor in theirs.items():
        assert torch.equal(ours[key], tensor), key
    assert _quantizers(legacy) == {}  # weight-only: no input is quantized
    # Only ModelOpt's W4A16 takes it: its W4A4 build needs its input_scale, and a compressed-tensors
    # W4A16 build has no input_global_scale parameter in vLLM.
    w4a4 = build(tiny_checkpoint, builds, "modelopt", "nvfp4-w4a4")
    missing = tmp_path / "w4a4-without"
    key = "context_proj.input_scale"
    copy_checkpoint(w4a4, missing, lambda k, _: {} if k == key else {k: None})
    assert f"{key}: missing; the nvfp4-w4a4 module context_proj needs it" in (
        check_checkpoint(missing).render()
    )
    ct = build(tiny_checkpoint, builds, "compressed-tensors", "nvfp4")
    extra = tmp_path / "ct-w4a16-with-input-scales"

    def add_input_scale(key: str, stored) -> dict[str, torch.Tensor | None]:
        if not key.endswith(".weight_global_scale"):
            return {key: None}
        value = read_tensor(stored.path, key)  # a W4A4 build's input_global_scale, in its place
        return {key: None, key.removesuffix("weight_global_scale") + "input_global_scale": value}

    copy_checkpoint(ct, extra, add_input_scale)
    assert "is stored as nvfp4-w4a4, but quantization_config says nvfp4" in (
        check_checkpoint(extra).render()
    )
