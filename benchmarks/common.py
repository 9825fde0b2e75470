# SPDX-License-Identifier: Apache-2.0
"""What every benchmark shares: paired timing against a baseline, bandwidth, and result files.

These machines are noisy and shared, so no figure stands alone: :func:`paired` runs a step and its
baseline in turn (A B A B ...) after a warm-up pair, and reports the median ratio with its min and
max over at least :data:`MIN_PAIRS` pairs; every run is kept in the result. :func:`rounds` is the
same for several steps measured together with one baseline. A goal is met only if the worst pair
meets it (:func:`meets`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from vllm_dspark.safety import staged

# Smoke tests point this elsewhere so that a tiny-preset run never overwrites committed results.
RESULTS_DIR = Path(os.environ.get("VLLM_DSPARK_BENCH_RESULTS", Path(__file__).parent / "results"))


MIN_PAIRS = 5  # what a committed result must hold; smoke runs may ask for fewer

Measurement = dict[str, Any]  # one run: "seconds" plus whatever else the step reports


def spread(values: Sequence[float]) -> dict[str, float]:
    """``{median, min, max}`` of ``values``."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def rounds(
    measure: Callable[[], dict[str, Measurement]],
    baseline: str,
    *,
    pairs: int = MIN_PAIRS,
    warmup: int = 1,
    progress: str | None = None,
) -> dict[str, Any]:
    """Call ``measure`` ``warmup`` times untimed, then ``pairs`` times; each call measures some steps
    and their ``baseline`` back to back (``{name: measurement}``), and each step's ratio to the
    baseline is taken within its own call.

    Returns every run (``runs``, warm-ups marked) and, over the timed runs, the median / min / max
    of each step's ratio (``ratio``) and of every measurement's seconds (``seconds``).
    """
    if pairs < 1:
        raise ValueError(f"pairs must be at least 1, got {pairs}")
    runs = []
    for i in range(warmup + pairs):
        measured = measure()
        base = measured[baseline]["seconds"]
        ratio = {k: m["seconds"] / base for k, m in measured.items() if k != baseline}
        runs.append({"warmup": i < warmup, "measured": measured, "ratio": ratio})
        if progress:
            kind = "warm-up" if i < warmup else f"pair {i - warmup + 1}/{pairs}"
            times = ", ".join(f"{k} {m['seconds']:.4g} s" for k, m in measured.items())
            ratios = ", ".join(f"{k} {r:.3f}x" for k, r in ratio.items())
            print(
                f"{progress} {kind}: {times}; vs {baseline}: {ratios}", file=sys.stderr, flush=True
            )
    timed_runs = [r for r in runs if not r["warmup"]]
    return {
        "pairs": pairs,
        "warmup": warmup,
        "ratio": {k: spread([r["ratio"][k] for r in timed_runs]) for k in runs[0]["ratio"]},
        "seconds": {
            k: spread([r["measured"][k]["seconds"] for r in timed_runs])
            for k in runs[0]["measured"]
        },
        "runs": runs,
    }


def paired(
    step: Callable[[], Measurement],
    baseline: Callable[[], Measurement],
    *,
    pairs: int = MIN_PAIRS,
    warmup: int = 1,
    progress: str | None = None,
) -> dict[str, Any]:
    """:func:`rounds` of one step and its baseline: step, baseline, step, baseline, ...

    Returns every run (``runs``: each with its ``step`` and ``baseline`` measurement and their
    ``ratio``, step / baseline) and the median / min / max of the ratio and of each side's seconds.
    """
    return paired_result(
        rounds(
            lambda: {"step": step(), "baseline": baseline()},
            "baseline",
            pairs=pairs,
            warmup=warmup,
            progress=progress,
        )
    )


def paired_result(result: dict[str, Any]) -> dict[str, Any]:
    """:func:`paired`'s result from a :func:`rounds` result over a ``step`` and its ``baseline``."""
    return {
        "pairs": result["pairs"],
        "warmup": result["warmup"],
        "ratio": result["ratio"]["step"],
        "step_seconds": result["seconds"]["step"],
        "baseline_seconds": result["seconds"]["baseline"],
        "runs": [
            {"warmup": r["warmup"], **r["measured"], "ratio": r["ratio"]["step"]}
            for r in result["runs"]
        ],
    }


def add_pairing_arguments(
    parser: argparse.ArgumentParser, unit: str = "pairs", per: str = ""
) -> None:
    """``--pairs`` (timed, default :data:`MIN_PAIRS`) and ``--warmup`` (untimed first, default 1)."""
    parser.add_argument("--pairs", type=int, default=MIN_PAIRS, help=f"timed {unit}{per}")
    parser.add_argument("--warmup", type=int, default=1, help=f"untimed {unit} first")


def meets(result: dict[str, Any], limit: float) -> bool:
    """Whether a :func:`paired` result meets "step within ``limit`` x baseline": its worst pair must."""
    return result["ratio"]["max"] <= limit


def timed(fn: Callable[[], Any]) -> Callable[[], Measurement]:
    """``fn`` as a step: each call runs it once in this process and returns its wall seconds."""

    def run() -> Measurement:
        start = time.perf_counter()
        fn()
        return {"seconds": time.perf_counter() - start}

    return run


def interleaved(
    fns: dict[str, Callable[[], Any]], min_seconds: float
) -> Callable[[], dict[str, Measurement]]:
    """One run of several calls taken in turn, call by call (a, b, a, b, ...), until ``min_seconds``
    have passed: each one's median wall seconds per call. A drift in the machine's speed within the
    run (a frequency step) then reaches every call alike, not one side of a pair, and a single
    stalled call (a neighbour's burst, a page fault) moves a mean but not the median."""

    def run() -> dict[str, Measurement]:
        spent: dict[str, list[float]] = {name: [] for name in fns}
        start = time.perf_counter()
        while True:
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                spent[name].append(time.perf_counter() - t0)
            if time.perf_counter() - start >= min_seconds:
                return {
                    name: {
                        "seconds": statistics.median(s),
                        "mean_seconds": statistics.fmean(s),
                        "calls": len(s),
                    }
                    for name, s in spent.items()
                }

    return run


