# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark quantize`` end to end on make-random checkpoints: real safetensors, real compressed-tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import QuantizationStrategy
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors import safe_open

from vllm_dspark.checkpoint import formats
from vllm_dspark.checkpoint.check import check_checkpoint
from vllm_dspark.checkpoint.layout import FP8_RECIPE, QUANTIZABLE_KINDS, REPORT_NAME
from vllm_dspark.checkpoint.quant_plan import declared
from vllm_dspark.checkpoint.store import load_config
from vllm_dspark.checkpoint_tools.make_random import make_random
from vllm_dspark.checkpoint_tools.quantize import quantize_checkpoint
from vllm_dspark.tools import cli
from vllm_dspark.tools.quantize import main


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    if not (model_dir / "model.safetensors.index.json").exists():  # make-random's one file
        with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(model_dir / shard), framework="pt") as f:
            out.update({key: f.get_tensor(key) for key in f.keys()})
    assert set(out) == set(index["weight_map"])
    return out


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    )


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def drafters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafters")
    return {
        preset: make_random(root / preset, preset, seed=1, progress=False)
        for preset in ("tiny", "small")
    }


@pytest.fixture(scope="module")
def quantized(
    drafters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for preset, model_dir in drafters.items():
        # fp8-block's 128x128 blocks tile small's recipe layers, not tiny's 64-wide ones.
        for fmt in (f for f in formats.names() if preset == "small" or f != "fp8-block"):
            out[preset, fmt] = root / f"{preset}-{fmt}"
            quantize_checkpoint(model_dir, out[preset, fmt], fmt, progress=False)
    return out


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_each_format_round_trips_with_snr_in_the_report(drafters, quantized, preset: str) -> None:
    source = _tensors(drafters[preset])
    snr = {}
    for fmt in (f for p, f in quantized if p == preset):
        out_dir = quantized[preset, fmt]
        report = json.loads((out_dir / f"{REPORT_NAME}.json").read_text())
        assert (
            f"| {report['modules'][0]['module']} |" in (out_dir / f"{REPORT_NAME}.md").read_text()
        )
        written = _tensors(out_dir)
        qc = json.loads((out_dir / "config.json").read_text())["quantization_config"]
        modules = declared(load_config(out_dir), qc)
        assert len(modules) == len(report["modules"]) == report["overall"]["modules_quantized"]
        for row in report["modules"]:
            name = row["module"]
            assert modules[name] == fmt
            weight = source[f"{name}.weight"]
            parts = {
                s: written[f"{name}.{s}"]
                for s in formats.get(fmt).tensor_specs(tuple(weight.shape))
            }
            # The report's SNR is what compressed-tensors' own decompression of the written tensors gives.
            restored = formats.dequantize_weight(parts, fmt, tuple(weight.shape))
            noise = (restored - weight.float()).double().square().sum()
            assert row["snr_db"] == pytest.approx(
                10 * torch.log10(weight.double().square().sum() / noise).item(), abs=0.01
            )
        # Everything not quantized is copied bit-identical.
        for key, tensor in source.items():
            if key.removesuffix(".weight") not in modules:
                assert _same_bytes(written[key], tensor), key
        assert report["overall"]["bytes_after"] == sum(
            t.numel() * t.element_size() for t in written.values()
        )
        assert check_checkpoint(out_dir).ok
        snr[fmt] = report["overall"]["snr_db_mean"]
    fp8, fp4 = [snr[f] for f in snr if f.startswith("fp8")], [snr[f] for f in snr if "fp4" in f]
    assert min(fp8) > 30 and all(14 < v < 24 for v in fp4)
    assert min(fp8) - max(fp4) > 8, snr


def test_output_is_a_complete_checkpoint(drafters, quantized) -> None:
    out_dir = quantized["small", "fp8"]
    config = json.loads((out_dir / "config.json").read_text())
    source_config = json.loads((drafters["small"] / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "quantization_config"} == source_config
    # The target's shared heads come along unchanged.
    assert (out_dir / "target" / "model.safetensors").read_bytes() == (
        drafters["small"] / "target" / "model.safetensors"
    ).read_bytes()
    report = json.loads((out_dir / f"{REPORT_NAME}.json").read_text())
    assert report["include_layers"] == [k for k in QUANTIZABLE_KINDS if k in FP8_RECIPE]
    assert report["overall"]["bytes_after"] < report["overall"]["bytes_before"]
    assert check_checkpoint(out_dir).ok
    assert not list(out_dir.parent.glob(".*partial*"))


def test_fp8_is_bit_identical_to_compressed_tensors(drafters, quantized) -> None:
    """The fused, chunked FP8 path writes what compressed-tensors' own quantizer gives for every
    quantized tensor: its channel-wise qparams and its naive compressor, on the whole weight."""
    fp8 = formats.get("fp8")
    args = fp8.scheme.weights
    assert args.strategy == QuantizationStrategy.CHANNEL and fp8.scheme.format == "naive-quantized"
    source, written = _tensors(drafters["small"]), _tensors(quantized["small", "fp8"])
    report = json.loads((quantized["small", "fp8"] / f"{REPORT_NAME}.json").read_text())
    assert len(report["modules"]) > 20
    for row in report["modules"]:
        name = row["module"]
        weight = source[f"{name}.weight"].float()
        scale, _ = calculate_qparams(
            weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True), args
        )
        expected = fp8.compressor.compress({"weight": weight, "weight_scale": scale}, fp8.scheme)
        assert expected.keys() == {"weight", "weight_scale"}
        for suffix, tensor in expected.items():
            assert _same_bytes(written[f"{name}.{suffix}"], tensor), f"{name}.{suffix}"


@pytest.mark.parametrize("fmt", [f for f in formats.names() if f != "fp8"])
def test_every_format_is_compressed_tensors_own_compression_of_the_whole_weight(
    drafters, quantized, fmt: str
) -> None:
    """What the chunked, multi-threaded writer stores for every module of ``small``, byte for byte,
    is compressed-tensors' compressor on the whole weight with its own qparam helpers' scales (a
    fused group's shared global scale where vLLM fuses under one), plus the static input scale."""
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    from vllm_dspark.checkpoint.layout import fused_module_groups

    f = formats.get(fmt)
    source, written = _tensors(drafters["small"]), _tensors(quantized["small", fmt])
    modules = sorted({k.rsplit(".", 1)[0] for k in written if k.endswith(".weight_scale")})
    assert len(modules) > 20
    shared = {}
    if f.fused_shares_scale:
        for members in fused_module_groups(modules).values():
            scale = f.shared_global_scale(source[f"{m}.weight"] for m in members)
            shared.update(dict.fromkeys(members, scale))
    args = f.scheme.weights
    for name in modules:
        weight = source[f"{name}.weight"].float()
        gs = shared.get(name, f.shared_global_scale([weight]))
        if args.strategy in ("channel", "block"):
            blocks = args.block_structure or [1, weight.shape[1]]
            grid = weight.unflatten(1, (-1, blocks[1])).unflatten(0, (-1, blocks[0]))
            scale, _ = calculate_qparams(grid.amin(dim=(1, 3)), grid.amax(dim=(1, 3)), args)
        elif args.strategy == "tensor":
            scale = gs.reshape(1)
            gs = None
        else:
            scale, _ = compute_dynamic_scales_and_zp(weight, args, module=None, global_scale=gs)
        state = {"weight": weight, "weight_scale": scale}
        if gs is not None:
            state["weight_global_scale"] = gs.reshape(1)
        with torch.compiler.set_stance("force_eager"):
            expected = {**f.compressor.compress(state, f.scheme), **f.input_scales()}
        if gs is not None:
            expected["weight_global_scale"] = gs.reshape(1)
        assert expected.keys() == f.tensor_specs(tuple(weight.shape)).keys(), name
        for suffix, tensor in expected.items():
            assert _same_bytes(written[f"{name}.{suffix}"], tensor), f"{name}.{suffix}"


def test_workers_give_the_same_bytes(drafters, quantized, tmp_path: Path) -> None:
    out_dir = tmp_path / "workers"
    quantize_checkpoint(drafters["small"], out_dir, "nvfp4", workers=1, progress=False)
    serial, parallel = _tensors(quantized["small", "nvfp4"]), _tensors(out_dir)
    assert serial.keys() == parallel.keys()
    assert all(_same_bytes(serial[k], parallel[k]) for k in serial)


def test_nvfp4_fused_modules_share_one_global_scale(drafters, tmp_path: Path) -> None:
    kinds = ["self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "mlp.gate_proj", "mlp.up_proj"]
    quantize_checkpoint(drafters["tiny"], tmp_path / "out", "nvfp4", kinds, progress=False)
    written = _tensors(tmp_path / "out")
    gs = {
        k.removesuffix(".weight_global_scale"): float(v)
        for k, v in written.items()
        if k.endswith("global_scale")
    }
    # q_a and kv_a share one scale across all layers (context_kv_proj stacks every layer's kv_a) ...
    assert len({v for k, v in gs.items() if "_a_proj" in k}) == 1
    # ... gate and up share one per layer.
    for layer in (0, 1):
        assert gs[f"layers.{layer}.mlp.gate_proj"] == gs[f"layers.{layer}.mlp.up_proj"]
    assert gs["layers.0.mlp.gate_proj"] != gs["layers.1.mlp.gate_proj"]
    assert check_checkpoint(tmp_path / "out").ok


def _refused(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    assert cli.main(["quantize", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vllm-dspark quantize: error: ") and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        (
            ["mlp.gate_proj", "mlp.down_proj"],
            "mlp.gate_proj and mlp.up_proj are fused into mlp.gate_up_proj at runtime and must be quantized together",
        ),
        (["self_attn.q_a_proj"], "fused into self_attn.fused_qkv_a_proj"),
        (
            ["mlp.gate", "mlp.up"],
            "unknown layer name(s) in --include-layers: 'mlp.gate', 'mlp.up'. Layer names are index-agnostic "
            f"module kinds; valid ones: {' '.join(QUANTIZABLE_KINDS)}",
        ),
        (["final_norm"], "'final_norm' cannot be quantized"),
        (["markov_head.markov_w1"], "'markov_head.markov_w1' cannot be quantized"),
    ],
)
def test_refuses_bad_include_layers(
    drafters, tmp_path, capsys, layers: list[str], message: str
) -> None:
    err = _refused(
        capsys,
        [
            "--model-dir",
            str(drafters["tiny"]),
            "--output-dir",
            str(tmp_path / "out"),
            "--quant-format",
            "fp8",
            "--include-layers",
            *layers,
        ],
    )
    assert message in err
    assert not (tmp_path / "out").exists()


def test_refuses_a_non_empty_output_dir_without_overwrite(drafters, tmp_path, capsys) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "notes.txt").write_text("keep me")
    argv = [
        "--model-dir",
        str(drafters["tiny"]),
        "--output-dir",
        str(out_dir),
        "--quant-format",
        "fp8",
    ]
    assert "exists and is not empty. Fix: pass --overwrite" in _refused(capsys, argv)
    assert (out_dir / "notes.txt").read_text() == "keep me"
    assert main([*argv, "--overwrite"]) == 0
    assert not (out_dir / "notes.txt").exists() and check_checkpoint(out_dir).ok


def test_refuses_to_write_into_its_input(drafters, capsys) -> None:
    err = _refused(
        capsys,
        [
            "--model-dir",
            str(drafters["tiny"]),
            "--output-dir",
            str(drafters["tiny"] / "fp8"),
            "--quant-format",
            "fp8",
        ],
    )
    assert f"lies inside the input {drafters['tiny']}" in err


def _copy(model_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    return copy, next(copy.glob("model*.safetensors"))


def test_refuses_a_truncated_shard(drafters, tmp_path, capsys) -> None:
    model_dir, shard = _copy(drafters["tiny"], tmp_path)
    shard.write_bytes(shard.read_bytes()[:-1000])
    err = _refused(
        capsys,
        [
            "--model-dir",
            str(model_dir),
            "--output-dir",
            str(tmp_path / "out"),
            "--quant-format",
            "fp8",
        ],
    )
    assert f"{shard} is not a readable safetensors file" in err and "not fully covered" in err
    assert not (tmp_path / "out").exists()


def test_refuses_a_corrupt_shard(drafters, tmp_path, capsys) -> None:
    model_dir, shard = _copy(drafters["tiny"], tmp_path)
    shard.write_bytes(b"\x00" * 8 + shard.read_bytes()[8:])  # header length zeroed
    err = _refused(
        capsys,
        [
            "--model-dir",
            str(model_dir),
            "--output-dir",
            str(tmp_path / "out"),
            "--quant-format",
            "fp8",
        ],
    )
    assert f"{shard} is not a readable safetensors file" in err


def test_refuses_an_already_quantized_checkpoint(quantized, tmp_path, capsys) -> None:
    err = _refused(
        capsys,
        [
            "--model-dir",
            str(quantized["tiny", "fp8"]),
            "--output-dir",
            str(tmp_path / "again"),
            "--quant-format",
            "nvfp4",
        ],
    )
    assert (
        "is already quantized (11 modules stored as fp8, per its quantization_config and tensors)"
        in err
    )

    # Quantized tensors under a config that lost its quantization_config are caught too.
    model_dir, _ = _copy(quantized["tiny", "fp8"], tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    del config["quantization_config"]
    (model_dir / "config.json").write_text(json.dumps(config))
    err = _refused(
        capsys,
        [
            "--model-dir",
            str(model_dir),
            "--output-dir",
            str(tmp_path / "again"),
            "--quant-format",
            "fp8",
        ],
    )
    assert (
        "is not a BF16 checkpoint: context_proj is stored as fp8 (11 quantized modules), but config.json has no "
        "quantization_config" in err
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_refuses_cuda_without_a_gpu(drafters, tmp_path, capsys) -> None:
    err = _refused(
        capsys,
        [
            "--model-dir",
            str(drafters["tiny"]),
            "--output-dir",
            str(tmp_path / "out"),
            "--quant-format",
            "fp8",
            "--device",
            "cuda",
        ],
    )
    assert "--device cuda, but torch sees no CUDA device" in err


def test_help_explains_why_smoothquant_is_off(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "SmoothQuant is off" in " ".join(capsys.readouterr().out.split())


def test_qstream_underscore_flags_still_parse_and_help_shows_kebab_case(
    drafters, tmp_path, capsys
) -> None:
    out_dir = tmp_path / "out"
    argv = ["--model_dir", str(drafters["tiny"]), "--output_dir", str(out_dir)]
    assert main([*argv, "--quant_format", "fp8", "--include_layers", *FP8_RECIPE]) == 0
    assert check_checkpoint(out_dir).ok
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    assert all(f"--{flag}" in help_text for flag in ("model-dir", "output-dir", "quant-format"))
    assert not any(f"--{flag}" in help_text for flag in ("model_dir", "output_dir", "quant_format"))
