# SPDX-License-Identifier: Apache-2.0
"""Runs a ``tests.support`` script in a child process: a fresh vLLM, its engine in that process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(
    module: str, *args: str | Path | int, env: Mapping[str, str] | None = None, timeout: int = 1200
) -> subprocess.CompletedProcess[str]:
    """``python -m module *args`` at the repo root, with it on ``PYTHONPATH`` and vLLM's engine in the child
    (``env``, default ``os.environ``); asserts it exits 0, with the tail of its output if not."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    proc = subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc
