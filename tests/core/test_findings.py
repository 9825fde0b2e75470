# SPDX-License-Identifier: Apache-2.0
"""Findings: one rendering, a refusal that keeps its findings, and re-homing under a tool's label."""

from __future__ import annotations

import pytest

from vllm_dspark.findings import Finding, FindingError, errors, most_severe_first, render, within


def test_a_finding_renders_as_one_line_naming_the_fix() -> None:
    assert render(Finding("is missing", "set it.", "K3DSparkConfig.block_size")) == (
        "K3DSparkConfig.block_size: is missing. Fix: set it."
    )
    assert (
        str(Finding("no weights.", "pass the directory")) == "no weights. Fix: pass the directory."
    )


def test_a_listing_problem_gets_its_fix_on_its_own_line() -> None:
    assert render(Finding("3 tensors disagree:\n  - a\n  - b", "re-export")) == (
        "3 tensors disagree:\n  - a\n  - b\nFix: re-export."
    )


def test_a_refusal_is_a_value_error_that_keeps_its_findings() -> None:
    first, second = Finding("bad", "fix it", "x"), Finding("worse", "fix that")
    with pytest.raises(ValueError, match=r"^x: bad\. Fix: fix it\. worse\. Fix: fix that\.$") as e:
        raise FindingError(first, second)
    assert e.value.findings == (first, second) and e.value.finding == first


def test_within_reports_findings_under_a_label_keeping_their_location_in_the_text() -> None:
    inner = [Finding("is missing", "set it", "K3DSparkConfig.block_size", "warning")]
    [outer] = within("drafter config", inner)
    assert outer == Finding(
        "K3DSparkConfig.block_size: is missing", "set it", "drafter config", "warning"
    )
    assert within("checkpoint", [Finding("bad", "fix")])[0].problem == "bad"


def test_most_severe_first_and_errors() -> None:
    note, error, warning = (Finding("p", "f", severity=s) for s in ("note", "error", "warning"))
    assert most_severe_first([note, error, warning]) == [error, warning, note]
    assert errors([note, error, warning]) == [error]
