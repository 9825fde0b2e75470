# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kimi-K3 DSpark drafter for vLLM's ``dspark`` speculative method (``K3DSparkModel``).

The registered class replaces vLLM's in-tree ``vllm.models.kimi_k3.nvidia.dspark_mla`` drafter
with one that serves quantized checkpoints correctly and also runs off-GPU. What it computes is
the in-tree model: five dense MLA decoder layers drafting a non-causal block
``[anchor, mask x (N-1)]`` over context latents projected from the target's aux hidden states, a
low-rank Markov head that the speculator applies sequentially, and a confidence head.

Design:

- **Module tree = checkpoint tree.** ``model.context_proj``, ``model.layers.{i}.self_attn.q_b_proj``
  ... are the checkpoint's modules under ``model.``; the only runtime fusions are vLLM's usual ones
  (``gate_proj + up_proj -> gate_up_proj``, ``q_a_proj + kv_a_proj_with_mqa -> fused_qkv_a_proj``)
  plus ``context_kv_proj``, every layer's ``kv_a_proj_with_mqa`` stacked into one GEMM that projects
  context latents for all layers at once. :meth:`K3DSparkForCausalLM.load_weights` routes each
  checkpoint key explicitly and strictly: a tensor that lands nowhere, or a parameter nothing
  filled, is a ``ValueError`` naming it. Fusing happens while loading, never by reading
  ``.weight`` back, because vLLM's CPU linears repack and drop it after loading.
- **Attention** is vLLM's Kimi-K3 MLA layer on GPUs, so draft layers join the target's MLA KV-cache
  group; elsewhere a plain-torch layer with the same submodules (:mod:`vllm_dspark.attention`).
- **Quantization.** One quantization-config instance serves every layer. It is the draft's own
  (``get_draft_quant_config``), checked against the checkpoint before any layer exists: what the
  checkpoint's ``quantization_config`` quantizes (:func:`vllm_dspark.formats.quantized_modules`,
  on checkpoint names) must be what vLLM will quantize at the runtime names, where draft layers
  are numbered after the target's (``model.layers.93-97`` for Kimi-K3). Literal per-layer names
  are renamed to the runtime numbering, ``packed_modules_mapping`` is set on that instance, and
  anything that would still diverge, split a fused module, or quantize a module this model runs
  unquantized is refused with the module and the fix.
- **Sharing and TP.** The embedding and lm_head are the target's (aliased by vLLM's
  ``load_dspark_model``). The Markov and confidence heads are replicated, so every TP rank drafts
  identical tokens; context projections are replicated too, attention heads and the MLP are split.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.qwen3_dspark import DSparkConfidenceHead, DSparkMarkovHead
from vllm.model_executor.models.utils import get_draft_quant_config, maybe_prefix
from vllm.models.common.ops.fused_allreduce_rms_norm import fused_allreduce_rms_norm
from vllm.platforms import current_platform

from vllm_dspark import formats
from vllm_dspark.attention import build_latent_attention, rotate_pe
from vllm_dspark.layout import (
    FUSED_GROUPS,
    QUANTIZABLE_KINDS,
    ModuleSpec,
    checkpoint_modules,
    kind_regex,
    validate_fused_decision,
)
from vllm_dspark.safety import invalid_scale_count

if TYPE_CHECKING:
    from vllm.config import CacheConfig
    from vllm.model_executor.layers.quantization import QuantizationConfig

    from vllm_dspark.config import K3DSparkConfig

__all__ = ["K3DSparkForCausalLM", "K3DSparkModel"]

# vLLM fuses these checkpoint modules into one runtime layer. Compressed-tensors matches a fused
# layer through its shards only when the quant config carries this mapping.
PACKED_MODULES_MAPPING: dict[str, list[str]] = {
    fused.rsplit(".", 1)[1]: [member.rsplit(".", 1)[1] for member in members]
    for fused, members in FUSED_GROUPS.items()
}
_FUSED_MEMBER: dict[str, tuple[str, int]] = {
    member: (fused, shard) for fused, members in FUSED_GROUPS.items() for shard, member in enumerate(members)
}
_KV_A_KIND = "self_attn.kv_a_proj_with_mqa"