def in_subprocess(argv: Sequence[str]) -> Callable[[], Measurement]:
    """A step run in a fresh interpreter (``python ARGV``): the JSON object its last line prints."""

    def run() -> Measurement:
        out = subprocess.run([sys.executable, *argv], check=True, capture_output=True, text=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    return run


# Spawns ARGV from a stdlib-only interpreter (so the child's peak RSS carries no large parent image)
# and reports its wall time and peak RSS as one JSON line.
_LAUNCHER = """
import json, os, sys, time
t0 = time.perf_counter()
pid = os.posix_spawnp(sys.argv[1], sys.argv[1:], os.environ)
_, status, usage = os.wait4(pid, 0)
seconds = time.perf_counter() - t0
print(json.dumps({"seconds": seconds, "peak_rss_bytes": usage.ru_maxrss * 1024,
                  "exit": os.waitstatus_to_exitcode(status)}))
"""


def whole_process(argv: Sequence[str]) -> Callable[[], Measurement]:
    """``argv`` run as a user runs it, a whole process: its wall time (interpreter start and
    imports included) and its own peak RSS. Its output is discarded; a non-zero exit raises."""

    def run() -> Measurement:
        out = subprocess.run(
            [sys.executable, "-c", _LAUNCHER, *argv], check=True, capture_output=True, text=True
        )
        measured = json.loads(out.stdout.strip().splitlines()[-1])
        if measured.pop("exit"):
            raise SystemExit(f"{' '.join(argv)} failed:\n{out.stderr[-3000:]}")
        return measured

    return run


def spread_text(s: dict[str, float], fmt: str = ".2f", unit: str = "") -> str:
    """``median (min–max)`` for a README cell."""
    return f"{s['median']:{fmt}}{unit} ({s['min']:{fmt}}–{s['max']:{fmt}}{unit})"


def best_time(fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1) -> float:
    """Best wall time of ``fn()`` in seconds over ``repeats`` runs (the least-disturbed one)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def memcpy_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Achieved copy bandwidth in GB/s (bytes read + bytes written), measured now."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    seconds = best_time(lambda: dst.copy_(src), repeats=repeats)
    return 2 * nbytes / seconds / 1e9


def existing_dir(text: str) -> Path:
    """An argparse type: a directory that exists (scratch space is made inside it, never it)."""
    path = Path(text).expanduser()
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"{text} {what}; pass an existing directory")
    return path


def add_drafter_arguments(parser: argparse.ArgumentParser) -> None:
    """``--preset`` and ``--model``: the drafter :func:`preset_drafter` resolves from them."""
    from vllm_dspark.checkpoint.presets import PRESETS

    parser.add_argument(
        "--preset",
        choices=list(PRESETS),
        default="k3",
        help="the drafter's preset (default k3, the published shapes)",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a BF16 drafter of --preset, with target/ (default /tmp/k3 for k3, "
        "/tmp/vllm-dspark-PRESET otherwise; a random one is written there if missing)",
    )


def preset_drafter(path: Path | None, preset: str) -> Path:
    """The drafter to measure: ``path``, or the preset's shared random drafter (written if missing:
    ``make-random --seed 0``, in ``/tmp/k3`` for k3), refusing one of other shapes."""
    from vllm_dspark.checkpoint.presets import preset_config_json
    from vllm_dspark.checkpoint.store import read_config_json

    path = path or Path("/tmp/k3" if preset == "k3" else f"/tmp/vllm-dspark-{preset}")
    if not (path / "config.json").exists():
        from vllm_dspark.checkpoint_tools.make_random import make_random

        print(
            f"{path} does not exist: writing a random {preset} drafter there (make-random --seed 0)"
        )
        return make_random(path, preset, seed=0)
    found, wanted = read_config_json(path), preset_config_json(preset)
    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
    if any(found.get(k) != wanted[k] for k in sizes):
        raise SystemExit(
            f"{path} is not a {preset} drafter ({', '.join(f'{k}={found.get(k)}' for k in sizes)}); "
            "pass --model for a drafter of that preset, or the --preset it was made with"
        )
    return path


def environment() -> dict[str, Any]:
    import torch

    from vllm_dspark.reference.gemm import native_bf16_gemm

    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "processor": platform.processor(),
        # BF16 GEMMs run many times slower on CPUs without AVX-512: say which this was.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_gemm": "oneDNN" if native_bf16_gemm() else "FP32 GEMM of the BF16 values",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A GitHub-markdown table of ``rows`` restricted to ``columns``."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_result(
    name: str,
    payload: dict[str, Any],
    table: str,
    out_dir: Path | None = None,
    measured_in: dict[str, Any] | None = None,
) -> Path:
    """Write ``<name>.json`` (payload + environment) and ``<name>.md`` (the table); print the table.

    ``measured_in`` is the environment of a run re-rendered from its report (default: this one).
    """
    out_dir = RESULTS_DIR if out_dir is None else out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "environment": measured_in or environment(), **payload}
    path = out_dir / f"{name}.json"
    for target, text in ((path, json.dumps(payload, indent=2)), (out_dir / f"{name}.md", table)):
        with staged(target, directory=False) as staging:  # a killed run leaves the old result whole
            staging.write_text(text + "\n")
    print(table)
    return path
