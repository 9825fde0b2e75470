# SPDX-License-Identifier: Apache-2.0
"""Smoke test of every benchmark at the tiny preset, and of the generated tables (README, docs/benchmarks.md).

Each benchmark runs end to end through ``python -m benchmarks NAME`` and must write its JSON and
table; results go to a temporary directory so committed results are never overwritten. Speed is not
asserted here (that is what the benchmarks are for), but every derived figure, in the smoke runs'
results and in the committed ones the README shows, is checked against arithmetic done here on the
result's raw measurements.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.common import MIN_PAIRS, interleaved, meets, paired, rounds, spread, spread_text
from benchmarks.registry import BENCHMARKS
from tests.support.bench_smoke import RENDERED, SMOKE_ARGS
from tests.support.child import run_script

ROOT = Path(__file__).resolve().parents[2]

# Smoke-run where their input already exists: e2e-cpu tabulates the end-to-end run of
# tests/serving/test_dspark_serving.py, which takes minutes to make.
SMOKED_ELSEWHERE = {"e2e-cpu"}


def _close(actual: float, expected: float, what: str) -> None:
    assert math.isclose(actual, expected, rel_tol=1e-9), f"{what}: {actual} != {expected}"


def check_paired(result: dict, *, committed: bool) -> None:
    """A :func:`benchmarks.common.paired` result: every pair's ratio and the spreads, from its runs."""
    runs = result["runs"]
    assert len(runs) == result["warmup"] + result["pairs"]
    assert [r["warmup"] for r in runs] == [True] * result["warmup"] + [False] * result["pairs"]
    if committed:
        assert result["pairs"] >= MIN_PAIRS
    for r in runs:
        _close(r["ratio"], r["step"]["seconds"] / r["baseline"]["seconds"], "pair ratio")
    timed = [r for r in runs if not r["warmup"]]
    for key, values in (
        ("ratio", [r["ratio"] for r in timed]),
        ("step_seconds", [r["step"]["seconds"] for r in timed]),
        ("baseline_seconds", [r["baseline"]["seconds"] for r in timed]),
    ):
        assert result[key] == {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
        }, key


def check_rounds(result: dict, baseline: str, *, committed: bool) -> None:
    """A :func:`benchmarks.common.rounds` result: every ratio and every spread, from its runs."""
    runs = result["runs"]
    assert [r["warmup"] for r in runs] == [True] * result["warmup"] + [False] * result["pairs"]
    if committed:
        assert result["pairs"] >= MIN_PAIRS
    for r in runs:
        assert set(r["ratio"]) == set(r["measured"]) - {baseline}
        for step, ratio in r["ratio"].items():
            base = r["measured"][baseline]["seconds"]
            _close(ratio, r["measured"][step]["seconds"] / base, f"{step} ratio")
    timed = [r for r in runs if not r["warmup"]]
    for step in runs[0]["ratio"]:
        assert result["ratio"][step] == spread([r["ratio"][step] for r in timed]), step
    for step in runs[0]["measured"]:
        values = [r["measured"][step]["seconds"] for r in timed]
        assert result["seconds"][step] == spread(values), step


