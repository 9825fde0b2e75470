# SPDX-License-Identifier: Apache-2.0
"""The acceptance guard's state machine (``vllm_dspark.acceptance_guard``): trip, back-off,
probe, resume, the context prior, the break-even threshold, and one-line errors for bad parameters."""

from __future__ import annotations

import pytest

from vllm_dspark.acceptance_guard import (
    ACTIVE,
    GUARDED,
    PROBING,
    AcceptanceGuard,
    GuardConfig,
)
from vllm_dspark.ops.speculation_cost import (
    TOKENSPEED_K3_MI355X,
    StepCost,
    break_even_acceptance_rate,
)

K = 7


def _guard(**config) -> AcceptanceGuard:
    return AcceptanceGuard(GuardConfig(**config), K)


def _run(guard: AcceptanceGuard, accepted_per_step: list[int], context_len: int = 100) -> list:
    """Feed one request ``accepted_per_step`` (K drafted where it verifies, 0 where guarded); the events."""
    events = []
    for accepted in accepted_per_step:
        drafted = K if guard.verifies("r") else 0
        events.append(guard.observe("r", 10, drafted, min(accepted, drafted), context_len))
    return events


def test_a_low_rate_trips_after_min_steps_and_not_before():
    guard = _guard(threshold=0.2, min_steps=3, window=4, backoff=100)
    assert _run(guard, [0, 0]) == [None, None]
    assert guard.verifies("r")
    assert _run(guard, [0]) == ["guard"]
    g = guard.requests["r"]
    assert (g.state, g.trips, g.verified_steps, g.drafted) == (GUARDED, 1, 3, 3 * K)
    assert not guard.verifies("r")


def test_a_healthy_rate_never_trips():
    guard = _guard(threshold=0.2, min_steps=2, window=4)
    assert _run(guard, [2, 1, 3, 2, 2, 1, 2] * 4) == [None] * 28  # 2/7 > 0.2 in every window
    assert guard.requests["r"].trips == 0


def test_the_window_forgets_old_steps():
    """A good start does not hold off the guard once the window has moved past it."""
    guard = _guard(threshold=0.2, min_steps=2, window=3, backoff=100, probe_steps=2)
    events = _run(guard, [7, 7, 0, 0, 0])
    assert events == [None, None, None, None, "guard"]  # (7+0+0)/21 = 0.33, then 0/21


def test_probes_recur_every_backoff_plus_probe_steps():
    guard = _guard(threshold=0.2, min_steps=2, window=4, backoff=3, probe_steps=2)
    _run(guard, [0] * 20)
    g = guard.requests["r"]
    assert list(g.events) == [
        (2, "guard"),
        (5, "probe"),
        (7, "guard"),
        (10, "probe"),
        (12, "guard"),
        (15, "probe"),
        (17, "guard"),
        (20, "probe"),
    ]
    assert (g.probes, g.trips, g.resumes) == (4, 4, 0)
    assert g.guarded_steps == 12 and g.verified_steps == 8 and g.steps == 20


def test_a_probe_resumes_only_past_the_hysteresis():
    # 2/7 = 0.286: above 0.2 but not above 0.2 + 0.1, so the probe fails; 3/7 = 0.43 resumes.
    guard = _guard(threshold=0.2, hysteresis=0.1, min_steps=2, window=4, backoff=1, probe_steps=2)
    assert _run(guard, [0, 0]) == [None, "guard"]
    assert _run(guard, [0]) == ["probe"]
    assert guard.requests["r"].state == PROBING
    assert _run(guard, [2, 2]) == [None, "guard"]
    assert _run(guard, [0, 3, 3]) == ["probe", None, "resume"]
    g = guard.requests["r"]
    assert (g.state, g.resumes, g.probes) == (ACTIVE, 1, 2)
    assert guard.verifies("r")


def test_the_context_prior_starts_long_prompts_guarded():
    guard = _guard(max_draft_context=16, backoff=4)
    assert guard.wants_drafts_after_step("short", 16)
    assert not guard.wants_drafts_after_step("long", 17)
    guard.observe("long", 17, 0, 0, 17)
    guard.observe("short", 16, 0, 0, 16)
    assert not guard.verifies("long") and guard.verifies("short")
    assert guard.requests["long"].trips == 1 and list(guard.requests["long"].events) == [
        (0, "guard")
    ]
    # The prefill step counted as its first guarded step: the probe comes after 3 more.
    assert [guard.observe("long", 17, 0, 0, 18 + i) for i in range(3)] == [None, None, "probe"]
    assert guard.verifies("long")


