# SPDX-License-Identifier: Apache-2.0
"""The reference drafter's semantics on the tiny preset: MLA forms, non-causal block attention,
context handling, heads, and the Markov rollout."""

from __future__ import annotations

import pytest
import torch

import vllm_dspark.reference.gemm as gemm
from vllm_dspark.checkpoint.presets import preset_config
from vllm_dspark.checkpoint_tools.make_random import (
    random_drafter_tensors,
    random_lm_head,
    random_tensor,
)
from vllm_dspark.config import K3DSparkConfig
from vllm_dspark.ops.sampling import markov_rollout
from vllm_dspark.reference.drafter import ReferenceDrafter


def build(
    config: K3DSparkConfig, compute_dtype: torch.dtype = torch.float32, seed: int = 0
) -> ReferenceDrafter:
    tensors = dict(random_drafter_tensors(config, seed=seed))
    return ReferenceDrafter.from_state_dict(
        config,
        tensors,
        embed_tokens=tensors["embed_tokens.weight"],
        lm_head=random_lm_head(config, seed=seed),
        compute_dtype=compute_dtype,
    )


@pytest.fixture(scope="module")
def config() -> K3DSparkConfig:
    return preset_config("tiny")


@pytest.fixture(scope="module")
def drafter(config) -> ReferenceDrafter:
    return build(config)


def inputs(config: K3DSparkConfig, batch: int = 2, context_len: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(
        batch, context_len, config.num_target_layers * config.target_hidden_size, generator=g
    )
    positions = torch.randint(0, 5000, (batch, 1), generator=g) + torch.arange(context_len)
    anchors = torch.randint(0, config.vocab_size, (batch,), generator=g)
    return aux, positions, anchors


def hidden_of(
    drafter: ReferenceDrafter, aux, positions, anchors, *, mask=None, absorbed=False, embeds=None
):
    """The block's hidden states for a context ending at each request's last position."""
    context_kv = drafter.context_kv(drafter.combine_hidden_states(aux), positions)
    last = (
        positions.max(1).values if mask is None else positions.masked_fill(~mask, -1).max(1).values
    )
    block_positions = last[:, None] + torch.arange(1, drafter.config.draft_block_size + 1)
    return drafter.block_hidden(
        anchors,
        context_kv,
        block_positions,
        context_mask=mask,
        absorbed=absorbed,
        inputs_embeds=embeds,
    )


def test_parameters_carry_the_checkpoint_key_names(drafter, config) -> None:
    from vllm_dspark.checkpoint.layout import tensor_shapes

    params = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    assert params == {
        **tensor_shapes(config),
        "lm_head.weight": (config.vocab_size, config.hidden_size),
    }


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.float64, 1e-12)])
def test_naive_and_absorbed_mla_agree(config, dtype, tol) -> None:
    drafter = build(config, compute_dtype=dtype)
    aux, positions, anchors = inputs(config, batch=3)
    mask = torch.ones_like(positions, dtype=torch.bool)
    mask[2, 8:] = False
    naive = hidden_of(drafter, aux, positions, anchors, mask=mask)
    absorbed = hidden_of(drafter, aux, positions, anchors, mask=mask, absorbed=True)
    assert naive.dtype == dtype
    torch.testing.assert_close(absorbed, naive, rtol=tol, atol=tol)
    # Attention itself (before residuals and norms dilute any difference) agrees as well.
    attn = drafter.layers[0].self_attn
    x = torch.randn(
        3,
        config.draft_block_size,
        config.hidden_size,
        dtype=dtype,
        generator=torch.Generator().manual_seed(1),
    )
    block_positions = positions[:, -1:] + torch.arange(1, config.draft_block_size + 1)
    context_latent = drafter.context_kv(drafter.combine_hidden_states(aux), positions)[0]
    key_mask = torch.cat([mask, torch.ones(3, config.draft_block_size, dtype=torch.bool)], 1)
    torch.testing.assert_close(
        attn(x, block_positions, context_latent, key_mask, True),
        attn(x, block_positions, context_latent, key_mask, False),
        rtol=tol,
        atol=tol,
    )


def test_block_attention_is_non_causal(drafter, config) -> None:
    aux, positions, anchors = inputs(config)
    embeds = drafter.embed_tokens(drafter.block_input_ids(anchors), torch.float32)
    base = hidden_of(drafter, aux, positions, anchors, embeds=embeds)
    torch.testing.assert_close(base, hidden_of(drafter, aux, positions, anchors))
    changed = embeds.clone()
    changed[:, 5] += 1.0  # a later mask position's input
    after = hidden_of(drafter, aux, positions, anchors, embeds=changed)
    # Every earlier position sees it (a causal block would leave positions 0-4 bit-identical).
    for i in range(5):
        assert (after[:, i] - base[:, i]).abs().max() > 1e-3, f"position {i} ignored position 5"


