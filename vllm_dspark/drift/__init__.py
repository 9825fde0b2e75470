# SPDX-License-Identifier: Apache-2.0
"""Drift evaluation: how far a quantized (or BF16) drafter's blocks move from an FP32 reference.

Acceptance length needs the target in the loop, so a variant is measured as drift from an FP32
reference on identical inputs (the 5 aux hidden states, in the regimes of :mod:`.regimes`). The
method, the metrics and the acceptance ceilings are described once, in the README's "Drift
evaluation" section; :mod:`.metrics` holds the formulas, :mod:`.harness` the passes.
"""
