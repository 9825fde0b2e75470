# SPDX-License-Identifier: Apache-2.0
"""Real OS errors (root without DAC override, a file-size limit) are named by their cause."""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.bad_input import (
    ROOT,
    Build,
    check_argv,
    copy_input,
    draft_argv,
    quantize_argv,
    tree,
    user_file,
)


def _no_dac_override() -> None:
    """``preexec_fn``: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set, so that
    root, after exec, gets EACCES from a mode-000 file like any user."""
    if os.geteuid() != 0:
        return  # an ordinary user has neither capability to drop
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0):  # PR_CAPBSETDROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSETDROP)")


def _file_size_limit(nbytes: int) -> Callable[[], None]:
    """``preexec_fn``: writes past ``nbytes`` fail with EFBIG (a full disk's path), as root too."""

    def limit() -> None:
        _no_dac_override()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the writer
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return limit


@dataclass(frozen=True)
class OsCase:
    id: str
    build: Build  # the argv, after making the files the case breaks
    broken: Callable[[Path], list[Path]]  # the paths whose mode becomes 000
    preexec: Callable[[], None]
    code: int
    message: str


def _unreadable(*names: str) -> Callable[[Path], list[Path]]:
    return lambda t: [t / "in" / name for name in names]


def _with_target_readme(model: Path, tmp: Path) -> Path:
    model = copy_input(model, tmp, "m")
    (model / "target" / "README").write_text("the target's shared heads")
    return model


def _with_big_tokenizer(model: Path, tmp: Path) -> Path:
    model = copy_input(model, tmp, "m")
    (model / "target" / "tokenizer.json").write_bytes(b"{}" + b" " * 2_000_000)
    return model


OS_CASES = [
    OsCase(
        "check-shard-eacces",
        lambda t, c: check_argv(copy_input(c["bf16"], t, "m"), t),
        _unreadable("m/model-00001-of-00001.safetensors"),
        _no_dac_override,
        1,
        "permission denied",
    ),
    OsCase(
        "check-folder-eacces",
        lambda t, c: check_argv(copy_input(c["bf16"], t, "m"), t),
        _unreadable("m"),
        _no_dac_override,
        1,
        "permission denied",
    ),
    OsCase(
        "draft-target-eacces",
        lambda t, c: draft_argv(copy_input(c["bf16"], t, "m"), c["inputs"], t),
        _unreadable("m/target/model.safetensors"),
        _no_dac_override,
        2,
        "permission denied",
    ),
    OsCase(
        "quantize-target-eacces",
        lambda t, c: quantize_argv(copy_input(c["bf16"], t, "m"), t),
        _unreadable("m/target/model.safetensors"),
        _no_dac_override,
        2,
        "permission denied",
    ),
    OsCase(
        "quantize-target-copy-eacces",
        lambda t, c: quantize_argv(_with_target_readme(c["bf16"], t), t),
        _unreadable("m/target/README"),
        _no_dac_override,
        2,
        "permission denied",
    ),
    OsCase(
        "quantize-out-folder-eacces",
        lambda t, c: [
            *quantize_argv(c["bf16"], t)[:3],
            "--output-dir",
            str(user_file(t / "in" / "locked" / "keep").parent / "out"),
            "--quant-format",
            "fp8",
        ],
        _unreadable("locked"),
        _no_dac_override,
        2,
        "permission denied",
    ),
    OsCase(
        "quantize-tokenizer-efbig",
        lambda t, c: quantize_argv(_with_big_tokenizer(c["bf16"], t), t),
        lambda t: [],
        _file_size_limit(1_000_000),
        2,
        "file too large",
    ),
    OsCase(
        "quantize-shard-efbig",
        lambda t, c: quantize_argv(c["bf16"], t),
        lambda t: [],
        _file_size_limit(64_000),
        2,
        "file too large",
    ),
]


@pytest.mark.parametrize("bad", OS_CASES, ids=[c.id for c in OS_CASES])
def test_a_real_os_error_is_named_by_its_cause(bad: OsCase, ckpts, tmp_path: Path) -> None:
    """Permission and full-disk cases with the real errno (EACCES, EFBIG) in a child process: one
    line naming the file, the cause and the fix; inputs unchanged; nothing left behind."""
    argv = bad.build(tmp_path, ckpts)
    spill = tmp_path / "tmpdir"
    spill.mkdir()
    before = tree(tmp_path, *ckpts.values())
    broken = bad.broken(tmp_path)
    modes = {path: path.stat().st_mode for path in broken}
    for path in broken:
        path.chmod(0)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "vllm_dspark.tools.cli", *argv],
            env={**os.environ, "TMPDIR": str(spill), "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            preexec_fn=bad.preexec,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        for path, mode in modes.items():
            path.chmod(mode)
    text = out.stdout + out.stderr
    assert out.returncode == bad.code, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    stream = out.stderr if bad.code == 2 else out.stdout
    [line] = [line for line in stream.splitlines() if bad.message in line]
    assert any(str(p) in line for p in broken) or not broken, line
    if bad.code == 2:
        assert [line for line in out.stderr.splitlines() if "error:" in line] == [line]
    # The errno's own fix, on one file: not "missing", not a shutil.Error list of tuples.
    fix = "ulimit -f" if bad.message == "file too large" else ("chmod u+r", "w and x on")
    assert any(f in line.partition("Fix:")[2] for f in ([fix] if isinstance(fix, str) else fix)), (
        line
    )
    assert "does not exist" not in line and "[(" not in line, line
    assert tree(tmp_path, *ckpts.values()) == before  # inputs unchanged, nothing left behind
