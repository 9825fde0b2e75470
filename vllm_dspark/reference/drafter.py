# SPDX-License-Identifier: Apache-2.0
"""Reference K3 DSpark drafter: the whole forward in plain PyTorch, the project's numerical oracle.

It computes what vLLM's ``dspark`` speculator gets from ``K3DSparkForCausalLM`` with no vLLM kernel:
the context latents (aux states -> ``context_proj`` -> per-layer ``kv_a_proj_with_mqa``), the block
``[anchor, mask x (N-1)]`` through MLA (non-causal over the block, or causal where config.json says is_causal) + SwiGLU layers, then the heads (logits, the
Markov rollout of :mod:`vllm_dspark.ops.sampling`, the confidence head). Attention exists in the naive
form (latents up-projected by ``kv_b_proj``) and the absorbed one the GPU kernels run; they must
agree. Module and parameter names mirror the checkpoint, so ``state_dict()`` keys are the HF keys.
Weights stored narrower than ``compute_dtype`` are upcast per use (exact for BF16 -> FP32), by
:mod:`vllm_dspark.reference.gemm`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dspark.checkpoint.layout import TARGET_DIR, tensor_shapes
from vllm_dspark.checkpoint.store import (
    input_quantizers,
    load_config,
    load_drafter_state_dict,
    load_target_heads,
    validate_tensor_shapes,
)
from vllm_dspark.config import K3DSparkConfig
from vllm_dspark.findings import Finding, FindingError
from vllm_dspark.finite import require_finite
from vllm_dspark.ops.act_quant import ActScheme
from vllm_dspark.ops.kv_fp8 import latent_round_trip
from vllm_dspark.ops.masks import block_key_mask
from vllm_dspark.ops.rope import RotaryEmbedding, softmax_scale
from vllm_dspark.ops.sampling import markov_rollout
from vllm_dspark.reference.gemm import einsum, linear


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape), requires_grad=False)


class Linear(nn.Module):
    # A W8A8 / W4A4 build's input quantization: (scheme, stored scale or None), as vLLM's kernels apply it.
    input_quant: tuple[ActScheme, torch.Tensor | None] | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_quant is not None:
            scheme, scale = self.input_quant
            x = scheme(x, scale)
        return linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = _param(num_embeddings, dim)

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return F.embedding(ids, self.weight).to(dtype)


class RMSNorm(nn.Module):
    """vLLM's RMSNorm: statistics in fp32, result cast back before the weight multiplies it."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = _param(size)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight.to(x.dtype)


