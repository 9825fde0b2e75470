# SPDX-License-Identifier: Apache-2.0
"""vLLM's ``dspark`` speculator end to end on CPU: spec-decode counters and interpreter tokens/s.

Runs ``python -m vllm_dspark.cpu_serving.pair`` (what ``make demo`` and the end-to-end tests serve:
the trained pair of ``tests/data/pair``, BF16 and FP8 drafters, on short held-out prompts) and tabulates, per engine,
vLLM's counters (drafts, drafted and accepted tokens, acceptance per position) and output tokens per
second. The acceptance is the engine's; ``vllm-dspark accept`` measures the same on these prompts
(the tests check they agree). Each run serves the engines one after another, so a run is one round
of :func:`benchmarks.common.rounds`: every engine's generate time is a ratio to the no-speculation
engine's in the same run, over a warm-up run and 5 timed ones, each in its own process. Tokens/s
are those of Model Runner V2 under Triton's interpreter on this machine: context, not a goal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import (
    Measurement,
    add_pairing_arguments,
    format_table,
    rounds,
    spread_text,
    write_result,
)

ROOT = Path(__file__).resolve().parents[1]
PAIR = ROOT / "tests" / "data" / "pair"
ENGINES = {
    "baseline": "no speculation",
    "bf16": "bf16",
    "fp8": "fp8",
    "probabilistic": "bf16, probabilistic + block",
}
COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
)


def measurements(results: dict[str, Any]) -> dict[str, Measurement]:
    """One pair run's engines: generate seconds, output tokens, vLLM's counters."""
    return {
        engine: {
            "seconds": results[engine]["generate_seconds"],
            "output_tokens": sum(len(o["tokens"]) for o in results[engine]["outputs"]),
            "counters": {
                k: v for k, v in results[engine].get("counters", {}).items() if k in COUNTERS
            },
        }
        for engine in ENGINES
    }


def _served_runs(fp8: Path, out: Path) -> Callable[[], dict[str, Measurement]]:
    """Each call: one ``python -m vllm_dspark.cpu_serving.pair`` run in a fresh interpreter."""
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
    }
    argv = ["-m", "vllm_dspark.cpu_serving.pair", "--pair", str(PAIR), "--fp8", str(fp8), "--out"]

    def run() -> dict[str, Measurement]:
        proc = subprocess.run(
            [sys.executable, *argv, str(out)], cwd=ROOT, env=env, capture_output=True, text=True
        )
        if proc.returncode:
            sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
            raise SystemExit(
                f"vllm_dspark.cpu_serving.pair failed (exit {proc.returncode}); its log is above"
            )
        return measurements(json.loads((out / "results.json").read_text()))

    return run


def rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One table row per engine: the first timed run's counters, the runs' generate seconds."""
    first = next(r for r in result["runs"] if not r["warmup"])["measured"]
    table = []
    for engine, label in ENGINES.items():
        m, seconds = first[engine], result["seconds"][engine]
        counters = m["counters"]
        per_position = counters.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])
        table.append(
            {
                "engine": label,
                "drafts": counters.get("vllm:spec_decode_num_drafts", "-"),
                "draft tokens": counters.get("vllm:spec_decode_num_draft_tokens", "-"),
                "accepted": counters.get("vllm:spec_decode_num_accepted_tokens", "-"),
                "accepted per position": " ".join(str(int(v)) for v in per_position) or "-",
                "output tokens": m["output_tokens"],
                "generate s: median (min–max)": spread_text(seconds, ".3g"),
                "output tok/s (median)": m["output_tokens"] / seconds["median"],
                "time vs no speculation: median (min–max)": spread_text(
                    result["ratio"][engine], unit="×"
                )
                if engine in result["ratio"]
                else "1",
            }
        )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks e2e-cpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--from",
        dest="sources",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="tabulate existing `python -m vllm_dspark.cpu_serving.pair --out DIR` runs (each one round, no warm-up) "
        "instead of running new ones",
    )
    add_pairing_arguments(parser, unit="runs")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.sources:
            runs = [json.loads((d / "results.json").read_text()) for d in args.sources]
            pending = iter(runs)
            result = rounds(
                lambda: measurements(next(pending)), "baseline", pairs=len(runs), warmup=0
            )
        else:
            from vllm_dspark.checkpoint_tools.quantize import quantize_checkpoint

            fp8, out = Path(tmp) / "drafter-fp8", Path(tmp) / "out"
            quantize_checkpoint(PAIR / "drafter", fp8, "fp8", progress=False)
            result = rounds(
                _served_runs(fp8, out),
                "baseline",
                pairs=args.pairs,
                warmup=args.warmup,
                progress="e2e-cpu",
            )
            runs = [json.loads((out / "results.json").read_text())]
    settings = {k: runs[0][k] for k in ("platform", "block", "prompts", "max_tokens")}
    timed = [r["measured"] for r in result["runs"] if not r["warmup"]]
    same = all(
        run[e]["counters"] == timed[0][e]["counters"]
        and run[e]["output_tokens"] == timed[0][e]["output_tokens"]
        for run in timed
        for e in ENGINES
    )
    table = rows(result)
    note = (
        f"{result['pairs']} runs after {result['warmup']} warm-up, each serving the engines in turn "
        f"in its own process; counters and output tokens "
        + (
            "identical in every run."
            if same
            else "from the first timed run: they differ between runs."
        )
    )
    write_result(
        "e2e_cpu",
        {"settings": settings, "counters_identical": same, "rows": table, **result},
        format_table(table, list(table[0])) + "\n\n" + note,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
