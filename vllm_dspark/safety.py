# SPDX-License-Identifier: Apache-2.0
"""Users' files are sacred: the output guard, staged outputs, spill folders and signal handling every tool
shares (docs/bad-input.md)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from vllm_dspark.findings import Finding, FindingError, os_error_finding, render

_STAGING_RE = re.compile(r"^\.(?P<name>.+)\.(?:partial|old)-(?P<pid>\d+)$")
_SPILL_PREFIX = "vllm-dspark-eval-"
_SPILL_RE = re.compile(rf"^{_SPILL_PREFIX}(?P<pid>\d+)-")


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived while a tool ran (a ``BaseException``, like ``KeyboardInterrupt``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# The signals received under the active signals_raise(): a library may swallow the Interrupted that
# the handler raised (tqdm's monitor start turns it into a RuntimeError it catches), so staged()
# checks here before it commits.
_received: list[int] = []

# Staging paths neither committed nor removed yet. A signal that lands after a staging path exists but
# before its with-block begins (no __exit__ will run) leaves it here, and signals_raise() removes it.
_uncommitted: set[Path] = set()

# Above zero inside held_signals(): the handler notes a signal without raising it.
_held = 0


def raise_if_interrupted() -> None:
    """Raise :class:`Interrupted` if a signal arrived under :func:`signals_raise`, even one swallowed."""
    if _received:
        raise Interrupted(_received[0])


# ----- output paths -----


def check_output(output: str | Path, inputs: Iterable[str | Path | None], *, flag: str) -> None:
    """Refuse an ``output`` that is an input, lies inside one, or contains one (``ValueError``)."""
    out = Path(output).resolve()
    for given in inputs:
        if given is None:
            continue
        source = Path(given).resolve()
        if out == source:
            relation = "is"
        elif source in out.parents:
            relation = "lies inside"
        elif out in source.parents:
            relation = "contains"
        else:
            continue
        raise FindingError(
            Finding(
                f"{flag} {output} {relation} the input {given}; tools never write into their inputs",
                f"choose an output path outside {given}",
            )
        )


def refuse_nonempty(output: Path, *, overwrite: bool, flag: str) -> None:
    """Refuse to replace a non-file or a non-empty directory at ``output`` unless ``overwrite``."""
    if output.exists() and not output.is_dir():
        raise FindingError(
            Finding(f"{flag} {output} exists and is not a directory", "choose a directory path")
        )
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise FindingError(
            Finding(
                f"{flag} {output} exists and is not empty",
                "pass --overwrite to replace it, or choose another directory",
            )
        )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _sweep(folder: Path, pattern: re.Pattern[str], *, name: str | None = None) -> None:
    """Remove the entries of ``folder`` that ``pattern`` names and whose writer's PID is gone."""
    try:
        entries = list(folder.iterdir())
    except OSError:
        return
    for entry in entries:
        m = pattern.match(entry.name)
        if m is None or (name is not None and m.group("name") != name):
            continue
        pid = int(m.group("pid"))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        _remove(entry)
        print(
            f"vllm-dspark: removed {entry}, left behind by an interrupted run (PID {pid} is gone)",
            file=sys.stderr,
        )


@contextmanager
def staged(target: str | Path, *, directory: bool, merge: bool = False) -> Iterator[Path]:
    """Yield a staging path beside ``target``; on success rename it into place, on any exception remove it.

    ``directory``: the staging path is created as a folder; otherwise the caller writes a file there.
    A finished folder replaces ``target`` (``merge``: its files replace theirs, others stay).
    """
    target = Path(target)
    parent = target.parent
    existing = next(p for p in (parent, *parent.parents) if p.exists())
    if not existing.is_dir():
        raise FindingError(
            Finding(
                f"{existing} is a file, not a directory, so {target} cannot be written",
                "choose an output path inside a directory",
            )
        )
    parent.mkdir(parents=True, exist_ok=True)
    _sweep(parent, _STAGING_RE, name=target.name)
    staging = parent / f".{target.name}.partial-{os.getpid()}"
    _remove(staging)
    _uncommitted.add(staging)
    try:
        if directory:
            staging.mkdir()
        yield staging
        raise_if_interrupted()
        with held_signals():  # a signal between two renames would leave neither output in place
            _commit(staging, target, directory=directory, merge=merge)
    except BaseException:
        _remove(staging)
        raise
    finally:
        _uncommitted.discard(staging)


def _commit(staging: Path, target: Path, *, directory: bool, merge: bool) -> None:
    if not directory or not target.exists():
        os.replace(staging, target)
    elif merge:
        for child in staging.iterdir():
            if (target / child.name).is_dir():
                shutil.rmtree(target / child.name)
            os.replace(child, target / child.name)
        staging.rmdir()
    else:
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        _remove(old)
        os.replace(target, old)
        os.replace(staging, target)
        _remove(old)


@contextmanager
def spill_dir() -> Iterator[Path]:
    """A scratch folder under ``$TMPDIR`` named for this process, removed on exit however it happens."""
    root = Path(tempfile.gettempdir())
    _sweep(root, _SPILL_RE)
    with tempfile.TemporaryDirectory(prefix=f"{_SPILL_PREFIX}{os.getpid()}-") as path:
        yield Path(path)


@contextmanager
def signals_raise() -> Iterator[list[int]]:
    """Turn SIGINT and SIGTERM into :class:`Interrupted`, so every ``staged`` and ``spill_dir`` cleans up.

    Yields the signals received: a library that converts errors raised inside its C code (torch
    does) may deliver the interrupt as another exception type, and the caller still knows.
    """
    global _received, _held
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum: int, frame: object) -> None:
        received.append(signum)
        if not _held:
            raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    outer, _received = _received, received
    try:
        yield received
    finally:
        _held += 1  # a second signal is noted, not raised, until the sweep and the restore are done
        for path in list(_uncommitted):  # interrupted where no staged() exit could run
            _remove(path)
            _uncommitted.discard(path)
        for s, old in previous.items():
            signal.signal(s, old)
        _held -= 1
        _received = outer


@contextmanager
def held_signals() -> Iterator[None]:
    """Under :func:`signals_raise`, a SIGINT or SIGTERM during this step is raised when it ends, not inside it."""
    global _held
    if threading.current_thread() is not threading.main_thread():
        yield  # Python runs signal handlers in the main thread only: nothing can cut this one
        return
    _held += 1
    try:
        yield
    finally:
        _held -= 1
    raise_if_interrupted()


def copy_tree(source: Path, target: Path) -> None:
    """``shutil.copytree`` that stops at the first failure with its own ``OSError`` (errno and path),
    not a ``shutil.Error`` list of strings."""
    target.mkdir()
    for child in sorted(source.iterdir()):
        if child.is_dir():
            copy_tree(child, target / child.name)
        else:
            shutil.copy2(child, target / child.name)


def describe_os_error(e: OSError) -> str:
    """One line naming the path, what went wrong, and the fix."""
    return render(os_error_finding(e))
