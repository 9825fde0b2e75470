# SPDX-License-Identifier: Apache-2.0
"""Smoke test of every benchmark at the tiny preset, and of the README's generated section.

Each benchmark runs end to end through ``python -m benchmarks NAME`` and must write its JSON and
table; results go to a temporary directory so committed results are never overwritten. Speed is not
asserted here (that is what the benchmarks are for).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.registry import BENCHMARKS

ROOT = Path(__file__).resolve().parents[1]

SMOKE_ARGS: dict[str, list[str]] = {
    "reference": ["--preset", "tiny", "--repeats", "1", "--context-len", "8"],
    "fp8-linear": ["--preset", "tiny", "--repeats", "1"],
    "quantizer": ["--preset", "tiny"],
    "drift-speed": ["--preset", "tiny", "--blocks", "4"],
    "register": ["--samples", "1"],
    "drift": ["--preset", "tiny", "--blocks", "8"],
    "drift-positions": ["--preset", "tiny", "--blocks", "4"],
}


# Smoke-run where their input already exists: e2e-cpu tabulates the end-to-end run of
# tests/test_dspark_serving.py, which takes minutes to make.
SMOKED_ELSEWHERE = {"e2e-cpu"}


def test_every_benchmark_has_a_smoke_run() -> None:
    assert set(BENCHMARKS) == set(SMOKE_ARGS) | SMOKED_ELSEWHERE


@pytest.mark.parametrize("name", list(SMOKE_ARGS))
def test_benchmark_runs_at_the_tiny_preset(name: str, tmp_path: Path) -> None:
    env = dict(os.environ, VLLM_DSPARK_BENCH_RESULTS=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "benchmarks", name, *SMOKE_ARGS[name]], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    result_name = BENCHMARKS[name].result
    result = json.loads((tmp_path / f"{result_name}.json").read_text())
    assert result["benchmark"] == result_name
    assert "environment" in result
    table = (tmp_path / f"{result_name}.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert len(rows) >= 3, table  # header, separator and at least one row
    assert rows[0] in out.stdout  # the table is printed too
    if name == "drift-speed":
        assert "reference (FP32)" in table and not (tmp_path / "drift_speed").exists()
        assert result["timing"]["reference_s"] > 0
    if name.startswith("drift") and name != "drift-speed":
        assert (tmp_path / result_name / "results.json").exists()


def test_readme_benchmark_section_is_generated_from_committed_results() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks", "readme", "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
