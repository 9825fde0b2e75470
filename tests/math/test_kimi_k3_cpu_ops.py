# SPDX-License-Identifier: Apache-2.0
"""The Kimi-K3 target's CPU emulations (:mod:`vllm_dspark.cpu_serving.kimi_k3_ops`) equal torch references
on tiny inputs: the KDA state ops (the initial-state gather; the short-conv state update in plain
decode and in speculative verification, where the line rolls by the accepted drafts) and the MLA
epilogues (latent insert, key and query concat, the context-latent gather)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_dspark.cpu_serving import kimi_k3_ops as kimi_k3

WIDTH, DIM = 4, 6


def _conv(stream: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """SiLU of the causal depthwise conv over ``stream [dim, T]`` (zero history), ``[dim, T]``."""
    padded = F.pad(stream, (WIDTH - 1, 0))
    return F.silu(F.conv1d(padded[None], weight[:, None], bias, groups=DIM)[0])


def test_gather_initial_states_zeroes_rows_without_one() -> None:
    state = torch.randn(5, 2, 3, 3)
    indices = torch.tensor([3, -1, 0, 4], dtype=torch.int32)
    has = torch.tensor([True, False, True, True])
    out = kimi_k3.gather_initial_states(state, indices, has)
    expected = torch.stack([state[3], torch.zeros_like(state[0]), state[0], state[4]])
    assert torch.equal(out, expected)


def test_conv_update_decode_equals_the_stream_conv_and_vllm_cpus_kernel() -> None:
    """One token per line: the output is the conv at that token, the line keeps the last inputs."""
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_update_cpu

    torch.manual_seed(0)
    weight, bias = torch.randn(DIM, WIDTH), torch.randn(DIM)
    streams = torch.randn(2, DIM, 7)
    state = torch.zeros(4, DIM, WIDTH - 1)
    lines = torch.tensor([2, 3], dtype=torch.int32)
    for line, stream in zip(lines, streams, strict=True):
        state[line] = stream[:, 3:6]
    theirs = state.clone()
    x = streams[:, :, 6].clone()
    out = kimi_k3.causal_conv1d_update(
        x.clone(), state, weight, bias, "silu", conv_state_indices=lines, out=torch.empty_like(x)
    )
    reference = torch.stack([_conv(s, weight, bias)[:, 6] for s in streams])
    torch.testing.assert_close(out, reference)
    for line, stream in zip(lines, streams, strict=True):
        assert torch.equal(state[line], stream[:, 4:7])
    vllm_out = causal_conv1d_update_cpu(x.clone(), theirs, weight, bias, "silu", lines)
    torch.testing.assert_close(out, vllm_out)
    torch.testing.assert_close(state, theirs)


@pytest.mark.parametrize("accepted", [(1, 1), (2, 4), (4, 3)])
def test_conv_update_verification_rolls_back_to_the_accepted_tokens(accepted) -> None:
    """Two verification steps of a 3-token draft block (4 query tokens) on two lines: after the
    first, each line accepts ``accepted[r]`` tokens; the second step's outputs are the conv over the
    prompt and the accepted tokens only, as if the rejected drafts had never been seen."""
    torch.manual_seed(1)
    query = 4
    weight, bias = torch.randn(DIM, WIDTH), torch.randn(DIM)
    prompts = [torch.randn(DIM, 5), torch.randn(DIM, 9)]
    state = torch.zeros(3, DIM, WIDTH - 2 + query)
    lines = torch.tensor([1, 2], dtype=torch.int32)
    for line, prompt in zip(lines, prompts, strict=True):
        state[line, :, : WIDTH - 1] = prompt[:, -(WIDTH - 1) :]  # as the prefill conv leaves it
    streams = list(prompts)
    num_accepted = torch.ones(2, dtype=torch.int32)  # the bonus token after prefill
    for step in range(2):
        blocks = [torch.randn(DIM, query), torch.randn(DIM, query - step)]
        x = torch.cat(blocks, dim=1).T.contiguous()
        starts = torch.tensor([0, query, 2 * query - step], dtype=torch.int32)
        out = kimi_k3.causal_conv1d_update(
            x,
            state,
            weight,
            bias,
            "silu",
            conv_state_indices=lines,
            num_accepted_tokens=num_accepted,
            query_start_loc=starts,
            max_query_len=query,
            out=torch.empty_like(x),
        )
        for r, block in enumerate(blocks):
            seen = torch.cat([streams[r], block], dim=1)
            expected = _conv(seen, weight, bias)[:, -block.shape[1] :]
            torch.testing.assert_close(out[starts[r] : starts[r + 1]].T, expected)
        num_accepted = torch.tensor([min(a, b.shape[1]) for a, b in zip(accepted, blocks)])
        num_accepted = num_accepted.to(torch.int32)
        streams = [
            torch.cat([s, b[:, :n]], dim=1) for s, b, n in zip(streams, blocks, num_accepted)
        ]


def test_conv_update_skips_null_lines() -> None:
    state = torch.randn(2, DIM, WIDTH - 1)
    before = state.clone()
    x = torch.randn(1, DIM)
    out = torch.full_like(x, 7.0)
    kimi_k3.causal_conv1d_update(
        x, state, torch.randn(DIM, WIDTH), None, "silu", torch.tensor([0]), out=out
    )
    assert torch.equal(state, before) and torch.equal(out, torch.full_like(x, 7.0))


def _paged(blocks: int = 4, block_size: int = 4, entry: int = 10) -> torch.Tensor:
    return torch.zeros(blocks, block_size, entry, dtype=torch.bfloat16)


def test_latent_insert_equals_vllm_cpu_mlas() -> None:
    """As vLLM's CPU MLA backend writes its cache (its ``do_kv_cache_update`` reads nothing of its impl)."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    torch.manual_seed(2)
    kv_c, k_pe = torch.randn(5, 8, dtype=torch.bfloat16), torch.randn(5, 1, 2, dtype=torch.bfloat16)
    slots = torch.tensor([3, 9, -1, 0, 14])
    ours, theirs = _paged(), _paged()
    kimi_k3.insert_latent(kv_c, k_pe, ours, slots)
    CPUMLAImpl.do_kv_cache_update(None, kv_c, k_pe, theirs, slots, "auto", torch.ones(()))
    assert torch.equal(ours, theirs) and ours.abs().sum() > 0


