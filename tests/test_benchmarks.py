# SPDX-License-Identifier: Apache-2.0
"""Smoke test of every benchmark at the tiny preset, and of the README's generated section.

Each benchmark runs end to end through ``python -m benchmarks NAME`` and must write its JSON and
table; results go to a temporary directory so committed results are never overwritten. Speed is not
asserted here (that is what the benchmarks are for), but every derived figure, in the smoke runs'
results and in the committed ones the README shows, is checked against arithmetic done here on the
result's raw measurements.
"""

from __future__ import annotations

import json
import math
import os
import statistics
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
    "pair": ["--prompts", "2", "--max-tokens", "4", "--blocks", "4"],
}


# Smoke-run where their input already exists: e2e-cpu tabulates the end-to-end run of
# tests/test_dspark_serving.py, which takes minutes to make.
SMOKED_ELSEWHERE = {"e2e-cpu"}


def _close(actual: float, expected: float, what: str) -> None:
    assert math.isclose(actual, expected, rel_tol=1e-9), f"{what}: {actual} != {expected}"


def check_arithmetic(name: str, result: dict) -> None:
    """The derived figures of benchmark result ``name``, recomputed from its raw measurements."""
    if name == "fp8_linear":
        rows = result["rows"]
        assert rows
        for row in rows:
            n, k = map(int, row["shape"].split("x"))
            key = (row["module"], row["tokens"], "bf16")
            (bf16,) = [r for r in rows if (r["module"], r["tokens"], r["path"]) == key]
            _close(row["vs bf16"], row["ms"] / bf16["ms"], f"{row['module']} {row['path']} vs bf16")
            _close(
                row["GB/s"],
                n * k * 2 / (row["ms"] / 1e3) / 1e9,
                f"{row['module']} {row['path']} GB/s",
            )
    elif name == "quantizer":
        for step in ("copy", "quantize"):
            _close(
                result[step]["input_gb_per_s"],
                result["input_bytes"] / result[step]["seconds"] / 1e9,
                step,
            )
        _close(
            result["quantize_vs_copy_seconds"],
            result["quantize"]["seconds"] / result["copy"]["seconds"],
            "ratio",
        )
        q = result["quantization"]
        _close(
            q["fraction_quantized"], q["params_quantized"] / q["params_total"], "fraction_quantized"
        )
        _close(q["gib_after"], q["bytes_after"] / 2**30, "gib_after")
        assert q["bytes_before"] == result["input_bytes"]
    elif name == "register_overhead":
        median = result["median"]
        for key in result["samples"][0]:
            _close(
                median[key], statistics.median(s[key] for s in result["samples"]), f"median {key}"
            )
        plugin_s = median["plugin_import_s"] + median["register_s"]
        _close(median["plugin_total_ms"], 1e3 * plugin_s, "plugin_total_ms")
        _close(
            median["ratio_to_vllm_import"],
            plugin_s / median["vllm_import_s"],
            "ratio_to_vllm_import",
        )
        assert median["meets_goal"] == (1e3 * plugin_s < median["goal_ms"])
    elif name == "reference_latency":
        assert result["weight_bytes_per_block"] == sum(result["weight_bytes_by_component"].values())
        for row in result["results"]:
            _close(row["ms_per_token"], row["seconds"] * 1e3 / result["block_size"], "ms_per_token")
            _close(
                row["weight_GBps"],
                result["weight_bytes_per_block"] / row["seconds"] / 1e9,
                "weight_GBps",
            )
            _close(
                row["fraction_of_memcpy"],
                row["weight_GBps"] / result["memcpy_GBps"],
                "fraction_of_memcpy",
            )
    elif name in ("drift", "drift_positions", "drift_speed"):
        timing, config = result["timing"], result["config"]
        evaluated = (
            config["blocks"]
            * len(config["regimes"])
            * len(config["positions"])
            * len(config["variants"])
        )
        eval_s = sum(v for k, v in timing.items() if k.startswith("eval_"))
        _close(timing["blocks_per_s"], evaluated / eval_s, "blocks_per_s")
    elif name == "pair":
        assert result["rows"]
        for row in result["rows"]:
            for key, over in row["overestimate"].items():
                _close(over, row[key]["value"] - row["tau"]["value"], f"{row['variant']} {key}")
            assert len(row["lossless"]) == result["accept_config"]["num_prompts"]
    elif name == "e2e_cpu":
        for row in result["rows"]:
            _close(
                row["output tok/s"],
                row["output tokens"] / row["generate s"],
                f"{row['engine']} tok/s",
            )
            if row["drafts"] != "-":
                per_position = [int(v) for v in row["accepted per position"].split()]
                assert (
                    len(per_position) == result["settings"]["block"]
                    and sum(per_position) == row["accepted"]
                )
                assert row["draft tokens"] == row["drafts"] * result["settings"]["block"]
    else:
        raise AssertionError(f"no arithmetic check for benchmark result {name!r}: add one")


@pytest.mark.parametrize("name", sorted({b.result for b in BENCHMARKS.values()}))
def test_committed_results_are_their_own_arithmetic(name: str) -> None:
    check_arithmetic(
        name, json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())
    )


def test_every_benchmark_has_a_smoke_run() -> None:
    assert set(BENCHMARKS) == set(SMOKE_ARGS) | SMOKED_ELSEWHERE


@pytest.mark.parametrize("name", list(SMOKE_ARGS))
def test_benchmark_runs_at_the_tiny_preset(name: str, tmp_path: Path) -> None:
    env = dict(os.environ, VLLM_DSPARK_BENCH_RESULTS=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", name, *SMOKE_ARGS[name]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    result_name = BENCHMARKS[name].result
    result = json.loads((tmp_path / f"{result_name}.json").read_text())
    assert result["benchmark"] == result_name
    assert "environment" in result
    check_arithmetic(result_name, result)
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
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "readme", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
