# SPDX-License-Identifier: Apache-2.0
"""Measured acceptance of a drafter against its target, per format: what ``vllm-dspark accept`` runs."""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from vllm_dspark.drift import metrics
from vllm_dspark.drift.harness import NON_FINITE_FIX
from vllm_dspark.finite import require_finite

MODES = ("full", "scheduled")


@dataclass(frozen=True)
class AcceptSpec:
    """What ``accept`` measures: a target, its drafter, the variants, the prompts and the decoding."""

    target: Path
    drafter: Path
    variants: tuple[str, ...]
    prompts: Path | None = None  # token-id JSON or text; default: the package's corpus
    num_prompts: int = 16
    prompt_len: int = 32
    max_tokens: int = 64
    temperature: float = 0.0
    scheduled: bool = False
    token_cost: float = 0.1
    seed: int = 0
    resamples: int = 1000
    progress: bool = True
    draft_kv: str = "bf16"  # the draft's KV cache: "bf16" (model dtype) or "fp8" (E4M3 pages)


DRAFT_KV = ("bf16", "fp8")


def use_draft_kv(drafter, mode: str, checkpoint: Path) -> dict[str, Any]:
    """Serve ``drafter``'s latents from a ``mode`` KV cache; returns what the results record of it.

    fp8 takes the per-layer k_scale ``checkpoint`` stores (``quantize --kv-cache-scheme fp8``), else
    1.0: what vLLM's fp8 MLA cache does with that checkpoint.
    """
    from vllm_dspark.checkpoint.store import stored_k_scales

    if mode not in DRAFT_KV:
        raise ValueError(f"--draft-kv takes {' or '.join(DRAFT_KV)}, not {mode!r}")
    if mode == "bf16":
        drafter.use_fp8_kv_cache(None)
        return {"dtype": mode}
    scales = stored_k_scales(checkpoint)
    source = f"calibrated, stored in {checkpoint}"
    if scales is None:
        scales = torch.ones(drafter.config.num_hidden_layers)
        source = f"1.0 ({checkpoint} stores no KV-cache scales)"
    drafter.use_fp8_kv_cache(scales)
    return {"dtype": mode, "k_scales": scales.tolist(), "scales": source}


# ----- prompts -----


def tokenizer(target: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(target))
    except (OSError, ValueError) as e:
        raise ValueError(
            f"text prompts need the target's tokenizer, and {target} has none loadable ({e}). Fix: "
            "pass --prompts as a .json list of token-id lists"
        ) from None


def load_prompts(
    path: Path | None, target: Path, vocab_size: int, *, count: int, length: int, seed: int
) -> tuple[list[list[int]], str]:
    """Prompts as token ids, and where they came from.

    ``.json``: a list (or ``{"prompts": [...]}``, as ``train-pair`` writes) of strings, token-id
    lists or objects with ``token_ids`` / ``prompt`` / ``text``; ``.jsonl``: one such item per line;
    any other file (or none: the drift corpus) is text cut into ``count`` windows of ``length``
    tokens at seeded offsets.
    """
    from vllm_dspark.drift import corpus

    if path is not None and not path.is_file():
        raise ValueError(f"--prompts {path} is not a file. Fix: pass a .json, .jsonl or text file.")
    if path is not None and path.suffix in (".json", ".jsonl"):
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            items = json.loads(text)
        else:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        if isinstance(items, dict):
            items = items.get("prompts")
        if not isinstance(items, list) or not items:
            raise ValueError(
                f"--prompts {path} holds no prompts. Fix: a list of strings or id lists."
            )
        tok = None
        prompts = []
        for item in items:
            if isinstance(item, dict):
                item = next((item[k] for k in ("token_ids", "prompt", "text") if k in item), None)
            if isinstance(item, str):
                tok = tok or tokenizer(target)
                prompts.append(tok.encode(item, add_special_tokens=False))
            elif isinstance(item, list) and item and all(isinstance(t, int) for t in item):
                prompts.append(list(item))
            else:
                raise ValueError(
                    f"--prompts {path}: each prompt must be a non-empty string or token-id list, "
                    f"got {str(item)[:40]!r}"
                )
        source = str(path)
    else:
        text_path = path or corpus.DEFAULT_CORPUS
        ids = tokenizer(target).encode(
            text_path.read_text(encoding="utf-8"), add_special_tokens=False
        )
        starts = corpus.window_starts(len(ids), length, count, seed)
        prompts = [ids[s : s + length] for s in starts.tolist()]
        source = f"{count} windows of {length} tokens from {text_path}"
    bad = [t for p in prompts for t in p if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt token {bad[0]} is outside the vocabulary [0, {vocab_size}). Fix: tokenize "
            "with the target's tokenizer"
        )
    return prompts, source


