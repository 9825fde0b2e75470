# SPDX-License-Identifier: Apache-2.0
"""What every benchmark shares: a same-run bandwidth baseline, timing, and result files.

These machines are noisy, so no figure stands alone: each is a ratio against a baseline measured
in the same run, or an achieved bandwidth next to a memory-copy bandwidth measured in the same run.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

# Smoke tests point this elsewhere so that a tiny-preset run never overwrites committed results.
RESULTS_DIR = Path(os.environ.get("VLLM_DSPARK_BENCH_RESULTS", Path(__file__).parent / "results"))


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


def median(values: Sequence[float]) -> float:
    return statistics.median(values)
