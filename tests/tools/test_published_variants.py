# SPDX-License-Identifier: Apache-2.0
"""The published drafters' variants (tests.support.checkpoints.TINY_VARIANTS: causal Block5 / K3.1-Pro,
K3.1-Pro without embed_tokens.weight, lightseekorg's fc_norm) through every tool: check, draft,
quantize (and the quantized build's check and reference load)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vllm_dspark.checkpoint.check import check_checkpoint
from vllm_dspark.checkpoint.st_io import read_header
from vllm_dspark.checkpoint.store import load_config, stored_tensors
from vllm_dspark.ops.masks import block_key_mask, paged_key_mask
from vllm_dspark.reference.drafter import ReferenceDrafter
from vllm_dspark.tools import cli

VARIANTS = ["causal", "no-embed", "fc-norm"]


@pytest.mark.parametrize("name", VARIANTS)
def test_check_passes_and_says_what_the_drafter_is(variant_checkpoints, name: str) -> None:
    report = check_checkpoint(variant_checkpoints[name])
    assert report.ok, report.render()
    text = report.render()
    assert ("non-causal" not in text) is (name != "fc-norm")
    assert ("no embed_tokens.weight" in text) is (name == "no-embed")
    assert ("per-tap fc_norm" in text) is (name == "fc-norm")


@pytest.mark.parametrize("name", VARIANTS)
def test_draft_cli_matches_the_reference(variant_checkpoints, name: str, tmp_path: Path) -> None:
    model = variant_checkpoints[name]
    inputs, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    assert cli.main(["draft", "--model", str(model), "--example-inputs", str(inputs)]) == 0
    assert (
        cli.main(["draft", "--model", str(model), "--inputs", str(inputs), "--out", str(out)]) == 0
    )
    got, given = load_file(str(out)), load_file(str(inputs))
    config = load_config(model)
    assert got["draft_tokens"].shape[1] == config.draft_block_size == (5 if name == "causal" else 7)
    expected = ReferenceDrafter.from_pretrained(model).draft(
        given["aux_hidden_states"],
        given["context_positions"],
        given["anchor_ids"],
        context_mask=given["context_mask"],
        temperature=given["temperature"],
        seeds=given["seeds"],
    )
    assert torch.equal(got["draft_tokens"], expected.tokens)


# float32 rounding differs with a GEMM's shape (a 3-slot block against the first 3 slots of a 5-slot
# one: 5.9e-6 at a scale of 3.07 on an AMD EPYC, bitwise equal on an AMX Xeon), so the blocks are
# compared within this many float32 eps of their magnitude. Each block's own float32 error, against
# the same computation in float64, is measured below and must stay under it (their sum bounds the two
# blocks' difference when the mask is right): 18 for the causal blocks, 44 for the non-causal ones on
# that Xeon. A slot that sees a later one moves by about 1e7.
CAUSAL_NOISE_EPS = 128


def _block_pair(
    model: Path, aux: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's hidden states for a block after 6 context positions, and for that block cut to 3 slots."""
    drafter = ReferenceDrafter.from_pretrained(model, compute_dtype=dtype)
    c = drafter.config
    positions = torch.arange(6)[None]
    kv = drafter.context_kv(drafter.combine_hidden_states(aux.to(dtype)), positions)
    anchors = torch.tensor([5])
    full = drafter.block_hidden(anchors, kv, torch.arange(6, 6 + c.draft_block_size)[None])
    # The same anchor and context with the block cut to 3 slots.
    embeds = drafter.embed_tokens(drafter.block_input_ids(anchors), drafter.compute_dtype)
    cut = drafter.block_hidden(anchors, kv, torch.arange(6, 9)[None], inputs_embeds=embeds[:, :3])
    return full[:, :3], cut


def test_causal_block_slots_never_see_later_ones(variant_checkpoints) -> None:
    """A causal drafter's first k hidden states are those of a k-slot block; a non-causal one's are not."""
    torch.manual_seed(0)
    eps = torch.finfo(torch.float32).eps
    results = {}
    for name in ("causal", "fc-norm"):
        c = load_config(variant_checkpoints[name])
        aux = torch.randn(1, 6, c.num_target_layers * c.target_hidden_size)
        full, cut = _block_pair(variant_checkpoints[name], aux, torch.float32)
        exact_full, exact_cut = _block_pair(variant_checkpoints[name], aux, torch.float64)
        assert full.dtype == torch.float32
        bound = CAUSAL_NOISE_EPS * eps * full.abs().max().item()
        noise = (full - exact_full).abs().max() + (cut - exact_cut).abs().max()
        assert noise <= bound, f"{name}: float32 noise {noise:.2e} above the bound {bound:.2e}"
        results[name] = torch.allclose(full, cut, rtol=0, atol=bound)
    assert results == {"causal": True, "fc-norm": False}


