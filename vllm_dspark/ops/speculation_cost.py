# SPDX-License-Identifier: Apache-2.0
"""When speculation pays: a speculative step's time over a plain decode step's, against context.

A speculative step drafts a block and verifies it; it emits τ tokens (the acceptance length, bonus
included) where a plain step emits one. So speculation pays while ``τ > ratio(L)``, the step-time
ratio at context length ``L``. The ratio is modelled as linear in ``L``: at long context the
target's verification attends ``k + 1`` queries and the drafter its own context, which grows with
``L``. The acceptance guard (per request) and ``accept --context-sweep`` (per length) share this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    """A speculative step's time over a plain step's: ``fixed + per_context_token * L``."""

    fixed: float
    per_context_token: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.fixed) and self.fixed >= 1.0):
            raise ValueError(
                f"step cost fixed={self.fixed} must be finite and >= 1: a speculative step is never cheaper than a plain one"
            )
        if not (math.isfinite(self.per_context_token) and self.per_context_token >= 0.0):
            raise ValueError(
                f"step cost per_context_token={self.per_context_token} must be finite and >= 0"
            )

    @classmethod
    def through(cls, context_len: int, ratio: float, fixed: float = 1.0) -> StepCost:
        """The line through one measured ``(context_len, ratio)`` point with the given ``fixed``."""
        if context_len <= 0:
            raise ValueError(f"context_len={context_len} must be > 0")
        return cls(fixed=fixed, per_context_token=(ratio - fixed) / context_len)

    def ratio(self, context_len: int) -> float:
        """The speculative step's time over a plain step's at ``context_len`` tokens of context."""
        return self.fixed + self.per_context_token * max(context_len, 0)


# tokenspeed#1132 (K3 DSpark, MI355X): τ = 1.0 at 131072 tokens cost 39.7 % of throughput, so the
# ratio there is 1 / (1 - 0.397). One point fixes one coefficient: ``fixed`` is set to its lower
# bound 1 (no overhead at zero context), which makes this prior lenient; measure your own.
TOKENSPEED_K3_MI355X = StepCost.through(131072, 1.0 / (1.0 - 0.397))


def break_even_acceptance_length(cost: StepCost, context_len: int) -> float:
    """The τ (tokens per step, bonus included) below which speculation is slower than none."""
    return cost.ratio(context_len)


def break_even_acceptance_rate(
    cost: StepCost, context_len: int, num_speculative_tokens: int
) -> float:
    """The accepted-over-drafted ratio at break-even, from ``τ = 1 + rate * k`` (above 1: never pays)."""
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be >= 1")
    return (cost.ratio(context_len) - 1.0) / num_speculative_tokens


def break_even_context(cost: StepCost, tau: float) -> float:
    """The context length past which an acceptance length ``tau`` no longer pays (inf: always pays)."""
    if tau <= cost.fixed:
        return 0.0
    if cost.per_context_token == 0.0:
        return math.inf
    return (tau - cost.fixed) / cost.per_context_token
