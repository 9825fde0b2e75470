# SPDX-License-Identifier: Apache-2.0
"""Runs the drift evaluation: the FP32 reference once, then each variant, one loaded at a time.

Each variant runs its backbone once per block and rolls the Markov head twice over the same base
logits (teacher-forced and free-running differ only in the Markov bias). The reference's rollout
logits are the teacher-forced logits every variant is compared with, so they are kept per cell in
a memory-mapped file under ``$TMPDIR``, not recomputed per variant. The reference keeps its BF16
storage (upcast per use, exact) and shares the target's heads with every variant. The reference
runs MLA naively, BF16 variants in the absorbed form the served kernels use (equal in exact math).
"""

from __future__ import annotations

import gc
import platform
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

import vllm_dspark.drift as drift_pkg
from vllm_dspark.checkpoint.layout import FP8_RECIPE
from vllm_dspark.config import K3DSparkConfig
from vllm_dspark.drift import (
    DEFAULT_REGIMES,
    REGIMES,
    SELF_CHECK,
    builtin_variants,
    default_variants,
    metrics,
)
from vllm_dspark.drift import corpus as corpus_mod
from vllm_dspark.drift.regimes import HEAVY_SIGMA, boot_aux, synthetic_aux
from vllm_dspark.drift.variants import load_reference, load_variant, variant_label
from vllm_dspark.finite import require_finite
from vllm_dspark.ops.sampling import markov_rollout
from vllm_dspark.reference.drafter import ReferenceDrafter
from vllm_dspark.reference.target import load_target, target_states
from vllm_dspark.safety import spill_dir
from vllm_dspark.version import __version__


@dataclass(frozen=True)
class EvalSpec:
    """Everything a drift run depends on (recorded verbatim in results.json)."""

    model: str
    variants: tuple[str, ...] = field(default_factory=default_variants)
    regimes: tuple[str, ...] = DEFAULT_REGIMES
    blocks: int = 1024
    batch_size: int = 32
    context_len: int = 32
    positions: tuple[
        int, ...
    ] = ()  # anchor positions to sweep, beyond the base position context_len
    seed: int = 0
    device: str = "cpu"
    corpus: str | None = None
    tokenizer: str | None = None
    target: str | None = None
    include_layers: tuple[str, ...] = FP8_RECIPE
    resamples: int = 1000
    heavy_sigma: float = HEAVY_SIGMA
    progress: bool = True

    def all_positions(self) -> list[int]:
        """The base position (context at 0 .. context_len - 1) followed by the sweep, ascending."""
        return sorted({self.context_len, *self.positions})


# ----- inputs -----


@dataclass
class Blocks:
    """The shared inputs of a run: a token window per block (context tokens, then the anchor)."""

    windows: torch.Tensor  # [blocks, context_len + 1] int64
    source: str
    # [blocks, context_len, aux width] bf16 per token-driven regime (boot, real) that runs
    states: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def anchors(self) -> torch.Tensor:
        return self.windows[:, -1]


@dataclass
class Batch:
    ids: np.ndarray  # [B] block indices
    aux: torch.Tensor  # [B, T, aux width] bf16
    anchors: torch.Tensor  # [B]
    context_positions: torch.Tensor  # [B, T]
    block_positions: torch.Tensor  # [B, N]


def batches(
    spec: EvalSpec, config: K3DSparkConfig, blocks: Blocks, regime: str, position: int
) -> Iterator[Batch]:
    """The blocks of one (regime, anchor position) cell in fixed batches, on ``spec.device``."""
    t, n = spec.context_len, config.draft_block_size
    dev = spec.device
    for start in range(0, spec.blocks, spec.batch_size):
        ids = np.arange(start, min(start + spec.batch_size, spec.blocks))
        if regime in blocks.states:
            aux = blocks.states[regime][ids]
        else:
            aux = synthetic_aux(
                regime,
                ids.tolist(),
                t,
                config.num_target_layers,
                config.target_hidden_size,
                spec.seed,
                heavy_sigma=spec.heavy_sigma,
            )
        b = len(ids)
        yield Batch(
            ids=ids,
            aux=aux.to(dev),
            anchors=blocks.anchors[ids].to(dev),
            context_positions=torch.arange(position - t, position, device=dev).expand(b, t),
            block_positions=torch.arange(position, position + n, device=dev).expand(b, n),
        )


