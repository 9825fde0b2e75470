# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""MLA attention of the K3 DSpark draft layers, chosen by platform.

CUDA/ROCm: vLLM's own Kimi-K3 ``MultiHeadLatentAttention`` (:mod:`vllm_dspark.runtime.attention_cuda`); its
576-wide latent KV spec puts the draft layers in the target's KV-cache group. CPU with Triton (Model
Runner V2 under its interpreter): the same layer with torch stand-ins for the CUDA decode epilogue
(:mod:`vllm_dspark.runtime.attention_cpu`). Without Triton, :class:`TorchLatentAttention` takes its place for
loading and testing outside an engine: same submodule names, same math in torch over a paged latent
cache of the same layout (model dtype, or FP8 E4M3 with the layer's KV-cache scale), bound with
:meth:`TorchLatentAttention.bind_kv_cache`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.platforms import current_platform
from vllm.triton_utils import HAS_TRITON

from vllm_dspark.compat import (
    ATTENTION_K_SCALE,
    absorbed_weight,
    keep_weight_on_cpu,
    kv_cache_scale,
    runs_in_tree_k3_layers,
)
from vllm_dspark.findings import Finding, FindingError
from vllm_dspark.ops.kv_fp8 import dequantize_latent, quantize_latent
from vllm_dspark.ops.masks import paged_key_mask
from vllm_dspark.ops.rope import rotate_pe, softmax_scale

# The FP8 cache dtypes vLLM's CUDA MLA inserts write as E4M3 ("fp8" is E4M3 on CUDA).
FP8_E4M3_CACHE_DTYPES = ("fp8", "fp8_e4m3")

if TYPE_CHECKING:
    from vllm.config import CacheConfig
    from vllm.model_executor.layers.quantization import QuantizationConfig

    from vllm_dspark.config import K3DSparkConfig


@dataclass
class LatentAttentionMetadata:
    """Per-layer attention metadata :class:`TorchLatentAttention` reads from the forward context.

    The query rows of request ``r`` are ``[query_start_loc[r], query_start_loc[r + 1])``; after
    their latents are written, positions ``0 .. seq_lens[r] - 1`` of the request are in the cache
    and every query row attends to all of them (a non-causal block), or to those up to its own
    position (a causal drafter's block).
    """

    query_start_loc: torch.Tensor  # [R + 1] int
    seq_lens: torch.Tensor  # [R] int
    block_table: torch.Tensor  # [R, max_blocks_per_request] int, physical block ids


def mla_rope_parameters(config: K3DSparkConfig) -> dict[str, Any]:
    """``rope_parameters`` as Kimi-K3's MLA layer hands them to ``get_rope``.

    Any scaled rope is DeepSeek-YaRN there (DeepSeek llama-scaling when ``attention_factor`` is
    1.0), not HF YaRN: the two differ in how they scale cos/sin.
    """
    rope_parameters = dict(config.rope_parameters)
    if rope_parameters["rope_type"] != "default":
        rope_parameters["rope_type"] = (
            "deepseek_llama_scaling"
            if rope_parameters.get("attention_factor") == 1.0
            else "deepseek_yarn"
        )
    return rope_parameters


class TorchLatentAttention(nn.Module):
    """Kimi-K3 MLA (q-LoRA, RoPE, a non-causal or causal block) in plain torch over a paged latent cache.

    The stand-in for ``MultiHeadLatentAttention`` where that layer cannot run (see the module
    docstring). Keys and values are up-projected from the cached latents with ``kv_b_proj`` (the
    "naive" MLA form) instead of absorbing it into the query, but with the weight absorption uses:
    dequantized, its input never quantized, as on a GPU. An FP8 cache holds ``latent / k_scale`` in
    E4M3, as vLLM's ``concat_and_cache_mla`` writes it.
    """

    def __init__(
        self,
        *,
        config: K3DSparkConfig,
        cache_config: CacheConfig,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        if cache_config.cache_dtype not in ("auto", *FP8_E4M3_CACHE_DTYPES):
            raise FindingError(
                Finding(
                    f"kv_cache_dtype={cache_config.cache_dtype!r} is not supported by the K3 DSpark drafter's "
                    f"{current_platform.device_name} attention (a plain-torch fallback with a model-dtype "
                    "or FP8 E4M3 cache)",
                    "use kv_cache_dtype='auto' or 'fp8', or serve on a GPU",
                )
            )
        c = config
        self.layer_name = prefix
        self.num_local_heads = c.num_attention_heads // get_tensor_model_parallel_world_size()
        self.q_lora_rank = c.q_lora_rank
        self.kv_lora_rank = c.kv_lora_rank
        self.qk_nope_head_dim = c.qk_nope_head_dim
        self.qk_rope_head_dim = c.qk_rope_head_dim
        self.qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
        self.v_head_dim = c.v_head_dim
        self.head_size = c.kv_latent_dim
        self.causal = c.causal
        self.scale = softmax_scale(self.qk_head_dim, c.rope_parameters)
        self.rotary_emb = get_rope(
            c.qk_rope_head_dim,
            max_position=c.max_position_embeddings,
            rope_parameters=mla_rope_parameters(c),
            is_neox_style=False,
            dtype=torch.float32,
        )
        # The latent Q and KV projections are replicated; TP splits heads in q_b_proj / kv_b_proj.
        self.fused_qkv_a_proj = MergedColumnParallelLinear(
            c.hidden_size,
            [c.q_lora_rank, self.head_size],
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.fused_qkv_a_proj",
            disable_tp=True,
        )
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, eps=c.rms_norm_eps)
        self.q_b_proj = ColumnParallelLinear(
            c.q_lora_rank,
            c.num_attention_heads * self.qk_head_dim,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.q_b_proj",
        )
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, eps=c.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(
            c.kv_lora_rank,
            c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim),
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.kv_b_proj",
        )
        # Up-projected with its weight as vLLM's MLA absorbs it (read at first use, after loading).
        keep_weight_on_cpu(self.kv_b_proj)
        self._kv_b_weight: torch.Tensor | None = None
        self.o_proj = RowParallelLinear(
            c.num_attention_heads * c.v_head_dim,
            c.hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.kv_cache = torch.tensor([])
        # Where vLLM's attention layers keep them: the in-tree context-KV path reads both.
        self.kv_cache_dtype = cache_config.cache_dtype
        self.register_buffer(
            ATTENTION_K_SCALE.reads, torch.tensor(1.0, dtype=torch.float32), persistent=False
        )

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Use ``kv_cache [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` as this layer's pages."""
        if kv_cache.dim() != 3 or kv_cache.shape[-1] != self.head_size:
            raise ValueError(
                f"{self.layer_name}: a latent KV cache is [num_blocks, block_size, {self.head_size}], "
                f"got {tuple(kv_cache.shape)}"
            )
        if self.kv_cache_dtype != "auto" and kv_cache.element_size() != 1:
            raise ValueError(
                f"{self.layer_name}: a {self.kv_cache_dtype} latent KV cache has 1-byte elements, "
                f"got {kv_cache.dtype}"
            )
        self.kv_cache = kv_cache

    def store_latent(
        self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Write ``[kv_c_normed | k_pe]`` (``[T, kv_lora_rank]``, ``[T, 1, rope]``) at ``slot_mapping [T]``.

        Negative slots are padding and are skipped, as vLLM's cache-insert kernels skip them.
        """
        if self.kv_cache.numel() == 0:
            # Profiling and dummy runs happen before the cache is allocated.
            return
        valid = slot_mapping >= 0
        latent = torch.cat([kv_c_normed, k_pe.squeeze(1)], dim=-1)[valid]
        if self.kv_cache_dtype != "auto":
            # As vLLM's fp8 insert; vLLM allocates FP8 pages as bytes.
            latent = quantize_latent(latent, kv_cache_scale(self)).view(self.kv_cache.dtype)
        self.kv_cache.view(-1, self.head_size)[slot_mapping[valid]] = latent.to(self.kv_cache.dtype)

    def load_latent(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The latents ``[len(slots), kv_lora_rank + rope]`` at ``slots``, dequantized to ``dtype``."""
        latent = self.kv_cache.view(-1, self.head_size)[slots]
        if self.kv_cache_dtype == "auto":
            return latent.to(dtype)
        return dequantize_latent(latent, kv_cache_scale(self), dtype)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q_c, kv_c, k_pe = self.fused_qkv_a_proj(hidden_states)[0].split(
            [self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        q = self.q_b_proj(self.q_a_layernorm(q_c.contiguous()))[0]
        q_nope, q_pe = q.view(-1, self.num_local_heads, self.qk_head_dim).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1
        )
        q_pe = rotate_pe(self.rotary_emb, positions, q_pe)
        kv_c_normed = self.kv_a_layernorm(kv_c.contiguous())
        k_pe = rotate_pe(self.rotary_emb, positions, k_pe.unsqueeze(1))
        return self.o_proj(self._attention(q_nope, q_pe, kv_c_normed, k_pe))[0]

    def _attention(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
    ) -> torch.Tensor:
        """Insert this step's latents, then attend every query row to its request's whole sequence."""
        out = q_nope.new_zeros(q_nope.shape[0], self.num_local_heads, self.v_head_dim)
        forward_context = get_forward_context()
        if forward_context.attn_metadata is None:
            # Profiling run without metadata: no attention, as in the GPU layer.
            return out.flatten(1)
        meta: LatentAttentionMetadata = forward_context.attn_metadata[self.layer_name]
        if self.kv_cache.numel() == 0:
            raise ValueError(
                f"{self.layer_name}: attention metadata was given but no KV cache is bound"
            )
        num_tokens = int(meta.query_start_loc[-1])
        slot_mapping = forward_context.slot_mapping[self.layer_name][:num_tokens]
        self.store_latent(kv_c_normed[:num_tokens], k_pe[:num_tokens], slot_mapping)

        cache = self.kv_cache.view(-1, self.head_size)
        block_size = self.kv_cache.shape[1]
        for r in range(meta.seq_lens.shape[0]):
            start, end = int(meta.query_start_loc[r]), int(meta.query_start_loc[r + 1])
            pos = torch.arange(int(meta.seq_lens[r]), device=cache.device)
            slots = meta.block_table[r, pos // block_size].long() * block_size + pos % block_size
            kv_c, pe = self.load_latent(slots, q_nope.dtype).split(
                [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
            )
            if self._kv_b_weight is None:
                self._kv_b_weight = absorbed_weight(self.kv_b_proj, q_nope.dtype)
            k_nope, v = (
                torch.nn.functional.linear(kv_c, self._kv_b_weight)
                .view(-1, self.num_local_heads, self.qk_nope_head_dim + self.v_head_dim)
                .split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
            )
            # The rope part of the key is one MQA head shared by every query head.
            scores = torch.einsum("qhd,khd->hqk", q_nope[start:end], k_nope)
            scores = scores + torch.einsum("qhd,kd->hqk", q_pe[start:end], pe)
            visible = paged_key_mask(end - start, len(pos), self.causal, cache.device)
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = (scores.float() * self.scale).softmax(dim=-1).to(v.dtype)
            out[start:end] = torch.einsum("hqk,khd->qhd", probs, v)
        return out.flatten(1)


def _k3_mla_arguments(
    config: K3DSparkConfig,
    cache_config: CacheConfig,
    quant_config: QuantizationConfig | None,
    prefix: str,
) -> dict[str, Any]:
    """Kimi-K3 ``MultiHeadLatentAttention``'s arguments for a DSpark draft layer (RoPE, non-causal block)."""
    return dict(
        config=config,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        cache_config=cache_config,
        quant_config=quant_config,
        prefix=prefix,
        use_rope=True,
        non_causal_multi_token_decode=True,
    )


def build_latent_attention(
    *,
    config: K3DSparkConfig,
    cache_config: CacheConfig,
    quant_config: QuantizationConfig | None,
    prefix: str,
) -> nn.Module:
    """One draft layer's attention: vLLM's Kimi-K3 MLA (on CPU with Triton, its CPU variant), else
    :class:`TorchLatentAttention`.

    ``prefix`` is the layer's runtime name (``model.layers.{target_layers + i}.self_attn``): the
    KV-cache layer name and the prefix quantization matches against.
    """
    if current_platform.is_cpu() and HAS_TRITON:
        # A CPU engine with Triton (its interpreter) runs vLLM's dspark speculator: the GPU layer
        # on TRITON_MLA. Without Triton no CPU engine can, and the torch layer serves loading.
        from vllm_dspark.runtime.attention_cpu import K3DSparkCPUMLA

        return K3DSparkCPUMLA(**_k3_mla_arguments(config, cache_config, quant_config, prefix))
    if runs_in_tree_k3_layers():
        # Imported here: the Kimi-K3 MLA module pulls in CUDA kernels and cute-dsl.
        from vllm_dspark.runtime.attention_cuda import K3DSparkMLA

        return K3DSparkMLA(**_k3_mla_arguments(config, cache_config, quant_config, prefix))
    return TorchLatentAttention(
        config=config, cache_config=cache_config, quant_config=quant_config, prefix=prefix
    )
