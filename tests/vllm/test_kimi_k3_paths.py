# SPDX-License-Identifier: Apache-2.0
"""What vLLM serves Kimi-K3's drafter with: one platform predicate for the draft layers' path, and no
vocab-sharded draft logits (marker ``vllm_api``: on each supported vLLM)."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from vllm_dspark import compat

pytestmark = pytest.mark.vllm_api

ROOT = Path(__file__).resolve().parents[2]
PLATFORM_PREDICATES = {"is_cuda", "is_cuda_alike", "is_rocm"}
IN_TREE_DRAFTER = ("vllm.models.kimi_k3.nvidia.dspark_mla", "K3DSparkForCausalLM")


def _vllm_package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return Path(spec.origin).parent


def test_the_runtime_picks_its_path_by_one_predicate() -> None:
    """attention.py and model.py once branched on is_cuda_alike() and is_cuda(): on ROCm they disagreed."""
    calls = [
        f"{path.name}:{node.lineno} {node.attr}"
        for path in sorted((ROOT / "vllm_dspark" / "runtime").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in PLATFORM_PREDICATES
    ]
    assert not calls, f"branch on compat.runs_in_tree_k3_layers(), not {calls}"


def test_vllm_serves_its_one_k3_drafter_on_cuda_and_rocm_alike() -> None:
    """The predicate's premise: the registry maps K3DSparkModel to the nvidia drafter, with no ROCm one."""
    from vllm.model_executor.models import registry

    assert registry._SPECULATIVE_DECODING_MODELS["K3DSparkModel"] == IN_TREE_DRAFTER
    k3 = _vllm_package_dir("vllm.models.kimi_k3")
    assert not [p.name for p in k3.rglob("*.py") if "dspark" in p.name and "nvidia" not in p.parts]


@pytest.mark.parametrize(
    "platform, in_tree", [("CUDA", True), ("ROCM", True), ("CPU", False), ("XPU", False)]
)
def test_the_predicate_follows_vllms_k3_drafter(
    monkeypatch: pytest.MonkeyPatch, platform: str, in_tree: bool
) -> None:
    from vllm.platforms import PlatformEnum, current_platform

    monkeypatch.setattr(current_platform, "_enum", PlatformEnum[platform])
    assert compat.runs_in_tree_k3_layers() is in_tree


def test_kimi_k3_never_takes_vocab_sharded_draft_logits() -> None:
    """vLLM calls a drafter's compute_draft_logits_local only for a target with compute_logits_local
    (batch-sharded sampling); no Kimi-K3 class has it, so the docs must not offer it for Kimi-K3."""
    k3 = _vllm_package_dir("vllm.models.kimi_k3")
    assert not [p.name for p in k3.rglob("*.py") if "def compute_logits_local" in p.read_text()]
    for doc in sorted((ROOT / "docs").rglob("*.md")):
        for paragraph in re.split(r"\n\s*\n", doc.read_text()):
            if "compute_draft_logits_local" in paragraph:
                assert "Kimi-K3 does not" in paragraph, f"{doc.name}: {paragraph[:200]}"
