# SPDX-License-Identifier: Apache-2.0
"""Drift evaluation: how far a quantized (or BF16) drafter's drafted blocks move from an FP32 reference."""

from __future__ import annotations

# Aux hidden-state regimes (drift.regimes builds them); ``real`` needs the full target model.
REGIMES: tuple[str, ...] = ("gauss", "heavy", "boot", "real")
DEFAULT_REGIMES: tuple[str, ...] = REGIMES[:3]
SELF_CHECK = "fp32"  # a second, independently loaded reference: agreement 1, KL 0
# The method, metric by metric, lives once: in the repository's docs.
METHOD = "The method, metric by metric: docs/drift.md#method in the vllm_dspark repository."


def default_variants() -> tuple[str, ...]:
    """``bf16`` and every weight-only format, quantized on the fly (loads the formats).

    The W8A8 / W4A4 formats wait for the harness to quantize activations as well (issue #28).
    """
    from vllm_dspark.checkpoint import formats

    return ("bf16", *(n for n in formats.names() if formats.get(n).activation is None))


def builtin_variants() -> tuple[str, ...]:
    """The variant names that are not checkpoint directories."""
    return (SELF_CHECK, *default_variants())
