# SPDX-License-Identifier: Apache-2.0
"""``K3DSparkForCausalLM`` built and loaded by vLLM's own dspark loader on CPU, against the reference drafter.

The drafter is built exactly as ``DSparkSpeculator.load_draft_model`` builds it (see
``tests/support/vllm_drafter.py``) from a real ``VllmConfig`` with ``speculative_config={"method": "dspark"}``,
in FP32 so it can be compared with the FP32 reference drafter. What is replaced on CPU, and why:
the draft layers' attention is ``TorchLatentAttention`` instead of vLLM's Kimi-K3
``MultiHeadLatentAttention``, whose decode/prefill epilogues are fused CUDA kernels; the tests bind
paged latent caches to it and pass attention metadata through vLLM's forward context. Everything
else (linears, norms, rotary table, Markov/confidence heads, logits processor, loader) is vLLM's.

The ``skewed`` drafter (``vllm_drafter.SKEWED_CONFIG``: ``logit_scale`` 1.75, ``mscale`` 1.0 against
``mscale_all_dim`` 0.5) is also served at a 40000-token context, so its block sits past the YaRN
boundary (``original_max_position_embeddings`` 32768) and every scale the presets leave at 1 counts.

Tolerance: both sides compute in FP32 from the same weights and differ only in operation order
(fused add+norm, GEMM blocking, the paged gather), so hooks agree to ``atol = rtol = 1e-4``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.support.vllm_drafter import (
    Served,
    assert_hooks_match_reference,
    bind_caches,
    load_drafter,
    make_batch,
    reference_context_kv,
    run_block,
)

FP32_TOL = {"atol": 1e-4, "rtol": 1e-4}
# A 40000-token context: the second request's block (positions 40000 .. 40006) lies past 32768.
LONG_CONTEXT = {"context_lens": (9, 40000), "block_size": 64}


@pytest.fixture(scope="module")
def drafters(tiny_mla_target: Path, request) -> Callable[[str], tuple[Served, Any]]:
    """The served drafter and its FP32 reference for a checkpoint fixture's name, each loaded once."""
    from vllm_dspark.reference.drafter import ReferenceDrafter

    loaded: dict[str, tuple[Served, Any]] = {}

    def load(checkpoint: str) -> tuple[Served, Any]:
        if checkpoint not in loaded:
            path = request.getfixturevalue(checkpoint)
            loaded[checkpoint] = (
                load_drafter(tiny_mla_target, path),
                ReferenceDrafter.from_pretrained(path),
            )
        return loaded[checkpoint]

    return load


@pytest.fixture(scope="module")
def served(drafters) -> Served:
    return drafters("tiny_checkpoint")[0]


@pytest.fixture(scope="module")
def reference(drafters):
    return drafters("tiny_checkpoint")[1]


def _fresh_model(served: Served):
    """A newly constructed, unloaded drafter, through vLLM's ``initialize_model``."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    vllm_config = served.vllm_config
    draft_model_config = vllm_config.speculative_config.draft_model_config
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(draft_model_config.dtype):
        return initialize_model(vllm_config=vllm_config, model_config=draft_model_config)


def _checkpoint_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def test_built_by_vllm_dspark_loader_with_target_numbering_and_shared_heads(served: Served) -> None:
    from vllm.model_executor.layers.linear import (
        LinearBase,
        ReplicatedLinear,
        UnquantizedLinearMethod,
    )
    from vllm.model_executor.models.registry import ModelRegistry

    from vllm_dspark.runtime.attention import TorchLatentAttention
    from vllm_dspark.runtime.model import K3DSparkForCausalLM

    model, target = served.model, served.target
    draft_config = served.vllm_config.speculative_config.draft_model_config
    assert (
        ModelRegistry.resolve_model_cls(draft_config.architectures, draft_config)[0]
        is K3DSparkForCausalLM
    )
    assert type(model) is K3DSparkForCausalLM

    # Draft layers are numbered after the target's 8 layers.
    assert model.get_draft_kv_cache_layer_names() == [
        "model.layers.8.self_attn",
        "model.layers.9.self_attn",
    ]
    assert model.model.context_kv_proj.prefix == "model.layers.8.self_attn.fused_qkv_a_proj"
    # The CPU stand-in for the Kimi-K3 MLA layer (see the module docstring).
    assert all(isinstance(layer.self_attn, TorchLatentAttention) for layer in model.model.layers)

    # Embedding and lm_head are the target's own modules, aliased by load_dspark_model.
    assert model.model.embed_tokens is target.model.embed_tokens
    assert model.lm_head is target.lm_head
    assert not model.has_own_embed_tokens and not model.has_own_lm_head
    assert model.draft_id_to_target_id is None
    ids = torch.tensor([3, 509])
    assert torch.equal(model.map_draft_to_target(ids), ids)

    # A BF16 checkpoint: no quant config, every linear unquantized.
    assert model.quant_config is None
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(isinstance(m.quant_method, UnquantizedLinearMethod) for m in linears)

    # TP: Markov and confidence heads and the latent projections are replicated on every rank.
    heads = model.model
    assert isinstance(heads.markov_head.markov_w1, torch.nn.Embedding)
    assert heads.markov_head.markov_w2.tp_size == 1
    assert isinstance(heads.confidence_head.proj, ReplicatedLinear)
    assert heads.confidence_head.proj.weight.dtype == torch.float32
    assert heads.context_kv_proj.tp_size == 1
    assert all(layer.self_attn.fused_qkv_a_proj.tp_size == 1 for layer in heads.layers)


def test_every_hook_matches_the_fp32_reference(served: Served, reference) -> None:
    assert_hooks_match_reference(served, reference, **FP32_TOL)


@pytest.mark.parametrize("name", ["causal", "no-embed", "fc-norm"])
def test_published_variants_match_the_fp32_reference(
    tiny_mla_target: Path, variant_checkpoints, name: str
) -> None:
    """Causal blocks (Block5, K3.1-Pro), no stored embedding (K3.1-Pro) and per-tap fc_norm
    (lightseekorg) load through vLLM's dspark loader and compute as the reference does."""
    from vllm_dspark.reference.drafter import ReferenceDrafter

    path = variant_checkpoints[name]
    served, reference = load_drafter(tiny_mla_target, path), ReferenceDrafter.from_pretrained(path)
    config = served.model.config
    assert config.causal is (name != "fc-norm") and config.fc_norm is (name == "fc-norm")
    assert_hooks_match_reference(served, reference, **FP32_TOL)
    if name == "fc-norm":
        norms = served.model.model.fc_norm
        assert len(norms) == config.num_target_layers and not norms[0].weight.eq(1).all()


