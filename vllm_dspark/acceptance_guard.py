# SPDX-License-Identifier: Apache-2.0
"""The per-request acceptance guard's state machine: when to stop verifying a request's drafts, and when to try again.

Per request, a window of its last ``window`` verified steps (tokens drafted, tokens accepted). Once
it holds ``min_steps`` steps and accepted over drafted falls below the threshold (the break-even
acceptance rate at the request's context length, :mod:`vllm_dspark.ops.speculation_cost`, or a flat one), the
request is *guarded*: its drafts are not verified, so it emits one token a step, the target's own.
After ``backoff`` guarded steps it *probes*: its drafts are verified for ``probe_steps`` steps, and
it resumes if their rate reaches the threshold plus ``hysteresis``, else it is guarded again. With
``max_draft_context``, a request whose prompt is longer starts guarded (it still probes). Pure: the
scheduler (``vllm_dspark.runtime.guard``) feeds it what vLLM verified and asks it what to verify.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from vllm_dspark.ops.speculation_cost import (
    TOKENSPEED_K3_MI355X,
    StepCost,
    break_even_acceptance_rate,
)

ACTIVE, GUARDED, PROBING = "active", "guarded", "probing"
# A request's last events kept for its stats (step, event): enough to see a pattern, bounded.
MAX_EVENTS = 64


@dataclass(frozen=True)
class GuardConfig:
    """The guard's parameters (``--additional-config '{"dspark_guard": {...}}'``), validated."""

    window: int = 16  # verified steps the moving rate covers
    min_steps: int = 4  # verified steps in the window before the guard judges
    backoff: int = 64  # guarded steps before a probe
    probe_steps: int = 4  # verified steps a probe lasts
    hysteresis: float = 0.05  # a probe resumes at threshold + this (accepted over drafted)
    threshold: float | None = None  # flat accepted-over-drafted threshold; None: break-even
    step_cost: StepCost = TOKENSPEED_K3_MI355X  # the break-even's cost model
    max_draft_context: int | None = None  # prompts longer than this start guarded

    def __post_init__(self) -> None:
        for name in ("window", "min_steps", "backoff", "probe_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"dspark_guard.{name}={value!r} must be an integer >= 1")
        if self.min_steps > self.window or self.probe_steps > self.window:
            raise ValueError(
                f"dspark_guard.min_steps={self.min_steps} and probe_steps={self.probe_steps} must "
                f"not exceed window={self.window}: raise window or lower them"
            )
        if not _number(self.hysteresis) or not 0.0 <= self.hysteresis <= 1.0:
            raise ValueError(f"dspark_guard.hysteresis={self.hysteresis!r} must be in [0, 1]")
        if self.threshold is not None and (
            not _number(self.threshold) or not 0.0 <= self.threshold <= 1.0
        ):
            raise ValueError(
                f"dspark_guard.threshold={self.threshold!r} must be in [0, 1] (accepted over "
                "drafted tokens), or null for the break-even from step_cost"
            )
        if self.max_draft_context is not None and (
            isinstance(self.max_draft_context, bool)
            or not isinstance(self.max_draft_context, int)
            or self.max_draft_context < 0
        ):
            raise ValueError(
                f"dspark_guard.max_draft_context={self.max_draft_context!r} must be an integer "
                ">= 0 (tokens), or null for no context prior"
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> GuardConfig:
        """The config from its JSON form; one-line ValueError naming a bad key or value."""
        if values is None:
            return cls()
        if not isinstance(values, Mapping):
            raise ValueError(
                f"dspark_guard must be a JSON object of its parameters, not {values!r}"
            )
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"dspark_guard has no parameter {unknown[0]!r}; it takes {known}")
        values = dict(values)
        cost = values.get("step_cost")
        if cost is not None and not isinstance(cost, StepCost):
            if not isinstance(cost, Mapping) or set(cost) != {"fixed", "per_context_token"}:
                raise ValueError(
                    f"dspark_guard.step_cost={cost!r} must be "
                    '{"fixed": F, "per_context_token": P} (speculative over plain step time: F + P * context)'
                )
            if not all(_number(v) for v in cost.values()):
                raise ValueError(
                    f"dspark_guard.step_cost={cost!r}: fixed and per_context_token must be numbers"
                )
            values["step_cost"] = StepCost(float(cost["fixed"]), float(cost["per_context_token"]))
        return cls(**values)

    def threshold_at(self, context_len: int, num_speculative_tokens: int) -> float:
        """The accepted-over-drafted rate below which a request at ``context_len`` is guarded."""
        if self.threshold is not None:
            return self.threshold
        return break_even_acceptance_rate(self.step_cost, context_len, num_speculative_tokens)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class RequestGuard:
    """One request's guard state and counters."""

    state: str = ACTIVE
    steps: int = 0  # steps it generated in, while the guard watched it
    drafted: int = 0  # drafted tokens verified
    accepted: int = 0
    verified_steps: int = 0
    guarded_steps: int = 0
    trips: int = 0  # times it was guarded (the context prior's start included)
    probes: int = 0
    resumes: int = 0
    since: int = 0  # guarded steps since it was last guarded
    window: deque = field(default_factory=deque)  # (drafted, accepted) per verified step
    events: deque = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))  # (step, event)

    def rate(self) -> float:
        """Accepted over drafted tokens in the window (0 when it holds none)."""
        drafted = sum(d for d, _ in self.window)
        return sum(a for _, a in self.window) / drafted if drafted else 0.0

    def counters(self) -> dict[str, Any]:
        """Its counters and recent events, as plain data."""
        names = ("state", "steps", "drafted", "accepted", "verified_steps", "guarded_steps")
        return {
            **{n: getattr(self, n) for n in names},
            "trips": self.trips,
            "probes": self.probes,
            "resumes": self.resumes,
            "events": list(self.events),
        }

    def _guard(self) -> None:
        self.state, self.since = GUARDED, 0
        self.trips += 1
        self.window.clear()
        self.events.append((self.steps, "guard"))