# ----- the target -----


class Target:
    """The target model with its KV cache: logits and the drafter's aux states for new tokens."""

    def __init__(self, path: Path, layer_ids: list[int], hidden: int, vocab: int) -> None:
        from vllm_dspark.reference.target import load_target

        self.model = load_target(path, layer_ids, hidden, vocab)
        self.layer_ids = layer_ids
        self.cache = None

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)

    def forward(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ``ids`` after the cached tokens: ``(logits [n, V] fp32, aux [n, W] bf16)``."""
        from vllm_dspark.reference.target import target_states

        logits, aux = target_states(self.model, torch.tensor([ids]), self.layer_ids, self.cache)
        # NaN logits argmax to token 0 on both sides: refused, so they never count as acceptance.
        require_finite(logits, "the target's logits", NON_FINITE_FIX)
        return logits[0], aux[0]

    def keep(self, length: int) -> None:
        """Drop cached tokens beyond the first ``length`` (the rejected drafts)."""
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            self.cache.crop(-extra)

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        """The target's own greedy decode: the losslessness reference."""
        self.reset()
        logits, _ = self.forward(prompt)
        out = [int(logits[-1].argmax())]
        while len(out) < max_tokens:
            logits, _ = self.forward(out[-1:])
            out.append(int(logits[-1].argmax()))
        return out


# ----- speculative decoding -----


@dataclass
class PromptRecord:
    """One prompt's speculative decode under one variant and mode."""

    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # per step: drafts kept
    verified: list[int] = field(default_factory=list)  # per step: drafts the target verified
    # the confidence of each verified position up to the first rejection, and whether it was accepted
    confidences: list[float] = field(default_factory=list)
    labels: list[bool] = field(default_factory=list)


def _generator(seed: int, *key: int) -> torch.Generator:
    state = np.random.SeedSequence([seed, *key]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state >> np.uint64(1)))


def speculate(
    target: Target,
    drafter,
    prompt: list[int],
    *,
    max_tokens: int,
    temperature: float,
    seed: int,
    token_cost: float | None,
) -> PromptRecord:
    """Decode ``max_tokens`` tokens after ``prompt`` by drafting a block and verifying it, repeatedly.

    ``token_cost`` set: the confidence head picks each step's verify budget (adaptive verification).
    """
    from vllm_dspark.ops.verify import adaptive_budget, block_verify, greedy_verify

    rec = PromptRecord()
    vocab = drafter.config.vocab_size
    rng = _generator(seed, 0x5EC)
    target.reset()
    logits, aux = target.forward(prompt)
    if temperature == 0:
        first = int(logits[-1].argmax())
    else:
        gumbel = -torch.log(-torch.log(torch.rand(vocab, generator=rng, dtype=torch.float64)))
        first = int((torch.log_softmax(logits[-1].double(), -1) + gumbel).argmax())
    tokens = [*prompt, first]
    while len(tokens) - len(prompt) < max_tokens:
        context = len(tokens) - 1  # every token but the anchor has its aux state
        draft = drafter.draft(
            aux[None],
            torch.arange(context)[None],
            torch.tensor([tokens[-1]]),
            temperature=temperature,
            seeds=torch.tensor([seed]),
        )
        require_finite(draft.logits, "the drafter's logits", NON_FINITE_FIX)
        drafts = draft.tokens[0]
        conf = draft.confidences[0] if draft.confidences is not None else None
        budget = len(drafts) if token_cost is None else adaptive_budget(conf, token_cost)
        drafts = drafts[:budget]
        logits, new_aux = target.forward([tokens[-1], *drafts.tolist()])
        if temperature == 0:
            verdict = greedy_verify(logits[None], drafts[None])
        else:
            uniforms = 1.0 - torch.rand(1, budget, generator=rng, dtype=torch.float64)
            u = torch.rand(1, vocab, generator=rng, dtype=torch.float64).clamp_min(1e-300)
            verdict = block_verify(
                torch.softmax(logits.double(), -1)[None],
                torch.softmax(draft.logits[0, :budget].double() / temperature, -1)[None],
                drafts[None],
                uniforms,
                -torch.log(-torch.log(u)),
            )
        kept = int(verdict.num_accepted[0])
        rec.accepted.append(kept)
        rec.verified.append(budget)
        if conf is not None:
            reached = min(kept + 1, budget)  # positions whose prefix was accepted
            rec.confidences += conf[:reached].tolist()
            rec.labels += [k < kept for k in range(reached)]
        target.keep(len(tokens) + kept)
        aux = torch.cat([aux, new_aux[: kept + 1]])
        tokens += [*drafts[:kept].tolist(), int(verdict.next_token[0])]
    rec.tokens = tokens[len(prompt) :][:max_tokens]
    return rec


