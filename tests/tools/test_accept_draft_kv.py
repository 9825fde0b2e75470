# SPDX-License-Identifier: Apache-2.0
"""``accept --draft-kv fp8`` on the trained pair (issue 43): the drafter's latents read back from E4M3
pages with the per-layer k_scale its checkpoint stores (``quantize --kv-cache-scheme fp8``, here
calibrated from a user's aux-state file), else 1.0, said in the output; greedy stays lossless."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vllm_dspark.tools.cli import main

PAIR = Path(__file__).resolve().parents[1] / "data" / "pair"


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pair's drafter in FP8 with KV scales calibrated from the target's aux states on two held-out
    prompts, supplied as a file (the documented ``--kv-calibration`` layout)."""
    from vllm_dspark.checkpoint.store import load_config
    from vllm_dspark.reference.target import load_target, target_states

    config = load_config(PAIR / "drafter")
    layers = list(config.target_layer_ids)
    target = load_target(PAIR / "target", layers, config.target_hidden_size, config.vocab_size)
    held_out = [
        p["token_ids"]
        for p in json.loads((PAIR / "heldout_prompts.json").read_text())["prompts"][-2:]
    ]
    _, aux = target_states(target, torch.tensor(held_out), layers)
    root = tmp_path_factory.mktemp("draft-kv")
    save_file({"aux_hidden_states": aux.contiguous()}, root / "aux.safetensors")
    out = root / "fp8-kv"
    argv = [
        "quantize",
        "--model",
        str(PAIR / "drafter"),
        "--out",
        str(out),
        "--quant-format",
        "fp8",
    ]
    argv += ["--kv-cache-scheme", "fp8", "--kv-calibration", str(root / "aux.safetensors")]
    assert main([*argv, "--no-progress"]) == 0
    return out


def test_fp8_draft_kv_takes_the_checkpoints_scales_else_one(calibrated, tmp_path, capsys) -> None:
    from vllm_dspark.checkpoint.store import stored_k_scales

    prompts = tmp_path / "prompts.json"
    held_out = json.loads((PAIR / "heldout_prompts.json").read_text())["prompts"]
    prompts.write_text(json.dumps({"prompts": held_out[:2]}))
    out = tmp_path / "accept"
    argv = ["accept", "--target", str(PAIR / "target"), "--drafter", str(PAIR / "drafter")]
    argv += ["--prompts", str(prompts), "--max-tokens", "10", "--resamples", "50", "--no-progress"]
    argv += ["--variants", "bf16", str(calibrated), "--draft-kv", "fp8", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["draft_kv"] == "fp8"
    by_variant = {c["variant"]: c for c in results["cells"]}
    stored = stored_k_scales(calibrated).tolist()
    assert stored != [1.0, 1.0]
    assert by_variant[calibrated.name]["draft_kv"]["k_scales"] == stored
    assert by_variant["bf16"]["draft_kv"]["k_scales"] == [1.0, 1.0]
    assert "stores no KV-cache scales" in by_variant["bf16"]["draft_kv"]["scales"]
    assert "k_scale 1.0" in printed and "calibrated" in printed
    assert "FP8 E4M3" in (out / "results.md").read_text()
    for cell in results["cells"]:
        assert cell["lossless"] == [True, True], cell["variant"]
        assert cell["tau"]["value"] > 1.0


def test_fp8_pages_move_the_drafters_logits_by_e4m3_rounding_only() -> None:
    """The reference drafter under an fp8 KV cache: close to its BF16-cache logits, not equal."""
    from vllm_dspark.reference.drafter import ReferenceDrafter

    drafter = ReferenceDrafter.from_pretrained(PAIR / "drafter")
    g = torch.Generator().manual_seed(0)
    width = drafter.config.num_target_layers * drafter.config.target_hidden_size
    aux = torch.randn(1, 24, width, generator=g)
    args = (aux, torch.arange(24)[None], torch.tensor([5]))
    exact = drafter.draft(*args).logits
    drafter.use_fp8_kv_cache(torch.ones(drafter.config.num_hidden_layers))
    fp8 = drafter.draft(*args).logits
    drafter.use_fp8_kv_cache(None)
    assert torch.equal(drafter.draft(*args).logits, exact)
    diff = (fp8 - exact).abs().max()
    assert 0 < diff < 0.1 * exact.abs().max()
