# SPDX-License-Identifier: Apache-2.0
"""ModelOpt's encoding (:mod:`vllm_dspark.checkpoint.modelopt`) against ModelOpt's own export.

tests/data/modelopt holds ModelOpt 0.47's drafter quantizer output for a few bf16 weights, and the
digests of its export of the whole ``small`` preset (its ``make.py`` regenerates both with ModelOpt):
the plugin's math and ``vllm-dspark quantize --export modelopt`` must reproduce every byte, and its
dequantization must equal vLLM's NVFP4 emulation on the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.checkpoints import tensor_digest
from vllm_dspark.checkpoint import modelopt
from vllm_dspark.checkpoint.layout import MODULE_SETS
from vllm_dspark.checkpoint.quant_plan import resolve
from vllm_dspark.checkpoint.store import read_checkpoint
from vllm_dspark.checkpoint_tools.make_random import make_random
from vllm_dspark.checkpoint_tools.quantize import quantize_checkpoint

DATA = Path(__file__).parents[1] / "data" / "modelopt"
QFORMATS = {"fp8": "fp8-static", "fp8_pc_pt": "fp8-dynamic", "nvfp4": "nvfp4-w4a4"}
QFORMATS["w4a16_nvfp4"] = "nvfp4"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize(("qformat", "fmt"), QFORMATS.items())
def test_quantize_reproduces_modelopts_export_byte_for_byte(qformat: str, fmt: str) -> None:
    source = load_file(DATA / "source.safetensors")
    exported = load_file(DATA / f"{qformat}.safetensors")
    modules = sorted({k.rsplit(".", 1)[0] for k in exported if k.endswith(".weight_scale")})
    assert modules  # the linears ModelOpt quantized (not the Markov head: excluded by default)
    for module in modules:
        ours = modelopt.quantize(source[f"{module}.weight"], fmt)
        theirs = {k.rsplit(".", 1)[1]: v for k, v in exported.items() if k.startswith(f"{module}.")}
        assert ours.keys() == theirs.keys(), module
        for suffix, tensor in ours.items():
            other = theirs[suffix]
            assert (tensor.dtype, tensor.shape) == (other.dtype, other.shape), (module, suffix)
            assert torch.equal(_bits(tensor), _bits(other)), (module, suffix)
        shape = tuple(source[f"{module}.weight"].shape)
        # What 0.47 writes; an optional spec (W4A16's input_scale of older exports) it leaves out.
        specs = {s: t for s, t in modelopt.tensor_specs(fmt, shape).items() if not t.optional}
        assert specs.keys() == theirs.keys()
        for suffix, spec in specs.items():
            assert (spec.dtype, spec.shape) == (theirs[suffix].dtype, tuple(theirs[suffix].shape))


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``small`` preset as make.py gave it to ModelOpt."""
    return make_random(tmp_path_factory.mktemp("small") / "small", "small", seed=0, progress=False)


@pytest.mark.parametrize(("qformat", "fmt"), QFORMATS.items())
def test_export_of_small_is_modelopts_byte_for_byte(
    small: Path, tmp_path: Path, qformat: str, fmt: str
) -> None:
    """ModelOpt's module set on ``small``, against ModelOpt's own export of it (small.json: with its
    fused-layer scale sharing applied to the layers vLLM fuses)."""
    theirs = json.loads((DATA / "small.json").read_text())[qformat]
    out = tmp_path / fmt
    quantize_checkpoint(small, out, fmt, MODULE_SETS["modelopt"], progress=False, export="modelopt")
    ours = {
        key: tensor_digest(tensor)
        for shard in sorted(out.glob("*.safetensors"))
        for key, tensor in load_file(shard).items()
    }
    assert ours == theirs["tensors"]
    written = json.loads((out / modelopt.HF_QUANT_CONFIG).read_text())
    assert written["producer"] == theirs["hf_quant_config"]["producer"]
    exclude = "exclude_modules"
    their_quantization = theirs["hf_quant_config"]["quantization"]
    assert {k: v for k, v in written["quantization"].items() if k != exclude} == {
        k: v for k, v in their_quantization.items() if k != exclude
    }
    # ModelOpt's excludes (globs) and ours (exact names) leave the same modules BF16.
    build = read_checkpoint(out)
    dtypes = {key: t.dtype for key, t in build.stored.items()}
    assert resolve(build.config, theirs["hf_quant_config"], dtypes).modules == build.plan().modules


@pytest.mark.parametrize(("qformat", "fmt"), QFORMATS.items())
def test_config_is_modelopts_and_parses_back(qformat: str, fmt: str) -> None:
    theirs = json.loads((DATA / f"{qformat}.json").read_text())
    ours = modelopt.quantization_config(fmt, theirs["exclude_modules"])
    assert list(ours) == list(theirs) and ours == theirs
    parsed = modelopt.Config.parse(theirs)
    assert parsed.fmt == fmt and parsed.excluded_by(["markov_head.markov_w2"])
    nested = modelopt.hf_quant_config(theirs)
    assert modelopt.is_modelopt(nested) and modelopt.Config.parse(nested) == parsed


@pytest.mark.parametrize("qformat", ["nvfp4", "w4a16_nvfp4"])
def test_nvfp4_dequantizes_as_vllms_emulation(qformat: str) -> None:
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        dequantize_to_dtype,
    )

    exported = load_file(DATA / f"{qformat}.safetensors")
    module = "layers.0.mlp.gate_proj"
    t = {k.rsplit(".", 1)[1]: v for k, v in exported.items() if k.startswith(f"{module}.")}
    n, k = t["weight"].shape[0], t["weight"].shape[1] * 2
    expected = dequantize_to_dtype(
        t["weight"], t["weight_scale"], t["weight_scale_2"], torch.float32, swizzle=False
    )
    assert torch.equal(modelopt.dequantize(t, QFORMATS[qformat], (n, k)), expected)


def test_negative_values_rounding_to_zero_keep_their_sign_bit() -> None:
    w = torch.tensor([[-1e-4, 1e-4, 6.0] + [0.0] * 13], dtype=torch.bfloat16)
    codes = modelopt.quantize(w, "nvfp4")["weight"][0, 0]
    assert int(codes) & 0x0F == 0x8 and int(codes) >> 4 == 0x0  # -0 is stored as 8, +0 as 0


def test_canonical_dtypes_name_nvfp4_as_compressed_tensors_does() -> None:
    stored = {
        "weight": "U8",
        "weight_scale": "F8_E4M3",
        "weight_scale_2": "F32",
        "input_scale": "F32",
    }
    assert modelopt.canonical_dtypes(stored) == {
        "weight_packed": "U8",
        "weight_scale": "F8_E4M3",
        "weight_global_scale": "F32",
        "input_global_scale": "F32",
    }
    fp8 = {"weight": "F8_E4M3", "weight_scale": "F32", "input_scale": "F32"}
    assert modelopt.canonical_dtypes(fp8) == fp8


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ({"quant_method": "modelopt", "quant_algo": "INT4_AWQ"}, "quant_algo is 'INT4_AWQ'"),
        (
            {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"},
            "kv_cache_quant_algo is 'FP8'",
        ),
        (
            {"quant_method": "modelopt_fp4", "quant_algo": "NVFP4", "group_size": 32},
            "group_size is 32",
        ),
        ({"quant_method": "modelopt", "quant_algo": "FP8", "ignore": "lm_head"}, "a list"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(config: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        modelopt.Config.parse(config)
