# SPDX-License-Identifier: Apache-2.0
"""The K3 DSpark draft layers' attention inside a CPU engine: the GPU layer on TRITON_MLA's metadata.

``dspark`` runs only in Model Runner V2, which on CPU needs Triton (under its interpreter). There the
draft layers are the GPU's :class:`~vllm_dspark.runtime.attention_cuda.K3DSparkMLA` with three substitutions:
the backend is :class:`TorchMLABackend` (TRITON_MLA's metadata builder, which flattens the
non-causal block into decode rows, with decode attention in torch; vLLM's CPU MLA backends cannot
take the block), the decode epilogue (RoPE, query concat, latent insert) is torch instead of a fused
CUDA op, and ``kv_b_proj`` keeps its weight (vLLM's CPU linears drop it) so decode can absorb it.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend, TritonMLAImpl

from vllm_dspark.compat import k3_mla_backend, keep_weight_on_cpu
from vllm_dspark.findings import Finding, FindingError
from vllm_dspark.ops.masks import paged_key_mask
from vllm_dspark.ops.rope import rotate_pe
from vllm_dspark.runtime.attention_cuda import K3DSparkMLA


class TorchMLAImpl(TritonMLAImpl):
    """TRITON_MLA's decode attention over the paged latent cache, in torch."""

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        """``q [rows, heads, kv_lora_rank + rope]`` -> latent output ``[rows, heads, kv_lora_rank]`` and LSE.

        Rows are ``query_len`` per request; each attends to its request's first ``seq_len`` cached
        latents (all of them for the non-causal draft block, a causal staircase otherwise).
        """
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        decode = attn_metadata.decode
        num_reqs = decode.seq_lens.shape[0]
        query_len = q.shape[0] // num_reqs
        cache = kv_c_and_k_pe_cache.reshape(-1, kv_c_and_k_pe_cache.shape[-1])
        block_size = kv_c_and_k_pe_cache.shape[1]
        out = q.new_zeros(q.shape[0], q.shape[1], self.kv_lora_rank)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        for r, seq_len in enumerate(decode.seq_lens.tolist()):
            if seq_len == 0:
                continue  # padding request
            pos = torch.arange(seq_len, device=q.device)
            slots = decode.block_table[r, pos // block_size].long() * block_size + pos % block_size
            latent = cache[slots].float()
            rows = slice(r * query_len, (r + 1) * query_len)
            scores = torch.einsum("qhd,kd->qhk", q[rows].float(), latent) * self.scale
            visible = paged_key_mask(query_len, seq_len, attn_metadata.causal, q.device)
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
            lse[rows] = scores.logsumexp(dim=-1)
            out[rows] = torch.einsum(
                "qhk,kd->qhd", scores.softmax(dim=-1), latent[:, : self.kv_lora_rank]
            ).to(q.dtype)
        return out, lse


class TorchMLABackend(TritonMLABackend):
    """TRITON_MLA with :class:`TorchMLAImpl`: non-causal draft blocks on CPU at torch speed."""

    @staticmethod
    def get_name() -> str:
        return "DSPARK_TORCH_MLA"

    @staticmethod
    def get_impl_cls() -> type[TorchMLAImpl]:
        return TorchMLAImpl


class K3DSparkCPUMLA(K3DSparkMLA):
    """:class:`K3DSparkMLA` on :class:`TorchMLABackend` with a torch decode epilogue (model-dtype cache)."""

    def __init__(self, **kwargs) -> None:
        cache_config = kwargs.get("cache_config")
        if cache_config is not None and cache_config.cache_dtype != "auto":
            raise FindingError(
                Finding(
                    f"kv_cache_dtype={cache_config.cache_dtype!r} is not supported by the K3 DSpark drafter on CPU "
                    "(its latent insert is written for a model-dtype cache)",
                    "use kv_cache_dtype='auto', or serve on a GPU",
                )
            )
        # The layer asks the platform for its backend, which on CPU is one without non-causal blocks.
        with k3_mla_backend(TorchMLABackend):
            super().__init__(**kwargs)
        keep_weight_on_cpu(self.kv_b_proj)

    def store_latent(
        self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Write ``[kv_c_normed | k_pe]`` at ``slot_mapping``; negative (padding) slots are skipped."""
        if self.kv_cache.numel() == 0:
            return  # profiling runs precede the cache
        valid = slot_mapping >= 0
        latent = torch.cat([kv_c_normed, k_pe.flatten(1)], dim=-1)[valid]
        self.kv_cache.view(-1, self.head_size)[slot_mapping[valid].long()] = latent.to(
            self.kv_cache.dtype
        )

    def _decode_concat_cache(
        self, ql_nope, q_pe, kv_c_normed, k_pe, positions, cos_sin_cache, slot_mapping
    ):
        """RoPE on ``q_pe``/``k_pe``, insert the latent, return ``[ql_nope | q_pe]``: the fused op's contract."""
        if positions is not None:
            q_pe = rotate_pe(self.rotary_emb, positions, q_pe)
            k_pe = rotate_pe(self.rotary_emb, positions, k_pe)
        self.store_latent(kv_c_normed, k_pe, slot_mapping)
        return torch.cat([ql_nope, q_pe.to(ql_nope.dtype)], dim=-1)
