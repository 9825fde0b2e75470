# SPDX-License-Identifier: Apache-2.0
"""Drift harness at real shapes: the ``k3`` preset, all three aux regimes, BF16 / FP8 / MXFP4 / NVFP4.

Runs ``vllm-dspark eval``'s harness on a random drafter with the published config's shapes and
realistic weight scales (``vllm-dspark make-random --preset k3 --seed 0``, created if ``--model``
does not exist) and writes the full report (results.json, results.md, PNG plots) under
``benchmarks/results/NAME/``, plus the headline table ``benchmarks/results/NAME.md`` that
docs/benchmarks.md shows. Its throughput per pass is ``python -m benchmarks drift-speed``.

The weights are random: the figures exercise the harness at real shapes and rank the formats on
this model; they are not the published checkpoint's drift. The k3 run holds ~17 GiB and takes the
machine's cores, so on shared machines run it under the k3 lock. ``python -m benchmarks`` names
the committed runs (``drift``, ``drift-positions``):

    flock /tmp/k3.lock python -m benchmarks drift            # 640 blocks per regime, an hour or more
    flock /tmp/k3.lock python -m benchmarks drift-positions  # the YaRN-range sweep
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS_DIR,
    add_drafter_arguments,
    environment,
    format_table,
    preset_drafter,
    spread,
    spread_text,
    write_result,
)
from vllm_dspark.drift.harness import EvalSpec, default_variants, run
from vllm_dspark.drift.report import (
    COLUMNS,
    ceiling_summary,
    fmt,
    position_table,
    worst_half_width_pp,
    write_report,
)
from vllm_dspark.tools.eval import parse_position


def _display(path: Path) -> str:
    """``path`` relative to the repository when it is inside it (as the README links it)."""
    try:
        return str(path.resolve().relative_to(Path(__file__).resolve().parent.parent))
    except ValueError:
        return str(path)


def _config_summary(results: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "variants",
        "regimes",
        "blocks",
        "batch_size",
        "context_len",
        "positions",
        "seed",
        "recipe",
    )
    return {k: results["config"][k] for k in keys}


def passes(timing: dict[str, Any]) -> list[dict[str, Any]]:
    """Each pass of the run (the FP32 reference's, then each variant's): its blocks, its seconds, and
    the median / min / max of its seconds per block over its batches."""
    recorded = timing["passes"]
    named = [("reference (FP32)", recorded["reference"]), *recorded["variants"].items()]
    return [
        {
            "pass": name,
            "batches": len(r["blocks"]),
            "blocks": sum(r["blocks"]),
            "seconds": sum(r["seconds"]),
            "s_per_block": spread([s / b for s, b in zip(r["seconds"], r["blocks"])]),
        }
        for name, r in named
    ]


def slowest_case_s(total_s: float, rows: list[dict[str, Any]]) -> float:
    """The run's wall time had every batch of each pass (``rows``, from :func:`passes`) taken that
    pass's slowest seconds per block."""
    return total_s + sum(p["s_per_block"]["max"] * p["blocks"] - p["seconds"] for p in rows)