def test_wants_drafts_foresees_the_probe():
    """The step before a probe already drafts: the probe verifies what that step drafts."""
    guard = _guard(threshold=0.5, min_steps=1, window=1, backoff=2, probe_steps=1)
    _run(guard, [0])  # guarded, since 0
    assert not guard.wants_drafts_after_step("r", 10)
    _run(guard, [0])  # since 1: the next observe makes it probe
    assert guard.wants_drafts_after_step("r", 10)
    assert _run(guard, [0]) == ["probe"]


def test_the_default_threshold_is_break_even_at_the_context_length():
    config = GuardConfig()
    assert config.step_cost == TOKENSPEED_K3_MI355X
    for context in (0, 4096, 131072, 1_000_000):
        assert config.threshold_at(context, K) == break_even_acceptance_rate(
            TOKENSPEED_K3_MI355X, context, K
        )
    # At 131072 tokens the prior's break-even τ is 1/(1-0.397): rate (τ - 1)/K.
    assert config.threshold_at(131072, K) == pytest.approx((1 / 0.603 - 1) / K)
    # A rate that pays at short context is guarded at long context.
    short, long = (_guard(min_steps=2, window=2, backoff=100, probe_steps=2) for _ in range(2))
    assert _run(short, [1, 1, 1], context_len=1000) == [None, None, None]
    assert _run(long, [1, 1, 1], context_len=1_000_000) == [None, "guard", None]


def test_a_flat_threshold_and_a_custom_cost_from_json():
    config = GuardConfig.from_dict(
        {"threshold": 0.3, "step_cost": {"fixed": 1.1, "per_context_token": 1e-6}}
    )
    assert config.threshold_at(10**6, K) == 0.3
    assert config.step_cost == StepCost(1.1, 1e-6)
    assert GuardConfig.from_dict(None) == GuardConfig() == GuardConfig.from_dict({})


def test_finished_requests_keep_their_counters():
    guard = _guard(threshold=0.2, min_steps=1, window=1, backoff=100, probe_steps=1)
    _run(guard, [0, 0, 0])
    guard.observe("other", 5, K, 3, 50)
    done = guard.retain(["other"])
    assert [rid for rid, _ in done] == ["r"] and "r" not in guard.requests
    stats = guard.stats()
    assert stats["requests"]["r"]["trips"] == 1 and stats["requests"]["r"]["guarded_steps"] == 2
    assert stats["totals"]["drafted"] == K + K and stats["totals"]["accepted"] == 3


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"windw": 4}, "has no parameter 'windw'"),
        ({"window": 0}, "window=0 must be an integer >= 1"),
        ({"backoff": 2.5}, "backoff=2.5 must be an integer >= 1"),
        ({"min_steps": True}, "min_steps=True must be an integer >= 1"),
        ({"window": 2, "min_steps": 3}, "must not exceed window=2"),
        ({"threshold": 1.5}, "threshold=1.5 must be in [0, 1]"),
        ({"threshold": float("nan")}, "threshold=nan must be in [0, 1]"),
        ({"hysteresis": -0.1}, "hysteresis=-0.1 must be in [0, 1]"),
        ({"max_draft_context": -1}, "max_draft_context=-1 must be an integer >= 0"),
        ({"step_cost": {"fixed": 1.0}}, 'must be {"fixed": F, "per_context_token": P}'),
        ({"step_cost": {"fixed": "a", "per_context_token": 0}}, "must be numbers"),
        (
            {"step_cost": {"fixed": 0.5, "per_context_token": 0}},
            "fixed=0.5 must be finite and >= 1",
        ),
        ([1, 2], "dspark_guard must be a JSON object"),
    ],
)
def test_bad_parameters_get_one_line(values, message: str):
    with pytest.raises(ValueError) as info:
        GuardConfig.from_dict(values)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_no_speculation_is_refused_by_name():
    with pytest.raises(ValueError, match="needs speculative decoding: give --speculative-config"):
        AcceptanceGuard(GuardConfig(), 0)


def test_accepted_past_drafted_is_refused():
    with pytest.raises(ValueError, match=r"accepted=3 must lie in \[0, drafted=2\]"):
        _guard().observe("r", 1, 2, 3, 10)