# ----- figures -----


def open_variant(
    name: str, spec: AcceptSpec, config, heads, reference
) -> tuple[Any, str, str, dict[str, Any]]:
    """One variant's drafter with its draft KV applied: the drafter, its source, its label, its draft-KV record."""
    from vllm_dspark.drift.variants import load_variant, variant_label

    if name == "fp32":
        drafter, source = reference, "the FP32 reference"
    else:
        drafter, source = load_variant(name, str(spec.drafter), config, heads, reference)
    checkpoint = Path(name) if Path(name).is_dir() else spec.drafter
    return drafter, source, variant_label(name), use_draft_kv(drafter, spec.draft_kv, checkpoint)


def speculate_prompts(
    target: Target,
    drafter,
    prompts: list[list[int]],
    spec: AcceptSpec,
    token_cost: float | None,
    bar,
) -> list[PromptRecord]:
    """One record per prompt, each seeded by its index; ``bar`` advances a step per prompt."""
    records = []
    for i, prompt in enumerate(prompts):
        records.append(
            speculate(
                target,
                drafter,
                prompt,
                max_tokens=spec.max_tokens,
                temperature=spec.temperature,
                seed=spec.seed * 1_000_003 + i,
                token_cost=token_cost,
            )
        )
        bar.update(1)
    return records


def summarize(records: list[PromptRecord], block: int, resamples: int, seed: int) -> dict[str, Any]:
    """τ, per-position acceptance, the confidence AUC and the verify cost, with CIs over prompts."""
    idx = metrics.bootstrap_indices(len(records), resamples, seed)
    steps = np.array([len(r.accepted) for r in records], dtype=np.float64)
    emitted = np.array([sum(a + 1 for a in r.accepted) for r in records], dtype=np.float64)
    verified = np.array([sum(b + 1 for b in r.verified) for r in records], dtype=np.float64)
    reached = np.zeros((len(records), block))
    passed = np.zeros((len(records), block))
    for i, r in enumerate(records):
        for kept, budget in zip(r.accepted, r.verified):
            reached[i, : min(kept + 1, budget)] += 1
            passed[i, :kept] += 1

    def ratio(num, den):
        return num.sum(1) / den.sum(1)

    def per_position(num, den):
        with np.errstate(invalid="ignore", divide="ignore"):
            return num.sum(1) / den.sum(1)

    tau = metrics.estimate(ratio, [emitted, steps], idx)
    cost = metrics.estimate(ratio, [verified, emitted], idx)
    with warnings.catch_warnings():  # a position no step reached has no rate: NaN, not a warning
        warnings.simplefilter("ignore", RuntimeWarning)
        positions = metrics.estimates(per_position, [passed, reached], idx)
    scores = [np.asarray(r.confidences) for r in records]
    labels = [np.asarray(r.labels, dtype=bool) for r in records]
    auc = metrics.NO_ESTIMATE
    if any(len(s) for s in scores):
        samples = [
            metrics.auc(
                np.concatenate([scores[j] for j in row]), np.concatenate([labels[j] for j in row])
            )
            for row in idx
        ]
        with warnings.catch_warnings():  # no resample with both classes: NaN bounds
            warnings.simplefilter("ignore", RuntimeWarning)
            lo, hi = np.nanquantile(samples, [0.025, 0.975])
        auc = metrics.Estimate(
            metrics.auc(np.concatenate(scores), np.concatenate(labels)), float(lo), float(hi)
        )
    return {
        "tau": tau.as_dict(),
        "target_tokens_per_accepted": cost.as_dict(),
        "per_position_acceptance": [e.as_dict() for e in positions],
        "confidence_auc": auc.as_dict(),
        "steps": int(steps.sum()),
        "tau_per_prompt": (emitted / steps).tolist(),
    }


