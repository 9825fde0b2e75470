# SPDX-License-Identifier: Apache-2.0
"""Adding a format is one class: a toy per-tensor FP8 format, registered here, runs quantize -> check ->
load (the reference loader and vLLM's) -> eval on the tiny preset with no other change to the package."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams

from vllm_dspark.checkpoint import formats, quant_config
from vllm_dspark.checkpoint.formats import TensorSpec


class PerTensorFP8(formats.FP8):
    """E4M3 with one scale for the whole tensor: weight f8e4m3 [N,K], weight_scale f32 [1]."""

    name = "fp8_tensor"
    preset = "FP8"
    description = "fp8_tensor: E4M3, one scale per tensor"
    strategy = "tensor"
    compiled_kernels = True  # compressed-tensors' own compressor and fake_quantize

    def tensor_specs(self, shape: tuple[int, int]) -> dict[str, TensorSpec]:
        return {
            "weight": TensorSpec("F8_E4M3", tuple(shape)),
            "weight_scale": TensorSpec("F32", (1,)),
        }

    def _scale(self, weight: torch.Tensor) -> torch.Tensor:
        x = weight.float()
        return calculate_qparams(x.amin().reshape(1), x.amax().reshape(1), self.scheme.weights)[0]

    def quantize(
        self, weight: torch.Tensor, global_scale: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        state = {"weight": weight.float(), "weight_scale": self._scale(weight)}
        return self.compressor.compress(state, self.scheme)

    def fake_quantize(
        self, weight: torch.Tensor, global_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        return fake_quantize(weight.float(), self._scale(weight), None, self.scheme.weights)


@pytest.fixture
def toy_format(monkeypatch: pytest.MonkeyPatch) -> formats.QuantFormat:
    monkeypatch.setitem(formats.REGISTRY, PerTensorFP8.name, PerTensorFP8())
    return formats.get(PerTensorFP8.name)


def test_toy_format_round_trips(toy_format: formats.QuantFormat) -> None:
    # Rows enough for several of the SNR's row chunks, which must all use the one per-tensor scale.
    weight = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(0))
    q = toy_format.quantize(weight)
    assert {s: (t.dtype, tuple(t.shape)) for s, t in q.items()} == {
        s: (spec.dtype, spec.shape) for s, spec in toy_format.tensor_specs((2048, 1024)).items()
    }
    restored = toy_format.dequantize(q, (2048, 1024))
    assert torch.equal(
        restored.to(torch.bfloat16), toy_format.fake_quantize(weight).to(torch.bfloat16)
    )
    direct = 10 * math.log10(weight.square().sum() / (weight - restored).square().sum())
    assert toy_format.snr_db(weight, q) == pytest.approx(direct, abs=1e-3)


def test_toy_format_quantize_check_load_eval(
    toy_format: formats.QuantFormat, tiny_checkpoint: Path, tiny_mla_target: Path, tmp_path: Path
) -> None:
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsW8A16Fp8,
    )

    from tests.support.vllm_drafter import assert_hooks_match_reference, load_drafter
    from vllm_dspark.checkpoint.check import check_checkpoint
    from vllm_dspark.checkpoint.store import load_drafter_state_dict, resolve_checkpoint
    from vllm_dspark.drift.harness import EvalSpec, run
    from vllm_dspark.reference.drafter import ReferenceDrafter
    from vllm_dspark.tools import cli

    out = tmp_path / "tiny-fp8_tensor"
    assert (
        cli.main(
            [
                "quantize",
                "--model-dir",
                str(tiny_checkpoint),
                "--output-dir",
                str(out),
                "--quant-format",
                toy_format.name,
            ]
        )
        == 0
    )

    report = check_checkpoint(out)
    assert report.ok, report.render()
    assert set(report.quantized_modules.values()) == {toy_format.name}
    assert resolve_checkpoint(out).modules == report.quantized_modules

    # The reference loader dequantizes exactly what the on-the-fly variant computes.
    _, bf16 = load_drafter_state_dict(tiny_checkpoint, dtype=torch.float32)
    _, loaded = load_drafter_state_dict(out, dtype=torch.float32)
    for module in report.quantized_modules:
        key = f"{module}.weight"
        assert torch.equal(loaded[key], toy_format.fake_quantize(bf16[key])), key

    # vLLM serves it with its own W8A16 FP8 scheme, one scale per tensor, and computes what the reference does.
    served = load_drafter(tiny_mla_target, out)
    schemes = [m.scheme for m in served.model.modules() if hasattr(m, "scheme")]
    assert schemes and all(
        isinstance(s, CompressedTensorsW8A16Fp8) and s.strategy == "tensor" for s in schemes
    )
    assert_hooks_match_reference(
        served, ReferenceDrafter.from_pretrained(out), atol=1e-4, rtol=1e-4
    )

    # eval: the format on the fly and its checkpoint score the same.
    spec = EvalSpec(
        model=str(tiny_checkpoint),
        variants=(toy_format.name, str(out)),
        regimes=("gauss",),
        blocks=8,
        batch_size=4,
        context_len=8,
        resamples=20,
        progress=False,
    )
    results = run(spec)
    cells = {c["variant"]: c["metrics"] for c in results["cells"]}
    for key in ("greedy_agreement", "kl_mean", "ceiling"):
        assert cells[toy_format.name][key] == cells[out.name][key], key


def test_the_command_line_lists_exactly_the_built_in_formats() -> None:
    """``--help`` reads the formats from ``layout.QUANT_FORMATS`` (no torch); the registry holds them."""
    from vllm_dspark.checkpoint.layout import QUANT_FORMATS

    assert formats.names() == tuple(QUANT_FORMATS)
    assert all(formats.get(n).description == d for n, d in QUANT_FORMATS.items())


def _library_config(targets: dict[str, list[str]], ignore: list[str]) -> dict:
    """What compressed-tensors itself dumps for these config groups."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    groups = {
        f"group_{i}": formats.get(fmt).scheme.model_copy(update={"targets": entries})
        for i, (fmt, entries) in enumerate(targets.items())
    }
    return QuantizationConfig(
        config_groups=groups,
        format=next(iter(groups.values())).format if len(groups) == 1 else "mixed-precision",
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=ignore,
    ).model_dump(mode="json")


