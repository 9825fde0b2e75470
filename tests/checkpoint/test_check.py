# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark check`` on real quantized checkpoints, and on each way one can be broken."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.checkpoints import edit_config
from vllm_dspark.checkpoint.check import check_checkpoint
from vllm_dspark.checkpoint.layout import FP8_RECIPE
from vllm_dspark.checkpoint_tools.make_random import make_random
from vllm_dspark.checkpoint_tools.quantize import quantize_checkpoint
from vllm_dspark.tools.check import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("check")
    out = {"bf16": make_random(root / "bf16", "tiny", seed=2, progress=False)}
    quantize_checkpoint(out["bf16"], root / "fp8", "fp8", FP8_RECIPE, progress=False)
    # NVFP4 over both fused groups, whose shards must share global scales.
    layers = [
        "mlp.gate_proj",
        "mlp.up_proj",
        "self_attn.q_a_proj",
        "self_attn.kv_a_proj_with_mqa",
        "context_proj",
    ]
    quantize_checkpoint(out["bf16"], root / "nvfp4", "nvfp4", layers, progress=False)
    quantize_checkpoint(out["bf16"], root / "mxfp4", "mxfp4", ["mlp.down_proj"], progress=False)
    out.update(fp8=root / "fp8", nvfp4=root / "nvfp4", mxfp4=root / "mxfp4")
    return out


def _broken(checkpoints: dict[str, Path], which: str, tmp_path: Path) -> Path:
    copy = tmp_path / which
    shutil.copytree(checkpoints[which], copy)
    return copy


def _edit_tensors(model_dir: Path, edit) -> None:
    shard = next(model_dir.glob("model*.safetensors"))
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    index["weight_map"] = dict.fromkeys(tensors, shard.name)
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sound_checkpoints_pass(checkpoints, capsys) -> None:
    bf16 = check_checkpoint(checkpoints["bf16"])
    assert bf16.ok and bf16.config_groups == 0 and not bf16.quantized_modules

    fp8 = check_checkpoint(checkpoints["fp8"])
    assert fp8.ok, fp8.problems
    assert fp8.config_groups == 1 and not fp8.warnings
    assert len(fp8.quantized_modules) == 1 + 5 * 2 and set(fp8.quantized_modules.values()) == {
        "fp8"
    }

    nvfp4 = check_checkpoint(checkpoints["nvfp4"])
    assert nvfp4.ok, nvfp4.problems
    assert "layers.1.self_attn.kv_a_proj_with_mqa" in nvfp4.quantized_modules
    assert check_checkpoint(checkpoints["mxfp4"]).ok

    assert main([str(checkpoints["fp8"])]) == 0
    out = capsys.readouterr().out
    # 7 unquantized modules per layer + 6 global ones (41 for the 5-layer K3).
    assert (
        "1 config group(s), format fp8: 11 quantized modules" in out
        and "20 unquantized modules" in out
    )
    assert "OK" in out


def _problems(model_dir: Path, capsys: pytest.CaptureFixture) -> str:
    report = check_checkpoint(model_dir)
    assert not report.ok
    assert main([str(model_dir)]) == 1
    out = capsys.readouterr().out
    problems = [str(problem) for problem in report.problems]
    assert all(problem.splitlines()[0] in out for problem in problems)
    return "\n".join(problems)


def test_ignore_wins_over_targets_as_compressed_tensors_defines(
    checkpoints, tmp_path, capsys
) -> None:
    model_dir = _broken(checkpoints, "fp8", tmp_path)
    edit_config(
        model_dir, lambda c: c["quantization_config"]["ignore"].append("re:.*mlp\\.down_proj$")
    )
    problems = _problems(model_dir, capsys)
    assert problems.startswith(
        "quantization_config and the stored tensors disagree: layers.0.mlp.down_proj is "
        "stored as fp8, but quantization_config leaves it unquantized (ignore "
        "'re:.*mlp\\\\.down_proj$') (and 1 more module(s))"
    )


