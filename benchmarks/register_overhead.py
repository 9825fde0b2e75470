# SPDX-License-Identifier: Apache-2.0
"""What the plugin adds to every vLLM process: ``import vllm_dspark`` + ``register()``.

vLLM calls ``register()`` in the API server, the engine core, every worker and its registry-inspection
subprocess, so its cost is paid many times per start. Each sample is a fresh interpreter that has
already imported vLLM's registry (as vLLM has when it loads plugins); the baseline is that import,
timed in the same interpreter, so the ratio is machine-independent. Goal: under 50 ms.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from benchmarks.common import format_table, median, write_result

_PROBE = """
import json, time
t0 = time.perf_counter()
import vllm
from vllm import ModelRegistry
from vllm.transformers_utils import config as _cfg
t1 = time.perf_counter()
import vllm_dspark
t2 = time.perf_counter()
vllm_dspark.register()
t3 = time.perf_counter()
vllm_dspark.register()
t4 = time.perf_counter()
print(json.dumps({"vllm_import_s": t1 - t0, "plugin_import_s": t2 - t1, "register_s": t3 - t2, "register_again_s": t4 - t3}))
"""


def run(samples: int = 5) -> dict:
    rows = []
    for _ in range(samples):
        out = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    summary = {k: median([r[k] for r in rows]) for k in rows[0]}
    summary["plugin_total_ms"] = 1e3 * (summary["plugin_import_s"] + summary["register_s"])
    summary["ratio_to_vllm_import"] = (
        summary["plugin_import_s"] + summary["register_s"]
    ) / summary["vllm_import_s"]
    summary["goal_ms"] = 50.0
    summary["meets_goal"] = summary["plugin_total_ms"] < summary["goal_ms"]
    return {"samples": rows, "median": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks register",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--samples", type=int, default=5, help="fresh interpreters to time (median reported)"
    )
    args = parser.parse_args(argv)
    result = run(args.samples)
    m = result["median"]
    row = {
        "import vllm (baseline) ms": 1e3 * m["vllm_import_s"],
        "import vllm_dspark ms": 1e3 * m["plugin_import_s"],
        "register() ms": 1e3 * m["register_s"],
        "second register() ms": 1e3 * m["register_again_s"],
        "plugin / baseline": m["ratio_to_vllm_import"],
        "goal < 50 ms": "met" if m["meets_goal"] else "MISSED",
    }
    table = format_table([row], list(row))
    write_result("register_overhead", result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
