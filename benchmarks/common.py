# SPDX-License-Identifier: Apache-2.0
"""What every benchmark shares: paired timing against a baseline, bandwidth, and result files.

These machines are noisy and shared, so no figure stands alone: :func:`paired` runs a step and its
baseline in turn (A B A B ...) after a warm-up pair, and reports the median ratio with its min and
max over at least :data:`MIN_PAIRS` pairs; every run is kept in the result. A goal is met only if
the worst pair meets it (:func:`meets`).
"""

from __future__ import annotations

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

# Smoke tests point this elsewhere so that a tiny-preset run never overwrites committed results.
RESULTS_DIR = Path(os.environ.get("VLLM_DSPARK_BENCH_RESULTS", Path(__file__).parent / "results"))


MIN_PAIRS = 5  # what a committed result must hold; smoke runs may ask for fewer

Measurement = dict[str, Any]  # one run: "seconds" plus whatever else the step reports


def spread(values: Sequence[float]) -> dict[str, float]:
    """``{median, min, max}`` of ``values``."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def paired(
    step: Callable[[], Measurement],
    baseline: Callable[[], Measurement],
    *,
    pairs: int = MIN_PAIRS,
    warmup: int = 1,
    progress: str | None = None,
) -> dict[str, Any]:
    """Run ``step`` then ``baseline``, ``warmup`` pairs untimed and then ``pairs`` timed pairs.

    Each call returns a measurement with its ``seconds``; the ratio of a pair is step / baseline.
    Returns every run (``runs``, warm-ups marked), and the median / min / max of the ratio and of
    each side's seconds over the timed pairs.
    """
    if pairs < 1:
        raise ValueError(f"pairs must be at least 1, got {pairs}")
    runs = []
    for i in range(warmup + pairs):
        a = step()
        b = baseline()
        runs.append(
            {"warmup": i < warmup, "step": a, "baseline": b, "ratio": a["seconds"] / b["seconds"]}
        )
        if progress:
            kind = "warm-up" if i < warmup else f"pair {i - warmup + 1}/{pairs}"
            print(
                f"{progress} {kind}: {a['seconds']:.4g} s vs {b['seconds']:.4g} s "
                f"= {runs[-1]['ratio']:.3f}x",
                file=sys.stderr,
                flush=True,
            )
    timed = [r for r in runs if not r["warmup"]]
    return {
        "pairs": pairs,
        "warmup": warmup,
        "ratio": spread([r["ratio"] for r in timed]),
        "step_seconds": spread([r["step"]["seconds"] for r in timed]),
        "baseline_seconds": spread([r["baseline"]["seconds"] for r in timed]),
        "runs": runs,
    }


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


def in_subprocess(argv: Sequence[str]) -> Callable[[], Measurement]:
    """A step run in a fresh interpreter (``python ARGV``): the JSON object its last line prints."""

    def run() -> Measurement:
        out = subprocess.run([sys.executable, *argv], check=True, capture_output=True, text=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

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


def environment() -> dict[str, Any]:
    import torch

    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "processor": platform.processor(),
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
    name: str, payload: dict[str, Any], table: str, out_dir: Path | None = None
) -> Path:
    """Write ``<name>.json`` (payload + environment) and ``<name>.md`` (the table); print the table."""
    out_dir = RESULTS_DIR if out_dir is None else out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "environment": environment(), **payload}
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    (out_dir / f"{name}.md").write_text(table + "\n")
    print(table)
    return path
