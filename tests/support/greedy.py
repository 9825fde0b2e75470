# SPDX-License-Identifier: Apache-2.0
"""Greedy text against a no-speculation baseline, up to near-ties (``cpu_serving.engines``' rule).

An output is ``{"tokens": [...]}``; a baseline output adds per step ``top2`` (the two likeliest
tokens) and ``gaps`` (their logprob gap). Tokens may be ids or, from the OpenAI API, strings.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_dspark.cpu_serving.engines import greedy_agreement, near_tie


def assert_greedy_equal(baseline: Sequence[dict], outputs: Sequence[dict]) -> int:
    """Each output equals its baseline up to a near-tie resolved the other way (fails on any other
    difference), and most tokens were compared (not vacuous); returns the tokens compared."""
    assert len(outputs) == len(baseline) > 0, (len(outputs), len(baseline))
    tie = near_tie([g for b in baseline for g in b["gaps"]])
    compared = 0
    for i, (base, out) in enumerate(zip(baseline, outputs)):
        agreed, verdict = greedy_agreement(
            out["tokens"], base["tokens"], base["top2"], base["gaps"], tie
        )
        assert verdict != "differs", (
            f"prompt {i}, step {agreed}: {out['tokens']} != {base['tokens']} "
            f"(top-2 {base['top2'][agreed]}, gap {base['gaps'][agreed]:.3g}, near-tie < {tie:.3g})"
        )
        compared += agreed
    total = sum(len(b["tokens"]) for b in baseline)
    assert compared >= 0.25 * total, f"only {compared} of {total} tokens before near-ties"
    return compared