def test_a_glob_target_is_served_with_its_rewrite(checkpoints, tmp_path, capsys) -> None:
    model_dir = _broken(checkpoints, "fp8", tmp_path)

    def glob(config):
        targets = config["quantization_config"]["config_groups"]["group_0"]["targets"]
        targets.remove("re:.*layers\\.\\d+\\.mlp\\.down_proj$")
        targets.append("*mlp.down_proj")

    edit_config(model_dir, glob)
    report = check_checkpoint(model_dir)
    assert report.ok and len(report.quantized_modules) == 11
    assert main([str(model_dir)]) == 0
    assert (
        "WARNING: quantization_config has entries that match no module" in capsys.readouterr().out
    )
    assert '"*mlp.down_proj" -> "re:.*mlp\\\\.down_proj$"' in str(report.warnings[0])


def test_checkpoint_layer_names_are_module_names(checkpoints, tmp_path) -> None:
    model_dir = _broken(checkpoints, "fp8", tmp_path)

    def per_layer(config):  # what an exporter that lists HF module names writes
        qc = config["quantization_config"]
        qc["ignore"].remove("re:.*layers\\.\\d+\\.self_attn\\.kv_b_proj$")
        qc["ignore"] += ["layers.0.self_attn.kv_b_proj", "layers.1.self_attn.kv_b_proj"]

    edit_config(model_dir, per_layer)
    report = check_checkpoint(model_dir)
    assert report.ok and not report.warnings, report.problems


def test_split_fused_module(checkpoints, tmp_path, capsys) -> None:
    model_dir = _broken(checkpoints, "fp8", tmp_path)

    def split(
        config,
    ):  # quantize gate_proj but ignore up_proj, as a substring-matched ignore once did
        qc = config["quantization_config"]
        qc["config_groups"]["group_0"]["targets"].remove("re:.*layers\\.\\d+\\.mlp\\.up_proj$")
        qc["ignore"].append("re:.*layers\\.\\d+\\.mlp\\.up_proj$")

    edit_config(model_dir, split)
    problems = _problems(model_dir, capsys)
    assert (
        "layers.0.mlp.up_proj is stored as fp8, but quantization_config leaves it unquantized (ignore "
        "'re:.*layers\\\\.\\\\d+\\\\.mlp\\\\.up_proj$')"
    ) in problems
    # ... and the tensors no longer match what config.json says.
    assert (
        "layers.0.mlp.up_proj.weight: dtype F8_E4M3, but the unquantized module layers.0.mlp.up_proj stores it "
        "as BF16 or F16 or F32"
    ) in problems
    assert (
        "layers.0.mlp.up_proj.weight_scale: unexpected tensor (layers.0.mlp.up_proj is not quantized by config.json)"
        in problems
    )


def test_wrong_dtype_missing_and_unexpected_tensors(checkpoints, tmp_path, capsys) -> None:
    model_dir = _broken(checkpoints, "fp8", tmp_path)

    def edit(tensors):
        tensors["layers.1.mlp.down_proj.weight"] = tensors["layers.1.mlp.down_proj.weight"].float()
        tensors["final_norm.weight"] = tensors["final_norm.weight"].to(torch.float8_e4m3fn)
        del tensors["context_proj.weight_scale"]
        tensors["layers.0.mlp.down_proj.weight_zero_point"] = torch.zeros(64, 1)

    _edit_tensors(model_dir, edit)
    problems = _problems(model_dir, capsys)
    assert (
        "layers.1.mlp.down_proj.weight: dtype F32, but the fp8 module layers.1.mlp.down_proj stores it as F8_E4M3"
        in problems
    )
    assert (
        "final_norm.weight: dtype F8_E4M3, but the unquantized module final_norm stores it as BF16 or F16 or F32"
        in problems
    )
    assert (
        "context_proj.weight_scale: missing; the fp8 module context_proj needs it (shape (64, 1))"
        in problems
    )
    assert (
        "layers.0.mlp.down_proj.weight_zero_point: unexpected tensor (layers.0.mlp.down_proj is fp8"
        in problems
    )
    assert "Fix: re-quantize the BF16 checkpoint with `vllm-dspark quantize`" in problems


def test_wrong_shape(checkpoints, tmp_path, capsys) -> None:
    model_dir = _broken(checkpoints, "fp8", tmp_path)
    _edit_tensors(
        model_dir, lambda t: t.update({"layers.0.self_attn.o_proj.weight_scale": torch.ones(32, 1)})
    )
    assert (
        "layers.0.self_attn.o_proj.weight_scale: shape (32, 1), but the fp8 module layers.0.self_attn.o_proj "
        "needs (64, 1)"
    ) in _problems(model_dir, capsys)