def test_key_concat_and_decode_query_concat() -> None:
    torch.manual_seed(3)
    q = torch.randn(3, 2, 6, dtype=torch.bfloat16)
    k_nope, k_pe = (
        torch.randn(3, 2, 4, dtype=torch.bfloat16),
        torch.randn(3, 1, 2, dtype=torch.bfloat16),
    )
    kv_c = torch.randn(3, 8, dtype=torch.bfloat16)
    cache, slots = _paged(), torch.tensor([1, 6, 11])
    k = kimi_k3.key_concat_cache_insert(q.clone(), k_nope, k_pe, kv_c, cache, slots)
    assert torch.equal(k[:, 1], torch.cat([k_nope[:, 1], k_pe[:, 0]], dim=-1)) and k.is_contiguous()
    assert torch.equal(cache.view(-1, 10)[slots], torch.cat([kv_c, k_pe[:, 0]], dim=-1))
    ql_nope, q_pe = (
        torch.randn(3, 2, 8, dtype=torch.bfloat16),
        torch.randn(3, 2, 2, dtype=torch.bfloat16),
    )
    decode_cache = _paged()
    mqa_q = kimi_k3.decode_q_concat_cache_insert(ql_nope, q_pe, kv_c, k_pe, decode_cache, slots)
    assert torch.equal(mqa_q, torch.cat([ql_nope, q_pe], dim=-1))
    assert torch.equal(decode_cache, cache)


