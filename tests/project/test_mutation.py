# SPDX-License-Identifier: Apache-2.0
"""The mutation check of the critical math: ``make test-mutation`` (``pytest -m mutation``), in CI too.

mutmut (PyPI, the ``test`` extra) mutates the functions matched by ``MUTANTS`` one mutation at a time,
in a copy of the package made here, and runs for each mutant the tests of ``[tool.mutmut]`` in
``pyproject.toml`` that execute the mutated function. A mutant is killed when a test fails. Covered:
the rotary embedding and softmax scale, the Markov rollout and its per-row sampling, the doctor's
``num_speculative_tokens`` check, the drift harness's cell inputs, the quant resolver's functions
(``checkpoint/quant_plan.py``), the config contract (``fields.py``) and the causal block mask. Left out: the seed mixing (``stream_seed``, ``gumbel_noise``: any
mixing is as right as the committed one, so no test can tell its constants apart).

The test prints the tally and fails when the run kills fewer mutants, or tallies a different number,
than the README states (its figure comes from this test), or when a quant resolver mutant survives
without being argued equivalent in ``ARGUED_EQUIVALENT``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from fnmatch import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MUTANTS = (
    "vllm_dspark.ops.rope.*",
    "vllm_dspark.ops.sampling.x_markov_rollout__mutmut_*",
    "vllm_dspark.ops.sampling.x_sample_tokens__mutmut_*",
    "vllm_dspark.doctor.checks.x_check_num_speculative_tokens__mutmut_*",
    "vllm_dspark.doctor.checks.x__block_size__mutmut_*",
    "vllm_dspark.drift.harness.x_batches__mutmut_*",
    # The quant resolver's module functions (its config readers' methods are reached through them).
    "vllm_dspark.checkpoint.quant_plan.x_*__mutmut_*",
    # The config contract: validation, defaults, the rope block, causality and the block's length.
    "vllm_dspark.fields.*",
    # The causal masks the reference and every attention path share.
    "vllm_dspark.ops.masks.*",
)
# The quant resolver's mutants must all be killed, or argued equivalent here ({mutant: why no test
# can tell it apart}).
QUANT_PLAN = "vllm_dspark.checkpoint.quant_plan."
ARGUED_EQUIVALENT: dict[str, str] = {
    # dead_entries(specs, None): an entry dead at the checkpoint's layer numbers but alive at the
    # runtime ones is an exact runtime name or an anchored regex; _lenient reads an anchored regex as
    # meant (None) and a name as its own suffix, which matches the same module, so plan and warning agree.
    QUANT_PLAN
    + "x_config_plan__mutmut_21": "an entry alive only at runtime numbers reads the same leniently",
}
README_FIGURE = re.compile(r"kills \*\*(\d+) of (\d+)\*\* mutants")


def mutant_status(mutants: Path) -> dict[str, str]:
    """``{mutant: mutmut's status}`` for the mutants ``MUTANTS`` selects, from a run's ``mutants/`` directory."""
    from mutmut.stats import status_by_exit_code

    status = {}
    for meta in mutants.rglob("*.meta"):
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            if any(fnmatch(name, pattern) for pattern in MUTANTS):
                status[name] = status_by_exit_code[code]
    return status


@pytest.mark.mutation
def test_mutation_check(tmp_path: Path) -> None:
    work = tmp_path / "repo"
    ignore = shutil.ignore_patterns("__pycache__", "mutants")
    for name in ("vllm_dspark", "tests"):
        shutil.copytree(ROOT / name, work / name, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", work)
    # mutmut's progress goes to the terminal (make test-mutation runs pytest -s).
    run = subprocess.run([sys.executable, "-m", "mutmut", "run", *MUTANTS], cwd=work, timeout=3600)
    assert run.returncode == 0, f"mutmut run exited with {run.returncode}"

    status = mutant_status(work / "mutants")
    tally = Counter(status.values())
    killed, total = tally["killed"], len(status)
    survivors = sorted(name for name, s in status.items() if s != "killed")
    print(f"\nmutation check: {killed} of {total} mutants killed {dict(tally)}")
    print("not killed:\n  " + "\n  ".join(survivors))
    assert tally["not checked"] == 0, "the run stopped before every mutant was tested"
    unargued = [n for n in survivors if n.startswith(QUANT_PLAN) and n not in ARGUED_EQUIVALENT]
    assert not unargued, f"quant_plan mutants neither killed nor argued equivalent: {unargued}"

    stated = README_FIGURE.search((ROOT / "README.md").read_text())
    assert stated, "README.md must state the mutation check's figure as 'kills **K of N** mutants'"
    assert total == int(stated[2]), f"{total} mutants now, the README states {stated[2]}: update it"
    assert killed >= int(stated[1]), (
        f"{killed} of {total} killed, fewer than the README's {stated[1]}"
    )