def test_block_and_paged_key_masks() -> None:
    assert block_key_mask(3, False).all() and block_key_mask(3, False).shape == (3, 3)
    staircase = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]]).bool()
    assert torch.equal(block_key_mask(3, True), staircase)
    # Two cached context positions, then a 3-slot block: the rows are positions 2, 3 and 4.
    assert paged_key_mask(3, 5, False).all() and paged_key_mask(3, 5, False).shape == (3, 5)
    context = torch.ones(3, 2, dtype=torch.bool)
    assert torch.equal(paged_key_mask(3, 5, True), torch.cat([context, staircase], 1))


@pytest.mark.parametrize(
    ("name", "fmt", "export"),
    [
        ("causal", "fp8", "compressed-tensors"),
        ("no-embed", "nvfp4", "compressed-tensors"),
        ("fc-norm", "fp8-dynamic", "modelopt"),
    ],
)
def test_quantized_variant_round_trips(
    variant_checkpoints, name: str, fmt: str, export: str, tmp_path: Path
) -> None:
    """A build keeps the variant: its config fields, BF16 fc_norm, no invented embedding."""
    out = tmp_path / "build"
    src = variant_checkpoints[name]
    args = ["--model-dir", str(src), "--out", str(out), "--quant-format", fmt, "--export", export]
    assert cli.main(["quantize", *args, "--no-progress"]) == 0
    report = check_checkpoint(out)
    assert report.ok, report.render()
    source, built = (
        json.loads((src / "config.json").read_text()),
        json.loads((out / "config.json").read_text()),
    )
    for field in ("is_causal", "block_size", "fc_norm", "aux_hidden_stream"):
        assert built.get(field) == source.get(field), field
    stored = stored_tensors(out)
    assert ("embed_tokens.weight" in stored) is (name != "no-embed")
    for key in (k for k in stored if k.startswith("fc_norm.")):
        assert read_header(stored[key].path)[key].dtype == "BF16"
    assert sum(k.startswith("fc_norm.") for k in stored) == (5 if name == "fc-norm" else 0)
    ReferenceDrafter.from_pretrained(out)  # loads and dequantizes


@pytest.mark.parametrize("name", VARIANTS)
def test_drift_harness_runs_on_the_variant(variant_checkpoints, name: str, tmp_path: Path) -> None:
    model = variant_checkpoints[name]
    args = ["--model", str(model), "--variants", "bf16", "fp8", "--regimes", "gauss"]
    assert cli.main(["eval", *args, "--blocks", "4", "--out", str(tmp_path), "--no-progress"]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    config = load_config(model)
    assert result["config"]["block_size"] == config.draft_block_size
    assert result["config"]["causal"] is config.causal
    assert {c["variant"] for c in result["cells"]} >= {"bf16", "fp8"}


def test_check_and_draft_on_a_small_drafter_with_exactly_the_published_key_set(
    tmp_path: Path,
) -> None:
    """The published document's keys, in its order, with nothing added: only sizes are smaller
    (the latent stays 512 + 64, so no target_kv_latent_dim is needed)."""
    from vllm_dspark.checkpoint.layout import TARGET_HEADS
    from vllm_dspark.checkpoint.presets import PUBLISHED_K3, preset_config_json
    from vllm_dspark.checkpoint.save import save_drafter
    from vllm_dspark.checkpoint.st_io import save_tensors
    from vllm_dspark.checkpoint.store import TARGET_EMBED_KEY, TARGET_LM_HEAD_KEY
    from vllm_dspark.checkpoint_tools.make_random import random_drafter_tensors, random_lm_head
    from vllm_dspark.config import K3DSparkConfig

    doc = preset_config_json("k3")
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
    sizes |= dict(num_key_value_heads=2, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16)
    sizes |= dict(vocab_size=512, draft_vocab_size=512, target_hidden_size=64, markov_rank=8)
    sizes |= dict(target_num_hidden_layers=8, target_layer_ids=[1, 2, 4, 5, 6])
    sizes |= dict(mask_token_id=509, bos_token_id=504, eos_token_id=506, pad_token_id=511)
    doc.update(sizes)
    assert list(doc) == list(PUBLISHED_K3)
    config = K3DSparkConfig(**doc)
    tensors = dict(random_drafter_tensors(config, seed=0))
    model = tmp_path / "drafter"
    save_drafter(model, doc, list(tensors.items()))
    heads = {
        TARGET_EMBED_KEY: tensors["embed_tokens.weight"],
        TARGET_LM_HEAD_KEY: random_lm_head(config, seed=0),
    }
    save_tensors(model / TARGET_HEADS, heads)
    assert list(json.loads((model / "config.json").read_text())) == list(PUBLISHED_K3)
    assert check_checkpoint(model).ok
    inputs, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    assert cli.main(["draft", "--model", str(model), "--example-inputs", str(inputs)]) == 0
    assert (
        cli.main(["draft", "--model", str(model), "--inputs", str(inputs), "--out", str(out)]) == 0
    )
    assert load_file(str(out))["draft_tokens"].shape[1] == 7  # no block_size: the tools draft 7