def _runtime_module_name(spec: ModuleSpec, *, model_prefix: str, start_layer_id: int) -> str:
    """The name vLLM gives checkpoint module ``spec`` at runtime (what quantization matches)."""
    if spec.layer is None:
        return f"{model_prefix}.{spec.name}"
    return f"{model_prefix}.layers.{start_layer_id + spec.layer}.{spec.kind}"


def _draft_quant_config(
    vllm_config: VllmConfig, config: K3DSparkConfig, *, model_prefix: str, start_layer_id: int
) -> QuantizationConfig | None:
    """The one quantization config every draft layer uses, checked against the checkpoint.

    ``vllm_config.quant_config`` is the draft's only inside ``load_dspark_model``; anywhere else it
    is the target's, so the draft's own is built here, once, and handed to every layer.
    """
    quant_config = get_draft_quant_config(vllm_config)
    if quant_config is None:
        return None
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    raw = getattr(config, "quantization_config", None)
    if not isinstance(quant_config, CompressedTensorsConfig) or raw is None:
        raise ValueError(
            f"the K3 DSpark drafter serves BF16 or compressed-tensors checkpoints, but its quantization is "
            f"{quant_config.get_name()!r}. Fix: serve the BF16 checkpoint without a quantization override, or "
            "quantize it with `vllm-dspark quantize --quant_format fp8`."
        )
    raw = raw if isinstance(raw, dict) else raw.to_dict()
    if current_platform.is_cpu():
        # vLLM has no CPU kernel for FP8 weight-only linears: add ours before any layer picks one.
        # Imported here: vLLM's kernel registry takes a second to import, and only quantized
        # drafters on CPU need it.
        from vllm_dspark.cpu_w8a16 import install

        install()
    specs = checkpoint_modules(config)
    try:
        plan = formats.quantized_modules(raw, [spec.name for spec in specs])
    except ValueError as e:
        raise ValueError(f"K3 DSpark drafter config.json quantization_config: {e}") from None
    runtime = {
        spec.name: _runtime_module_name(spec, model_prefix=model_prefix, start_layer_id=start_layer_id)
        for spec in specs
    }
    _check_quantized_modules(plan, specs, runtime)

    # Literal checkpoint names would never match the renumbered runtime layers: rename them. `re:`
    # patterns are left alone and checked below.
    quant_config.ignore = [runtime.get(entry, entry) for entry in quant_config.ignore]
    quant_config.target_scheme_map = {
        runtime.get(target, target): scheme for target, scheme in quant_config.target_scheme_map.items()
    }
    quant_config.packed_modules_mapping = dict(PACKED_MODULES_MAPPING)

    diverging = []
    for spec in specs:
        if spec.kind not in QUANTIZABLE_KINDS:
            continue  # built without a quant config, whatever the patterns say
        # Scheme lookup by name only: module-class targets were refused by quantized_modules.
        scheme = quant_config.get_scheme_dict(nn.Module(), runtime[spec.name])
        if bool(scheme and scheme.get("weights") is not None) != (spec.name in plan):
            stored = f"stored as {plan[spec.name]}" if spec.name in plan else "stored unquantized"
            served = "would quantize" if spec.name not in plan else "does not match"
            diverging.append(f"{spec.name} ({stored}; vLLM names it {runtime[spec.name]}, which the config {served})")
    if diverging:
        raise ValueError(
            "the drafter's quantization_config matches checkpoint names and vLLM's runtime names differently "
            f"for: {'; '.join(diverging)}. Fix: write targets and ignore entries as index-agnostic 're:' "
            f"patterns that also match a 'model.' prefix, e.g. {kind_regex('mlp.gate_proj')!r} "
            "(`vllm-dspark quantize` writes them)."
        )
    return quant_config


