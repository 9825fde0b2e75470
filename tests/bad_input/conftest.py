# SPDX-License-Identifier: Apache-2.0
"""The shared, read-only checkpoints every bad-input case starts from, and a private $TMPDIR."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from vllm_dspark.tools import cli


@pytest.fixture(scope="package")
def ckpts(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """bf16 (the shared tiny drafter, sharded), its fp8 / mxfp4 / nvfp4 builds, and a different model
    (seed 1).

    make-random writes the published single ``model.safetensors``; the malformed cases break an index
    and its shards, so bf16 is the same drafter re-saved as ``model-00001-of-00001.safetensors`` plus
    ``model.safetensors.index.json`` (the layout ``quantize`` and ``train-pair`` write)."""
    import shutil

    from vllm_dspark.checkpoint.save import save_drafter
    from vllm_dspark.checkpoint.st_io import read_tensors
    from vllm_dspark.checkpoint.store import read_config_json
    from vllm_dspark.checkpoint_tools.make_random import make_random
    from vllm_dspark.checkpoint_tools.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("bad_input_ckpts")
    bf16 = root / "bf16"
    tensors = read_tensors(tiny_checkpoint / "model.safetensors")
    save_drafter(bf16, read_config_json(tiny_checkpoint), tensors.items())
    shutil.copytree(tiny_checkpoint / "target", bf16 / "target")
    out = {"bf16": bf16}
    for fmt in ("fp8", "mxfp4", "nvfp4"):
        out[fmt] = root / fmt
        quantize_checkpoint(bf16, out[fmt], fmt, progress=False)
    out["other"] = make_random(root / "other", "tiny", seed=1, progress=False)
    out["other-fp8"] = root / "other-fp8"
    quantize_checkpoint(out["other"], out["other-fp8"], "fp8", progress=False)
    out["inputs"] = root / "inputs.safetensors"
    assert (
        cli.main(["draft", "--model", str(tiny_checkpoint), "--example-inputs", str(out["inputs"])])
        == 0
    )
    return out


@pytest.fixture
def isolated_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private $TMPDIR, so a spill folder left behind would show."""
    spill = tmp_path / "tmpdir"
    spill.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spill))
    return spill
