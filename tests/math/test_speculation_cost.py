# SPDX-License-Identifier: Apache-2.0
"""The step-cost model that says where speculation stops paying."""

from __future__ import annotations

import math

import pytest

from vllm_dspark.ops.speculation_cost import (
    TOKENSPEED_K3_MI355X,
    StepCost,
    break_even_acceptance_length,
    break_even_acceptance_rate,
    break_even_context,
)


def test_the_prior_reproduces_the_measured_point():
    """τ = 1.0 at 131072 tokens gives 60.3 % of plain throughput, as tokenspeed#1132 measured."""
    ratio = TOKENSPEED_K3_MI355X.ratio(131072)
    assert 1.0 / ratio == pytest.approx(1.0 - 0.397)
    assert TOKENSPEED_K3_MI355X.ratio(0) == 1.0


def test_break_even_length_rate_and_context_agree():
    cost = StepCost(fixed=1.2, per_context_token=1e-5)
    tau = break_even_acceptance_length(cost, 40_000)
    assert tau == pytest.approx(1.6)
    assert break_even_acceptance_rate(cost, 40_000, 4) == pytest.approx(0.6 / 4)
    assert break_even_context(cost, tau) == pytest.approx(40_000)
    assert break_even_context(cost, 1.1) == 0.0  # below the fixed cost: never pays
    assert break_even_context(StepCost(1.2, 0.0), 2.0) == math.inf


@pytest.mark.parametrize(
    ("fixed", "per_token", "message"),
    [
        (0.9, 0.0, "fixed=0.9"),
        (math.nan, 0.0, "fixed=nan"),
        (1.0, -1e-6, "per_context_token"),
        (1.0, math.inf, "per_context_token"),
    ],
)
def test_impossible_costs_are_refused_by_name(fixed, per_token, message):
    with pytest.raises(ValueError, match=message):
        StepCost(fixed, per_token)


def test_a_rate_needs_a_drafted_token():
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        break_even_acceptance_rate(TOKENSPEED_K3_MI355X, 1000, 0)