# ----- the run -----


def run(spec: AcceptSpec) -> dict[str, Any]:
    from vllm_dspark.drift.harness import versions
    from vllm_dspark.drift.variants import load_reference

    config, reference, heads = load_reference(str(spec.drafter))
    target = Target(
        spec.target, list(config.target_layer_ids), config.target_hidden_size, config.vocab_size
    )
    prompts, source = load_prompts(
        spec.prompts,
        spec.target,
        config.vocab_size,
        count=spec.num_prompts,
        length=spec.prompt_len,
        seed=spec.seed,
    )
    modes = MODES if spec.scheduled else MODES[:1]
    if spec.scheduled and reference.confidence_head is None:
        raise ValueError("--scheduled needs a confidence head; this drafter has none.")
    total = len(prompts) * len(spec.variants) * len(modes)
    timing: dict[str, float] = {}
    baseline: list[list[int]] = []
    if spec.temperature == 0:
        t0 = time.perf_counter()
        for p in tqdm(prompts, desc="target greedy", unit="prompt", disable=not spec.progress):
            baseline.append(target.greedy(p, spec.max_tokens))
        timing["baseline_s"] = time.perf_counter() - t0
    cells = []
    with tqdm(total=total, desc="accept", unit="prompt", disable=not spec.progress) as bar:
        for name in spec.variants:
            t0 = time.perf_counter()
            drafter, source_v, label, draft_kv = open_variant(name, spec, config, heads, reference)
            timing[f"load_{label}_s"] = time.perf_counter() - t0
            for mode in modes:
                t0 = time.perf_counter()
                bar.set_postfix_str(f"{label} {mode}")
                cost = spec.token_cost if mode == "scheduled" else None
                records = speculate_prompts(target, drafter, prompts, spec, cost, bar)
                cell = {
                    "variant": label,
                    "mode": mode,
                    "source": source_v,
                    "draft_kv": draft_kv,
                    **summarize(records, config.draft_block_size, spec.resamples, spec.seed),
                    "seconds": time.perf_counter() - t0,
                }
                if baseline:
                    cell["lossless"] = [r.tokens == b for r, b in zip(records, baseline)]
                cells.append(cell)
    return {
        "tool": "vllm-dspark accept",
        "methodology": __doc__,
        "config": {
            "target": str(spec.target),
            "drafter": str(spec.drafter),
            "variants": list(spec.variants),
            "prompts": source,
            "num_prompts": len(prompts),
            "prompt_tokens": [len(p) for p in prompts],
            "max_tokens": spec.max_tokens,
            "temperature": spec.temperature,
            "scheduled": spec.scheduled,
            "token_cost": spec.token_cost,
            "block_size": config.draft_block_size,
            "causal": config.causal,
            "target_layer_ids": list(config.target_layer_ids),
            "seed": spec.seed,
            "resamples": spec.resamples,
            "draft_kv": spec.draft_kv,
        },
        "versions": versions(),
        "timing": timing,
        "cells": cells,
    }