def headline(results: dict[str, Any], report_dir: str) -> str:
    """The README table: the run's cost (each pass's seconds per block over its batches, and the run
    had every batch been its pass's slowest), CI widths, the ceiling summary and the heavy-regime
    metric set. ``drift-speed`` pairs each pass with the reference's, in turn."""
    cfg, timing = results["config"], results["timing"]
    timed = passes(timing)
    row = {
        "preset": cfg["preset"],
        "blocks/regime": cfg["blocks"],
        "context": cfg["context_len"],
        "variants": len(cfg["variants"]),
        "run min": timing["total_s"] / 60,
        "slowest-case min": slowest_case_s(timing["total_s"], timed) / 60,
        "worst_CI_greedy_pp": worst_half_width_pp(results, ["greedy_agreement"]),
        "worst_CI_rollout_pp": worst_half_width_pp(results, ["rollout_agreement"]),
    }
    pass_rows = [
        {
            "pass": p["pass"],
            "batches": p["batches"],
            "s/block: median (min–max)": spread_text(p["s_per_block"], ".3g"),
            "pass min": p["seconds"] / 60,
        }
        for p in timed
    ]
    lines = [
        format_table([row], list(row)),
        "",
        f"Each pass, timed per batch of {cfg['batch_size']} blocks (slowest-case min: the run had "
        "every batch taken its pass's slowest seconds per block):",
        "",
        format_table(pass_rows, list(pass_rows[0])),
        "",
        "Drift-limited acceptance ceiling τ (bonus token included, max "
        f"{cfg['block_size'] + 1}) — random weights at the real shapes, not the published checkpoint:",
        "",
        ceiling_summary(results),
    ]
    if "heavy" in cfg["regimes"]:
        base = cfg["positions"][0]
        rows = []
        for v in cfg["variants"]:
            (cell,) = [
                c
                for c in results["cells"]
                if (c["variant"], c["regime"], c["position"]) == (v, "heavy", base)
            ]
            rows.append(
                "| "
                + " | ".join([v] + [fmt(cell["metrics"][k], kind) for k, _, kind in COLUMNS])
                + " |"
            )
        lines += [
            "",
            "Full metric set, heavy regime:",
            "",
            "| variant | " + " | ".join(h for _, h, _ in COLUMNS) + " |",
            "|" + "---|" * (len(COLUMNS) + 1),
            *rows,
        ]
    if len(cfg["positions"]) > 1:
        for regime in cfg["regimes"]:
            lines += [
                "",
                f"Position sweep, {regime} regime: ceiling τ and greedy agreement % by anchor position "
                "(short context at offset position ids):",
                "",
                position_table(results, regime),
                "",
                position_table(results, regime, "greedy_agreement"),
            ]
    lines += ["", f"Plots and every figure with its CI: `{report_dir}/`."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.drift",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_drafter_arguments(parser)
    parser.add_argument(
        "--blocks",
        type=int,
        default=640,
        help="blocks per regime (default 640: worst 95 %% CI half-width under 2 pp at k3)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=64,
        help="blocks per pass (default 64: the FP32 reference's GEMMs run ~2x faster than at 16)",
    )
    parser.add_argument("--context-len", type=int, default=32)
    parser.add_argument("--regimes", nargs="+", default=["gauss", "heavy", "boot"])
    parser.add_argument("--variants", nargs="+", default=list(default_variants()))
    parser.add_argument(
        "--positions",
        nargs="*",
        type=parse_position,
        default=(),
        help="anchor positions to sweep as well (multiplies the run time)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--name",
        default="drift",
        help="result name: benchmarks/results/NAME.{json,md} and, by default, the report in "
        "benchmarks/results/NAME/ (default drift, the table docs/benchmarks.md shows)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="report directory (default benchmarks/results/NAME)"
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--render",
        action="store_true",
        help="run nothing: rewrite NAME.{json,md} from the report already in --out",
    )
    args = parser.parse_args(argv)

    out = args.out or RESULTS_DIR / args.name
    if args.render:
        results = json.loads((out / "results.json").read_text())
        files = []
    else:
        model = preset_drafter(args.model, args.preset)
        spec = EvalSpec(
            model=str(model),
            variants=tuple(args.variants),
            regimes=tuple(args.regimes),
            blocks=args.blocks,
            batch_size=args.batch_size,
            context_len=args.context_len,
            positions=tuple(args.positions),
            seed=args.seed,
            progress=not args.no_progress,
        )
        start = time.perf_counter()
        results = run(spec)
        results["timing"]["total_s"] = time.perf_counter() - start
        results["config"]["preset"] = args.preset
        results["environment"] = environment()
        files = write_report(results, out)
    pass_rows = passes(results["timing"])
    payload = {
        "preset": results["config"]["preset"],
        "model": results["config"]["model"],
        "report": _display(out),
        "timing": results["timing"],
        "passes": pass_rows,
        "slowest_case_s": slowest_case_s(results["timing"]["total_s"], pass_rows),
        "config": _config_summary(results),
        "ceiling": {
            f"{c['variant']}/{c['regime']}/{c['position']}": c["metrics"]["ceiling"]
            for c in results["cells"]
        },
    }
    write_result(
        args.name,
        payload,
        headline(results, _display(out)),
        measured_in=results["environment"],
    )
    print("\n".join(f"wrote {f}" for f in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