def check_arithmetic(name: str, result: dict, *, committed: bool = True) -> None:
    """The derived figures of benchmark result ``name``, recomputed from its raw measurements."""
    if name == "fp8_linear":
        rows = result["rows"]
        assert rows
        for row in rows:
            n, k = map(int, row["shape"].split("x"))
            _close(
                row["GB/s"],
                n * k * 2 / (row["ms"] / 1e3) / 1e9,
                f"{row['module']} {row['path']} GB/s",
            )
            if row["path"] == "bf16":
                assert row["paired"] is None and row["vs bf16"] == "1"
                continue
            paired_result = row["paired"]
            check_paired(paired_result, committed=committed)
            _close(row["ms"], 1e3 * paired_result["step_seconds"]["median"], "ms")
            assert row["vs bf16"] == spread_text(paired_result["ratio"], unit="×")
    elif name == "quantizer":
        check_paired(result, committed=committed)
        for r in result["runs"]:
            for step in (r["step"], r["baseline"]):
                _close(
                    step["input_gb_per_s"],
                    result["input_bytes"] / step["seconds"] / 1e9,
                    "input GB/s",
                )
        assert result["quantize_vs_copy"] == result["ratio"]
        assert result["meets_goal"] == (result["ratio"]["max"] <= result["goal_ratio"])
        timed = [r for r in result["runs"] if not r["warmup"]]
        assert result["quantize_peak_rss_bytes"] == max(r["step"]["peak_rss_bytes"] for r in timed)
        q = result["quantization"]
        _close(
            q["fraction_quantized"], q["params_quantized"] / q["params_total"], "fraction_quantized"
        )
        _close(q["gib_after"], q["bytes_after"] / 2**30, "gib_after")
        assert q["bytes_before"] == result["input_bytes"]
    elif name == "register_overhead":
        check_paired(result, committed=committed)
        for r in result["runs"]:
            step = r["step"]
            _close(step["seconds"], step["plugin_import_s"] + step["register_s"], "plugin seconds")
        _close(result["worst_ms"], 1e3 * result["step_seconds"]["max"], "worst_ms")
        assert result["meets_goal"] == (result["worst_ms"] < result["goal_ms"])
    elif name == "check_startup":
        check_rounds(result, "python -c pass", committed=committed)
        _close(result["worst_s"], result["seconds"]["vllm-dspark check"]["max"], "worst_s")
        assert result["meets_goal"] == (result["worst_s"] < result["goal_s"])
    elif name == "reference_latency":
        assert result["weight_bytes_per_block"] == sum(result["weight_bytes_by_component"].values())
        for row in result["results"]:
            check_paired(row, committed=committed)
            seconds = row["step_seconds"]["median"]
            _close(row["ms_per_token"], seconds * 1e3 / result["block_size"], "ms_per_token")
            _close(row["weight_GBps"], result["weight_bytes_per_block"] / seconds / 1e9, "GB/s")
            assert row["meets_goal"] == (row["ratio"]["max"] <= row["goal_ratio"])
            for r in row["runs"]:
                _close(
                    r["baseline"]["seconds"],
                    r["baseline"]["memcpy_seconds"]
                    * result["weight_bytes_per_block"]
                    / (2 * result["memcpy_bytes"]),
                    "streaming seconds",
                )
    elif name == "drift_speed":
        assert [r["variant"] for r in result["results"]] == ["bf16", "fp8"]
        for row in result["results"]:
            check_paired(row, committed=committed)
            for side, key in (("step", "variant"), ("baseline", "reference")):
                _close(
                    row[f"{key}_blocks_per_s"],
                    result["batch_size"] / row[f"{side}_seconds"]["median"],
                    f"{row['variant']} {key} blocks/s",
                )
    elif name in ("drift", "drift_positions"):
        timing, config = result["timing"], result["config"]
        evaluated = (
            config["blocks"]
            * len(config["regimes"])
            * len(config["positions"])
            * len(config["variants"])
        )
        eval_s = sum(v for k, v in timing.items() if k.startswith("eval_"))
        _close(timing["blocks_per_s"], evaluated / eval_s, "blocks_per_s")
        recorded = timing["passes"]
        assert list(recorded["variants"]) == config["variants"]
        batches = [recorded["reference"], *recorded["variants"].values()]
        # Each pass's batches lie within its wall time (loads and inputs are outside them).
        walls = [timing["reference_s"]] + [timing[f"eval_{v}_s"] for v in config["variants"]]
        extra = 0.0
        for row, record, wall in zip(result["passes"], batches, walls, strict=True):
            assert sum(record["blocks"]) == row["blocks"] == evaluated / len(config["variants"])
            _close(row["seconds"], sum(record["seconds"]), f"{row['pass']} seconds")
            assert row["seconds"] <= wall
            rates = [s / b for s, b in zip(record["seconds"], record["blocks"])]
            assert row["s_per_block"]["max"] == max(rates)
            assert row["s_per_block"]["min"] == min(rates)
            extra += max(rates) * row["blocks"] - row["seconds"]
        _close(result["slowest_case_s"], timing["total_s"] + extra, "slowest_case_s")
    elif name == "pair":
        assert result["rows"]
        # The results name their inputs by paths that hold on any clone: no temporary files.
        for path in (result["pair"], result["accept_config"]["prompts"]):
            assert not Path(path).is_absolute(), path
        assert result["eval_config"]["corpus_source"] == result["accept_config"]["prompts"]
        for row in result["rows"]:
            for key, over in row["overestimate"].items():
                _close(over, row[key]["value"] - row["tau"]["value"], f"{row['variant']} {key}")
            assert len(row["lossless"]) == result["accept_config"]["num_prompts"]
        check_rounds(result["accept_timing"], "target greedy", committed=committed)
        # Seeded: every accept run reproduces the committed figures.
        assert result["figures_identical"] is True
    elif name == "e2e_cpu":
        check_rounds(result, "baseline", committed=committed)
        timed = [r["measured"] for r in result["runs"] if not r["warmup"]]
        labels = {row["engine"]: row for row in result["rows"]}
        assert len(labels) == len(timed[0])
        for engine, row in zip(timed[0], result["rows"]):
            _close(
                row["output tok/s (median)"],
                row["output tokens"] / result["seconds"][engine]["median"],
                f"{row['engine']} tok/s",
            )
            assert row["output tokens"] == timed[0][engine]["output_tokens"]
            if row["drafts"] != "-":
                per_position = [int(v) for v in row["accepted per position"].split()]
                assert (
                    len(per_position) == result["settings"]["block"]
                    and sum(per_position) == row["accepted"]
                )
                assert row["draft tokens"] == row["drafts"] * result["settings"]["block"]

        def counted(run: dict) -> dict:
            return {e: (m["counters"], m["output_tokens"]) for e, m in run.items()}

        assert result["counters_identical"] == all(counted(t) == counted(timed[0]) for t in timed)
    elif name == "draft_bytes":
        from benchmarks.draft_bytes import IN_TREE, MARKOV_W2, STEP_GROUPS, VARIANTS

        for build in result["builds"].values():
            per_rank = build["bytes_per_rank"]
            assert set(per_rank) == set(VARIANTS)
            for v in VARIANTS:
                step = sum(per_rank[v][g] for g in STEP_GROUPS)
                assert build["step_bytes"][v] == step
                with_markov = step + result["positions"] * per_rank[v][MARKOV_W2]
                assert build["step_with_markov_bytes"][v] == with_markov
                _close(build["ratio_vs_in_tree"][v], step / build["step_bytes"][IN_TREE], v)
                _close(
                    build["ratio_with_markov_vs_in_tree"][v],
                    with_markov / build["step_with_markov_bytes"][IN_TREE],
                    v,
                )
                _close(build["context_proj_share"][v], per_rank[v]["context_proj"] / step, v)
    elif name == "context_sweep":
        from vllm_dspark.drift.context_sweep import break_even_length
        from vllm_dspark.ops.speculation_cost import StepCost, break_even_context

        assert not Path(result["pair"]).is_absolute()
        config = result["config"]
        cost = StepCost(config["cost"]["fixed"], config["cost"]["per_context_token"])
        for cell in result["cells"]:
            _close(cell["break_even_tau"], cost.ratio(cell["context"]), "break-even τ")
            assert cell["pays"] == (cell["tau"]["value"] > cell["break_even_tau"])
            _close(cell["pays_up_to"], break_even_context(cost, cell["tau"]["value"]), "pays up to")
        for label, be in result["break_even"].items():
            cells = [c for c in result["cells"] if c["variant"] == label]
            assert [c["context"] for c in cells] == config["lengths"]
            taus = [c["tau"]["value"] for c in cells]
            assert be["measured"] == break_even_length(config["lengths"], taus, cost)
    elif name == "draft_kv":
        from benchmarks.draft_kv import KV, WEIGHTS

        assert not Path(result["pair"]).is_absolute()
        assert not Path(result["accept_config"]["prompts"]).is_absolute()
        assert [r["weights"] for r in result["rows"]] == list(WEIGHTS)
        calibrated = result["rows"][0]["k_scales"]["fp8 calibrated"]
        assert (
            calibrated and all(s > 0 for s in calibrated) and calibrated != [1.0] * len(calibrated)
        )
        for row in result["rows"]:
            assert set(row["tau"]) == set(row["lossless"]) == {kv for kv, _ in KV}
            for lossless in row["lossless"].values():
                assert len(lossless) == result["accept_config"]["num_prompts"]
            assert row["k_scales"]["bf16"] is None
            assert row["k_scales"]["fp8 at 1.0"] == [1.0] * len(calibrated)
            # Both builds carry the one calibration (the BF16 one is given the FP8 build's shard).
            assert row["k_scales"]["fp8 calibrated"] == calibrated
    else:
        raise AssertionError(f"no arithmetic check for benchmark result {name!r}: add one")