def markdown(results: dict[str, Any]) -> str:
    """The per-format table."""
    c = results["config"]
    lines = [
        "# Measured acceptance",
        "",
        f"Target `{c['target']}`, drafter `{c['drafter']}`, {c['num_prompts']} prompts "
        f"({c['prompts']}), {c['max_tokens']} tokens each, temperature {c['temperature']}, "
        f"block {c['block_size']}. τ counts the bonus token; ± is the 95 % bootstrap CI over prompts.",
        *_draft_kv_lines(results),
        "",
        "| Variant | Mode | τ | Per-position acceptance | Confidence AUC | Target tokens / accepted | Lossless |",
        "|---|---|---|---|---|---|---|",
    ]
    for cell in results["cells"]:
        per_pos = " ".join(f"{e['value']:.2f}" for e in cell["per_position_acceptance"])
        lossless = cell.get("lossless")
        lossless = "n/a" if lossless is None else f"{sum(lossless)}/{len(lossless)}"
        auc = cell["confidence_auc"]
        auc_text = "n/a" if not np.isfinite(auc["value"]) else fmt_pm(auc, 3)
        lines.append(
            f"| {cell['variant']} | {cell['mode']} | {fmt_pm(cell['tau'])} | {per_pos} | "
            f"{auc_text} | {fmt_pm(cell['target_tokens_per_accepted'])} | {lossless} |"
        )
    return "\n".join(lines) + "\n"


def _draft_kv_lines(results: dict[str, Any]) -> list[str]:
    """Under an fp8 draft KV cache, one line per variant naming its k_scales and where they came from."""
    if results["config"].get("draft_kv", "bf16") == "bf16":
        return []
    seen = {c["variant"]: c["draft_kv"] for c in results["cells"]}
    return [
        "",
        *(
            f"Draft KV cache of {variant}: FP8 E4M3, k_scale "
            f"{', '.join(f'{s:.4g}' for s in kv['k_scales'])} ({kv['scales']})."
            for variant, kv in seen.items()
        ),
    ]


def fmt_pm(est: dict[str, float], digits: int = 2) -> str:
    return f"{est['value']:.{digits}f} ± {(est['hi'] - est['lo']) / 2:.{digits}f}"


def write_plots(results: dict[str, Any], out: Path) -> list[Path]:
    """τ per variant and per-position acceptance, as PNGs (none without matplotlib)."""
    from vllm_dspark.plots import pyplot

    plt = pyplot()
    if plt is None:
        return []
    cells = results["cells"]
    names = [f"{c['variant']}\n{c['mode']}" for c in cells]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(cells)), 3.4))
    values = [c["tau"]["value"] for c in cells]
    errors = [
        [v - c["tau"]["lo"] for v, c in zip(values, cells)],
        [c["tau"]["hi"] - v for v, c in zip(values, cells)],
    ]
    ax.bar(names, values, yerr=errors, capsize=4, color="tab:blue")
    ax.set_ylabel("τ (accepted + bonus per step)")
    ax.set_title(f"Measured acceptance length, temperature {results['config']['temperature']}")
    fig.tight_layout()
    fig.savefig(out / "tau.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    for c in cells:
        est = c["per_position_acceptance"]
        xs = np.arange(1, len(est) + 1)
        ax.errorbar(
            xs,
            [e["value"] for e in est],
            yerr=[[e["value"] - e["lo"] for e in est], [e["hi"] - e["value"] for e in est]],
            label=f"{c['variant']} {c['mode']}",
            capsize=3,
            marker="o",
        )
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | prefix accepted)")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "acceptance_per_position.png", dpi=120)
    plt.close(fig)
    return [out / "tau.png", out / "acceptance_per_position.png"]


def write_report(results: dict[str, Any], out: Path) -> list[Path]:
    """``results.json``, ``results.md`` and the plots into ``out``."""
    (out / "results.json").write_text(json.dumps(results, indent=1, allow_nan=True) + "\n")
    (out / "results.md").write_text(markdown(results))
    return [out / "results.json", out / "results.md", *write_plots(results, out)]


def summary_lines(results: dict[str, Any]) -> list[str]:
    """One line per measured cell: variant, mode and τ with its CI."""
    return [
        f"{cell['variant']:>8} {cell['mode']:<9} τ {fmt_pm(cell['tau'])}" + _kv_note(cell)
        for cell in results["cells"]
    ]


def _kv_note(cell: dict[str, Any]) -> str:
    kv = cell.get("draft_kv", {"dtype": "bf16"})
    return "" if kv["dtype"] == "bf16" else f"  (draft KV fp8, k_scale {kv['scales']})"