def test_skewed_drafter_at_a_long_context_matches_the_fp32_reference(drafters) -> None:
    served_skewed, reference_skewed = drafters("skewed_checkpoint")
    config = served_skewed.model.config
    rope = config.rope_parameters
    assert config.logit_scale != 1.0 and rope["mscale"] != rope["mscale_all_dim"]
    batch = make_batch(config, **LONG_CONTEXT)
    assert (
        int(batch.block_positions(config.draft_block_size).min(dim=1).values[1])
        > rope["original_max_position_embeddings"]
    )
    assert_hooks_match_reference(served_skewed, reference_skewed, batch=batch, **FP32_TOL)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("drafter", ["tiny", "skewed-long-context"])
def test_drafted_block_matches_the_reference_draft(
    drafters, drafter: str, temperature: float
) -> None:
    """One speculator step end to end (hooks + the shared Markov rollout) drafts the reference's tokens."""
    from vllm_dspark.ops.sampling import markov_rollout

    if drafter == "tiny":
        served, reference = drafters("tiny_checkpoint")
        batch = make_batch(served.model.config, seed=1)
    else:
        served, reference = drafters("skewed_checkpoint")
        batch = make_batch(served.model.config, seed=1, **LONG_CONTEXT)
    model, config = served.model, served.model.config
    bind_caches(model, batch, torch.float32)
    model.precompute_and_store_context_kv(
        model.combine_hidden_states(batch.aux), batch.context_positions, batch.context_slots
    )
    hidden = run_block(served, batch)
    num_requests, n = len(batch.context_lens), config.draft_block_size
    seeds = torch.tensor([11, 12])
    block_positions = batch.block_positions(n)
    rollout = markov_rollout(
        model.compute_draft_logits(hidden).view(num_requests, n, -1),
        batch.anchors,
        model.markov_embed,
        model.markov_bias,
        temperature=temperature,
        seeds=seeds,
        positions=block_positions,
    )
    confidence = model.compute_confidence(hidden, rollout.markov_embeds.flatten(0, 1)).view(
        num_requests, n
    )

    aux, positions, mask = batch.padded_context()
    expected = reference.draft(
        aux, positions, batch.anchors, temperature=temperature, seeds=seeds, context_mask=mask
    )
    assert torch.equal(expected.block_positions, block_positions)
    assert torch.equal(rollout.tokens, expected.tokens)
    torch.testing.assert_close(rollout.logits, expected.logits, **FP32_TOL)
    torch.testing.assert_close(confidence, expected.confidences, **FP32_TOL)


