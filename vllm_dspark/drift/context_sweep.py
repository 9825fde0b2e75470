# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark accept --context-sweep``: measured acceptance against context length, and the length
past which speculation stops paying under a step-cost model (:mod:`vllm_dspark.ops.speculation_cost`).

Each prompt ends at a seeded point of real text (the target's tokenizer over a text file, by default
the package's corpus); at context length ``L`` it is the ``L`` tokens before that point. So every
length decodes from the same place and only the amount of real text before it grows. Decoding is
``accept``'s: the target (transformers, FP32, KV-cached) verifies each block the drafter drafts from
the target's own aux states. τ counts the bonus token; ± is the 95 % bootstrap CI over prompts.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from vllm_dspark.drift.acceptance import (
    AcceptSpec,
    Target,
    fmt_pm,
    open_variant,
    speculate_prompts,
    summarize,
    tokenizer,
)
from vllm_dspark.fields import validated_context_len
from vllm_dspark.ops.speculation_cost import StepCost, break_even_context


@dataclass(frozen=True)
class SweepSpec:
    """What the sweep measures: ``accept``'s spec (its ``prompts`` a text file or None), the context
    lengths, and the step-cost model with a line saying where it comes from."""

    accept: AcceptSpec
    lengths: tuple[int, ...]
    cost: StepCost
    cost_source: str


def padded_prompts(
    ids: list[int], lengths: tuple[int, ...], count: int, seed: int
) -> dict[int, list[list[int]]]:
    """Per length, ``count`` prompts: prompt ``i`` is the ``L`` tokens before end point ``i``, the end
    points seeded and distinct while the text has room, all at least the longest length in."""
    from vllm_dspark.drift.corpus import window_starts

    longest = max(lengths)
    if len(ids) < longest:
        raise ValueError(
            f"--context-sweep {longest} needs {longest} tokens of text, the padding text has "
            f"{len(ids)}. Fix: pass --prompts a longer text file, or shorter lengths"
        )
    ends = window_starts(len(ids), longest, count, seed) + longest
    return {length: [ids[e - length : e] for e in ends.tolist()] for length in lengths}


def break_even_length(lengths: list[int], taus: list[float], cost: StepCost) -> float | None:
    """The first context length where the measured τ (linear between measured lengths) falls to the
    cost model's break-even τ; None where it stays above over the whole sweep."""
    margins = [tau - cost.ratio(length) for length, tau in zip(lengths, taus)]
    if margins[0] <= 0:
        return float(lengths[0])
    for (l0, m0), (l1, m1) in pairwise(zip(lengths, margins)):
        if m1 <= 0:
            return l0 + (l1 - l0) * m0 / (m0 - m1)
    return None


def _padding_ids(spec: AcceptSpec, vocab_size: int) -> tuple[list[int], str]:
    from vllm_dspark.drift.corpus import DEFAULT_CORPUS

    path = spec.prompts or DEFAULT_CORPUS
    if not path.is_file() or path.suffix in (".json", ".jsonl"):
        raise ValueError(
            f"--context-sweep pads prompts with real text; --prompts {path} is not a text file. "
            "Fix: pass a text file, or leave --prompts out for the package's corpus"
        )
    ids = tokenizer(spec.target).encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
    if any(not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"{path} tokenizes outside the drafter's vocabulary. Fix: use its target")
    return ids, str(spec.prompts) if spec.prompts else "the package's corpus.txt"