def test_context_sensitivity_and_padding(drafter, config) -> None:
    aux, positions, anchors = inputs(config, context_len=12)
    base = hidden_of(drafter, aux, positions, anchors)
    aux2 = aux.clone()
    aux2[:, 3] += 1.0
    changed = hidden_of(drafter, aux2, positions, anchors)
    assert ((changed - base).abs().amax(dim=-1) > 1e-4).all(), (
        "every block position reads every context token"
    )

    # A request padded into a longer batch drafts exactly as it does alone.
    alone = hidden_of(drafter, aux[:1, :7], positions[:1, :7], anchors[:1])
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, 7:] = False
    padded_aux = aux.clone()
    padded_aux[0, 7:] = 1e3  # garbage in the padding must not leak
    batched = hidden_of(drafter, padded_aux, positions, anchors, mask=mask)
    torch.testing.assert_close(batched[:1], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batched[1:], base[1:], rtol=1e-5, atol=1e-5)


def test_positions_enter_only_relatively(drafter, config) -> None:
    aux, positions, anchors = inputs(config)
    base = hidden_of(drafter, aux, positions, anchors)
    shifted = hidden_of(drafter, aux, positions + 1000, anchors)  # context and block move together
    torch.testing.assert_close(shifted, base, rtol=2e-4, atol=2e-4)
    moved = positions.clone()
    moved[:, 2] -= 1  # one context token at another distance
    assert (hidden_of(drafter, aux, moved, anchors) - base).abs().max() > 1e-4


def test_draft_block_layout_and_heads_are_consistent(drafter, config) -> None:
    aux, positions, anchors = inputs(config, batch=2)
    mask = torch.ones_like(positions, dtype=torch.bool)
    mask[1, 9:] = False
    out = drafter.draft(aux, positions, anchors, context_mask=mask)
    n = config.draft_block_size
    assert out.tokens.shape == (2, n) and out.tokens.dtype == torch.int64
    assert out.logits.shape == (2, n, config.vocab_size) and out.logits.dtype == torch.float32
    assert torch.equal(out.block_positions[0], positions[0, -1] + torch.arange(1, n + 1))
    assert torch.equal(out.block_positions[1], positions[1, 8] + torch.arange(1, n + 1))
    assert torch.equal(
        drafter.block_input_ids(anchors)[:, 1:], torch.full((2, n - 1), config.mask_token_id)
    )
    torch.testing.assert_close(out.hidden, hidden_of(drafter, aux, positions, anchors, mask=mask))
    # Greedy: each token is the argmax of base logits + the bias of the previous token (the anchor first).
    prev = torch.cat([anchors[:, None], out.tokens[:, :-1]], 1)
    torch.testing.assert_close(out.markov_embeds, drafter.markov_embed(prev))
    expected = drafter.base_logits(out.hidden) + drafter.markov_bias(drafter.markov_embed(prev))
    torch.testing.assert_close(out.logits, expected)
    assert torch.equal(out.tokens, out.logits.argmax(-1))
    torch.testing.assert_close(out.confidences, drafter.confidence(out.hidden, out.markov_embeds))
    # The absorbed form drafts the same block.
    assert torch.equal(
        drafter.draft(aux, positions, anchors, context_mask=mask, absorbed=True).tokens, out.tokens
    )


def test_greedy_token_follows_the_previous_token(drafter, config) -> None:
    aux, positions, anchors = inputs(config, batch=1)
    hidden = hidden_of(drafter, aux, positions, anchors)
    base = drafter.base_logits(hidden)
    free = markov_rollout(base, anchors, drafter.markov_embed, drafter.markov_bias)
    i = 3
    changed_any = False
    for alternative in range(40):
        forced = torch.cat([anchors[:, None], free.tokens[:, :-1]], 1)
        forced[0, i] = alternative
        teacher = markov_rollout(
            base, anchors, drafter.markov_embed, drafter.markov_bias, forced_prev=forced
        )
        assert torch.equal(teacher.tokens[:, :i], free.tokens[:, :i])
        delta = drafter.markov_bias(
            drafter.markov_embed(torch.tensor([alternative]))
        ) - drafter.markov_bias(drafter.markov_embed(free.tokens[:, i - 1]))
        torch.testing.assert_close(
            teacher.logits[:, i] - free.logits[:, i], delta, rtol=1e-5, atol=1e-5
        )
        changed_any |= bool(teacher.tokens[0, i] != free.tokens[0, i])
    assert changed_any, "the Markov bias never changed the greedy token"


