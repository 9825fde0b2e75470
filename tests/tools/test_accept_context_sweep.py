# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark accept --context-sweep`` on the trained pair: τ per context length from prompts
padded with real text, the break-even τ and length under the step-cost model, its files, and one-line
errors for lengths the text or the target cannot hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.bad_input import run_cli, tree
from vllm_dspark.drift.context_sweep import break_even_length, padded_prompts
from vllm_dspark.ops.speculation_cost import TOKENSPEED_K3_MI355X, StepCost

PAIR = Path(__file__).resolve().parents[1] / "data" / "pair"
BASE = ["accept", "--target", str(PAIR / "target"), "--drafter", str(PAIR / "drafter")]
FAST = ["--variants", "fp32", "--num-prompts", "2", "--max-tokens", "8", "--resamples", "50"]


@pytest.fixture(autouse=True)
def one_thread():
    """The pair is tiny: one thread runs it faster than two contending ones on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_sweep_runs_on_the_pair(tmp_path) -> None:
    out = tmp_path / "sweep"
    inputs = tree(PAIR)
    r = run_cli(
        [*BASE, *FAST, "--context-sweep", "512", "32", "128", "--no-progress", "--out", str(out)]
    )
    assert r.code == 0, r.err
    assert tree(PAIR) == inputs  # the inputs are read, never written
    assert "step cost: the tokenspeed#1132 prior (K3 DSpark, MI355X)" in r.out
    names = sorted(p.name for p in out.iterdir())
    assert names[:2] == ["context_sweep.json", "context_sweep.md"]
    assert names[2:] in ([], ["tau_vs_context.png"])  # the plot needs matplotlib
    results = json.loads((out / "context_sweep.json").read_text())
    config = results["config"]
    assert config["lengths"] == [32, 128, 512]
    assert config["padding_text"].endswith("corpus.txt") and config["padding_tokens"] >= 512
    assert config["validated_context_len"] == 3 * 32768  # the pair's YaRN original window 32768
    assert config["cost"]["per_context_token"] == TOKENSPEED_K3_MI355X.per_context_token
    cells = results["cells"]
    assert [(c["variant"], c["context"]) for c in cells] == [("fp32", n) for n in (32, 128, 512)]
    for cell in cells:
        tau = cell["tau"]["value"]
        assert 1.0 <= tau <= 1 + config["block_size"] and cell["steps"] >= 2
        assert cell["break_even_tau"] == TOKENSPEED_K3_MI355X.ratio(cell["context"])
        assert cell["pays"] == (tau > cell["break_even_tau"])
        assert len(cell["tau_per_prompt"]) == 2 and cell["draft_kv"] == {"dtype": "bf16"}
    (be,) = results["break_even"].values()
    taus = [c["tau"]["value"] for c in cells]
    assert be["measured"] == break_even_length([32, 128, 512], taus, TOKENSPEED_K3_MI355X)
    table = (out / "context_sweep.md").read_text()
    assert "| fp32 | 512 |" in table and "Break-even length (measured)" in table


def test_longer_prompts_only_add_real_text_before_the_same_point() -> None:
    ids = list(range(1000))
    prompts = padded_prompts(ids, (16, 64, 256), 4, seed=0)
    assert [len(p) for p in prompts[256]] == [256] * 4
    for short, long in zip(prompts[16], prompts[256]):
        assert long[-16:] == short  # the same end point; the longer one has more text before it
        assert long == list(range(long[0], long[0] + 256))  # contiguous text, nothing repeated
    assert len({p[-1] for p in prompts[16]}) == 4
    with pytest.raises(ValueError, match="needs 2000 tokens of text, the padding text has 1000"):
        padded_prompts(ids, (2000,), 2, seed=0)


def test_break_even_length_interpolates_the_crossing() -> None:
    cost = StepCost(fixed=1.0, per_context_token=0.001)  # break-even τ 2 at 1000, 3 at 2000
    assert break_even_length([500, 1000, 2000], [4.0, 3.0, 2.0], cost) == pytest.approx(1500.0)
    assert break_even_length([500, 1000], [4.0, 3.5], cost) is None  # pays over the whole sweep
    assert break_even_length([500, 1000], [1.2, 3.5], cost) == 500.0  # never paid at the shortest


def test_step_cost_flags_and_bad_lengths_are_one_line(tmp_path) -> None:
    r = run_cli(
        [
            *BASE,
            *FAST,
            "--context-sweep",
            "64",
            "--step-cost",
            "0.5",
            "0",
            "--out",
            str(tmp_path / "a"),
        ]
    )
    assert (
        r.code == 2 and "must be finite and >= 1" in r.err and len(r.err.strip().splitlines()) == 1
    )
    r = run_cli(
        [*BASE, *FAST, "--context-sweep", "4090", "--no-progress", "--out", str(tmp_path / "b")]
    )
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1
    assert "pass the target's max_position_embeddings 4096. Fix: lengths up to 4081" in r.err
    r = run_cli(
        [*BASE, *FAST, "--context-sweep", "3000", "--no-progress", "--out", str(tmp_path / "c")]
    )
    assert (
        r.code == 2 and "needs 3000 tokens of text" in r.err and "--prompts a longer text" in r.err
    )
    assert not any((tmp_path / n).exists() for n in "abc")  # nothing left behind