def _check_quantized_modules(plan: dict[str, str], specs: list[ModuleSpec], runtime: dict[str, str]) -> None:
    """Refuse checkpoint quantization that this model cannot run."""
    for spec in specs:
        if spec.name in plan and spec.kind not in QUANTIZABLE_KINDS:
            raise ValueError(
                f"{spec.name} is quantized ({plan[spec.name]}) by the checkpoint's quantization_config, but "
                f"K3DSparkForCausalLM runs {spec.kind} unquantized (only {', '.join(QUANTIZABLE_KINDS)} can be "
                f"quantized). Fix: re-quantize with {spec.kind} left out (add {kind_regex(spec.kind)!r} to the "
                "ignore list; `vllm-dspark quantize` does)."
            )
    for layer in sorted({spec.layer for spec in specs if spec.layer is not None}):
        names = {spec.kind: spec.name for spec in specs if spec.layer == layer}
        served_as = runtime[names["input_layernorm"]].removesuffix(".input_layernorm")
        try:
            validate_fused_decision({kind for kind, name in names.items() if name in plan})
        except ValueError as e:
            raise ValueError(f"layers.{layer} (served as {served_as}): {e} Fix: re-quantize this checkpoint "
                             "(`vllm-dspark quantize` never splits a fused group).") from None
        for fused, members in FUSED_GROUPS.items():
            formats_found = {plan[names[m]] for m in members if names[m] in plan}
            if len(formats_found) > 1:
                raise ValueError(
                    f"layers.{layer} (served as {served_as}): {' and '.join(members)} are fused into {fused} at "
                    f"runtime but stored in different formats ({', '.join(sorted(formats_found))}). Fix: "
                    "re-quantize both to one format."
                )
    # context_kv_proj stacks every layer's kv_a_proj_with_mqa into one linear: one decision for all.
    kv_a = {spec.name: plan.get(spec.name, "bf16") for spec in specs if spec.kind == _KV_A_KIND}
    if len(set(kv_a.values())) > 1:
        decisions = ", ".join(f"{name}: {fmt}" for name, fmt in kv_a.items())
        raise ValueError(
            f"kv_a_proj_with_mqa is quantized differently across layers ({decisions}), "
            "but the drafter stacks all of them into one context_kv_proj. Fix: quantize self_attn.q_a_proj and "
            "self_attn.kv_a_proj_with_mqa in every layer or in none."
        )


def _grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM's RMSNorm math (fp32 statistics) for ``x [T, L, D]`` with one weight row per layer ``[L, D]``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf.to(weight.dtype) * weight).to(x.dtype)


class K3DSparkMLP(nn.Module):
    """SwiGLU MLP; ``down_proj``'s TP all-reduce is fused into the next RMSNorm."""

    def __init__(self, *, config: K3DSparkConfig, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [config.intermediate_size] * 2,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size,
            config.hidden_size,
            bias=False,
            quant_config=quant_config,
            reduce_results=False,
            prefix=f"{prefix}.down_proj",
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)[0]))[0]