def test_confidence_head(drafter, config) -> None:
    aux, positions, anchors = inputs(config)
    out = drafter.draft(aux, positions, anchors)
    assert ((out.confidences > 0) & (out.confidences < 1)).all()
    other = drafter.markov_embed((out.tokens + 1) % config.vocab_size)
    assert (drafter.confidence(out.hidden, other) - out.confidences).abs().max() > 1e-4
    assert (
        drafter.confidence(out.hidden + 0.5, out.markov_embeds) - out.confidences
    ).abs().max() > 1e-4

    hidden_only = build(preset_config("tiny", confidence_head_with_markov=False))
    assert hidden_only.confidence_head.proj.weight.shape == (1, config.hidden_size)
    c = hidden_only.confidence(out.hidden, out.markov_embeds)
    torch.testing.assert_close(hidden_only.confidence(out.hidden, other), c)
    assert ((c > 0) & (c < 1)).all()

    no_head = build(
        preset_config("tiny", enable_confidence_head=False, confidence_head_with_markov=False)
    )
    assert no_head.draft(aux, positions, anchors).confidences is None
    with pytest.raises(ValueError, match="no confidence head"):
        no_head.confidence(out.hidden, out.markov_embeds)


def test_seeded_sampling_through_the_drafter(drafter, config) -> None:
    aux, positions, anchors = inputs(config, batch=3)
    temperature = torch.tensor([1.0, 0.0, 1.0])
    seeds = torch.tensor([11, 12, 13])
    a = drafter.draft(aux, positions, anchors, temperature=temperature, seeds=seeds)
    b = drafter.draft(aux, positions, anchors, temperature=temperature, seeds=seeds)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.tokens[1], a.logits[1].argmax(-1))
    # The same request in another batch drafts the same tokens.
    alone = drafter.draft(aux[2:], positions[2:], anchors[2:], temperature=1.0, seeds=seeds[2:])
    assert torch.equal(alone.tokens[0], a.tokens[2])


def test_bf16_compute(config) -> None:
    fp32, bf16 = build(config), build(config, compute_dtype=torch.bfloat16)
    assert all(
        p.dtype == torch.bfloat16
        for n, p in bf16.named_parameters()
        if not n.startswith("confidence_head")
    )
    assert bf16.confidence_head.proj.weight.dtype == torch.float32
    aux, positions, anchors = inputs(config)
    context = bf16.combine_hidden_states(aux)
    assert (
        context.dtype == torch.bfloat16
        and bf16.context_kv(context, positions).dtype == torch.bfloat16
    )
    h32, h16 = hidden_of(fp32, aux, positions, anchors), hidden_of(bf16, aux, positions, anchors)
    assert h16.dtype == torch.bfloat16
    relative = (h16.float() - h32).norm() / h32.norm()
    assert 1e-4 < relative < 5e-2, relative  # really computed in bf16, and still close
    out = bf16.draft(aux, positions, anchors)
    assert out.logits.dtype == torch.float32 and out.confidences.dtype == torch.float32


def test_bf16_weights_under_fp32_compute_are_exact(config) -> None:
    tensors = dict(random_drafter_tensors(config, seed=0))
    lm_head = random_lm_head(config, seed=0)
    stored_bf16 = ReferenceDrafter.from_state_dict(
        config, tensors, embed_tokens=tensors["embed_tokens.weight"], lm_head=lm_head
    )
    assert stored_bf16.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16  # kept narrow in memory
    upcast = {k: v.float() for k, v in tensors.items()}
    stored_fp32 = ReferenceDrafter.from_state_dict(
        config, upcast, embed_tokens=upcast["embed_tokens.weight"], lm_head=lm_head.float()
    )
    aux, positions, anchors = inputs(config)
    assert torch.equal(
        stored_bf16.draft(aux, positions, anchors).logits,
        stored_fp32.draft(aux, positions, anchors).logits,
    )