class MultiHeadLatentAttention(nn.Module):
    """K3 MLA with q-LoRA and RoPE on the 64-wide ``pe`` parts, attending over context and block latents."""

    # An fp8 KV cache's k_scale: every latent attended over (context and block) is read back from
    # E4M3 pages, as vLLM's fp8 MLA cache serves them. None: the latents stay in the compute dtype.
    kv_scale: torch.Tensor | None = None

    def __init__(self, config: K3DSparkConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        c = config
        self.num_heads = c.num_attention_heads
        self.qk_nope_head_dim = c.qk_nope_head_dim
        self.qk_rope_head_dim = c.qk_rope_head_dim
        self.v_head_dim = c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        self.scale = softmax_scale(c.qk_nope_head_dim + c.qk_rope_head_dim, c.rope_parameters)
        self.rope = rope
        self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.q_b_proj = Linear(
            c.q_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
        )
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.kv_latent_dim)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = Linear(
            c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim)
        )
        self.o_proj = Linear(c.num_attention_heads * c.v_head_dim, c.hidden_size)

    def latent(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[..., T, H]`` (normed), ``[..., T]`` -> ``[..., T, kv_lora_rank + rope]``: what the KV page holds."""
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        return torch.cat([self.kv_a_layernorm(kv_c), self.rope(k_pe, positions)], dim=-1)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        context_latent: torch.Tensor,
        key_mask: torch.Tensor,
        absorbed: bool,
    ) -> torch.Tensor:
        """Block ``x [B, N, H]`` (normed) at ``positions [B, N]`` attends over ``[context ; block]`` latents.

        ``context_latent [B, T, kv_lora_rank + rope]``; ``key_mask [B, T + N]`` marks valid keys,
        or ``[B, N, T + N]`` per query (several blocks sharing one context, as in training).
        """
        batch, block, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(batch, block, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_pe = self.rope(q_pe, positions)
        latents = torch.cat([context_latent.to(x.dtype), self.latent(x, positions)], dim=1)
        if self.kv_scale is not None:
            latents = latent_round_trip(latents, self.kv_scale)
        attend = self._attend_absorbed if absorbed else self._attend_naive
        out = attend(q_nope, q_pe, latents, key_mask)  # [B, N, heads, v_head_dim]
        return self.o_proj(out.flatten(-2))

    def _probs(
        self, q: torch.Tensor, k: torch.Tensor, equation: str, key_mask: torch.Tensor
    ) -> torch.Tensor:
        """Masked softmax of ``scale * q.k`` over the keys, as ``[B, heads, N, S]`` in q's dtype.

        Scores and softmax run in (at least) fp32 from the operands' exact values, as the MLA kernels
        accumulate them; the probabilities go back to the compute dtype for the value product.
        """
        wide = torch.promote_types(q.dtype, torch.float32)
        scores = torch.einsum(equation, q.to(wide), k.to(wide)) * self.scale
        per_query = key_mask[:, None] if key_mask.dim() == 3 else key_mask[:, None, None, :]
        scores = scores.masked_fill(~per_query, float("-inf"))
        return scores.softmax(dim=-1).to(q.dtype)

    def _attend_naive(self, q_nope, q_pe, latents, key_mask) -> torch.Tensor:
        """Up-project every latent with ``kv_b_proj`` into per-head keys and values, then attend.

        ``q_nope [B, N, heads, P]``, ``q_pe [B, N, heads, R]``, ``latents [B, S, L + R]``.
        """
        kv_c, k_pe = latents.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        batch, keys, _ = kv_c.shape
        kv = self.kv_b_proj(kv_c).view(
            batch, keys, self.num_heads, self.qk_nope_head_dim + self.v_head_dim
        )
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        # The rope part of the key is one MQA head shared by every query head.
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(-1, -1, self.num_heads, -1)], dim=-1)
        probs = self._probs(torch.cat([q_nope, q_pe], dim=-1), k, "bnhd,bshd->bhns", key_mask)
        return einsum("bhns,bshd->bnhd", probs, v)

    def _attend_absorbed(self, q_nope, q_pe, latents, key_mask) -> torch.Tensor:
        """Fold ``W_UK`` into the query, attend over the latents themselves, apply ``W_UV`` after.

        The scores ``q_nope . (W_UK kv_c)`` become ``(W_UK^T q_nope) . kv_c``: one 576-wide MQA head
        ``[kv_c ; k_pe]`` serves every query head, which is what the paged-latent kernels exploit.
        """
        kv_c = latents[..., : self.kv_lora_rank]
        # kv_b_proj rows are per head [k_nope (P) ; v (V)], each a map from the kv_lora_rank latent.
        w = self.kv_b_proj.weight.to(kv_c.dtype).view(
            self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1
        )
        w_uk, w_uv = w.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        q_latent = einsum("bnhp,hpl->bnhl", q_nope, w_uk)
        probs = self._probs(
            torch.cat([q_latent, q_pe], dim=-1), latents, "bnhd,bsd->bhns", key_mask
        )
        out_latent = einsum("bhns,bsl->bnhl", probs, kv_c)
        return einsum("bnhl,hvl->bnhv", out_latent, w_uv)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size)
        self.up_proj = Linear(hidden_size, intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: K3DSparkConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MultiHeadLatentAttention(config, rope)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        context_latent: torch.Tensor,
        key_mask: torch.Tensor,
        absorbed: bool,
    ) -> torch.Tensor:
        x = x + self.self_attn(
            self.input_layernorm(x), positions, context_latent, key_mask, absorbed
        )
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """Low-rank transition bias ``W2 W1[y_prev]``: ``markov_w1`` is V x r, ``markov_w2`` is V x r."""

    def __init__(self, config: K3DSparkConfig) -> None:
        super().__init__()
        self.markov_w1 = Embedding(config.vocab_size, config.markov_rank)
        self.markov_w2 = Linear(config.markov_rank, config.draft_vocab_size)


class ConfidenceHead(nn.Module):
    """One fp32 logit per drafted position, from ``[h ; W1[y_{i-1}]]`` or from ``h`` alone."""

    def __init__(self, config: K3DSparkConfig) -> None:
        super().__init__()
        self.with_markov = bool(config.confidence_head_with_markov)
        self.proj = Linear(
            config.hidden_size + (config.markov_rank if self.with_markov else 0), 1, bias=True
        )

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        x = (
            torch.cat([hidden, markov_embed.to(hidden.dtype)], dim=-1)
            if self.with_markov
            else hidden
        )
        return self.proj(x.float()).squeeze(-1)


@dataclass
class DraftOutput:
    """One drafted block per request (B requests, N = block_size, vocabulary V, Markov rank r)."""

    tokens: torch.Tensor  # [B, N] int64
    logits: torch.Tensor  # [B, N, V] fp32, pre-temperature, Markov bias included
    confidences: torch.Tensor | None  # [B, N] fp32 in (0, 1); None without a confidence head
    markov_embeds: torch.Tensor  # [B, N, r] W1[y_{i-1}]
    hidden: torch.Tensor  # [B, N, H] post-final-norm block hidden states
    block_positions: torch.Tensor  # [B, N] int64 positions last+1 .. last+N


class ReferenceDrafter(nn.Module):
    """The K3 DSpark drafter in plain PyTorch. Build it with :meth:`from_pretrained` or :meth:`from_state_dict`."""

    def __init__(
        self, config: K3DSparkConfig, *, compute_dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        c = config
        self.config = config
        self.compute_dtype = compute_dtype
        rope = RotaryEmbedding.from_rope_parameters(c.rope_parameters, c.qk_rope_head_dim)
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size)
        self.fc_norm = (
            nn.ModuleList(
                RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in range(c.num_target_layers)
            )
            if c.fc_norm
            else None
        )
        self.context_proj = Linear(c.target_hidden_size * c.num_target_layers, c.hidden_size)
        self.context_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(c, rope) for _ in range(c.num_hidden_layers))
        self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.markov_head = MarkovHead(c)
        self.confidence_head = ConfidenceHead(c) if c.enable_confidence_head else None
        self.lm_head = Linear(c.hidden_size, c.draft_vocab_size)

    # ----- construction -----

    @classmethod
    def from_state_dict(
        cls,
        config: K3DSparkConfig,
        state_dict: dict[str, torch.Tensor],
        *,
        embed_tokens: torch.Tensor,
        lm_head: torch.Tensor,
        compute_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> ReferenceDrafter:
        """Build from HF-keyed, already dequantized tensors and the target's embedding / lm_head.

        A ``embed_tokens.weight`` in ``state_dict`` is ignored: the drafter uses the target's.
        Tensors wider than ``compute_dtype`` are narrowed to it; narrower ones are kept and upcast
        per use. The confidence head is kept in fp32, as vLLM keeps it.
        """
        weights = {k: v for k, v in state_dict.items() if k != "embed_tokens.weight"}
        expected: dict[str, tuple[int, ...] | None] = dict(tensor_shapes(config))
        del expected["embed_tokens.weight"]
        validate_tensor_shapes(
            {k: tuple(v.shape) for k, v in weights.items()},
            expected,
            source="state_dict",
            config=config,
        )
        heads_shape = (config.vocab_size, config.hidden_size)
        for name, tensor in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            if tuple(tensor.shape) != heads_shape:
                raise FindingError(
                    Finding(
                        f"target {name} has shape {tuple(tensor.shape)}, but the drafter's config needs "
                        f"{heads_shape} (vocab_size, hidden_size)",
                        "pass the target the drafter was trained for",
                    )
                )
        weights["embed_tokens.weight"] = embed_tokens
        weights["lm_head.weight"] = lm_head

        def stored(key: str, tensor: torch.Tensor) -> torch.Tensor:
            if key.startswith("confidence_head."):
                return tensor.to(device, torch.float32)
            if tensor.dtype.itemsize > compute_dtype.itemsize:
                return tensor.to(device, compute_dtype)
            return tensor.to(device)

        with torch.device("meta"):
            model = cls(config, compute_dtype=compute_dtype)
        model.load_state_dict(
            {k: stored(k, v) for k, v in weights.items()}, strict=True, assign=True
        )
        return model.eval()

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        *,
        target_dir: str | Path | None = None,
        compute_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> ReferenceDrafter:
        """Load a drafter directory; the embedding and lm_head come from ``target_dir``.

        ``target_dir`` defaults to ``model_dir/target`` (what ``vllm-dspark make-random`` writes).
        BF16 weights stay BF16 in memory under FP32 compute; quantized weights are dequantized once,
        in fp32 for an fp32 reference and in bf16 for bf16 compute.
        """
        model_dir = Path(model_dir)
        load_config(model_dir)  # a broken drafter directory is the first thing to report
        if target_dir is None:
            target_dir = model_dir / TARGET_DIR
            if not target_dir.exists():
                raise FindingError(
                    Finding(
                        f"no target given and {target_dir} does not exist",
                        "pass the target model directory (--target), whose embedding and lm_head the "
                        "drafter shares",
                    )
                )
        load_dtype = None if compute_dtype == torch.float32 else compute_dtype
        config, state_dict = load_drafter_state_dict(model_dir, dtype=load_dtype)
        state_dict.pop("embed_tokens.weight", None)
        embed_tokens, lm_head = load_target_heads(target_dir, dtype=load_dtype)
        model = cls.from_state_dict(
            config,
            state_dict,
            embed_tokens=embed_tokens,
            lm_head=lm_head,
            compute_dtype=compute_dtype,
            device=device,
        )
        model.quantize_inputs(input_quantizers(model_dir))
        return model

    def quantize_inputs(
        self, quantizers: Mapping[str, tuple[ActScheme, torch.Tensor | None]]
    ) -> None:
        """Give each named linear its input quantization ``(scheme, static scale or None)``, as served."""
        for module, (scheme, scale) in quantizers.items():
            linear = self.get_submodule(module)
            linear.input_quant = (scheme, None if scale is None else scale.to(linear.weight.device))

    def use_fp8_kv_cache(self, k_scales: torch.Tensor | None) -> None:
        """Read every layer's latents from an FP8 E4M3 cache with ``k_scales [L]`` (None: model dtype)."""
        if k_scales is not None and tuple(k_scales.shape) != (len(self.layers),):
            raise ValueError(
                f"an fp8 KV cache takes one k_scale per draft layer ({len(self.layers)}), got shape "
                f"{tuple(k_scales.shape)}"
            )
        for i, layer in enumerate(self.layers):
            layer.self_attn.kv_scale = None if k_scales is None else k_scales[i].float()

    # ----- the hooks vLLM's speculator calls, as pure tensor functions -----

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """``[..., T, num_target_layers * target_hidden]`` -> ``[..., T, H]``: [fc_norm per tap ->]
        context_proj -> context_norm."""
        aux = aux.to(self.compute_dtype)
        if self.fc_norm is not None:
            taps = aux.split(self.config.target_hidden_size, dim=-1)
            aux = torch.cat([norm(tap) for norm, tap in zip(self.fc_norm, taps)], dim=-1)
        return self.context_norm(self.context_proj(aux))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[B, T, H]``, ``[B, T]`` -> ``[L, B, T, kv_lora_rank + rope]``: every layer's context latents.

        The context skips the layers' input_layernorm and query path: it only feeds the KV pages.
        """
        context = context.to(self.compute_dtype)
        return torch.stack([layer.self_attn.latent(context, positions) for layer in self.layers])

    def block_input_ids(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """``[B]`` -> ``[B, N]``: the anchor followed by ``block_size - 1`` mask tokens."""
        masks = anchor_ids.new_full(
            (anchor_ids.shape[0], self.config.draft_block_size - 1), self.config.mask_token_id
        )
        return torch.cat([anchor_ids[:, None], masks], dim=1)

    def block_hidden(
        self,
        anchor_ids: torch.Tensor,
        context_kv: torch.Tensor,
        block_positions: torch.Tensor,
        *,
        context_mask: torch.Tensor | None = None,
        absorbed: bool = False,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The block's post-final-norm hidden states ``[B, N, H]``.

        Args:
            anchor_ids: ``[B]`` anchor tokens.
            context_kv: ``[L, B, T, kv_lora_rank + rope]`` from :meth:`context_kv`.
            block_positions: ``[B, N]`` positions of the block slots.
            context_mask: ``[B, T]`` bool, False for padding in a batch of unequal contexts.
            absorbed: attend in the absorbed MLA form (``W_UK`` folded into q) instead of the naive one.
            inputs_embeds: ``[B, N, H]`` to replace the embedded ``[anchor, mask...]`` block input.
        """
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(self.block_input_ids(anchor_ids), self.compute_dtype)
        x = inputs_embeds.to(self.compute_dtype)
        batch, block, _ = x.shape
        num_context = context_kv.shape[2]
        if context_mask is None:
            context_mask = torch.ones(batch, num_context, dtype=torch.bool, device=x.device)
        own = block_key_mask(block, self.config.causal, x.device)  # [N, N]
        key_mask = torch.cat(
            [context_mask.bool()[:, None].expand(-1, block, -1), own.expand(batch, -1, -1)], dim=2
        )
        for layer, context_latent in zip(self.layers, context_kv):
            x = layer(x, block_positions, context_latent, key_mask, absorbed)
        return self.final_norm(x)

    def blocks_hidden(
        self, token_ids: torch.Tensor, anchor_positions: torch.Tensor, context_kv: torch.Tensor
    ) -> torch.Tensor:
        """Training's block-parallel pass: ``[B, A, N, H]`` hidden states of A blocks per sequence.

        ``token_ids [B, T]`` is the text, ``anchor_positions [B, A]`` (>= 1) its anchors and
        ``context_kv [L, B, T, latent]`` the latents of all ``T`` positions. Block ``a`` is
        ``[token at anchor ; mask x (N-1)]`` at positions ``anchor .. anchor + N - 1``; it sees the
        context before its anchor and its own slots, never another block (DeepSpec's DSpark mask).
        """
        batch, num_anchors = anchor_positions.shape
        block, length = self.config.draft_block_size, token_ids.shape[1]
        anchors = token_ids.gather(1, anchor_positions)
        ids = self.block_input_ids(anchors.flatten()).view(batch, num_anchors * block)
        device = token_ids.device
        positions = (anchor_positions[..., None] + torch.arange(block, device=device)).view(
            batch, -1
        )
        context = torch.arange(length, device=device) < anchor_positions[..., None]  # [B, A, T]
        own = torch.block_diag(
            *[block_key_mask(block, self.config.causal, device)] * num_anchors
        ).expand(batch, -1, -1)
        key_mask = torch.cat([context.repeat_interleave(block, 1), own], dim=2)
        x = self.embed_tokens(ids, self.compute_dtype)
        for layer, context_latent in zip(self.layers, context_kv):
            x = layer(x, positions, context_latent, key_mask, False)
        return self.final_norm(x).view(batch, num_anchors, block, -1)

    def causal_states(self, token_ids: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
        """The residual stream ``[B, T, H]`` after the embedding and after each layer, with the layers
        run causally over ``token_ids [B, T]`` in ``dtype``: token t attends to itself and the tokens before it.

        The layers are non-causal within a block, so causality is built from them: each of the ``T``
        tokens becomes its own one-token block whose context is the layer's latents of all ``T`` tokens
        with the later ones masked out, so a layer is one batched call. The absorbed MLA form keeps
        that affordable (it never up-projects the ``T x T`` context copies).
        """
        batch, length = token_ids.shape
        positions = torch.arange(length, device=token_ids.device).expand(batch, length)
        # Query t sees context keys j < t and its own key, which the layer appends after the context.
        keys = torch.ones(length, length + 1, dtype=torch.bool, device=token_ids.device).tril(-1)
        keys[:, -1] = True
        key_mask = keys.repeat(batch, 1)  # [B*T, T + 1]
        x = self.embed_tokens(token_ids, dtype)
        states = [x]
        for layer in self.layers:
            latents = layer.self_attn.latent(layer.input_layernorm(x), positions)  # [B, T, latent]
            context = latents.repeat_interleave(length, dim=0)  # [B*T, T, latent]
            x = layer(
                x.reshape(batch * length, 1, -1), positions.reshape(-1, 1), context, key_mask, True
            )
            x = x.reshape(batch, length, -1)
            states.append(x)
        return states

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``logit_scale * lm_head(h)`` in fp32 ``[..., V]``."""
        return self.lm_head(hidden.to(self.compute_dtype)).float() * self.config.logit_scale

    def markov_embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """r-dim Markov embedding ``W1[token]`` (``[...] -> [..., r]``)."""
        return self.markov_head.markov_w1(token_ids, self.compute_dtype)

    def markov_bias(self, m: torch.Tensor) -> torch.Tensor:
        """``logit_scale * m @ W2^T`` in fp32 (``[..., r] -> [..., V]``)."""
        return (
            self.markov_head.markov_w2(m.to(self.compute_dtype)).float() * self.config.logit_scale
        )

    def confidence(self, hidden: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """Probability in (0, 1) that each drafted token is accepted given its prefix was (``[...]``)."""
        if self.confidence_head is None:
            raise ValueError(
                "this drafter has no confidence head (enable_confidence_head is false in its config)."
            )
        return torch.sigmoid(self.confidence_head(hidden, m))

    # ----- one block end to end -----

    @torch.no_grad()
    def draft(
        self,
        aux: torch.Tensor,
        context_positions: torch.Tensor,
        anchor_ids: torch.Tensor,
        *,
        temperature: float | torch.Tensor = 0.0,
        seeds: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
        absorbed: bool = False,
    ) -> DraftOutput:
        """Draft one block per request.

        Args:
            aux: ``[B, T, num_target_layers * target_hidden_size]`` the target's aux hidden states
                (layers ``target_layer_ids``, concatenated in ascending order) at the context tokens.
            context_positions: ``[B, T]`` int64 positions of the context tokens.
            anchor_ids: ``[B]`` int64 last verified token of each request.
            temperature: float or ``[B]``; 0 = greedy.
            seeds: ``[B]`` int64, needed when sampling.
            context_mask: ``[B, T]`` bool, False marks padding; the block starts after the last
                valid position of each request.
        """
        self._check_draft_inputs(aux, context_positions, anchor_ids, context_mask, seeds)
        if context_mask is None:
            last = context_positions.max(dim=1).values
        else:
            last = (
                context_positions.masked_fill(
                    ~context_mask, torch.iinfo(context_positions.dtype).min
                )
                .max(1)
                .values
            )
        offsets = torch.arange(1, self.config.draft_block_size + 1, device=last.device)
        block_positions = last[:, None] + offsets

        context = self.combine_hidden_states(aux)
        hidden = self.block_hidden(
            anchor_ids,
            self.context_kv(context, context_positions),
            block_positions,
            context_mask=context_mask,
            absorbed=absorbed,
        )
        rollout = markov_rollout(
            self.base_logits(hidden),
            anchor_ids,
            self.markov_embed,
            self.markov_bias,
            temperature=temperature,
            seeds=seeds,
            positions=block_positions,
        )
        confidences = (
            None if self.confidence_head is None else self.confidence(hidden, rollout.markov_embeds)
        )
        return DraftOutput(
            rollout.tokens,
            rollout.logits,
            confidences,
            rollout.markov_embeds,
            hidden,
            block_positions,
        )

    def _check_draft_inputs(self, aux, context_positions, anchor_ids, context_mask, seeds) -> None:
        c = self.config
        width = c.num_target_layers * c.target_hidden_size
        if aux.dim() != 3 or aux.shape[-1] != width:
            raise ValueError(
                f"aux_hidden_states must be [B, T, {width}] (num_target_layers {c.num_target_layers} x "
                f"target_hidden_size {c.target_hidden_size}), got shape {tuple(aux.shape)}."
            )
        batch, num_context, _ = aux.shape
        if batch < 1 or num_context < 1:
            raise ValueError(
                f"aux_hidden_states has shape {tuple(aux.shape)}: every request needs at least one "
                "context token, and there must be at least one request."
            )
        if not aux.is_floating_point():
            raise ValueError(f"aux_hidden_states must be floating point, got {aux.dtype}.")
        require_finite(
            aux,
            "aux_hidden_states",
            "pass the target's real hidden states; NaN or Inf would draft garbage",
        )
        if (
            tuple(context_positions.shape) != (batch, num_context)
            or context_positions.is_floating_point()
        ):
            raise ValueError(
                f"context_positions must be integer [B, T] = [{batch}, {num_context}], got "
                f"{context_positions.dtype} {tuple(context_positions.shape)}."
            )
        # The block runs to last + block_size, which must stay inside the rotary table.
        top = c.max_position_embeddings - c.draft_block_size
        if bool(((context_positions < 0) | (context_positions >= top)).any()):
            raise ValueError(
                f"context_positions must lie in [0, {top}) (max_position_embeddings "
                f"{c.max_position_embeddings} - block_size {c.draft_block_size}, so the block fits), got "
                f"values from {int(context_positions.min())} to {int(context_positions.max())}."
            )
        if seeds is not None and (seeds.is_floating_point() or seeds.dtype == torch.bool):
            raise FindingError(
                Finding(
                    f"seeds must be integers (int64), got {seeds.dtype}",
                    "store them as int64; a float seed would be truncated silently",
                )
            )
        if tuple(anchor_ids.shape) != (batch,) or anchor_ids.is_floating_point():
            raise ValueError(
                f"anchor_ids must be integer [B] = [{batch}], got {anchor_ids.dtype} "
                f"{tuple(anchor_ids.shape)}."
            )
        if bool(((anchor_ids < 0) | (anchor_ids >= c.vocab_size)).any()):
            raise ValueError(
                f"anchor_ids must be token ids in [0, {c.vocab_size}), got {anchor_ids.tolist()}."
            )
        if context_mask is not None:
            if (
                tuple(context_mask.shape) != (batch, num_context)
                or context_mask.dtype != torch.bool
            ):
                raise ValueError(
                    f"context_mask must be bool [B, T] = [{batch}, {num_context}], got "
                    f"{context_mask.dtype} {tuple(context_mask.shape)}."
                )
            empty = (~context_mask.any(dim=1)).nonzero().flatten().tolist()
            if empty:
                raise ValueError(
                    f"context_mask leaves request(s) {empty} without any context token; "
                    "every request needs at least its anchor's context."
                )
