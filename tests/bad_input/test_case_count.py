# SPDX-License-Identifier: Apache-2.0
"""docs/bad-input.md quotes how many cases this folder runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def test_the_case_count_in_the_docs_is_this_folders() -> None:
    collected = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            str(HERE),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    cases = [
        line for line in collected.splitlines() if "::" in line and Path(__file__).name not in line
    ]
    assert len(cases) >= 250
    page = (ROOT / "docs" / "bad-input.md").read_text()
    assert f"{len(cases)} bad-input and interruption cases" in page, len(cases)