def test_linear_upcasts_large_weights_in_slabs(monkeypatch) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g)
    w = torch.randn(100, 64, generator=g).to(torch.bfloat16)
    bias = torch.randn(100, generator=g)
    whole = gemm.linear(x, w, bias)
    monkeypatch.setattr(gemm, "_UPCAST_CHUNK_ELEMENTS", 64 * 7)
    monkeypatch.setattr(gemm, "_MIN_SLAB_ROWS", 1)  # 15 slabs of 7 rows (the last one shorter)
    torch.testing.assert_close(gemm.linear(x, w, bias), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole, x @ w.float().T + bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("native", [True, False])
def test_bf16_products_without_native_bf16_gemm_match_torchs_bf16_gemm(
    monkeypatch, native: bool
) -> None:
    """On CPUs without AVX-512 the BF16 product runs as an FP32 GEMM of the BF16 values: it must give
    torch's own BF16 GEMM (FP32 accumulation) up to the output's rounding. Up to 16 rows it stays native."""
    monkeypatch.setattr(gemm, "native_bf16_gemm", lambda: native)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g).to(torch.bfloat16)
    bias = torch.randn(200, generator=g).to(torch.bfloat16)
    for rows in (16, 17):
        x = torch.randn(rows, 300, generator=g).to(torch.bfloat16)
        out = gemm.linear(x, w, bias)
        assert out.dtype == torch.bfloat16
        exact = x.double() @ w.double().T + bias.double()
        # Within one BF16 rounding (2^-8 relative) of the exact sum, as torch's BF16 GEMM is.
        torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=1e-6)
        native_out = torch.nn.functional.linear(x, w, bias)
        torch.testing.assert_close(out, native_out, rtol=2**-7, atol=0)
        if native or rows <= 16:
            assert torch.equal(out, native_out)
        else:  # the FP32 GEMM of the BF16 values, rounded once
            assert torch.equal(out, gemm.linear(x.float(), w, bias).to(torch.bfloat16))
    q = torch.randn(2, 3, 4, 300, generator=g).to(torch.bfloat16)
    out = gemm.einsum("bnhp,hpl->bnhl", q, w.view(4, 50, 300).transpose(1, 2))
    assert out.dtype == torch.bfloat16
    exact = torch.einsum("bnhp,hpl->bnhl", q.double(), w.view(4, 50, 300).transpose(1, 2).double())
    torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=1e-6)


def test_from_state_dict_rejects_mismatches(config) -> None:
    tensors = dict(random_drafter_tensors(config, seed=0))
    embed = tensors["embed_tokens.weight"]
    broken = dict(tensors)
    del broken["layers.1.mlp.up_proj.weight"]
    with pytest.raises(
        ValueError,
        match=r"missing tensor 'layers.1.mlp.up_proj.weight' \(expected shape \(128, 64\)\)",
    ):
        ReferenceDrafter.from_state_dict(config, broken, embed_tokens=embed, lm_head=embed)
    with pytest.raises(ValueError, match=r"lm_head has shape \(512, 32\).*\(512, 64\)"):
        ReferenceDrafter.from_state_dict(config, tensors, embed_tokens=embed, lm_head=embed[:, :32])


def test_draft_rejects_bad_inputs(drafter, config) -> None:
    aux, positions, anchors = inputs(config)
    with pytest.raises(ValueError, match=r"aux_hidden_states must be \[B, T, 320\]"):
        drafter.draft(aux[..., :-1], positions, anchors)
    with pytest.raises(ValueError, match="context_positions must be integer"):
        drafter.draft(aux, positions[:, :-1], anchors)
    with pytest.raises(ValueError, match=r"anchor_ids must be token ids in \[0, 512\)"):
        drafter.draft(aux, positions, anchors + 512)
    mask = torch.ones_like(positions, dtype=torch.bool)
    mask[1] = False
    with pytest.raises(ValueError, match=r"request\(s\) \[1\] without any context"):
        drafter.draft(aux, positions, anchors, context_mask=mask)
    with pytest.raises(ValueError, match="needs per-request seeds"):
        drafter.draft(aux, positions, anchors, temperature=0.7)


def test_random_weights_are_deterministic_and_structured() -> None:
    a = random_tensor("layers.0.mlp.up_proj.weight", (256, 512), "linear", seed=3)
    assert torch.equal(
        a, random_tensor("layers.0.mlp.up_proj.weight", (256, 512), "linear", seed=3)
    )
    assert not torch.equal(
        a, random_tensor("layers.0.mlp.up_proj.weight", (256, 512), "linear", seed=4)
    )
    assert not torch.equal(
        a, random_tensor("layers.0.mlp.gate_proj.weight", (256, 512), "linear", seed=3)
    )
    w = a.float()
    assert w.std().item() == pytest.approx(512**-0.5, rel=0.6)  # ~N(0, 1/fan_in) overall
    rows, cols = w.std(dim=1), w.std(dim=0)
    assert rows.max() / rows.min() > 2  # per-output-channel spread
    assert cols.max() / cols.median() > 4  # outlier input channels
    norm = random_tensor("final_norm.weight", (512,), "norm", seed=3).float()
    assert (norm - 1).abs().max() < 0.3 and norm.std() > 0.01