@pytest.mark.parametrize(
    "targets",
    [{name: ["re:.*a$"]} for name in formats.names()]
    + [{"fp8": ["re:.*a$"], "nvfp4": ["re:.*b$"], "mxfp4": ["re:.*c$"]}],
    ids=[*formats.names(), "mixed"],
)
def test_quantization_config_written_without_the_library_is_the_librarys_own(targets) -> None:
    """The library-free writer, read back by compressed-tensors, is exactly what it writes itself."""
    from compressed_tensors.quantization import QuantizationConfig

    ours = quant_config.compressed_tensors_config(targets, ignore=["re:.*z$"])
    read = QuantizationConfig.model_validate(ours).model_dump(mode="json")
    assert read == _library_config(targets, ["re:.*z$"])
    assert quant_config.group_formats(ours) == {f"group_{i}": fmt for i, fmt in enumerate(targets)}


def test_quantizing_fp8_imports_neither_compressed_tensors_nor_transformers(
    tiny_checkpoint, tmp_path
) -> None:
    """`vllm-dspark quantize --quant-format fp8` pays for torch and safetensors only, as a copy does."""
    import subprocess
    import sys

    heavy = ["compressed_tensors", "transformers", "torch._dynamo"]
    probe = (
        "import sys\n"
        "from vllm_dspark.tools.quantize import main\n"
        f"main(['--model-dir', {str(tiny_checkpoint)!r}, '--output-dir', {str(tmp_path / 'q')!r}, "
        "'--quant-format', 'fp8'])\n"
        f"print([m for m in {heavy!r} if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "q" / "config.json").exists()