def run(sweep: SweepSpec) -> dict[str, Any]:
    """Every variant at every length: τ with CIs, the break-even τ there, and the break-even length."""
    from vllm_dspark.drift.harness import versions
    from vllm_dspark.drift.variants import load_reference

    spec, lengths = sweep.accept, sorted(sweep.lengths)
    from transformers import AutoConfig

    config, reference, heads = load_reference(str(spec.drafter))
    limit = AutoConfig.from_pretrained(str(spec.target)).max_position_embeddings
    room = limit - spec.max_tokens - config.draft_block_size
    if lengths[-1] > room:
        raise ValueError(
            f"--context-sweep {lengths[-1]} + --max-tokens {spec.max_tokens} + a block of "
            f"{config.draft_block_size} pass the target's max_position_embeddings {limit}. "
            f"Fix: lengths up to {room}"
        )
    ids, source = _padding_ids(spec, config.vocab_size)
    prompts = padded_prompts(ids, tuple(lengths), spec.num_prompts, spec.seed)
    target = Target(
        spec.target, list(config.target_layer_ids), config.target_hidden_size, config.vocab_size
    )
    cells, timing = [], {}
    total = len(spec.variants) * len(lengths) * spec.num_prompts
    with tqdm(total=total, desc="context sweep", unit="prompt", disable=not spec.progress) as bar:
        for name in spec.variants:
            t0 = time.perf_counter()
            drafter, _, label, draft_kv = open_variant(name, spec, config, heads, reference)
            timing[f"load_{label}_s"] = time.perf_counter() - t0
            for length in lengths:
                bar.set_postfix_str(f"{label} {length}")
                t0 = time.perf_counter()
                records = speculate_prompts(target, drafter, prompts[length], spec, None, bar)
                s = summarize(records, config.draft_block_size, spec.resamples, spec.seed)
                tau = s["tau"]["value"]
                cells.append(
                    {
                        "variant": label,
                        "context": length,
                        "draft_kv": draft_kv,
                        "tau": s["tau"],
                        "tau_per_prompt": s["tau_per_prompt"],
                        "per_position_acceptance": s["per_position_acceptance"],
                        "steps": s["steps"],
                        "break_even_tau": sweep.cost.ratio(length),
                        "pays": tau > sweep.cost.ratio(length),
                        "pays_up_to": break_even_context(sweep.cost, tau),
                        "seconds": time.perf_counter() - t0,
                    }
                )
    labels = list(dict.fromkeys(c["variant"] for c in cells))
    break_even = {}
    for label in labels:
        mine = [c for c in cells if c["variant"] == label]
        measured = break_even_length(lengths, [c["tau"]["value"] for c in mine], sweep.cost)
        break_even[label] = {
            "measured": measured,  # None: speculation pays over the whole sweep
            # τ held at the longest length's: where the cost model alone ends it
            "extrapolated": measured if measured is not None else mine[-1]["pays_up_to"],
        }
    return {
        "tool": "vllm-dspark accept --context-sweep",
        "methodology": __doc__,
        "config": {
            "target": str(spec.target),
            "drafter": str(spec.drafter),
            "variants": list(spec.variants),
            "lengths": lengths,
            "padding_text": source,
            "padding_tokens": len(ids),
            "num_prompts": spec.num_prompts,
            "max_tokens": spec.max_tokens,
            "temperature": spec.temperature,
            "draft_kv": spec.draft_kv,
            "block_size": config.draft_block_size,
            "target_max_position_embeddings": limit,
            "validated_context_len": validated_context_len(config.to_dict()),
            "cost": {
                "fixed": sweep.cost.fixed,
                "per_context_token": sweep.cost.per_context_token,
                "source": sweep.cost_source,
            },
            "seed": spec.seed,
            "resamples": spec.resamples,
        },
        "versions": versions(),
        "timing": timing,
        "cells": cells,
        "break_even": break_even,
    }


def _length_text(value: float | None) -> str:
    if value is None:
        return "beyond the sweep"
    return (
        "never pays"
        if value == 0
        else ("always pays" if value == float("inf") else f"{value:,.0f}")
    )