class K3DSparkDecoderLayer(nn.Module):
    def __init__(
        self,
        *,
        config: K3DSparkConfig,
        cache_config: CacheConfig,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = build_latent_attention(
            config=config, cache_config=cache_config, quant_config=quant_config, prefix=f"{prefix}.self_attn"
        )
        # Both row-parallel outputs stay un-reduced: fused_allreduce_rms_norm reduces them inside
        # the RMSNorm that follows.
        self.self_attn.o_proj.reduce_results = False
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = K3DSparkMLP(config=config, quant_config=quant_config, prefix=f"{prefix}.mlp")

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            # First layer: the (already reduced) embedding.
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = fused_allreduce_rms_norm(hidden_states, residual, self.input_layernorm)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states, residual = fused_allreduce_rms_norm(hidden_states, residual, self.post_attention_layernorm)
        return self.mlp(hidden_states), residual


class K3DSparkModel(nn.Module):
    """The drafter backbone: context projections, decoder layers, final norm, Markov and confidence heads."""

    def __init__(
        self,
        *,
        vllm_config: VllmConfig,
        config: K3DSparkConfig,
        quant_config: QuantizationConfig | None,
        start_layer_id: int,
        prefix: str,
    ) -> None:
        super().__init__()
        c = config
        self.config = c
        # The target's embedding, aliased by vLLM's load_dspark_model after loading.
        self.embed_tokens: nn.Module | None = None
        self.context_proj = ReplicatedLinear(
            c.target_hidden_size * c.num_target_layers,
            c.hidden_size,
            bias=False,
            return_bias=False,
            quant_config=quant_config,
            prefix=maybe_prefix(prefix, "context_proj"),
        )
        self.context_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        # Draft layers are numbered after the target's, so their attention-layer names don't
        # collide with the target's and quantization matches the names vLLM uses.
        self.layers = nn.ModuleList(
            K3DSparkDecoderLayer(
                config=c,
                cache_config=vllm_config.cache_config,
                quant_config=quant_config,
                prefix=maybe_prefix(prefix, f"layers.{start_layer_id + i}"),
            )
            for i in range(c.num_hidden_layers)
        )
        # Every layer's kv_a_proj_with_mqa stacked into one GEMM: context tokens only need the KV
        # latent, so this projects L * 576 rows instead of L full q+kv projections. Its prefix is
        # the first layer's fused_qkv_a_proj, so it is quantized exactly as kv_a_proj_with_mqa is.
        self.context_kv_proj = MergedColumnParallelLinear(
            c.hidden_size,
            [c.kv_lora_rank + c.qk_rope_head_dim] * c.num_hidden_layers,
            bias=False,
            return_bias=False,
            quant_config=quant_config,
            prefix=maybe_prefix(prefix, f"layers.{start_layer_id}.self_attn.fused_qkv_a_proj"),
            disable_tp=True,
        )
        self.final_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        # Replicated and unquantized: the Markov head runs once per drafted position.
        self.markov_head = DSparkMarkovHead(
            c.vocab_size, c.draft_vocab_size, c.markov_rank, prefix=maybe_prefix(prefix, "markov_head")
        )
        self.confidence_head: DSparkConfidenceHead | None = None
        if c.enable_confidence_head:
            self.confidence_head = DSparkConfidenceHead(
                c.hidden_size + (c.markov_rank if c.confidence_head_with_markov else 0),
                prefix=maybe_prefix(prefix, "confidence_head"),
                bias=True,
                with_markov=c.confidence_head_with_markov,
            )
        # Every layer's kv_a_layernorm weight, stacked after loading by stack_context_kv_norms.
        self.register_buffer("_context_kv_norm_weight", None, persistent=False)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None, "the target's embedding is shared after loading"
        return self.embed_tokens(input_ids)

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.context_norm(self.context_proj(hidden_states))

    def stack_context_kv_norms(self) -> None:
        """Stack the layers' kv_a_layernorm weights, so one op normalizes every layer's context latent."""
        self._context_kv_norm_weight = torch.stack(
            [layer.self_attn.kv_a_layernorm.weight.detach() for layer in self.layers]
        )

    @torch.inference_mode()
    def precompute_and_store_context_kv(
        self,
        context_states: torch.Tensor,
        context_positions: torch.Tensor,
        context_slot_mapping: torch.Tensor | list[torch.Tensor | None] | None = None,
    ) -> None:
        """Write every layer's latent for the context tokens into its KV pages.

        ``context_states [T, H]`` (from :meth:`combine_hidden_states`) skip the layers' input norm
        and query path: per layer, ``kv_a_proj_with_mqa`` -> ``kv_a_layernorm`` on the latent and
        RoPE on ``k_pe``. ``context_slot_mapping`` is one tensor shared by all layers or one per
        layer (``None`` entries skip a layer); ``None`` computes without storing (profiling).
        """
        assert self._context_kv_norm_weight is not None, "process_weights_after_loading has not run"
        c = self.config
        num_layers = len(self.layers)
        latent = self.context_kv_proj(context_states).view(-1, num_layers, c.kv_lora_rank + c.qk_rope_head_dim)
        kv_c, k_pe = latent.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv_c_normed = _grouped_rms_norm(kv_c, self._context_kv_norm_weight, c.rms_norm_eps)
        # All layers share one rotary table; the layer axis sits where heads would.
        k_pe = rotate_pe(self.layers[0].self_attn.rotary_emb, context_positions, k_pe)
        if context_slot_mapping is None:
            return
        for i, layer in enumerate(self.layers):
            slots = (
                context_slot_mapping[i] if isinstance(context_slot_mapping, (list, tuple)) else context_slot_mapping
            )
            if slots is not None:
                layer.self_attn.store_latent(kv_c_normed[:, i], k_pe[:, i : i + 1], slots)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden_states = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = fused_allreduce_rms_norm(hidden_states, residual, self.final_norm)
        return hidden_states


class K3DSparkForCausalLM(nn.Module):
    """The ``K3DSparkModel`` drafter, with the hooks vLLM's ``DSparkSpeculator`` calls."""

    has_own_embed_tokens = False
    has_own_lm_head = False
    draft_id_to_target_id = None
    packed_modules_mapping = PACKED_MODULES_MAPPING

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        if vllm_config.speculative_config is None:
            raise ValueError(
                "K3DSparkModel is a speculative drafter, not a standalone model. Fix: serve the target model "
                "with speculative_config={'method': 'dspark', 'model': <this drafter>}."
            )
        self.config: K3DSparkConfig = vllm_config.speculative_config.draft_model_config.hf_config
        # Draft layers are numbered after the target's (93-97 for Kimi-K3).
        start_layer_id = vllm_config.model_config.get_total_num_hidden_layers()
        target_depth = getattr(self.config, "target_num_hidden_layers", None)
        if target_depth is not None and target_depth != start_layer_id:
            raise ValueError(
                f"the drafter was made for a {target_depth}-layer target (target_num_hidden_layers), but the "
                f"target has {start_layer_id} layers. Fix: serve it with the target it was trained for."
            )
        model_prefix = maybe_prefix(prefix, "model")
        self.quant_config = _draft_quant_config(
            vllm_config, self.config, model_prefix=model_prefix, start_layer_id=start_layer_id
        )
        self.model = K3DSparkModel(
            vllm_config=vllm_config,
            config=self.config,
            quant_config=self.quant_config,
            start_layer_id=start_layer_id,
            prefix=model_prefix,
        )
        # The target's lm_head, aliased by load_dspark_model. No placeholder: it would allocate a
        # full-vocabulary matrix only to be thrown away.
        self.lm_head: nn.Module | None = None
        self.logits_processor = LogitsProcessor(self.config.draft_vocab_size, scale=self.config.logit_scale)
        self._weight_routes = _weight_routes(self.config)

    # ----- speculator hooks -----

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Post-final-norm hidden states of the query rows ``[T, hidden]``."""
        return self.model(input_ids, positions, inputs_embeds)

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[T, num_target_layers * target_hidden]`` aux states -> ``[T, hidden]`` context states."""
        return self.model.combine_hidden_states(hidden_states)

    def precompute_and_store_context_kv(
        self,
        context_states: torch.Tensor,
        context_positions: torch.Tensor,
        context_slot_mapping: torch.Tensor | list[torch.Tensor | None] | None = None,
    ) -> None:
        self.model.precompute_and_store_context_kv(context_states, context_positions, context_slot_mapping)

    def get_draft_kv_cache_layer_names(self) -> list[str]:
        return [layer.self_attn.layer_name for layer in self.model.layers]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "the target's lm_head is shared after loading"
        return self.logits_processor(self.lm_head, hidden_states)

    def compute_draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Base draft logits ``logit_scale * lm_head(h)``; the Markov bias is added per position."""
        return self.compute_logits(hidden_states)

    def map_draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        # The draft vocabulary is the target's.
        return draft_ids

    def markov_embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``W1[token]`` (``[R] -> [R, markov_rank]``)."""
        return self.model.markov_head.embed(token_ids)

    def markov_bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
        """``logit_scale * W2 m`` (``[R, markov_rank] -> [R, vocab]``)."""
        return self.model.markov_head.bias(markov_embed, self.logits_processor)

    def compute_confidence(self, head_hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """Probability in (0, 1) that each drafted token is accepted given its prefix was."""
        assert self.model.confidence_head is not None
        return torch.sigmoid(self.model.confidence_head(head_hidden, markov_embed))

    # ----- loading -----

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors by explicit name mapping; refuse anything that does not fit.

        Returns the names of the parameters loaded (every parameter, or this raises).
        """
        params = dict(self.named_parameters())
        filled: dict[str, set[int | None]] = defaultdict(set)
        for name, tensor in weights:
            module, _, param_name = name.rpartition(".")
            routes = self._weight_routes.get(module)
            if routes is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} belongs to no module of this drafter (its config.json says "
                    f"num_hidden_layers={self.config.num_hidden_layers}, enable_confidence_head="
                    f"{self.config.enable_confidence_head}). Fix: use the config.json written with these weights."
                )
            if param_name.endswith("scale") and (bad := invalid_scale_count(tensor)):
                raise ValueError(f"checkpoint tensor {name!r}: {bad} of {tensor.numel()} scale values are NaN, "
                                 "infinite, zero or negative. Fix: re-quantize the BF16 checkpoint with "
                                 "`vllm-dspark quantize`.")
            for path, shard in routes:
                target = f"{path}.{param_name}"
                param = params.get(target)
                if param is None:
                    raise ValueError(_no_parameter_message(name, target, module, params))
                if shard in filled[target]:
                    raise ValueError(f"checkpoint tensor {name!r} appears twice")
                loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    if shard is None:
                        loader(param, tensor)
                    else:
                        loader(param, tensor, shard)
                except (AssertionError, RuntimeError, ValueError) as e:
                    raise ValueError(
                        f"checkpoint tensor {name!r} ({tensor.dtype}, {tuple(tensor.shape)}) does not fit parameter "
                        f"{target!r} ({param.dtype}, {tuple(param.shape)}): {e}"
                    ) from None
                filled[target].add(shard)

        expected = _expected_shards(self._weight_routes)
        unfilled = [
            f"{name}" + (f" (missing shards {sorted(want - filled[name])})" if len(want) > 1 else "")
            for name in params
            if filled[name] != (want := expected.get(name.rpartition(".")[0], {None}))
        ]
        if unfilled:
            raise ValueError(
                f"the checkpoint left these parameters unfilled: {', '.join(unfilled)}. Fix: the checkpoint is "
                "incomplete or its config.json does not describe it (`vllm-dspark check` lists what is missing)."
            )
        return set(filled)

    def process_weights_after_loading(self) -> None:
        # Runs after every layer's own post-load step; norms keep their weights (only linears are
        # repacked), so the context path can stack them now.
        self.model.stack_context_kv_norms()


def _weight_routes(config: K3DSparkConfig) -> dict[str, list[tuple[str, int | None]]]:
    """``{checkpoint module: [(parameter module path, shard id or None), ...]}``.

    ``embed_tokens`` routes nowhere: the drafter uses the target's. Each layer's
    ``kv_a_proj_with_mqa`` also fills its shard of the stacked ``context_kv_proj``.
    """
    routes: dict[str, list[tuple[str, int | None]]] = {}
    for spec in checkpoint_modules(config):
        if spec.kind == "embed_tokens":
            routes[spec.name] = []
        elif spec.kind in _FUSED_MEMBER:
            fused, shard = _FUSED_MEMBER[spec.kind]
            routes[spec.name] = [(f"model.layers.{spec.layer}.{fused}", shard)]
        else:
            routes[spec.name] = [(f"model.{spec.name}", None)]
        if spec.kind == _KV_A_KIND:
            routes[spec.name].append(("model.context_kv_proj", spec.layer))
    return routes


def _expected_shards(routes: dict[str, list[tuple[str, int | None]]]) -> dict[str, set[int | None]]:
    """``{parameter module path: the shard ids loading must fill}``."""
    expected: dict[str, set[int | None]] = defaultdict(set)
    for targets in routes.values():
        for path, shard in targets:
            expected[path].add(shard)
    return expected


def _no_parameter_message(name: str, target: str, module: str, params: dict[str, Any]) -> str:
    """Why checkpoint tensor ``name`` has no parameter ``target``, and the fix."""
    path, _, param_name = target.rpartition(".")
    if f"{path}.weight_scale" in params:
        built = f"vLLM builds {module} quantized, without a {param_name!r} tensor"
    elif param_name.startswith(("weight_", "input_")):
        built = f"the checkpoint stores {module} quantized, but its quantization_config does not quantize it"
    else:
        built = f"{module} has no {param_name!r} in this model"
    return (f"checkpoint tensor {name!r} has no parameter {target!r}: {built}. Fix: use the config.json written "
            "with these weights.")
