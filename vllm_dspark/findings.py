# SPDX-License-Identifier: Apache-2.0
"""A finding is a problem, its fix, where it is and how bad it is: data, rendered only here.

Config validation, ``check``, the quantization-plan resolver, the loaders and the doctor all report
:class:`Finding`; a refusal raises :class:`FindingError`, a ``ValueError`` whose message is the
findings' one-line rendering and which keeps the findings for callers that report them.
"""

from __future__ import annotations

import dataclasses
import errno
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Severity = Literal["error", "warning", "note"]
SEVERITY_ORDER: dict[str, int] = {"error": 0, "warning": 1, "note": 2}


@dataclass(frozen=True)
class Finding:
    """One problem: what is wrong, the fix, where (a field, tensor or setting; may be empty)."""

    problem: str
    fix: str
    where: str = ""
    severity: Severity = "error"

    def __str__(self) -> str:
        return render(self)

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


class FindingError(ValueError):
    """A refusal: its message is the rendering of :attr:`findings` (the first is the main one)."""

    def __init__(self, *findings: Finding) -> None:
        self.findings = findings
        super().__init__(" ".join(render(f) for f in findings))

    @property
    def finding(self) -> Finding:
        return self.findings[0]


def render(finding: Finding) -> str:
    """``where: problem. Fix: fix.``: one line, or a listing problem with the fix on its own line."""
    head = f"{finding.where}: {finding.problem}" if finding.where else finding.problem
    separator = "\nFix: " if "\n" in head else ". Fix: "
    return f"{head.rstrip('.')}{separator}{finding.fix.rstrip('.')}."


def render_table(findings: Iterable[Finding]) -> str:
    """Two lines per finding: ``SEVERITY where: problem`` and an indented ``fix:`` line."""
    lines = []
    for f in findings:
        lines.append(f"{f.severity.upper():<8} {f.where}: {f.problem}")
        lines.append(f"{'':<8} fix: {f.fix}")
    return "\n".join(lines)


def within(where: str, findings: Iterable[Finding]) -> list[Finding]:
    """``findings`` reported under ``where`` (their own location leads the problem)."""
    return [
        dataclasses.replace(
            f, where=where, problem=f"{f.where}: {f.problem}" if f.where else f.problem
        )
        for f in findings
    ]


def most_severe_first(findings: Iterable[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: SEVERITY_ORDER[f.severity])


def errors(findings: Sequence[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "error"]


# ----- OS errors -----


_OS_FIXES = {
    errno.EROFS: "that filesystem is read-only: choose a writable location",
    errno.ENOSPC: "free space on that disk, or write somewhere with room",
    errno.EDQUOT: "free space within your disk quota, or write somewhere with room",
    errno.EFBIG: "the file outgrew this process's size limit (ulimit -f) or the filesystem's: "
    "raise the limit, or write somewhere with room",
    errno.ENOENT: "check the path",
    errno.EISDIR: "pass a file path, not a directory",
    errno.ENOTDIR: "a component of that path is a file: pass a directory path",
    errno.ENAMETOOLONG: "use a shorter path",
}


def _permission_fix(filename: str | None) -> str:
    """What a permission error on ``filename`` needs: its mode, and the bits to read or write it."""
    if not filename:
        return "fix the permissions of that path, or choose one you can access"
    path = Path(filename)
    try:
        mode = stat.filemode(path.stat().st_mode)
    except OSError:  # it does not exist yet: writing it needs its folder
        return f"writing it needs w and x on {path.parent}: fix that folder's permissions or write elsewhere"
    needs = "r and x (w and x to write into it)" if path.is_dir() else "r (w to overwrite it)"
    return (
        f"it is there ({mode}) but this user may not use it: reading it needs {needs}; "
        f"chmod u+r {path} or run as a user who may"
    )


def os_error_finding(e: OSError) -> Finding:
    """What went wrong, on which path, and the fix, by errno (permission, missing, no space, read-only)."""
    where = f" {e.filename}" if e.filename else ""
    if e.filename2:
        where += f" -> {e.filename2}"
    problem = (e.strerror or str(e)).lower()
    if e.errno in (errno.EACCES, errno.EPERM):
        return Finding(f"{problem}:{where}", _permission_fix(e.filename))
    return Finding(f"{problem}:{where}", _OS_FIXES.get(e.errno, "check the path and the disk"))