@pytest.mark.parametrize("name", sorted({b.result for b in BENCHMARKS.values()}))
def test_committed_results_are_their_own_arithmetic(name: str) -> None:
    check_arithmetic(
        name, json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())
    )


def test_every_benchmark_has_a_smoke_run() -> None:
    assert set(BENCHMARKS) == set(SMOKE_ARGS) | SMOKED_ELSEWHERE


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every smoke run, in one child process (``tests/support/bench_smoke.py``); their output folder."""
    out = tmp_path_factory.mktemp("bench_smoke")
    run_script("tests.support.bench_smoke", out, timeout=1800)
    return out


@pytest.mark.parametrize("name", list(SMOKE_ARGS))
def test_benchmark_runs_at_the_tiny_preset(smoke_runs: Path, name: str) -> None:
    out = smoke_runs
    codes = json.loads((out / "exit_codes.json").read_text())
    stdout = (out / f"{name}.stdout").read_text()
    assert codes[name] == 0, stdout[-4000:]
    result_name = BENCHMARKS[name].result
    result = json.loads((out / f"{result_name}.json").read_text())
    assert result["benchmark"] == result_name
    assert "environment" in result
    check_arithmetic(result_name, result, committed=False)
    table = (out / f"{result_name}.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert len(rows) >= 3, table  # header, separator and at least one row
    assert rows[0] in stdout  # the table is printed too
    if name == "drift-speed":
        assert "time vs reference" in table and not (out / "drift_speed").exists()
    if name.startswith("drift") and name != "drift-speed":
        assert name in RENDERED and (out / result_name / "results.json").exists()
        # --render rewrites the headline from the report alone, byte for byte.
        assert codes[f"{name} --render"] == 0
        kept = sorted((out / "before-render").glob(f"{result_name}.*"))
        assert kept
        assert {p.name: p.read_bytes() for p in kept} == {
            p.name: (out / p.name).read_bytes() for p in kept
        }


def test_readme_benchmark_section_is_generated_from_committed_results() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "readme", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr


def _recorder(log: list[str], name: str, seconds: list[float]):
    """A cheap step that logs its calls and reports the next of ``seconds``."""
    it = iter(seconds)

    def step() -> dict:
        log.append(name)
        return {"seconds": next(it)}

    return step


def test_paired_alternates_step_and_baseline_after_the_warmup() -> None:
    log: list[str] = []
    result = paired(
        _recorder(log, "A", [9.0, 2, 3, 4, 5, 6]),
        _recorder(log, "B", [1.0, 1, 2, 1, 1, 2]),
        pairs=5,
        warmup=1,
    )
    assert log == ["A", "B"] * 6
    assert [r["warmup"] for r in result["runs"]] == [True] + [False] * 5
    # The warm-up pair (9x) is kept in the runs but not in the figures.
    assert [r["ratio"] for r in result["runs"]] == [9.0, 2.0, 1.5, 4.0, 5.0, 3.0]
    assert result["ratio"] == {"median": 3.0, "min": 1.5, "max": 5.0}
    assert result["step_seconds"] == {"median": 4, "min": 2, "max": 6}
    assert result["baseline_seconds"] == {"median": 1, "min": 1, "max": 2}
    check_paired(result, committed=True)


def test_rounds_take_each_ratio_within_its_own_round() -> None:
    seconds = iter([(4.0, 1.0, 8.0), (3.0, 1.0, 2.0), (6.0, 2.0, 2.0), (2.0, 2.0, 9.0)])

    def measure() -> dict:
        a, b, base = next(seconds)
        return {"a": {"seconds": a}, "b": {"seconds": b}, "base": {"seconds": base}}

    result = rounds(measure, "base", pairs=3, warmup=1)
    # The warm-up round (a 0.5x, b 0.125x) is kept in the runs but not in the figures.
    assert [r["ratio"] for r in result["runs"]] == [
        {"a": 0.5, "b": 0.125},
        {"a": 1.5, "b": 0.5},
        {"a": 3.0, "b": 1.0},
        {"a": 2 / 9, "b": 2 / 9},
    ]
    assert result["ratio"]["a"] == {"median": 1.5, "min": 2 / 9, "max": 3.0}
    assert result["seconds"]["base"] == {"median": 2.0, "min": 2.0, "max": 9.0}
    check_rounds(result, "base", committed=False)
    with pytest.raises(ValueError, match="pairs must be at least 1"):
        rounds(measure, "base", pairs=0)


def test_spread_of_an_even_count_takes_the_middle_pair_mean() -> None:
    assert spread([4.0, 1.0, 3.0, 2.0]) == {"median": 2.5, "min": 1.0, "max": 4.0}


def test_a_goal_is_met_only_if_the_worst_pair_meets_it() -> None:
    log: list[str] = []
    result = paired(
        _recorder(log, "A", [1.0, 1.0, 1.0, 1.0, 1.0, 1.4]),
        _recorder(log, "B", [1.0] * 6),
        pairs=5,
    )
    assert result["ratio"]["median"] == 1.0  # the median meets 1.3x ...
    assert not meets(result, 1.3)  # ... but one pair took 1.4x
    assert meets(result, 1.4)


def test_paired_timed_steps_in_this_process() -> None:
    from benchmarks.common import timed

    log: list[str] = []
    result = paired(timed(lambda: log.append("A")), timed(lambda: log.append("B")), pairs=2)
    assert log == ["A", "B"] * 3
    assert all(r["step"]["seconds"] >= 0 and r["baseline"]["seconds"] > 0 for r in result["runs"])
    with pytest.raises(ValueError, match="pairs must be at least 1"):
        paired(timed(lambda: None), timed(lambda: None), pairs=0)


def test_interleaved_takes_calls_in_turn_and_a_stalled_call_moves_the_mean_not_the_median() -> None:
    log: list[str] = []

    def stalls_once() -> None:
        log.append("A")
        if len(log) == 1:
            time.sleep(0.1)

    measured = interleaved({"a": stalls_once, "b": lambda: log.append("B")}, 0.2)()
    assert log == ["A", "B"] * (len(log) // 2)
    assert measured["a"]["calls"] == measured["b"]["calls"] == len(log) // 2 > 2
    assert measured["a"]["mean_seconds"] >= 0.1 / measured["a"]["calls"]
    assert measured["a"]["seconds"] < 0.01  # the median: the one 100 ms call is an outlier