def test_context_kv_slot_mapping_forms(served: Served, reference) -> None:
    """``None`` computes without storing; a per-layer list may skip layers; negative slots are padding."""
    model, config = served.model, served.model.config
    batch = make_batch(config)
    caches = bind_caches(model, batch, torch.float32)
    context = model.combine_hidden_states(batch.aux)

    model.precompute_and_store_context_kv(context, batch.context_positions, None)
    assert all(cache.abs().sum() == 0 for cache in caches)

    slots = batch.context_slots.clone()
    slots[1] = -1  # a padded row
    model.precompute_and_store_context_kv(context, batch.context_positions, [None, slots])
    assert caches[0].abs().sum() == 0, "layer 0 was given no slots and must stay untouched"
    expected, _ = reference_context_kv(reference, context, batch)
    expected_rows = torch.cat([expected[1, r, :n] for r, n in enumerate(batch.context_lens)])
    flat = caches[1].view(-1, caches[1].shape[-1])
    written = slots >= 0
    torch.testing.assert_close(flat[slots[written]], expected_rows[written], **FP32_TOL)
    assert flat[batch.context_slots[1]].abs().sum() == 0, "a padded row was written"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.update({"layers.0.mlp.extra_proj.weight": torch.zeros(4, 4)}),
            r"checkpoint tensor 'layers\.0\.mlp\.extra_proj\.weight' belongs to no module of this drafter",
        ),
        (
            lambda t: t.update({"layers.1.mlp.down_proj.bias": torch.zeros(64)}),
            r"'layers\.1\.mlp\.down_proj\.bias' has no parameter 'model\.layers\.1\.mlp\.down_proj\.bias': "
            r"layers\.1\.mlp\.down_proj has no 'bias'",
        ),
        (
            lambda t: t.update({"context_proj.weight_scale": torch.ones(64, 1)}),
            r"'context_proj\.weight_scale' has no parameter .*stores context_proj quantized, but its "
            r"quantization_config does not quantize it",
        ),
        (
            lambda t: t.pop("layers.1.mlp.down_proj.weight"),
            r"left these parameters unfilled: model\.layers\.1\.mlp\.down_proj\.weight\.",
        ),
        (
            lambda t: t.pop("layers.0.mlp.up_proj.weight"),
            r"unfilled: model\.layers\.0\.mlp\.gate_up_proj\.weight \(missing shards \[1\]\)",
        ),
        (
            lambda t: t.pop("layers.1.self_attn.kv_a_proj_with_mqa.weight"),
            r"unfilled: model\.layers\.1\.self_attn\.fused_qkv_a_proj\.weight \(missing shards \[1\]\), "
            r"model\.context_kv_proj\.weight \(missing shards \[1\]\)",
        ),
        (
            lambda t: t.update({"final_norm.weight": torch.ones(65)}),
            r"'final_norm\.weight' \(torch\.float32, \(65,\)\) does not fit parameter 'model\.final_norm\.weight'",
        ),
    ],
    ids=[
        "unknown-module",
        "unknown-param",
        "quantized-tensor",
        "missing",
        "missing-shard",
        "missing-stacked-shard",
        "wrong-shape",
    ],
)
def test_loading_is_strict(served: Served, tiny_checkpoint: Path, edit, message: str) -> None:
    tensors = {k: v.float() for k, v in _checkpoint_tensors(tiny_checkpoint).items()}
    edit(tensors)
    with pytest.raises(ValueError, match=message):
        _fresh_model(served).load_weights(iter(tensors.items()))


def test_loading_fills_every_parameter_once(served: Served, tiny_checkpoint: Path) -> None:
    model = _fresh_model(served)
    loaded = model.load_weights(iter(_checkpoint_tensors(tiny_checkpoint).items()))
    assert loaded == {name for name, _ in model.named_parameters()}
    # A copy of the target's lm_head in the drafter's shards is skipped, as vLLM's in-tree class skips it.
    tensors = dict(_checkpoint_tensors(tiny_checkpoint), **{"lm_head.weight": torch.zeros(512, 64)})
    assert _fresh_model(served).load_weights(iter(tensors.items())) == loaded


def test_target_of_another_depth_is_refused(
    tmp_path: Path, tiny_mla_target: Path, tiny_checkpoint: Path
) -> None:
    deeper = tmp_path / "target9"
    deeper.mkdir()
    config = json.loads((tiny_mla_target / "config.json").read_text())
    (deeper / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 9}))
    with pytest.raises(
        ValueError, match=r"made for a 8-layer target .* but the target has 9 layers"
    ):
        load_drafter(deeper, tiny_checkpoint)


def test_not_a_standalone_model() -> None:
    from vllm_dspark.runtime.model import K3DSparkForCausalLM

    with pytest.raises(
        ValueError, match=r"speculative drafter, not a standalone model.*method': 'dspark'"
    ):
        K3DSparkForCausalLM(vllm_config=SimpleNamespace(speculative_config=None))


@pytest.mark.vllm_api
def test_gpu_attention_layer_accepts_what_the_drafter_passes() -> None:
    """The GPU path cannot run here, but its API can be checked: the Kimi-K3 MLA layer takes every
    argument build_latent_attention passes, and the subclass adds only the context-latent insert."""
    import inspect

    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention

    from vllm_dspark.runtime.attention_cuda import K3DSparkMLA

    params = inspect.signature(MultiHeadLatentAttention.__init__).parameters
    passed = {
        "config",
        "hidden_size",
        "num_heads",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "q_lora_rank",
        "kv_lora_rank",
        "cache_config",
        "quant_config",
        "prefix",
        "use_rope",
        "non_causal_multi_token_decode",
    }
    assert passed <= set(params)
    assert issubclass(K3DSparkMLA, MultiHeadLatentAttention)
    assert {name for name in vars(K3DSparkMLA) if not name.startswith("_")} == {"store_latent"}