def markdown(results: dict[str, Any]) -> str:
    """The τ-per-length table and the break-even lengths."""
    c = results["config"]
    cost = c["cost"]
    lines = [
        "# Measured acceptance against context length",
        "",
        f"Target `{c['target']}`, drafter `{c['drafter']}`, {c['num_prompts']} prompts padded with "
        f"real text ({c['padding_text']}), {c['max_tokens']} tokens decoded at each length, "
        f"temperature {c['temperature']}, block {c['block_size']}, draft KV cache "
        f"{c['draft_kv']}. τ counts the bonus token; ± is "
        f"the 95 % bootstrap CI over prompts. Step cost: {cost['source']} "
        f"(speculative step / plain step = {cost['fixed']:g} + {cost['per_context_token']:.3g} × L). "
        f"The drafter's validated context: {c['validated_context_len']}.",
        "",
        "| Variant | Context | τ | Break-even τ | Pays | τ pays up to (tokens) |",
        "|---|---|---|---|---|---|",
    ]
    for cell in results["cells"]:
        lines.append(
            f"| {cell['variant']} | {cell['context']} | {fmt_pm(cell['tau'])} | "
            f"{cell['break_even_tau']:.3f} | {'yes' if cell['pays'] else 'no'} | "
            f"{_length_text(cell['pays_up_to'])} |"
        )
    lines += [
        "",
        "| Variant | Break-even length (measured) | Extrapolated (τ held at the longest) |",
    ]
    lines.append("|---|---|---|")
    for label, be in results["break_even"].items():
        lines.append(
            f"| {label} | {_length_text(be['measured'])} | {_length_text(be['extrapolated'])} |"
        )
    return "\n".join(lines) + "\n"


def write_plot(results: dict[str, Any], out: Path) -> list[Path]:
    """τ against context length per variant, with the break-even τ line (none without matplotlib)."""
    from vllm_dspark.plots import pyplot

    plt = pyplot()
    if plt is None:
        return []
    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    for label in results["break_even"]:
        cells = [c for c in results["cells"] if c["variant"] == label]
        xs = [c["context"] for c in cells]
        ys = np.array([c["tau"]["value"] for c in cells])
        lo = ys - [c["tau"]["lo"] for c in cells]
        hi = np.array([c["tau"]["hi"] for c in cells]) - ys
        ax.errorbar(xs, ys, yerr=[lo, hi], capsize=3, marker="o", label=f"{label} τ")
    lengths = results["config"]["lengths"]
    cost = results["config"]["cost"]
    grid = np.geomspace(lengths[0], lengths[-1], 64)
    ax.plot(grid, cost["fixed"] + cost["per_context_token"] * grid, "k--", label="break-even τ")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("τ (accepted + bonus per step)")
    ax.set_title("Measured acceptance against context")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "tau_vs_context.png", dpi=120)
    plt.close(fig)
    return [out / "tau_vs_context.png"]


def write_report(results: dict[str, Any], out: Path) -> list[Path]:
    """``context_sweep.json``, ``context_sweep.md`` and the plot into ``out``."""
    (out / "context_sweep.json").write_text(json.dumps(results, indent=1, allow_nan=True) + "\n")
    (out / "context_sweep.md").write_text(markdown(results))
    return [out / "context_sweep.json", out / "context_sweep.md", *write_plot(results, out)]


def summary_lines(results: dict[str, Any]) -> list[str]:
    """The cost model, one line per variant and length, and the break-even lengths."""
    cost = results["config"]["cost"]
    lines = [
        f"step cost: {cost['source']} ({cost['fixed']:g} + {cost['per_context_token']:.3g} × L)"
    ]
    lines += [
        f"{c['variant']:>8} L {c['context']:>7} τ {fmt_pm(c['tau'])}  break-even τ "
        f"{c['break_even_tau']:.3f}  {'pays' if c['pays'] else 'does not pay'}"
        for c in results["cells"]
    ]
    lines += [
        f"{label:>8} break-even length: {_length_text(be['measured'])} "
        f"(extrapolated {_length_text(be['extrapolated'])})"
        for label, be in results["break_even"].items()
    ]
    return lines
