# SPDX-License-Identifier: Apache-2.0
"""What the plugin adds to every vLLM process: ``import vllm_dspark`` + ``register()``.

vLLM calls ``register()`` in the API server, the engine core, every worker and its registry-inspection
subprocess, so its cost is paid many times per start. Each run is a fresh interpreter: the step
imports vLLM's registry (as vLLM has when it loads plugins) and then times the plugin's import and
``register()``; its baseline, run in turn (:func:`benchmarks.common.paired`), times that vLLM import.
Goal: under 50 ms in every pair.

Then each command's start: ``vllm-dspark --help`` and ``vllm-dspark COMMAND --help`` timed as whole
processes, as a user runs them, paired with a bare interpreter start (``python -c pass``).
Goal: under 1 s in every pair.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.common import (
    MIN_PAIRS,
    add_pairing_arguments,
    format_table,
    in_subprocess,
    paired,
    spread_text,
    whole_process,
    write_result,
)
from vllm_dspark.tools.cli import COMMANDS

GOAL_MS = 50.0
HELP_GOAL_S = 1.0

_PROBE = """
import json, sys, time
t0 = time.perf_counter()
import vllm
from vllm import ModelRegistry
from vllm.transformers_utils import config as _cfg
t1 = time.perf_counter()
if sys.argv[1] == "vllm":
    print(json.dumps({"seconds": t1 - t0}))
    sys.exit(0)
import vllm_dspark
t2 = time.perf_counter()
vllm_dspark.register()
t3 = time.perf_counter()
vllm_dspark.register()
t4 = time.perf_counter()
print(json.dumps({"seconds": t3 - t1, "vllm_import_s": t1 - t0, "plugin_import_s": t2 - t1,
                  "register_s": t3 - t2, "register_again_s": t4 - t3}))
"""


def run(pairs: int = MIN_PAIRS, warmup: int = 1) -> dict:
    result = paired(
        in_subprocess(["-c", _PROBE, "plugin"]),
        in_subprocess(["-c", _PROBE, "vllm"]),
        pairs=pairs,
        warmup=warmup,
        progress="register",
    )
    worst_ms = 1e3 * result["step_seconds"]["max"]
    script = Path(sys.executable).with_name("vllm-dspark")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "vllm_dspark.tools.cli"]
    bare = whole_process([sys.executable, "-c", "pass"])
    help_starts = {
        " ".join(["vllm-dspark", *sub, "--help"]): paired(
            whole_process([*command, *sub, "--help"]), bare, pairs=pairs, warmup=warmup
        )
        for sub in [[], *([name] for name in COMMANDS)]
    }
    return {
        "goal_ms": GOAL_MS,
        "worst_ms": worst_ms,
        "meets_goal": worst_ms < GOAL_MS,
        **result,
        "help_goal_s": HELP_GOAL_S,
        "help": {
            name: {
                "step_seconds": r["step_seconds"],
                "baseline_seconds": r["baseline_seconds"],
                "meets_goal": r["step_seconds"]["max"] < HELP_GOAL_S,
            }
            for name, r in help_starts.items()
        },
    }


def table(result: dict) -> str:
    timed = [r for r in result["runs"] if not r["warmup"]]

    def ms(key: str) -> str:
        values = sorted(1e3 * r["step"][key] for r in timed)
        return f"{values[len(values) // 2]:.1f} ({values[0]:.1f}–{values[-1]:.1f})"

    ms_spread = {k: 1e3 * v for k, v in result["step_seconds"].items()}
    row = {
        "import vllm (baseline) ms": spread_text(
            {k: 1e3 * v for k, v in result["baseline_seconds"].items()}, ".0f"
        ),
        "import vllm_dspark ms": ms("plugin_import_s"),
        "register() ms": ms("register_s"),
        "second register() ms": ms("register_again_s"),
        "plugin total ms": spread_text(ms_spread, ".1f"),
        "plugin / baseline": spread_text(result["ratio"], ".3f"),
        f"goal < {result['goal_ms']:.0f} ms (worst pair)": "met"
        if result["meets_goal"]
        else "MISSED",
    }
    helps = [
        {
            "command": f"`{name}`",
            "seconds: median (min–max)": spread_text(r["step_seconds"], ".3f"),
            "bare interpreter s": spread_text(r["baseline_seconds"], ".3f"),
            f"goal < {result['help_goal_s']:.0f} s (worst pair)": "met"
            if r["meets_goal"]
            else "MISSED",
        }
        for name, r in result["help"].items()
    ]
    return "\n".join(
        [
            format_table([row], list(row)),
            "",
            format_table(helps, list(helps[0])),
            "",
            f"Median (min–max) over {result['pairs']} pairs of fresh interpreters after "
            f"{result['warmup']} warm-up pair; each command timed as a whole process.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks register",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_pairing_arguments(parser)
    args = parser.parse_args(argv)
    result = run(args.pairs, args.warmup)
    write_result("register_overhead", result, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