def timed_batches(cell_batches: Iterator[Batch], record: dict[str, list]) -> Iterator[Batch]:
    """``cell_batches``, appending each batch's block count and the seconds its consumer spent on it
    to ``record["blocks"]`` and ``record["seconds"]``."""
    for batch in cell_batches:
        start = time.perf_counter()
        yield batch
        record["blocks"].append(len(batch.ids))
        record["seconds"].append(time.perf_counter() - start)


def make_blocks(spec: EvalSpec, config: K3DSparkConfig, reference: ReferenceDrafter) -> Blocks:
    stream, source = corpus_mod.load_corpus(
        spec.corpus, tokenizer=spec.tokenizer, vocab_size=config.vocab_size
    )
    window = spec.context_len + 1
    starts = corpus_mod.window_starts(len(stream), window, spec.blocks, spec.seed)
    windows = torch.from_numpy(np.stack([stream[s : s + window] for s in starts]))
    blocks = Blocks(windows=windows, source=source)
    makers = {"boot": lambda ids: boot_aux(reference, ids, config.num_target_layers)}
    if "real" in spec.regimes:
        target = load_target(
            spec.target or Path(spec.model) / "target",
            config.target_layer_ids,
            config.target_hidden_size,
            config.vocab_size,
        ).to(spec.device)
        makers["real"] = lambda ids: target_states(target, ids, config.target_layer_ids)[1]
    for regime in (r for r in spec.regimes if r in makers):
        parts = []
        with tqdm(
            total=spec.blocks, desc=f"{regime} aux states", unit="block", disable=not spec.progress
        ) as bar:
            for start in range(0, spec.blocks, spec.batch_size):
                ids = windows[start : start + spec.batch_size, :-1].to(spec.device)
                parts.append(makers[regime](ids).cpu())
                bar.update(len(ids))
        blocks.states[regime] = torch.cat(parts)
    return blocks


# ----- passes -----