def test_non_finite_scales(checkpoints, tmp_path, capsys) -> None:
    model_dir = _broken(checkpoints, "fp8", tmp_path)

    def poison(tensors):
        tensors["layers.0.mlp.gate_proj.weight_scale"][3] = float("nan")
        tensors["layers.1.mlp.up_proj.weight_scale"][0] = 0.0

    _edit_tensors(model_dir, poison)
    problems = _problems(model_dir, capsys)
    assert (
        "layers.0.mlp.gate_proj.weight_scale: 1 of 128 scale values are NaN, infinite or not positive"
        in problems
    )
    assert "layers.1.mlp.up_proj.weight_scale: 1 of 128 scale values" in problems


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.uint8,
        torch.int32,
    ],
)
def test_scales_are_judged_from_their_bytes_as_torch_reads_them(dtype: torch.dtype) -> None:
    """``check`` reads scales without torch, from their stored bytes: every bit pattern of a one-byte
    dtype, and NaN, infinities, zeros, negatives and subnormals of wider ones, decode to torch's own
    values, and count as invalid exactly when torch's values are not finite and positive (FP8 and
    E8M0 as :func:`vllm_dspark.finite.invalid_scale_values` says)."""
    import numpy as np

    from vllm_dspark.finite import invalid_scale_values, stored_values

    if dtype.itemsize == 1:
        scale = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    elif not dtype.is_floating_point:
        scale = torch.tensor([-3, 0, 1, 7], dtype=dtype)
    else:
        special = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -1.5, 1e-40, 2.0, 3e38]
        scale = torch.tensor(special, dtype=torch.float64).to(dtype)
    name = str(dtype).removeprefix("torch.")
    raw = scale.view(torch.uint8).numpy().tobytes()
    values = scale.double()
    assert np.array_equal(
        stored_values(raw, name).astype(np.float64), values.numpy(), equal_nan=True
    )
    if dtype == torch.uint8:
        want = int((scale == 255).sum())
    else:
        fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        positive = values >= 0 if fp8 else values > 0
        want = int((~torch.isfinite(values) | ~positive).sum())
    assert invalid_scale_values(raw, name) == want > 0


def test_nan_e8m0_scale(checkpoints, tmp_path, capsys) -> None:
    model_dir = _broken(checkpoints, "mxfp4", tmp_path)
    _edit_tensors(
        model_dir, lambda t: t["layers.1.mlp.down_proj.weight_scale"][0].fill_(255)
    )  # E8M0 NaN
    assert "layers.1.mlp.down_proj.weight_scale: 4 of 256 scale values are NaN" in _problems(
        model_dir, capsys
    )


def test_nvfp4_fused_shards_with_different_global_scales(checkpoints, tmp_path, capsys) -> None:
    model_dir = _broken(checkpoints, "nvfp4", tmp_path)
    _edit_tensors(
        model_dir, lambda t: t["layers.1.self_attn.kv_a_proj_with_mqa.weight_global_scale"].mul_(2)
    )
    problems = _problems(model_dir, capsys)
    assert (
        "self_attn.fused_qkv_a_proj: NVFP4 weight_global_scale differs across the fused modules"
        in problems
    )


def test_several_config_groups_of_one_format(checkpoints, tmp_path) -> None:
    model_dir = _broken(checkpoints, "fp8", tmp_path)

    def two_groups(config):
        groups = config["quantization_config"]["config_groups"]
        groups["group_1"] = dict(groups["group_0"], targets=[groups["group_0"]["targets"].pop()])

    edit_config(model_dir, two_groups)
    report = check_checkpoint(model_dir)
    assert report.ok and report.config_groups == 2 and len(report.quantized_modules) == 11


def test_truncated_shard_and_missing_config_are_problems_not_exceptions(
    checkpoints, tmp_path, capsys
) -> None:
    model_dir = _broken(checkpoints, "fp8", tmp_path)
    shard = next(model_dir.glob("model*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-100])
    assert f"{shard} is not a readable safetensors file" in _problems(model_dir, capsys)
    (model_dir / "config.json").unlink()
    assert "has no config.json" in _problems(model_dir, capsys)
