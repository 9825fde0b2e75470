# SPDX-License-Identifier: Apache-2.0
"""The mutation check of the critical math: ``make test-mutation`` (``pytest -m mutation``), in CI too.

mutmut (PyPI, the ``test`` extra) mutates the functions matched by ``MUTANTS`` one mutation at a time,
in a copy of the package made here, and runs for each mutant the tests of ``[tool.mutmut]`` in
``pyproject.toml`` that execute the mutated function. A mutant is killed when a test fails. Covered:
the rotary embedding and softmax scale, the Markov rollout and its per-row sampling, the doctor's
``num_speculative_tokens`` check, the drift harness's cell inputs, the quant resolver's functions
(``checkpoint/quant_plan.py``), the config contract (``fields.py``) and the causal block mask. Left out: the seed mixing (``stream_seed``, ``gumbel_noise``: any
mixing is as right as the committed one, so no test can tell its constants apart).

The gate pays only for what changed (``tests/support/mutation_gate.py``): the functions whose source,
whose tests' files or whose mutated callees changed since the record committed in
``tests/data/mutation-record.json`` are mutated again, the rest are read from the record. It fails
when a mutation the record has killed now survives, when a quant resolver mutant survives without
being argued equivalent in ``ARGUED_EQUIVALENT``, or when the README's figure is not the record's.
``make test-mutation RECORD=1`` writes the merged record (and the README's figure);
``make test-mutation FULL=1`` reruns every function and rewrites both.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest

from tests.support.mutation_gate import (
    RECORD,
    load_record,
    mutmut_settings,
    run_gate,
    tally,
    write_record,
    write_text,
)

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


def readme_figure(killed: int, total: int) -> str:
    """The README's sentence part that states the mutation check's figure."""
    return f"kills **{killed} of {total}** mutants"


def test_readme_figure_is_the_records() -> None:
    stated = README_FIGURE.search((ROOT / "README.md").read_text())
    assert stated, "README.md must state the mutation check's figure as 'kills **K of N** mutants'"
    assert (int(stated[1]), int(stated[2])) == tally(load_record()), (
        "README's mutation figure differs from tests/data/mutation-record.json: make test-mutation RECORD=1"
    )


@pytest.mark.mutation
def test_mutation_check(tmp_path: Path) -> None:
    full = os.environ.get("MUTATION_FULL") == "1"
    result = run_gate(ROOT, MUTANTS, load_record(), tmp_path / "repo", full=full)
    statuses = result.statuses()
    killed, total = tally(result.record)
    survivors = sorted(name for name, s in statuses.items() if s != "killed")
    print(
        f"\nmutation check: {len(result.rerun)} functions mutated again, the rest from the record"
    )
    print(f"mutation check: {killed} of {total} mutants killed {dict(Counter(statuses.values()))}")
    print("not killed:\n  " + "\n  ".join(survivors))
    assert "not checked" not in statuses.values(), "the run stopped before every mutant was tested"
    assert not result.regressions, (
        f"killed in the record, surviving now (mutmut show NAME in {tmp_path / 'repo'}): "
        f"{result.regressions}"
    )
    unargued = [n for n in survivors if n.startswith(QUANT_PLAN) and n not in ARGUED_EQUIVALENT]
    assert not unargued, f"quant_plan mutants neither killed nor argued equivalent: {unargued}"
    if full or os.environ.get("MUTATION_RECORD") == "1":
        write_record(result.record)
        readme = ROOT / "README.md"
        write_text(readme, README_FIGURE.sub(readme_figure(killed, total), readme.read_text()))
        print(f"mutation check: wrote {RECORD.relative_to(ROOT)} and the README's figure")
    elif result.rerun:
        print(
            f"mutation check: the record is stale for {result.rerun}: make test-mutation RECORD=1"
        )


# A planted regression: the masks module alone, two tests, three gate runs in a copy of the repo.
PLANTED = ("vllm_dspark.ops.masks.*",)
PLANTED_TESTS = "tests/tools/test_published_variants.py"
WEAK_TEST = """def test_block_and_paged_key_masks() -> None:
    block_key_mask(3, True), paged_key_mask(3, 5, True)  # executes both, asserts nothing: planted
"""


@pytest.mark.mutation
def test_gate_catches_a_weakened_test_and_skips_unchanged_functions(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for name in ("vllm_dspark", "tests"):
        shutil.copytree(ROOT / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    pyproject = (ROOT / "pyproject.toml").read_text()
    settings = mutmut_settings(ROOT)
    selection = [
        t for t in settings["pytest_add_cli_args_test_selection"] if t.startswith(PLANTED_TESTS)
    ]
    only = 'only_mutate = ["vllm_dspark/ops/masks.py"]'
    pyproject = re.sub(r"only_mutate = \[.*?\]", only, pyproject)
    tests = "pytest_add_cli_args_test_selection = " + json.dumps(selection)
    pyproject = re.sub(
        r"pytest_add_cli_args_test_selection = \[.*?\n\]", tests, pyproject, flags=re.S
    )
    (repo / "pyproject.toml").write_text(pyproject)

    first = run_gate(repo, PLANTED, load_record(repo / "none.json"), tmp_path / "w0")
    functions = ["vllm_dspark.ops.masks.x_block_key_mask", "vllm_dspark.ops.masks.x_paged_key_mask"]
    assert first.rerun == functions and not first.regressions
    assert tally(first.record)[0] > 0

    again = run_gate(repo, PLANTED, first.record, tmp_path / "w1")
    assert again.rerun == [] and again.record == first.record

    masks = repo / "vllm_dspark" / "ops" / "masks.py"
    masks.write_text(
        masks.read_text().replace(
            "    keys = torch.arange", "    # planted\n    keys = torch.arange"
        )
    )
    code_only = run_gate(repo, PLANTED, first.record, tmp_path / "w2")
    assert code_only.rerun == functions[1:] and not code_only.regressions

    test_file = repo / PLANTED_TESTS
    text = test_file.read_text()
    start = text.index("def test_block_and_paged_key_masks")
    body = text[start : text.index("\n\n\n", start)]
    test_file.write_text(text.replace(body, WEAK_TEST.rstrip("\n")))
    weakened = run_gate(repo, PLANTED, first.record, tmp_path / "w3")
    assert functions[1] in weakened.rerun
    regressed = {name.split(" ")[0].rpartition("__mutmut_")[0] for name in weakened.regressions}
    assert functions[1] in regressed, weakened.regressions