class AcceptanceGuard:
    """Every live request's :class:`RequestGuard`, fed each step's verification, asked what to verify."""

    def __init__(self, config: GuardConfig, num_speculative_tokens: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(
                "the dspark acceptance guard needs speculative decoding: give --speculative-config"
            )
        self.config = config
        self.num_speculative_tokens = num_speculative_tokens
        self.requests: dict[str, RequestGuard] = {}
        # Finished requests' counters, the most recent last (bounded like events).
        self.finished: deque[tuple[str, dict[str, Any]]] = deque(maxlen=1024)
        self.undrafted_steps = 0  # engine steps with no drafting at all (every request guarded)

    def admit(self, req_id: str, prompt_len: int) -> RequestGuard:
        """The request's state, created on first sight (guarded if its prompt is past the context prior)."""
        guard = self.requests.get(req_id)
        if guard is None:
            guard = self.requests[req_id] = RequestGuard()
            prior = self.config.max_draft_context
            if prior is not None and prompt_len > prior:
                guard._guard()
        return guard

    def observe(
        self, req_id: str, prompt_len: int, drafted: int, accepted: int, context_len: int
    ) -> str | None:
        """One step the request generated in: ``drafted`` tokens verified, ``accepted`` of them.
        Returns the transition it caused (``guard``, ``probe``, ``resume``), if any."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted={accepted} must lie in [0, drafted={drafted}]")
        cfg = self.config
        g = self.admit(req_id, prompt_len)
        g.steps += 1
        if g.state == GUARDED:
            g.guarded_steps += 1
            g.since += 1
            if g.since >= cfg.backoff:
                g.state = PROBING
                g.probes += 1
                g.window.clear()
                g.events.append((g.steps, "probe"))
                return "probe"
            return None
        if drafted == 0:  # nothing verified this step (a prefill, or a step given no drafts)
            return None
        g.drafted += drafted
        g.accepted += accepted
        g.verified_steps += 1
        g.window.append((drafted, accepted))
        while len(g.window) > cfg.window:
            g.window.popleft()
        threshold = cfg.threshold_at(context_len, self.num_speculative_tokens)
        if g.state == PROBING:
            if len(g.window) < cfg.probe_steps:
                return None
            if g.rate() >= threshold + cfg.hysteresis:
                g.state = ACTIVE
                g.resumes += 1
                g.events.append((g.steps, "resume"))
                return "resume"
            g._guard()
            return "guard"
        if len(g.window) >= cfg.min_steps and g.rate() < threshold:
            g._guard()
            return "guard"
        return None

    def verifies(self, req_id: str) -> bool:
        """Whether the request's next drafts are to be verified."""
        guard = self.requests.get(req_id)
        return guard is None or guard.state != GUARDED

    def wants_drafts_after_step(self, req_id: str, prompt_len: int) -> bool:
        """Whether the request, scheduled in this step, will verify the drafts this step makes."""
        guard = self.requests.get(req_id)
        if guard is None:
            prior = self.config.max_draft_context
            return prior is None or prompt_len <= prior or self.config.backoff <= 1
        return guard.state != GUARDED or guard.since + 1 >= self.config.backoff

    def retain(self, live: Iterable[str]) -> list[tuple[str, dict[str, Any]]]:
        """Forget requests not in ``live``; their final counters (also kept in :attr:`finished`)."""
        keep = set(live)
        done = [(rid, g.counters()) for rid, g in self.requests.items() if rid not in keep]
        for rid, counters in done:
            del self.requests[rid]
            self.finished.append((rid, counters))
        return done

    def stats(self) -> dict[str, Any]:
        """Per request (live and finished) counters, and the totals over them."""
        per_request = dict(self.finished)
        per_request.update((rid, g.counters()) for rid, g in self.requests.items())
        keys = (
            "drafted",
            "accepted",
            "verified_steps",
            "guarded_steps",
            "trips",
            "probes",
            "resumes",
        )
        totals = {k: sum(c[k] for c in per_request.values()) for k in keys}
        return {"requests": per_request, "totals": totals, "undrafted_steps": self.undrafted_steps}