def backbone(
    drafter: ReferenceDrafter, batch: Batch, *, absorbed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One parallel block pass from the shared aux states: ``(hidden [B, N, H], base logits [B, N, V])``."""
    context = drafter.combine_hidden_states(batch.aux)
    kv = drafter.context_kv(context, batch.context_positions)
    hidden = drafter.block_hidden(batch.anchors, kv, batch.block_positions, absorbed=absorbed)
    return hidden, drafter.base_logits(hidden)


def confidence(
    drafter: ReferenceDrafter, hidden: torch.Tensor, markov_embeds: torch.Tensor
) -> torch.Tensor:
    if drafter.confidence_head is None:
        return torch.full(hidden.shape[:-1], float("nan"))
    return drafter.confidence(hidden, markov_embeds).float()


NON_FINITE_FIX = (
    "its weights or the target heads hold NaN or Inf values, or scales overflow: run `vllm-dspark "
    "check` on it and re-export or re-quantize it"
)


@dataclass
class ReferenceCell:
    """The reference's results on one cell's blocks: all the harness keeps of them."""

    logits: np.ndarray  # [blocks, N, V] fp32 memory map: the rollout's logits, Markov bias included
    tokens: list[torch.Tensor] = field(default_factory=list)  # per batch [B, N]
    conf: list[torch.Tensor] = field(default_factory=list)  # per batch [B, N]

    def batch_logits(self, batch: Batch) -> torch.Tensor:
        return torch.from_numpy(np.array(self.logits[batch.ids[0] : batch.ids[-1] + 1]))


@torch.inference_mode()
def reference_cell(
    reference: ReferenceDrafter,
    cell_batches: Iterator[Batch],
    spill: Path,
    shape: tuple[int, ...],
    bar: tqdm,
) -> ReferenceCell:
    out = ReferenceCell(
        logits=np.lib.format.open_memmap(spill, mode="w+", dtype=np.float32, shape=shape)
    )
    for batch in cell_batches:
        hidden, logits = backbone(reference, batch, absorbed=False)
        rollout = markov_rollout(
            logits, batch.anchors, reference.markov_embed, reference.markov_bias
        )
        require_finite(rollout.logits, "the reference's logits", NON_FINITE_FIX)
        out.logits[batch.ids[0] : batch.ids[-1] + 1] = rollout.logits.cpu().numpy()
        out.tokens.append(rollout.tokens)
        out.conf.append(confidence(reference, hidden, rollout.markov_embeds))
        bar.update(len(batch.ids))
    out.logits.flush()
    return out


def _divergence(
    ref_logits: torch.Tensor, var_logits: torch.Tensor, rows: int = 4
) -> metrics.TokenDivergence:
    """:func:`metrics.token_divergence` a few blocks at a time: its float64 temporaries are
    ~10 x ``[rows, N, V]``, a few hundred MiB per 4 blocks at V = 163840."""
    parts = [
        metrics.token_divergence(r, v)
        for r, v in zip(ref_logits.split(rows), var_logits.split(rows))
    ]
    fields = ("overlap", "kl", "reverse_kl")
    return metrics.TokenDivergence(*(torch.cat([getattr(p, f) for p in parts]) for f in fields))


@torch.inference_mode()
def variant_cell(
    variant: ReferenceDrafter,
    ref: ReferenceCell,
    cell_batches: Iterator[Batch],
    bar: tqdm,
    variant_name: str,
    *,
    absorbed: bool,
) -> metrics.BlockRecords:
    parts = []
    for i, batch in enumerate(cell_batches):
        ref_tokens = ref.tokens[i]
        forced = torch.cat([batch.anchors[:, None], ref_tokens[:, :-1]], dim=1)
        hidden, logits = backbone(variant, batch, absorbed=absorbed)
        free = markov_rollout(logits, batch.anchors, variant.markov_embed, variant.markov_bias)
        forced_var = markov_rollout(
            logits, batch.anchors, variant.markov_embed, variant.markov_bias, forced_prev=forced
        )
        var_conf = confidence(variant, hidden, free.markov_embeds)
        del logits
        # NaN logits argmax to token 0 on both sides: refused, so they never count as agreement.
        for rollout in (free, forced_var):
            require_finite(rollout.logits, f"variant {variant_name}'s logits", NON_FINITE_FIX)
        div = _divergence(ref.batch_logits(batch).to(forced_var.logits.device), forced_var.logits)
        parts.append(
            metrics.BlockRecords(
                tf_agree=(forced_var.tokens == ref_tokens).cpu().numpy(),
                rollout_agree=(free.tokens == ref_tokens).cpu().numpy(),
                overlap=div.overlap.cpu().numpy(),
                kl=div.kl.cpu().numpy(),
                reverse_kl=div.reverse_kl.cpu().numpy(),
                ref_conf=ref.conf[i].cpu().numpy(),
                var_conf=var_conf.cpu().numpy(),
            )
        )
        bar.update(len(batch.ids))
    return metrics.BlockRecords.concat(parts)


# ----- the run -----


def versions() -> dict[str, str]:
    import compressed_tensors
    import transformers

    return {
        "vllm_dspark": __version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "transformers": transformers.__version__,
        "compressed_tensors": compressed_tensors.__version__,
        "python": platform.python_version(),
    }


def validate(spec: EvalSpec, config: K3DSparkConfig) -> None:
    unknown = [r for r in spec.regimes if r not in REGIMES]
    if unknown:
        raise ValueError(
            f"unknown regime(s) {', '.join(unknown)}; choose from {', '.join(REGIMES)}"
        )
    if spec.blocks < 2 or spec.batch_size < 1 or spec.context_len < 1 or spec.resamples < 1:
        raise ValueError(
            "--blocks must be >= 2 (a bootstrap needs blocks to resample), --batch-size, "
            f"--context-len and --resamples >= 1; got {spec.blocks}, {spec.batch_size}, "
            f"{spec.context_len} and {spec.resamples}"
        )
    unknown = [v for v in spec.variants if v not in builtin_variants() and not Path(v).is_dir()]
    if unknown:
        raise ValueError(
            f"unknown variant(s) {', '.join(map(repr, unknown))}: use {', '.join(builtin_variants())} "
            "or checkpoint directories"
        )
    labels = [variant_label(v) for v in spec.variants]
    if len(set(labels)) != len(labels):
        raise ValueError(f"variant labels must be unique, got {labels}")
    top = config.max_position_embeddings - config.draft_block_size
    bad = [p for p in spec.positions if not spec.context_len <= p <= top]
    if bad:
        raise ValueError(
            f"--positions {bad} out of range: the anchor position must leave room for the context "
            f"before it (>= --context-len {spec.context_len}) and the block after it "
            f"(<= max_position_embeddings - block_size = {top})"
        )


def run(spec: EvalSpec) -> dict[str, Any]:
    """Evaluate every variant on every (regime, position) cell; returns the JSON-ready results."""
    timing: dict[str, float] = {}
    t0 = time.perf_counter()
    config, reference, heads = load_reference(spec.model, target=spec.target, device=spec.device)
    validate(spec, config)
    timing["load_reference_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    blocks = make_blocks(spec, config, reference)
    timing["inputs_s"] = time.perf_counter() - t0

    cells = [(r, p) for r in spec.regimes for p in spec.all_positions()]
    total = spec.blocks * len(cells)
    results_cells: list[dict[str, Any]] = []
    sources: dict[str, str] = {}
    # Every batch of every pass, timed: the run's own spread, and its slowest case.
    reference_pass: dict[str, list] = {"blocks": [], "seconds": []}
    variant_passes: dict[str, dict[str, list]] = {}
    with spill_dir() as spill_root:
        t0 = time.perf_counter()
        ref_cells: dict[tuple[str, int], ReferenceCell] = {}
        with tqdm(
            total=total, desc="reference fp32", unit="block", disable=not spec.progress
        ) as bar:
            for regime, position in cells:
                cell_batches = batches(spec, config, blocks, regime, position)
                spill = spill_root / f"reference-{regime}-{position}.npy"
                shape = (spec.blocks, config.draft_block_size, config.vocab_size)
                ref_cells[regime, position] = reference_cell(
                    reference, timed_batches(cell_batches, reference_pass), spill, shape, bar
                )
        timing["reference_s"] = time.perf_counter() - t0

        indices = metrics.bootstrap_indices(spec.blocks, spec.resamples, spec.seed)
        for name in spec.variants:
            label = variant_label(name)
            t0 = time.perf_counter()
            if name == SELF_CHECK:
                # Loaded again from disk: comparing the reference object with itself would prove nothing.
                _, variant, _ = load_reference(spec.model, target=spec.target, device=spec.device)
                sources[label] = (
                    "a second FP32 reference, loaded independently (FP32 weights, FP32 compute)"
                )
            else:
                variant, sources[label] = load_variant(
                    name,
                    spec.model,
                    config,
                    heads,
                    reference,
                    include_layers=spec.include_layers,
                    device=spec.device,
                )
            timing[f"load_{label}_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            with tqdm(total=total, desc=label, unit="block", disable=not spec.progress) as bar:
                for regime, position in cells:
                    # Variants attend in the absorbed form the GPU kernels run; the self-check in the
                    # reference's own naive form, so it is exact.
                    records = variant_cell(
                        variant,
                        ref_cells[regime, position],
                        timed_batches(
                            batches(spec, config, blocks, regime, position),
                            variant_passes.setdefault(label, {"blocks": [], "seconds": []}),
                        ),
                        bar,
                        label,
                        absorbed=name != SELF_CHECK,
                    )
                    results_cells.append(
                        {
                            "variant": label,
                            "regime": regime,
                            "position": position,
                            "metrics": metrics.summarize(records, indices),
                        }
                    )
            timing[f"eval_{label}_s"] = time.perf_counter() - t0
            del variant
            gc.collect()
        ref_cells.clear()  # unmap the spill files before their directory goes

    timing["passes"] = {"reference": reference_pass, "variants": variant_passes}
    evaluated = total * len(spec.variants)
    timing["blocks_per_s"] = evaluated / max(
        sum(v for k, v in timing.items() if k.startswith("eval_")), 1e-9
    )
    return {
        "tool": "vllm-dspark eval",
        "methodology": drift_pkg.METHOD,
        "config": {
            **asdict(spec),
            "variants": [variant_label(v) for v in spec.variants],
            "variant_sources": sources,
            "regimes": list(spec.regimes),
            "positions": spec.all_positions(),
            "recipe": list(spec.include_layers),
            "block_size": config.draft_block_size,
            "causal": config.causal,
            "corpus_source": blocks.source,
            "original_max_position_embeddings": config.rope_parameters.get(
                "original_max_position_embeddings"
            ),
            "rope_parameters": dict(config.rope_parameters),
            "drafter": {
                k: getattr(config, k)
                for k in (
                    "hidden_size",
                    "intermediate_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "q_lora_rank",
                    "kv_lora_rank",
                    "qk_rope_head_dim",
                    "vocab_size",
                    "markov_rank",
                    "num_target_layers",
                    "target_hidden_size",
                    "max_position_embeddings",
                )
            },
            "seeds": {
                "root": spec.seed,
                "aux": "SeedSequence([seed, regime, block + 1])",
                "corpus_windows": "default_rng([seed, 0xC0])",
                "bootstrap": "default_rng(seed)",
            },
        },
        "versions": versions(),
        "timing": timing,
        "cells": results_cells,
    }
