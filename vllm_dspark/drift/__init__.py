# SPDX-License-Identifier: Apache-2.0
"""Drift evaluation: how far a quantized (or BF16) drafter's drafted blocks move from an FP32 reference.

Acceptance length cannot be measured without the ~1 T-param target in the loop, so a variant's
quality is measured as drift from a high-precision reference on identical inputs: every token
where the two agree is a token whose accept/reject outcome the numerics cannot have changed.

Method:

- Reference = FP32 weights + FP32 compute (a BF16 checkpoint is upcast exactly). ``bf16`` (BF16
  weights, BF16 compute — what ships) is measured as a variant: its drift is the noise floor.
  Formats are never referenced against BF16, which would credit them with BF16's own error.
- Variants: ``bf16``; ``fp8`` / ``mxfp4`` / ``nvfp4`` quantized on the fly from the model
  directory (quantize -> dequantize with ``vllm_dspark.checkpoint.formats`` on exactly the modules the recipe
  names, ``--include-layers``, default the published FP8 build's) and computed in BF16 like the
  served weight-only kernels; or a checkpoint directory (e.g. written by ``vllm-dspark quantize``),
  dequantized and computed in BF16. ``fp32`` (the reference against itself) is the sanity check:
  agreement 1, KL 0.
- Only the unobservable input is shared: the 5 aux hidden states (regimes ``gauss``, ``heavy``,
  ``boot``, and ``real``: the trained target's own, given as ``--target``; rounded to BF16 as vLLM
  hands them over). Each variant runs its own context_proj and
  its own context-KV projections, so quantizing them is measured, not excluded. Anchors come from a
  real token stream (``--corpus``); embedding and lm_head are the target's, shared and unquantized.
- The block backbone is one parallel pass per block. The Markov head is rolled out sequentially in
  every variant, each token feeding the next position's bias.
  * teacher-forced: the variant's Markov bias is fed the reference's tokens, so reference and
    variant distributions share their conditioning: greedy agreement (argmax = reference token),
    1−TV = Σ min(p, q), KL(p‖q) mean and p99, reverse KL(q‖p) — at temperature 1 (raw logits);
  * free-running greedy rollout: sequential rollout agreement (variant token = reference token at
    each position; errors compound through the Markov bias);
  * confidence: each drafter's confidence head on its own free-running rollout, as served;
    Pearson r with the reference, and the scheduling flip rate: how often "confidence above the
    per-block median of the reference's confidences" differs between variant and reference (a
    knife-edge threshold, so only comparisons between variants are meaningful).
- Drift-limited acceptance ceiling, bonus token included:
  ``τ = 1 + Σ_{k=1..N} Π_{i≤k} a_i`` with ``a_i`` the per-position sequential-rollout agreement;
  the most a greedy (temperature 0) target could accept if it agreed with the reference exactly.
  Multiplying marginal agreements that are already compounded by the rollout makes it
  conservative; ``τ prefix`` is the direct count, 1 + the mean length of the leading run of
  positions whose rollout token equals the reference's (exact when the target is the reference).
  ``τ from 1−TV`` is the sampling-aware analogue (rejection sampling, the reference as target):
  the mean over blocks of ``1 + Σ_k Π_{i≤k} (1−TV)_{b,i}``. Both bound acceptance loss from
  numerics; neither is acceptance against Kimi-K3.
- 95 % confidence intervals: percentile bootstrap over blocks (a block's positions share context
  and anchor, so the block is the independent unit).
- ``--positions``: the same metrics with the block's anchor at large position ids (through the YaRN
  regime: original 32768 x factor 32) without a long context: a short context whose position ids
  are offset, its latent KV computed at those positions. Attention sees only relative offsets in
  exact arithmetic, so this measures the precision of positions, rotary tables and attention at
  large ids — not attention over a genuinely long context.
"""

from __future__ import annotations

# Aux hidden-state regimes (drift.regimes builds them); ``real`` needs the full target model.
REGIMES: tuple[str, ...] = ("gauss", "heavy", "boot", "real")
DEFAULT_REGIMES: tuple[str, ...] = REGIMES[:3]
SELF_CHECK = "fp32"  # a second, independently loaded reference: agreement 1, KL 0


def default_variants() -> tuple[str, ...]:
    """``bf16`` and every registered format, quantized on the fly (loads the formats)."""
    from vllm_dspark.checkpoint import formats

    return ("bf16", *formats.names())


def builtin_variants() -> tuple[str, ...]:
    """The variant names that are not checkpoint directories."""
    return (SELF_CHECK, *default_variants())
