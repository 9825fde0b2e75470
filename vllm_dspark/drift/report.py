# SPDX-License-Identifier: Apache-2.0
"""Writes a drift run: ``results.json`` (everything), ``results.md`` (the card's tables) and PNG plots.

Everything here reads only the results dict, so tables and plots can be regenerated from a saved
``results.json`` (:func:`write_report`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_dspark.plots import pyplot

# (key, column header, formatter kind)
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("greedy_agreement", "Greedy agree %", "pct"),
    ("rollout_agreement", "Seq rollout %", "pct"),
    ("one_minus_tv", "1−TV %", "pct"),
    ("kl_mean", "KL mean", "sci"),
    ("kl_p99", "KL p99", "sci"),
    ("reverse_kl_mean", "Rev KL", "sci"),
    ("confidence_r", "Conf r", "r"),
    ("sched_flip_rate", "Sched flip %", "pct"),
    ("ceiling", "Ceiling τ", "tau"),
    ("prefix_length", "τ prefix", "tau"),
    ("ceiling_tv", "τ from 1−TV", "tau"),
)


PERCENT_KEYS = tuple(k for k, _, kind in COLUMNS if kind == "pct")


def worst_half_width_pp(results: dict[str, Any], keys: Sequence[str] = PERCENT_KEYS) -> float:
    """The widest 95 % CI half-width of the ``keys`` metrics over every cell, in percentage points."""
    return max(
        100 * (c["metrics"][k]["hi"] - c["metrics"][k]["lo"]) / 2
        for c in results["cells"]
        for k in keys
    )


def fmt(est: dict[str, float], kind: str) -> str:
    """``value ± half-width`` of a ``{"value", "lo", "hi"}`` estimate, in the unit ``kind`` names."""
    v, half = est["value"], (est["hi"] - est["lo"]) / 2
    if not math.isfinite(v):
        return "n/a"
    if kind == "pct":
        return f"{100 * v:.1f} ± {100 * half:.1f}"
    if kind == "sci":
        return f"{v:.2e}"
    if kind == "r":
        return f"{v:.4f}"
    return f"{v:.2f} ± {half:.2f}"


def position_label(position: int) -> str:
    """``131072`` -> ``128k``; positions that are not whole multiples of 1024 stay as digits."""
    if position >= 1024 and position % 1024 == 0:
        k = position // 1024
        return f"{k // 1024}M" if k % 1024 == 0 else f"{k}k"
    return str(position)


def _cells(results: dict[str, Any], **match: Any) -> list[dict[str, Any]]:
    return [c for c in results["cells"] if all(c[k] == v for k, v in match.items())]


def _cell(results: dict[str, Any], variant: str, regime: str, position: int) -> dict[str, Any]:
    (cell,) = _cells(results, variant=variant, regime=regime, position=position)
    return cell


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def ceiling_summary(results: dict[str, Any]) -> str:
    """The headline table: ceiling τ per variant (rows) and regime (columns) at the base position."""
    cfg = results["config"]
    base = cfg["positions"][0]
    rows = [
        [v] + [fmt(_cell(results, v, r, base)["metrics"]["ceiling"], "tau") for r in cfg["regimes"]]
        for v in cfg["variants"]
    ]
    return "\n".join(_table(["variant"] + list(cfg["regimes"]), rows))


def position_table(results: dict[str, Any], regime: str, key: str = "ceiling") -> str:
    """``key`` per variant (rows) and anchor position (columns) in one regime."""
    cfg = results["config"]
    kind = {k: kind for k, _, kind in COLUMNS}[key]
    rows = [
        [v] + [fmt(_cell(results, v, regime, p)["metrics"][key], kind) for p in cfg["positions"]]
        for v in cfg["variants"]
    ]
    return "\n".join(_table(["variant"] + [position_label(p) for p in cfg["positions"]], rows))


def markdown(results: dict[str, Any]) -> str:
    """The card-style report: ceiling summary, the full metric set per regime, the position sweep."""
    cfg = results["config"]
    variants, regimes, positions = cfg["variants"], cfg["regimes"], cfg["positions"]
    base = positions[0]
    block = cfg["block_size"]
    lines = [
        f"# Drift of `{cfg['model']}` from its FP32 reference",
        "",
        f"{cfg['blocks']} blocks per regime x {block} drafted positions; context {cfg['context_len']} tokens; "
        f"95 % bootstrap CI over blocks ({cfg['resamples']} resamples); seed {cfg['seed']}; "
        f"device {cfg['device']}. Reference: FP32 weights + FP32 compute. "
        f"Variants compute in BF16. Quantized on the fly: {', '.join(cfg['recipe'])}.",
        "",
        f"## Drift-limited acceptance ceiling (τ, bonus token included, max {block + 1})",
        "",
    ]
    lines.append(ceiling_summary(results))
    for regime in regimes:
        for position in positions:
            where = f"anchor at position {position_label(position)}"
            lines += ["", f"## {regime} — {where}", ""]
            rows = [
                [v]
                + [
                    fmt(_cell(results, v, regime, position)["metrics"][k], kind)
                    for k, _, kind in COLUMNS
                ]
                for v in variants
            ]
            lines += _table(["variant"] + [h for _, h, _ in COLUMNS], rows)
        lines += [
            "",
            f"Per-position sequential-rollout agreement % ({regime}, anchor at {position_label(base)}):",
            "",
        ]
        curves = {
            v: _cell(results, v, regime, base)["metrics"]["per_position"]["rollout_agreement"]
            for v in variants
        }
        rows = [[v] + [f"{100 * e['value']:.1f}" for e in curves[v]] for v in variants]
        lines += _table(["variant"] + [str(i + 1) for i in range(block)], rows)
    if len(positions) > 1:
        lines += ["", "## Position sweep: ceiling τ by anchor position", ""]
        for regime in regimes:
            lines += [f"{regime}:", "", position_table(results, regime), ""]
    lines += ["", "## Method", "", results["methodology"].strip()]
    return "\n".join(lines) + "\n"


# ----- plots -----


def _axes_row(plt, n: int, width: float = 4.2, height: float = 3.4):
    # A single panel still needs room for the figure title.
    fig, axes = plt.subplots(1, n, figsize=(max(width * n, 6.5), height), squeeze=False)
    return fig, list(axes[0])


def plot_agreement(results: dict[str, Any], path: Path, plt) -> None:
    cfg = results["config"]
    fig, axes = _axes_row(plt, len(cfg["regimes"]))
    x = list(range(1, cfg["block_size"] + 1))
    for ax, regime in zip(axes, cfg["regimes"]):
        for i, v in enumerate(cfg["variants"]):
            pp = _cell(results, v, regime, cfg["positions"][0])["metrics"]["per_position"]
            color = f"C{i}"
            for key, style, label in (
                ("greedy_agreement", "-", "teacher-forced"),
                ("rollout_agreement", "--", "rollout"),
            ):
                ys = [100 * e["value"] for e in pp[key]]
                ax.plot(x, ys, style, color=color, marker="o", ms=3, label=f"{v} {label}")
                ax.fill_between(
                    x,
                    [100 * e["lo"] for e in pp[key]],
                    [100 * e["hi"] for e in pp[key]],
                    color=color,
                    alpha=0.15,
                    lw=0,
                )
        ax.set(
            title=regime,
            xlabel="draft position",
            ylabel="agreement with FP32 reference (%)",
            xticks=x,
        )
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, loc="lower left")
    fig.suptitle(
        "Per-position greedy agreement (solid: teacher-forced, dashed: sequential rollout)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ceiling(results: dict[str, Any], path: Path, plt) -> None:
    cfg = results["config"]
    variants, regimes = cfg["variants"], cfg["regimes"]
    fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(regimes) * max(1, len(variants)) / 2, 3.8))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        ests = [_cell(results, v, r, cfg["positions"][0])["metrics"]["ceiling"] for r in regimes]
        xs = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(regimes))]
        ys = [e["value"] for e in ests]
        err = [[e["value"] - e["lo"] for e in ests], [e["hi"] - e["value"] for e in ests]]
        ax.bar(xs, ys, width, yerr=err, capsize=3, label=v, color=f"C{i}")
    ax.axhline(cfg["block_size"] + 1, color="k", lw=0.8, ls=":", label="max (block + bonus)")
    ax.set_xticks(range(len(regimes)), regimes)
    ax.set(ylabel="drift-limited ceiling τ", title="Acceptance ceiling vs FP32 reference (95 % CI)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_kl_tails(results: dict[str, Any], path: Path, plt) -> None:
    cfg = results["config"]
    fig, axes = _axes_row(plt, len(cfg["regimes"]))
    for ax, regime in zip(axes, cfg["regimes"]):
        for i, v in enumerate(cfg["variants"]):
            tail = _cell(results, v, regime, cfg["positions"][0])["metrics"]["kl_tail"]
            pts = [(k, f) for k, f in zip(tail["kl"], tail["fraction"]) if k > 0]
            if pts:
                ax.loglog(
                    [k for k, _ in pts], [f for _, f in pts], marker=".", color=f"C{i}", label=v
                )
        ax.set(
            title=regime,
            xlabel="KL(reference ‖ variant) per token (nats)",
            ylabel="fraction of tokens above",
        )
        ax.grid(alpha=0.3, which="both")
    axes[-1].legend(fontsize=7)
    fig.suptitle("KL tails")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_positions(results: dict[str, Any], path: Path, plt) -> None:
    cfg = results["config"]
    positions = cfg["positions"]
    fig, axes = _axes_row(plt, len(cfg["regimes"]))
    for ax, regime in zip(axes, cfg["regimes"]):
        for i, v in enumerate(cfg["variants"]):
            ests = [_cell(results, v, regime, p)["metrics"]["ceiling"] for p in positions]
            ax.errorbar(
                positions,
                [e["value"] for e in ests],
                yerr=[[e["value"] - e["lo"] for e in ests], [e["hi"] - e["value"] for e in ests]],
                marker="o",
                ms=3,
                capsize=2,
                color=f"C{i}",
                label=v,
            )
        orig = cfg.get("original_max_position_embeddings")
        if orig:
            ax.axvline(orig, color="k", lw=0.8, ls=":", label="YaRN original context")
        ax.set_xscale("log", base=2)
        ax.set_xticks(positions, [position_label(p) for p in positions], rotation=45, fontsize=7)
        ax.set(title=regime, xlabel="anchor position", ylabel="ceiling τ")
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, loc="best", framealpha=0.6)
    fig.suptitle("Position sweep (short context with offset position ids)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(results: dict[str, Any], out: Path) -> list[Path]:
    """Write the PNGs into ``out``; returns their paths (none without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return []
    plots = [
        ("agreement_per_position.png", plot_agreement),
        ("ceiling.png", plot_ceiling),
        ("kl_tails.png", plot_kl_tails),
    ]
    if len(results["config"]["positions"]) > 1:
        plots.append(("position_sweep.png", plot_positions))
    paths = []
    for name, fn in plots:
        fn(results, out / name, plt)
        paths.append(out / name)
    return paths


def write_report(results: dict[str, Any], out: str | Path) -> list[Path]:
    """Write ``results.json``, ``results.md`` and the plots into ``out``; returns the files written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, allow_nan=True) + "\n")
    (out / "results.md").write_text(markdown(results))
    return [out / "results.json", out / "results.md", *write_plots(results, out)]
