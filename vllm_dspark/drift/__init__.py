# SPDX-License-Identifier: Apache-2.0
"""Drift evaluation: how far a quantized (or BF16) drafter's drafted blocks move from an FP32 reference."""

from __future__ import annotations

# Aux hidden-state regimes (drift.regimes builds them); ``real`` needs the full target model.
REGIMES: tuple[str, ...] = ("gauss", "heavy", "boot", "real")
DEFAULT_REGIMES: tuple[str, ...] = REGIMES[:3]
SELF_CHECK = "fp32"  # a second, independently loaded reference: agreement 1, KL 0
# The method, metric by metric, lives once: in the repository's docs.
METHOD = "The method, metric by metric: docs/drift.md#method in the vllm_dspark repository."


def on_the_fly_variants() -> tuple[str, ...]:
    """``bf16`` and every registered format, quantized on the fly (loads the formats); W8A8 / W4A4
    ones quantize their inputs too, as the served model does."""
    from vllm_dspark.checkpoint import formats

    return ("bf16", *formats.names())


def default_variants() -> tuple[str, ...]:
    """:func:`on_the_fly_variants` but block formats, which are named explicitly: their 128x128
    blocks tile only shapes of that size (the real drafter's, not the test presets')."""
    from vllm_dspark.checkpoint import formats

    return tuple(n for n in on_the_fly_variants() if n == "bf16" or formats.get(n).block is None)


def builtin_variants() -> tuple[str, ...]:
    """The variant names that are not checkpoint directories."""
    return (SELF_CHECK, *on_the_fly_variants())
