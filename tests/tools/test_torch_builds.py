# SPDX-License-Identifier: Apache-2.0
"""A CUDA torchvision/torchaudio/torchcodec beside a CPU torch is caught from package metadata before
vLLM or transformers import it: ``serve-cpu``, ``doctor`` and the demo stop at once with the one-line
fix. The installs are real ``*.dist-info`` folders on the path, ahead of the environment's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_dspark.doctor.torch_builds import FIX, torch_build_findings

ROOT = Path(__file__).resolve().parents[2]
PAIR = ROOT / "tests" / "data" / "pair"

# Runs one entry point, then says which heavy modules it imported.
DRIVER = """
import sys
from vllm_dspark.tools import cli
if sys.argv[1] == "demo":
    from vllm_dspark.tools import demo
    rc = cli.guarded("make demo", lambda: demo.main(sys.argv[2:]))
else:
    rc = cli.main(sys.argv[1:])
heavy = ("vllm", "transformers", "torchvision", "torchaudio", "torchcodec")
print("IMPORTED", [m for m in heavy if m in sys.modules])
sys.exit(rc)
"""


def _dist_info(site: Path, name: str, version: str, *requires: str) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


@pytest.fixture
def cuda_torchvision(tmp_path: Path) -> Path:
    """A site folder with a CPU torch and PyPI's (CUDA) torchvision 0.29.1, as pip leaves them."""
    site = tmp_path / "site"
    _dist_info(site, "torch", "2.13.0+cpu")
    _dist_info(site, "torchvision", "0.29.1", "numpy", "torch==2.14.1")
    return site


@pytest.mark.parametrize(
    "companions, wrong",
    [
        ([], None),
        ([("torchvision", "0.28.0+cpu", "torch==2.13.0")], None),
        ([("torchvision", "0.29.1", "torch==2.14.1")], "torchvision 0.29.1 (not a +cpu build)"),
        ([("torchvision", "0.29.1+cpu", "torch==2.14.1")], "built for torch 2.14.1"),
        ([("torchaudio", "2.11.1+cu128", "torch==2.13.0")], "torchaudio 2.11.1+cu128"),
        ([("torchcodec", "0.17.0"), ("torchaudio", "2.13.0+cpu")], "torchcodec 0.17.0 ("),
    ],
)
def test_companions_beside_a_cpu_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, companions: list[tuple[str, ...]], wrong
) -> None:
    site = tmp_path / "site"
    _dist_info(site, "torch", "2.13.0+cpu")
    for name, version, *requires in companions:
        _dist_info(site, name, version, *requires)
    monkeypatch.syspath_prepend(str(site))
    findings = torch_build_findings()
    if wrong is None:
        assert findings == []
    else:
        [finding] = findings
        assert wrong in finding.problem and FIX in finding.fix and finding.severity == "error"
        assert "torch 2.13.0+cpu is a CPU build" in finding.problem


def test_a_cuda_torch_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    _dist_info(site, "torch", "2.14.1")
    _dist_info(site, "torchvision", "0.29.1", "torch==2.14.1")
    monkeypatch.syspath_prepend(str(site))
    assert torch_build_findings() == []


def _run(site: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-c", DRIVER, *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )


def _assert_stopped_before_vllm(proc: subprocess.CompletedProcess, rc: int) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == rc, out
    assert "IMPORTED []" in proc.stdout, out
    assert "torchvision 0.29.1 (not a +cpu build)" in out and FIX in out, out
    assert "Traceback" not in out, out
    return out


def test_serve_cpu_stops_with_the_fix(cuda_torchvision: Path) -> None:
    proc = _run(
        cuda_torchvision, "serve-cpu", str(PAIR / "target"), "--drafter", str(PAIR / "drafter")
    )
    out = _assert_stopped_before_vllm(proc, 2)
    assert out.startswith("IMPORTED") and "vllm-dspark serve-cpu: error: torch builds:" in out


def test_doctor_reports_it(cuda_torchvision: Path) -> None:
    spec = {"method": "dspark", "model": str(PAIR / "drafter"), "num_speculative_tokens": 7}
    proc = _run(cuda_torchvision, "doctor", "--speculative-config", json.dumps(spec), "--json")
    _assert_stopped_before_vllm(proc, 1)
    report = json.loads(proc.stdout.split("IMPORTED")[0])
    assert not report["ok"] and [f["where"] for f in report["findings"]] == ["torch builds"]


def test_the_demo_stops_with_the_fix(cuda_torchvision: Path, tmp_path: Path) -> None:
    proc = _run(cuda_torchvision, "demo", "--pair", str(PAIR), "--out", str(tmp_path / "out"))
    out = _assert_stopped_before_vllm(proc, 2)
    assert "make demo: error: torch builds:" in out and not (tmp_path / "out").exists()