def test_context_gather_reads_back_each_requests_latents() -> None:
    """Two requests' context latents, inserted through their block tables, gathered from ``seq_starts``."""
    torch.manual_seed(4)
    cache = _paged(blocks=6)
    block_table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    latents = [torch.randn(7, 10, dtype=torch.bfloat16), torch.randn(9, 10, dtype=torch.bfloat16)]
    for r, latent in enumerate(latents):
        pos = torch.arange(latent.shape[0])
        slots = block_table[r, pos // 4].long() * 4 + pos % 4
        kimi_k3.insert_latent(latent[:, :8], latent[:, 8:], cache, slots)
    starts = torch.tensor([2, 0], dtype=torch.int32)
    lens = [5, 9]
    cu = torch.tensor([0, 5, 14], dtype=torch.int32)
    token_to_seq = torch.tensor([0] * 5 + [1] * 9, dtype=torch.int32)
    dst = torch.zeros(16, 10, dtype=torch.bfloat16)
    kimi_k3.gather_and_maybe_dequant_cache(
        cache, dst, block_table, cu, token_to_seq, 14, "auto", torch.ones(()), starts
    )
    expected = torch.cat(
        [latents[r][int(starts[r]) : int(starts[r]) + n] for r, n in enumerate(lens)]
    )
    assert torch.equal(dst[:14], expected) and not dst[14:].any()


def _context_chunk(q_lens: list[int], kv_lens: list[int]):
    """vLLM's ``ContextChunk`` for requests with these query and context lengths (one chunk, from 0)."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonPrefillMetadata

    def cu(lens: list[int]) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    return MLACommonPrefillMetadata.ContextChunk(
        index=0,
        request_slice=slice(0, len(q_lens)),
        token_slice=slice(0, sum(q_lens)),
        continuation_token_end=0,
        is_continuation=False,
        num_context_tokens=sum(kv_lens),
        query_start_loc=cu(q_lens),
        max_query_len=max(q_lens),
        cu_seq_lens=cu(kv_lens),
        starts=torch.zeros(len(q_lens), dtype=torch.int32),
        max_seq_len=max(kv_lens),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        token_to_seq=torch.repeat_interleave(torch.arange(len(kv_lens)), torch.tensor(kv_lens)),
        all_rows_active=True,
    )


def _context_chunk_case():
    """CPU_SDPA_MLA on two requests' queries (3 and 1 tokens) over their contexts (5 and 2), BF16."""
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

    heads, qk, dv, scale = 2, 6, 4, 0.4
    backend = CPUSDPAMLAPrefillBackend(heads, scale, 8, 4, 2, dv, vllm_config=None)
    torch.manual_seed(5)
    q_lens, kv_lens = [3, 1], [5, 2]
    q = torch.randn(sum(q_lens), heads, qk, dtype=torch.bfloat16)
    k = torch.randn(sum(kv_lens), heads, qk, dtype=torch.bfloat16)
    v = torch.randn(sum(kv_lens), heads, dv, dtype=torch.bfloat16)
    return backend, _context_chunk(q_lens, kv_lens), q, k, v


def _unpatched(method):
    return getattr(method, "__wrapped__", method)


def test_context_chunk_into_out_writes_the_partial_the_backend_returns() -> None:
    """The patched method with ``out`` returns that very ``out`` (Kimi-K3's MLA asserts it) holding
    what the unpatched one returns without it, and both equal non-causal attention in torch."""
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

    backend, chunk, q, k, v = _context_chunk_case()
    original = _unpatched(CPUSDPAMLAPrefillBackend.run_prefill_context_chunk)
    want, want_lse = original(backend, chunk, q, k, v)
    patched = kimi_k3.context_chunk_into_out(original)
    out = torch.full_like(want, float("nan"))
    got, got_lse = patched(backend, chunk, q, k, v, out=out)
    assert got is out and torch.equal(got, want) and torch.equal(got_lse, want_lse)
    no_out, no_out_lse = patched(backend, chunk, q, k, v)
    assert torch.equal(no_out, want) and torch.equal(no_out_lse, want_lse)
    for r, (qs, ks) in enumerate(zip([(0, 3), (3, 4)], [(0, 5), (5, 7)], strict=True)):
        scores = torch.einsum("qhd,khd->hqk", q[slice(*qs)].float(), k[slice(*ks)].float()) * 0.4
        attention = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[slice(*ks)].float())
        torch.testing.assert_close(want[slice(*qs)].float(), attention, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(want_lse[:, slice(*qs)], scores.logsumexp(-1))


@pytest.mark.upstream_bug
def test_cpu_mla_context_chunk_promises_out_and_refuses_it() -> None:
    """Pins vLLM's contradiction (0.32-0.34): ``supports_out()`` is True, yet a context chunk given
    ``out`` asserts. When this fails, vLLM honours ``out`` and ``context_chunk_into_out`` can go."""
    backend, chunk, q, k, v = _context_chunk_case()
    original = _unpatched(type(backend).run_prefill_context_chunk)
    assert backend.supports_out()
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=v.dtype)
    with pytest.raises(AssertionError, match="does not support in-place output"):
        original(backend, chunk, q, k, v, out=out)
