# SPDX-License-Identifier: Apache-2.0
"""The trained pair: measured acceptance per format next to the drift harness's predictions.

Runs ``vllm-dspark accept`` (greedy, plus the confidence-scheduled mode) and ``vllm-dspark eval
--regimes real`` (the target's own aux states over the held-out prompts) on the committed pair
(``tests/data/pair``, made by ``vllm-dspark train-pair``), then joins them per format: measured τ
against the drift ceiling, τ prefix and τ from 1−TV. ``accept`` runs ``--warmup`` + ``--pairs``
times, each paired with the target's own greedy decode of the same prompts (which ``accept`` times
first for its lossless check); its figures are seeded, so every run must reproduce them. Writes
``benchmarks/results/pair/`` (both tools' reports, the scatter plot) and
``benchmarks/results/pair.{json,md}``:

    python -m benchmarks pair
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS_DIR,
    Measurement,
    add_pairing_arguments,
    rounds,
    spread_text,
    write_result,
)
from vllm_dspark.drift import default_variants
from vllm_dspark.safety import staged

PAIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "pair"
# (eval key, column header): the drift figures shown next to the measured τ
PREDICTIONS = (
    ("ceiling", "Ceiling τ"),
    ("prefix_length", "τ prefix"),
    ("ceiling_tv", "τ from 1−TV"),
)


def _pm(est: dict[str, float]) -> str:
    return f"{est['value']:.2f} ± {(est['hi'] - est['lo']) / 2:.2f}"


def join(accept: dict[str, Any], drift: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per format: measured τ (greedy, all drafts verified) and the real regime's predictions."""
    measured = {c["variant"]: c for c in accept["cells"] if c["mode"] == "full"}
    base = min(c["position"] for c in drift["cells"])
    rows = []
    for cell in drift["cells"]:
        if cell["regime"] != "real" or cell["position"] != base:
            continue
        m = measured.get(cell["variant"])
        if m is None:
            continue
        scheduled = next(
            (
                c
                for c in accept["cells"]
                if c["variant"] == cell["variant"] and c["mode"] == "scheduled"
            ),
            None,
        )
        rows.append(
            {
                "variant": cell["variant"],
                "tau": m["tau"],
                "confidence_auc": m["confidence_auc"],
                "lossless": m.get("lossless"),
                "scheduled_tau": scheduled and scheduled["tau"],
                "scheduled_cost": scheduled and scheduled["target_tokens_per_accepted"],
                **{k: cell["metrics"][k] for k, _ in PREDICTIONS},
                "kl_p99": cell["metrics"]["kl_p99"],
                # how far each drift figure sits above the measured τ
                "overestimate": {
                    k: cell["metrics"][k]["value"] - m["tau"]["value"] for k, _ in PREDICTIONS
                },
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    header = ["Format", "Measured τ", *(h for _, h in PREDICTIONS), "KL p99", "Conf AUC"]
    header += ["Scheduled τ", "Target tok / accepted", "Lossless"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        auc = r["confidence_auc"]
        lossless = r["lossless"]
        cells = [
            r["variant"],
            _pm(r["tau"]),
            *(_pm(r[k]) for k, _ in PREDICTIONS),
            f"{r['kl_p99']['value']:.2e}",
            "n/a" if auc["value"] != auc["value"] else f"{auc['value']:.3f}",
            _pm(r["scheduled_tau"]) if r["scheduled_tau"] else "n/a",
            _pm(r["scheduled_cost"]) if r["scheduled_cost"] else "n/a",
            "n/a" if lossless is None else f"{sum(lossless)}/{len(lossless)}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def partial_note(payload: dict[str, Any]) -> str:
    """Which formats left which recipe layers BF16 (their blocks do not tile them), or nothing."""
    left = payload.get("bf16_layers", {})
    return "".join(
        f"{name}: the recipe but {', '.join(kinds)}, which its blocks do not tile here (BF16). "
        for name, kinds in left.items()
        if kinds
    )


def timing_note(payload: dict[str, Any]) -> str:
    """``accept``'s wall time per run, paired with the target's greedy decode, and the eval's."""
    t = payload["accept_timing"]
    figures = "identical in every run" if payload["figures_identical"] else "**not reproduced**"
    return (
        f"`accept` ({len(payload['rows'])} formats, greedy and scheduled, "
        f"{payload['accept_config']['num_prompts']} prompts): "
        f"{spread_text(t['seconds']['accept'], '.1f', ' s')} per run, "
        f"{spread_text(t['ratio']['accept'], unit='×')} the target's greedy decode of the same "
        f"prompts, over {t['pairs']} runs after {t['warmup']} warm-up; its figures {figures}. "
        f"`eval --regimes real`: {payload['eval_s']:.1f} s (one run)."
    )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Predicted τ (each drift figure) against measured τ, one point per format, y = x drawn."""
    from vllm_dspark.plots import pyplot

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5.2, 4.4))
    for (key, label), marker in zip(PREDICTIONS, "os^"):
        xs = [r["tau"]["value"] for r in rows]
        ys = [r[key]["value"] for r in rows]
        ax.scatter(xs, ys, marker=marker, label=label)
        for x, y, r in zip(xs, ys, rows):
            ax.annotate(r["variant"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    values = [r["tau"]["value"] for r in rows] + [
        r[k]["value"] for r in rows for k, _ in PREDICTIONS
    ]
    lo, hi = min(values) - 0.1, max(values) + 0.1
    ax.plot([lo, hi], [lo, hi], color="gray", linewidth=0.8, label="y = x")
    ax.set_xlabel("measured τ (accept, greedy)")
    ax.set_ylabel("predicted by drift (real regime)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def block_builds(pair: Path, root: Path) -> dict[str, list[str]]:
    """Quantize the pair's drafter into ``root/FORMAT`` for each block format, on the recipe layers its
    blocks tile; returns ``{build directory: the recipe layers left BF16}`` (accept and eval take
    the directories as variants)."""
    from vllm_dspark.checkpoint import formats
    from vllm_dspark.checkpoint.layout import FP8_RECIPE, checkpoint_modules
    from vllm_dspark.checkpoint.store import load_config
    from vllm_dspark.tools.cli import main as cli

    shapes = {s.kind: s.shape for s in checkpoint_modules(load_config(pair / "drafter"))}
    builds = {}
    for name in formats.names():
        fmt = formats.get(name)
        if fmt.block is None:
            continue
        left = [k for k in FP8_RECIPE if fmt.shape_problem(shapes[k]) is not None]
        argv = ["quantize", "--model-dir", str(pair / "drafter"), "--out", str(root / name)]
        argv += ["--quant-format", name, "--no-progress", "--include-layers"]
        if cli([*argv, *(k for k in FP8_RECIPE if k not in left)]) != 0:
            raise SystemExit(1)
        builds[str(root / name)] = left
    return builds


def _figures(report: dict[str, Any]) -> list[dict[str, Any]]:
    """An accept report's cells without their wall times: what a rerun must reproduce."""
    return [{k: v for k, v in c.items() if k != "seconds"} for c in report["cells"]]


def main(argv: list[str] | None = None) -> int:
    from vllm_dspark.tools.cli import main as cli

    parser = argparse.ArgumentParser(prog="python -m benchmarks pair", description=__doc__)
    parser.add_argument("--pair", type=Path, default=PAIR, help="a train-pair output directory")
    parser.add_argument("--prompts", type=int, default=32, help="held-out prompts accept decodes")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=512, help="eval blocks in the real regime")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    add_pairing_arguments(parser, "accept runs", " (each paired with the target's greedy decode)")
    args = parser.parse_args(argv)
    # Paths relative to the working directory: results record where the pair is, not this machine.
    pair, out = Path(os.path.relpath(args.pair)), args.out / "pair"
    prompts = json.loads((pair / "heldout_prompts.json").read_text())["prompts"][: args.prompts]
    # Every format on the fly; the block ones as builds of the layers their 128x128 blocks tile.
    scratch = tempfile.TemporaryDirectory(prefix="pair-builds-")
    partial = block_builds(pair, Path(scratch.name))
    variants = [*default_variants(), *partial]
    # The prompts' ids are kept with the results: both tools read them, and the results name them.
    ids = Path(os.path.relpath(out / "prompts.json"))
    with staged(ids, directory=False) as staging:
        staging.write_text(json.dumps([p["token_ids"] for p in prompts]) + "\n")
    common = ["--target", str(pair / "target"), "--no-progress"]
    accept_argv = (
        ["accept", *common, "--drafter", str(pair / "drafter"), "--prompts", str(ids)]
        + ["--max-tokens", str(args.max_tokens), "--scheduled", "--out", str(out / "accept")]
        + ["--variants", *variants]
    )
    reports: list[dict[str, Any]] = []

    def accept_once() -> dict[str, Measurement]:
        if cli(accept_argv) != 0:
            raise SystemExit(1)
        reports.append(json.loads((out / "accept" / "results.json").read_text()))
        timing = reports[-1]["timing"]
        return {
            "accept": {"seconds": timing["total_s"]},
            "target greedy": {"seconds": timing["baseline_s"]},
        }

    accept_timing = rounds(
        accept_once, "target greedy", pairs=args.pairs, warmup=args.warmup, progress="accept"
    )
    eval_argv = (
        ["eval", *common, "--model", str(pair / "drafter"), "--regimes", "real"]
        + ["--corpus", str(ids), "--blocks", str(args.blocks), "--out", str(out / "eval")]
        + ["--variants", *variants]
    )
    if cli(eval_argv) != 0:
        return 1
    accept = reports[-1]
    drift = json.loads((out / "eval" / "results.json").read_text())
    rows = join(accept, drift)
    plot(rows, out / "tau_vs_drift.png")
    payload = {
        "pair": str(pair),
        "accept_config": accept["config"],
        "eval_config": {k: drift["config"][k] for k in ("blocks", "context_len", "corpus_source")},
        "accept_timing": accept_timing,
        "figures_identical": all(_figures(r) == _figures(reports[0]) for r in reports),
        "eval_s": drift["timing"]["total_s"],
        "bf16_layers": {Path(b).name: left for b, left in partial.items()},
        "rows": rows,
    }
    scratch.cleanup()
    text = table(rows) + "\n\n" + partial_note(payload) + timing_note(payload)
    write_result("pair", payload, text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
