# SPDX-License-Identifier: Apache-2.0
"""SIGTERM / SIGINT once the staging folder exists, swallowed signals, and stale folders of killed runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.bad_input import ROOT, draft_argv, eval_argv, quantize_argv, run_cli, tree


def _spawn(argv: list[str], tmpdir: Path) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "vllm_dspark.tools.cli", *argv],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(proc: subprocess.Popen, appeared: Callable[[], bool], timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not appeared():
        assert proc.poll() is None, f"finished before it could be interrupted: {proc.communicate()}"
        assert time.monotonic() < deadline, "the staging folder never appeared"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``small`` drafter: its quantization takes long enough (seconds) to be interrupted midway."""
    from vllm_dspark.checkpoint_tools.make_random import make_random

    return make_random(tmp_path_factory.mktemp("small") / "small", "small", progress=False)


INTERRUPTIONS = [
    ("make-random", signal.SIGTERM),
    ("quantize", signal.SIGTERM),
    ("quantize", signal.SIGINT),
    ("eval", signal.SIGTERM),
]


@pytest.mark.parametrize(
    ("command", "signum"), INTERRUPTIONS, ids=[f"{c}-{s.name}" for c, s in INTERRUPTIONS]
)
def test_interrupted_once_staging_exists(
    command: str, signum: signal.Signals, ckpts, small: Path, tmp_path: Path
) -> None:
    """Signal the real process once its staging (or spill) folder exists: exit 128 + signum, one line, nothing left."""
    spill = tmp_path / "tmpdir"
    spill.mkdir()
    out = tmp_path / "out"
    if command == "make-random":
        argv = ["make-random", "--preset", "small", "--quiet", "--out", str(out)]
    elif command == "quantize":
        argv = [
            "quantize",
            "--model-dir",
            str(small),
            "--output-dir",
            str(out),
            "--quant-format",
            "nvfp4",
        ]
    else:
        argv = eval_argv(
            ckpts["bf16"], tmp_path, "bf16", extra=("--blocks", "4096", "--batch-size", "8")
        )
    before = tree(small, *ckpts.values())
    proc = _spawn(argv, spill)
    if command == "eval":
        _wait_for(proc, lambda: any(spill.iterdir()))
    else:
        _wait_for(proc, lambda: any(p.name.startswith(".out.partial-") for p in tmp_path.iterdir()))
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"vllm-dspark {command}: interrupted by {signum.name}; partial output "
        "removed, inputs untouched."
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "tmpdir"
    ]  # no staging folder, no partial --out
    assert list(spill.iterdir()) == []  # no spill folder
    assert tree(small, *ckpts.values()) == before


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


STALE_COMMANDS = ["make-random", "quantize", "draft", "eval"]


def test_a_signal_a_library_swallowed_still_stops_the_output(tmp_path: Path) -> None:
    """SIGTERM raised inside a library that turns it into an error it catches (tqdm starting its
    monitor thread: "release unlocked lock") still keeps the output from appearing, and still
    ends the run as interrupted."""
    from vllm_dspark.safety import Interrupted, signals_raise, staged

    target = tmp_path / "out.json"
    with pytest.raises(Interrupted), signals_raise() as received:
        with staged(target, directory=False) as staging:
            staging.write_text("{}")
            try:
                try:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(5)  # the handler raises before this ends
                except Interrupted:
                    raise RuntimeError("release unlocked lock") from None
            except RuntimeError:
                pass  # what the library does with it
    assert received == [signal.SIGTERM]
    assert list(tmp_path.iterdir()) == []


def test_a_signal_before_the_with_block_begins_leaves_no_staging(tmp_path: Path) -> None:
    """SIGTERM after staged() made its folder but before the with-block began, where no ``__exit__``
    runs (CI caught the real run there): signals_raise() removes the folder on its way out."""
    from vllm_dspark.safety import Interrupted, signals_raise, staged

    context = staged(tmp_path / "out", directory=True)  # kept alive, so no collection cleans up
    with pytest.raises(Interrupted), signals_raise():
        staging = context.__enter__()  # what `with` does before its body
        assert staging.is_dir()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
    assert list(tmp_path.iterdir()) == []


def test_a_signal_during_the_commit_waits_for_it(tmp_path: Path, monkeypatch) -> None:
    """SIGTERM between the two renames that replace an output: both happen, then the run stops, so
    the new output is in place and no old one is left aside."""
    from vllm_dspark.safety import Interrupted, signals_raise, staged

    target = tmp_path / "out"
    target.mkdir()
    (target / "weights").write_text("old")
    rename = os.replace

    def rename_then_signal(src: Path, dst: Path) -> None:
        rename(src, dst)
        os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Interrupted), signals_raise():
        with staged(target, directory=True) as staging:
            (staging / "weights").write_text("new")
            monkeypatch.setattr(os, "replace", rename_then_signal)
    assert list(tmp_path.iterdir()) == [target]
    assert (target / "weights").read_text() == "new"


@pytest.mark.parametrize("command", STALE_COMMANDS)
def test_stale_staging_of_a_killed_run_is_removed(
    command: str, ckpts, tmp_path: Path, isolated_tmpdir: Path, one_torch_thread
) -> None:
    """A folder a SIGKILLed run left (its PID is gone) is removed by the next run, which says so."""
    pid = _dead_pid()
    out = tmp_path / ("out.safetensors" if command == "draft" else "out")
    if command == "eval":
        stale = isolated_tmpdir / f"vllm-dspark-eval-{pid}-abc123"
        argv = eval_argv(ckpts["bf16"], tmp_path)
    else:
        stale = tmp_path / f".{out.name}.partial-{pid}"
        argv = {
            "make-random": ["make-random", "--preset", "tiny", "--quiet", "--out", str(out)],
            "quantize": quantize_argv(ckpts["bf16"], tmp_path),
            "draft": draft_argv(ckpts["bf16"], ckpts["inputs"], tmp_path),
        }[command]
    stale.mkdir()
    (stale / "model-00001-of-00001.safetensors").write_bytes(b"\x00" * 1024)
    alive = (
        tmp_path / f".{out.name}.partial-{os.getpid()}"
    )  # a live writer's staging is never touched...
    alive_other = tmp_path / f".other.partial-{pid}"  # ...nor another target's
    alive_other.mkdir()
    result = run_cli(argv)
    assert result.code == 0, result.err
    assert not stale.exists() and alive_other.exists() and not alive.exists()
    assert f"removed {stale}, left behind by an interrupted run (PID {pid} is gone)" in result.err
    assert out.exists()
