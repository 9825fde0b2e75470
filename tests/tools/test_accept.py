# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark accept`` on the trained pair (``tests/data/pair``): lossless greedy decoding that
accepts drafts, figures that add up, its files, and one-line errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vllm_dspark.drift.metrics import acceptance_ceiling
from vllm_dspark.tools.cli import main

PAIR = Path(__file__).resolve().parents[1] / "data" / "pair"
MODELS = {"target": PAIR / "target", "drafter": PAIR / "drafter"}
BLOCK = json.loads((PAIR / "drafter" / "config.json").read_text())["block_size"]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.json"
    held_out = json.loads((PAIR / "heldout_prompts.json").read_text())["prompts"]
    path.write_text(json.dumps({"prompts": held_out[:2]}))
    return path


def _accept(models: dict[str, Path], prompts: Path, out: Path, *extra: str) -> dict:
    argv = ["accept", "--target", str(models["target"]), "--drafter", str(models["drafter"])]
    argv += ["--prompts", str(prompts), "--max-tokens", "16", "--resamples", "50", "--no-progress"]
    assert main([*argv, "--out", str(out), *extra]) == 0
    return json.loads((out / "results.json").read_text())


def test_greedy_is_lossless_and_its_figures_add_up(prompts, tmp_path):
    out = tmp_path / "accept"
    results = _accept(
        MODELS,
        prompts,
        out,
        "--variants",
        "fp32",
        "fp8",
        "--scheduled",
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "acceptance_per_position.png",
        "results.json",
        "results.md",
        "tau.png",
    ]
    assert [(c["variant"], c["mode"]) for c in results["cells"]] == [
        ("fp32", "full"),
        ("fp32", "scheduled"),
        ("fp8", "full"),
        ("fp8", "scheduled"),
    ]
    for cell in results["cells"]:
        assert cell["lossless"] == [True, True], cell["variant"]
        assert cell["tau"]["value"] > 1, cell  # the trained drafter's drafts are accepted
        assert len(cell["per_position_acceptance"]) == BLOCK
        tau = cell["tau"]["value"]
        assert 1 <= tau <= BLOCK + 1 and cell["tau"]["lo"] <= tau <= cell["tau"]["hi"]
        if cell["mode"] == "full":
            # Every draft verified: tau is the product of the per-position rates, and the target
            # verifies N + 1 tokens per step.
            rates = [e["value"] for e in cell["per_position_acceptance"]]
            rates = np.nan_to_num(rates, nan=0.0)
            assert acceptance_ceiling(rates) == pytest.approx(tau)
            assert cell["target_tokens_per_accepted"]["value"] == pytest.approx((BLOCK + 1) / tau)
        else:
            assert cell["target_tokens_per_accepted"]["value"] <= (BLOCK + 1) / tau + 1e-9
    assert "| fp32 | full |" in (out / "results.md").read_text()


def test_temperature_one_runs_block_verification(prompts, tmp_path):
    results = _accept(MODELS, prompts, tmp_path / "t1", "--variants", "bf16", "--temperature", "1")
    (cell,) = results["cells"]
    assert "lossless" not in cell  # sampled outputs have no single reference to equal
    assert cell["steps"] >= 2 * 16 / (BLOCK + 1)


def test_bad_input_is_one_line(tiny_llama_target, prompts, tmp_path, capsys):
    base = ["accept", "--drafter", str(MODELS["drafter"]), "--prompts", str(prompts)]
    assert (
        main(
            [
                *base,
                "--target",
                str(MODELS["target"]),
                "--variants",
                "int3",
                "--out",
                str(tmp_path / "a"),
            ]
        )
        == 2
    )
    assert "unknown variant(s) 'int3'" in capsys.readouterr().err
    assert main([*base, "--target", str(tiny_llama_target), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not the drafter's full target" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_non_finite_logits_are_refused_not_accepted(prompts, tmp_path, capsys):
    """A NaN weight gives NaN logits, whose argmax (token 0) would match the target's: refused."""
    import shutil

    from safetensors.torch import load_file, save_file

    drafter = tmp_path / "drafter"
    shutil.copytree(MODELS["drafter"], drafter)
    shard = drafter / "model-00001-of-00001.safetensors"
    tensors = load_file(shard)
    tensors["layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    argv = ["accept", "--target", str(MODELS["target"]), "--drafter", str(drafter)]
    argv += ["--prompts", str(prompts), "--max-tokens", "8", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err  # transformers' loading bar comes first
    assert "Traceback" not in err and "NaN or infinite" in err.strip().splitlines()[-1], err
    assert not (tmp_path / "out").exists()


def test_the_causal_pair_is_lossless_and_drafts_causally(prompts, tmp_path) -> None:
    """``tests/data/pair-causal``: a causal-block drafter of the same target through ``accept``."""
    causal = PAIR.with_name("pair-causal")
    models = {"target": causal / "target", "drafter": causal / "drafter"}
    results = _accept(models, prompts, tmp_path / "accept", "--variants", "bf16")
    assert results["config"]["causal"] is True and results["config"]["block_size"] == 7
    [cell] = results["cells"]
    assert cell["lossless"] == [True, True] and cell["tau"]["value"] > 1.0
