# SPDX-License-Identifier: Apache-2.0
"""``make demo``: its verdict per drafter (PASS for equal text or a near-tie, FAIL otherwise, exit
status 1 on any FAIL), the console that shows only the demo while vLLM and everything else write to
its log, and the demo itself on the trained pair (marker ``e2e``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_dspark.tools import demo

ROOT = Path(__file__).resolve().parents[2]
PAIR = ROOT / "tests" / "data" / "pair"

# The baseline's two prompts as serve_pair records them (greedy tokens with the top-2 ids and their
# logprob gap per step). Gaps' median 1.1: the near-tie cutoff is 0.11; only prompt 1's 2nd token ties.
BASELINE = [
    {"tokens": [5, 6, 7, 8], "top2": [[5, 9], [6, 2], [7, 3], [8, 1]], "gaps": [1.5, 0.02, 2.0, 1.0]},
    {"tokens": [4, 4, 4, 4], "top2": [[4, 1], [4, 2], [4, 3], [4, 0]], "gaps": [1.0, 1.2, 0.8, 1.1]},
]  # fmt: skip
COUNTERS = {
    "vllm:spec_decode_num_drafts": 3,
    "vllm:spec_decode_num_draft_tokens": 21,
    "vllm:spec_decode_num_accepted_tokens": 5,
    "vllm:spec_decode_num_accepted_tokens_per_pos": [3, 2, 0, 0, 0, 0, 0],
}


def _results(bf16_first_prompt: list[int]) -> dict[str, dict[str, Any]]:
    """serve_pair's results: the FP8 run equal to the baseline, the BF16 run's first prompt given."""
    equal = [{"tokens": list(o["tokens"])} for o in BASELINE]
    return {
        "baseline": {"outputs": BASELINE, "counters": {}, "generate_seconds": 1.0},
        "bf16": {
            "outputs": [{"tokens": bf16_first_prompt}, equal[1]],
            "counters": COUNTERS,
            "generate_seconds": 2.0,
        },
        "fp8": {"outputs": equal, "counters": COUNTERS, "generate_seconds": 2.0},
    }


@pytest.mark.parametrize(
    ("tokens", "greedy", "verdict", "status", "note"),
    [
        ([5, 6, 7, 8], "equal", "PASS", 0, ""),
        # the 2nd token is the other of the near-tied two; the text may part from there on
        ([5, 2, 0, 0], "near-tie", "PASS", 0, "; prompt 1 near-tie at generated token 2 (top-2 logprob gap 0.0200 < cutoff 0.1100)"),
        ([5, 6, 3, 8], "differs", "FAIL", 1, "; prompt 1 differs at generated token 3 (top-2 logprob gap 2.0000 >= cutoff 0.1100)"),
        ([5, 7, 7, 8], "differs", "FAIL", 1, "; prompt 1 differs at generated token 2 (top-2 logprob gap 0.0200 < cutoff 0.1100, neither of the top 2)"),
    ],
    ids=["equal", "near-tie", "mismatch", "mismatch-off-top2"],
)  # fmt: skip
def test_verdict_per_drafter(
    tokens: list[int], greedy: str, verdict: str, status: int, note: str
) -> None:
    rows = demo.comparison(_results(tokens))
    bf16, fp8 = rows["bf16"], rows["fp8"]
    assert (bf16["greedy"], bf16["verdict"]) == (greedy, verdict)
    assert (fp8["greedy"], fp8["verdict"]) == ("equal", "PASS")
    assert demo.exit_status(rows) == status
    equal = 2 if greedy == "equal" else 1
    target = demo.served_target(PAIR / "target")
    assert demo.verdict("bf16", bf16, target) == (
        f"bf16: {verdict} (target {target}): {equal} of 2 prompts' greedy text equal to no "
        f"speculation's{note}"
    )
    assert bf16["near_tie_cutoff"] == pytest.approx(0.11)
    assert bf16["tau"] == pytest.approx(1 + 5 / 3)


def test_the_demo_names_the_target_it_serves_by_architecture_and_path() -> None:
    k3 = PAIR.with_name("pair-k3") / "target"  # train-pair --target kimi-k3's
    assert demo.served_target(PAIR / "target") == f"DeepseekV3ForCausalLM at {PAIR / 'target'}"
    assert demo.served_target(k3) == f"KimiK3ForConditionalGeneration at {k3}"


# vLLM's handler writes to the sys.stdout it was given, tqdm to sys.stderr, C and Triton to the fds.
CONSOLE_DRIVER = """
import logging, os, sys
from pathlib import Path
from vllm_dspark.tools import demo
with demo.console_only(Path(sys.argv[1])) as say:
    logger = logging.getLogger("vllm")
    logger.addHandler(logging.StreamHandler(sys.stdout))
    logger.warning("a vLLM warning")
    print("a library's print")
    print("a progress bar", file=sys.stderr)
    os.write(1, b"C stdout\\n")
    os.write(2, b"C stderr\\n")
    say("the demo's step")
print("after the demo")
"""


def test_the_console_shows_only_the_demo(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    proc = subprocess.run(
        [sys.executable, "-c", CONSOLE_DRIVER, str(log)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (proc.stdout, proc.stderr) == ("the demo's step\nafter the demo\n", "")
    assert log.read_text().splitlines() == [
        "a vLLM warning",
        "a library's print",
        "a progress bar",
        "C stdout",
        "C stderr",
    ]


@pytest.mark.e2e
def test_make_demo_serves_the_pair_with_dspark(tmp_path: Path) -> None:
    """``make demo``'s code path, smaller: quantize + check, three engines, the table it prints,
    the verdicts last, vLLM's logs in the file it names and not on the console."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the demo serves on CPU")
    out = tmp_path / "demo"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_dspark.tools.demo", "--pair", str(PAIR),
         "--out", str(out), "--prompts", "2", "--max-tokens", "12"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    log = out / demo.LOG
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    rows = results["comparison"]
    assert set(rows) == {"bf16", "fp8"}
    for name, row in rows.items():
        counters = results["runs"][name]["counters"]
        assert row["greedy"] in ("equal", "near-tie"), (name, row)
        assert row["verdict"] == "PASS" and len(row["prompts"]) == 2
        assert row["drafts"] == counters["vllm:spec_decode_num_drafts"] > 0
        assert row["accepted_per_position"] == [
            int(v) for v in counters["vllm:spec_decode_num_accepted_tokens_per_pos"]
        ]
        assert row["tau"] == pytest.approx(1 + sum(row["accepted_per_position"]) / row["drafts"])
        assert f"| {name} | {row['greedy']} | {row['drafts']} |" in proc.stdout
    target = demo.served_target(PAIR / "target")
    assert results["target"] == target and f"target: {target}" in proc.stdout
    lines = proc.stdout.splitlines()
    assert lines[0].endswith(str(log)) and lines[-2:] == [
        demo.verdict(name, rows[name], target) for name in ("bf16", "fp8")
    ]
    assert "check: OK" in proc.stdout and (out / "drafter-fp8" / "config.json").is_file()
    # vLLM's log lines carry its process prefix: all of them in the log, none on the console.
    assert proc.stderr == "" and "pid=" not in proc.stdout
    assert "(MainProcess pid=" in log.read_text()
