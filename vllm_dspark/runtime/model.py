# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``K3DSparkForCausalLM``: the Kimi-K3 DSpark drafter for vLLM's ``dspark`` method, replacing the in-tree
class so quantized builds load right and it runs off-GPU (docs/model-class.md)."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.models.qwen3_dspark import DSparkConfidenceHead, DSparkMarkovHead
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    WeightsMapper,
    get_draft_quant_config,
    maybe_prefix,
)
from vllm.models.common.ops.fused_allreduce_rms_norm import fused_allreduce_rms_norm
from vllm.platforms import current_platform

from vllm_dspark.checkpoint import formats, kv_scales
from vllm_dspark.checkpoint.layout import FUSED_GROUPS, checkpoint_modules
from vllm_dspark.checkpoint.quant_plan import (
    QuantPlan,
    QuantPlanError,
    config_plan,
    fused_scale_conflicts,
    is_stray,
    resolve,
    vllm_quantization_config,
)
from vllm_dspark.checkpoint.st_io import dtype_name
from vllm_dspark.compat import (
    bind_upstream_context_kv,
    dspark_speculator_config_class,
    runs_in_tree_k3_layers,
    set_kv_cache_scale,
)
from vllm_dspark.findings import Finding, FindingError, within
from vllm_dspark.finite import invalid_scale_count
from vllm_dspark.ops.rope import rotate_pe
from vllm_dspark.runtime.attention import build_latent_attention

if TYPE_CHECKING:
    from vllm.config import CacheConfig
    from vllm.model_executor.layers.quantization import QuantizationConfig

    from vllm_dspark.config import K3DSparkConfig

logger = init_logger(__name__)

# vLLM fuses these checkpoint modules into one runtime layer. Compressed-tensors matches a fused
# layer through its shards only when the quant config carries this mapping.
PACKED_MODULES_MAPPING: dict[str, list[str]] = {
    fused.rsplit(".", 1)[1]: [member.rsplit(".", 1)[1] for member in members]
    for fused, members in FUSED_GROUPS.items()
}
# Checkpoint names -> parameter names: the embedding is the target's (shared after loading, not
# loaded), every module moves under ``model.``, and the members of a fused layer load as its shards.
HF_TO_VLLM_MAPPER = WeightsMapper(
    orig_to_new_regex={re.compile(r"^embed_tokens\."): None},
    orig_to_new_stacked={
        "." + member.rsplit(".", 1)[1]: ("." + fused.rsplit(".", 1)[1], shard)
        for fused, members in FUSED_GROUPS.items()
        for shard, member in enumerate(members)
    },
    orig_to_new_prefix={"": "model."},
)
_KV_A_TENSOR = re.compile(r"^layers\.(\d+)\.self_attn\.kv_a_proj_with_mqa\.(\w+)$")


def _drafter(vllm_config: VllmConfig) -> str:
    """How findings name the drafter: as it was given to vLLM."""
    return f"K3 DSpark drafter {vllm_config.speculative_config.draft_model_config.model}"


def _draft_quant_config(
    vllm_config: VllmConfig, config: K3DSparkConfig, *, model_prefix: str, start_layer_id: int
) -> tuple[QuantizationConfig | None, QuantPlan]:
    """The one quantization config every draft layer uses, and the plan it was built from.

    The plan is :func:`vllm_dspark.checkpoint.quant_plan.config_plan`'s, from the quantization config
    vLLM parsed with the drafter's config (no file is read here: the loader streams the tensors, and
    ``load_weights`` checks them against the plan); vLLM gets it as one normalized compressed-tensors
    config naming the quantized modules by their runtime names (draft layers numbered after the
    target's), with ``packed_modules_mapping``. ``vllm_config.quant_config`` is the draft's only
    inside ``load_dspark_model``; anywhere else it is the target's, so the draft's own is built
    here, once, and handed to every layer.
    """
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.layers.quantization.modelopt import (
        ModelOptFp8Config,
        ModelOptNvFp4Config,
        ModelOptQuantConfigBase,
    )

    quant_config = get_draft_quant_config(vllm_config)
    if quant_config is not None and not isinstance(
        quant_config, (CompressedTensorsConfig, ModelOptQuantConfigBase)
    ):
        raise FindingError(
            Finding(
                "the K3 DSpark drafter serves BF16, compressed-tensors or ModelOpt checkpoints, but "
                f"its quantization is {quant_config.get_name()!r}",
                "serve the BF16 checkpoint without a quantization override, or quantize it with "
                "`vllm-dspark quantize --quant-format fp8`",
            )
        )
    try:
        plan = config_plan(config, getattr(config, "quantization_config", None))
    except QuantPlanError as e:
        raise FindingError(*within(_drafter(vllm_config), e.findings)) from None
    if plan.warning is not None:
        logger.warning("%s: %s", _drafter(vllm_config), plan.warning)
    normalized = vllm_quantization_config(
        plan, config, start_layer_id=start_layer_id, prefix=model_prefix
    )
    if normalized is None:
        return None, plan
    if current_platform.is_cpu():
        # vLLM has no CPU kernels for FP8 weight-only or FP4 linears: add ours before any layer picks one.
        from vllm_dspark.runtime import cpu_fp4, cpu_fp8

        cpu_fp8.install()
        cpu_fp4.install()
    vllm_class = {
        "compressed-tensors": CompressedTensorsConfig,
        "modelopt": ModelOptFp8Config,
        "modelopt_fp4": ModelOptNvFp4Config,
    }[normalized["quant_method"]]
    quant_config = vllm_class.from_config(normalized)
    quant_config.packed_modules_mapping = dict(PACKED_MODULES_MAPPING)
    return quant_config, plan


def linear_kernel(scheme: object) -> object:
    """The kernel a quantized linear's scheme (or ModelOpt linear method) runs, or the scheme itself."""
    for attr in ("linear_kernel", "fp8_linear", "kernel"):
        if getattr(scheme, attr, None) is not None:
            return getattr(scheme, attr)
    return scheme


def _log_linear_kernels(model: nn.Module) -> None:
    """One INFO line naming the kernel vLLM picked for each quantized linear (it chooses per platform)."""
    by_kernel: dict[str, list[str]] = defaultdict(list)
    for name, module in model.named_modules():
        # compressed-tensors keeps a scheme per layer; ModelOpt's linear method holds the kernel.
        method = getattr(module, "quant_method", None)
        scheme = getattr(module, "scheme", None) or (
            method if type(method).__name__.startswith("ModelOpt") else None
        )
        if isinstance(module, LinearBase) and scheme is not None:
            by_kernel[f"{type(scheme).__name__} via {type(linear_kernel(scheme)).__name__}"].append(
                name
            )
    if by_kernel:
        logger.info(
            "K3 DSpark drafter quantized linears: %s",
            "; ".join(f"{kernel}: {', '.join(names)}" for kernel, names in by_kernel.items()),
        )


def shards_context_proj(config: K3DSparkConfig, fmt: str | None) -> bool:
    """Whether ``context_proj`` (quant format ``fmt``, None: BF16) splits its rows over the TP ranks."""
    # Each rank's rows must hold whole weight-scale blocks: vLLM refuses a block-FP8 split that cuts
    # one (7168 / 16 = 448 rows), so that build keeps context_proj whole at TP 16 (TP 8 splits it).
    rows = 1 if fmt is None else formats.get(fmt).row_block
    return config.hidden_size % (get_tensor_model_parallel_world_size() * rows) == 0


def _grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM's RMSNorm math (fp32 statistics) for ``x [T, L, D]`` with one weight row per layer ``[L, D]``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf.to(weight.dtype) * weight).to(x.dtype)


class K3DSparkMLP(nn.Module):
    """SwiGLU MLP; ``down_proj``'s TP all-reduce is fused into the next RMSNorm."""

    def __init__(
        self, *, config: K3DSparkConfig, quant_config: QuantizationConfig | None, prefix: str
    ) -> None:
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
            config=config,
            cache_config=cache_config,
            quant_config=quant_config,
            prefix=f"{prefix}.self_attn",
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
            hidden_states, residual = fused_allreduce_rms_norm(
                hidden_states, residual, self.input_layernorm
            )
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states, residual = fused_allreduce_rms_norm(
            hidden_states, residual, self.post_attention_layernorm
        )
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
        context_proj_format: str | None,
    ) -> None:
        super().__init__()
        c = config
        self.config = c
        # The target's embedding, aliased by vLLM's load_dspark_model after loading.
        self.embed_tokens: nn.Module | None = None
        # lightseekorg's drafter normalizes each target tap before context_proj (config fc_norm).
        self.fc_norm = (
            nn.ModuleList(
                RMSNorm(c.target_hidden_size, eps=c.rms_norm_eps)
                for _ in range(c.num_target_layers)
            )
            if c.fc_norm
            else None
        )
        # Column-parallel with its output all-gathered, as vLLM's specialized drafter builds it: each
        # rank streams 1/TP of the largest draft weight (same dot products, full K per output column).
        self.context_proj = ColumnParallelLinear(
            c.target_hidden_size * c.num_target_layers,
            c.hidden_size,
            bias=False,
            gather_output=True,
            return_bias=False,
            quant_config=quant_config,
            prefix=maybe_prefix(prefix, "context_proj"),
            disable_tp=not shards_context_proj(c, context_proj_format),
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
        # Context tokens need only the KV latent: every layer's kv_a_proj_with_mqa in one GEMM, under
        # layer 0's fused_qkv_a_proj prefix so it is quantized exactly as kv_a_proj_with_mqa is.
        self.context_kv_proj = MergedColumnParallelLinear(
            c.hidden_size,
            [c.kv_latent_dim] * c.num_hidden_layers,
            bias=False,
            return_bias=False,
            quant_config=quant_config,
            prefix=maybe_prefix(prefix, f"layers.{start_layer_id}.self_attn.fused_qkv_a_proj"),
            disable_tp=True,
        )
        self.final_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        # Replicated and unquantized: the Markov head runs once per drafted position.
        self.markov_head = DSparkMarkovHead(
            c.vocab_size,
            c.draft_vocab_size,
            c.markov_rank,
            prefix=maybe_prefix(prefix, "markov_head"),
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
        if runs_in_tree_k3_layers():
            # The draft layers are vLLM's own MLA there, so its fused context-KV path runs unchanged.
            bind_upstream_context_kv(self, vllm_config.scheduler_config.max_num_batched_tokens)

    def set_kv_cache_scales(self, k_scales: torch.Tensor) -> None:
        """Each draft layer's FP8 KV-cache ``k_scale`` (``[L]``), where vLLM's attention reads it.

        vLLM attaches KV-cache quant methods (which load ``k_scale``) only to its Attention and
        MLAAttention classes, so the draft layers get the checkpoint's scales here; a model-dtype
        cache keeps 1.0, as vLLM enforces for an unquantized cache.
        """
        for layer, scale in zip(self.layers, k_scales.tolist()):
            if layer.self_attn.kv_cache_dtype != "auto":
                set_kv_cache_scale(layer.self_attn, scale)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None, "the target's embedding is shared after loading"
        return self.embed_tokens(input_ids)

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.fc_norm is not None:
            taps = hidden_states.split(self.config.target_hidden_size, dim=-1)
            hidden_states = torch.cat([norm(t) for norm, t in zip(self.fc_norm, taps)], dim=-1)
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
        """Write every layer's latent for the context tokens into its KV pages, in torch (CUDA runs vLLM's).

        ``context_states [T, H]`` (from :meth:`combine_hidden_states`) skip the layers' input norm
        and query path: per layer, ``kv_a_proj_with_mqa`` -> ``kv_a_layernorm`` on the latent and
        RoPE on ``k_pe``. ``context_slot_mapping`` is one tensor shared by all layers or one per
        layer (``None`` entries skip a layer); ``None`` computes without storing (profiling).
        """
        assert self._context_kv_norm_weight is not None, "process_weights_after_loading has not run"
        c = self.config
        num_layers = len(self.layers)
        latent = self.context_kv_proj(context_states).view(-1, num_layers, c.kv_latent_dim)
        kv_c, k_pe = latent.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv_c_normed = _grouped_rms_norm(kv_c, self._context_kv_norm_weight, c.rms_norm_eps)
        # All layers share one rotary table; the layer axis sits where heads would.
        k_pe = rotate_pe(self.layers[0].self_attn.rotary_emb, context_positions, k_pe)
        if context_slot_mapping is None:
            return
        for i, layer in enumerate(self.layers):
            slots = (
                context_slot_mapping[i]
                if isinstance(context_slot_mapping, (list, tuple))
                else context_slot_mapping
            )
            if slots is not None:
                layer.self_attn.store_latent(kv_c_normed[:, i], k_pe[:, i : i + 1], slots)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden_states = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = fused_allreduce_rms_norm(hidden_states, residual, self.final_norm)
        return hidden_states


class K3DSparkForCausalLM(nn.Module):
    """The ``K3DSparkModel`` drafter, with the hooks vLLM's ``DSparkSpeculator`` calls."""

    # vLLM >= 0.34 serves a draft class that declares no speculator config as DeepSeek-V4's drafter.
    speculator_config_class = dspark_speculator_config_class()
    has_own_embed_tokens = False
    has_own_lm_head = False
    draft_id_to_target_id = None
    packed_modules_mapping = PACKED_MODULES_MAPPING
    hf_to_vllm_mapper = HF_TO_VLLM_MAPPER

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        if vllm_config.speculative_config is None:
            raise FindingError(
                Finding(
                    "K3DSparkModel is a speculative drafter, not a standalone model",
                    "serve the target model with speculative_config={'method': 'dspark', "
                    "'model': <this drafter>}",
                )
            )
        self.config: K3DSparkConfig = vllm_config.speculative_config.draft_model_config.hf_config
        # Draft layers are numbered after the target's (93-97 for Kimi-K3).
        start_layer_id = vllm_config.model_config.get_total_num_hidden_layers()
        target_depth = getattr(self.config, "target_num_hidden_layers", None)
        if target_depth is not None and target_depth != start_layer_id:
            raise FindingError(
                Finding(
                    f"the drafter was made for a {target_depth}-layer target "
                    f"(target_num_hidden_layers), but the target has {start_layer_id} layers",
                    "serve it with the target it was trained for",
                )
            )
        model_prefix = maybe_prefix(prefix, "model")
        self._drafter = _drafter(vllm_config)
        self.quant_config, self._quant_plan = _draft_quant_config(
            vllm_config, self.config, model_prefix=model_prefix, start_layer_id=start_layer_id
        )
        self.model = K3DSparkModel(
            vllm_config=vllm_config,
            config=self.config,
            quant_config=self.quant_config,
            start_layer_id=start_layer_id,
            prefix=model_prefix,
            context_proj_format=self._quant_plan.modules.get("context_proj"),
        )
        # The target's lm_head, aliased by load_dspark_model. No placeholder: it would allocate a
        # full-vocabulary matrix only to be thrown away.
        self.lm_head: nn.Module | None = None
        # The checkpoint's FP8 KV-cache k_scale per draft layer, if it stores them (load_weights).
        self._kv_k_scales: torch.Tensor | None = None
        self.logits_processor = LogitsProcessor(
            self.config.draft_vocab_size, scale=self.config.logit_scale
        )

    # ----- speculator hooks -----

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
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
        self.model.precompute_and_store_context_kv(
            context_states, context_positions, context_slot_mapping
        )

    def get_draft_kv_cache_layer_names(self) -> list[str]:
        return [layer.self_attn.layer_name for layer in self.model.layers]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "the target's lm_head is shared after loading"
        return self.logits_processor(self.lm_head, hidden_states)

    def compute_draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Base draft logits ``logit_scale * lm_head(h)``; the Markov bias is added per position."""
        return self.compute_logits(hidden_states)

    def compute_draft_logits_local(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """This TP rank's vocab shard of :meth:`compute_draft_logits`, not gathered (vLLM 0.34
        samples sequentially with each rank owning a slice of the batch)."""
        assert self.lm_head is not None, "the target's lm_head is shared after loading"
        return self.logits_processor(self.lm_head, hidden_states, skip_gather=True)

    def map_draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        # The draft vocabulary is the target's.
        return draft_ids

    def markov_embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``W1[token]`` (``[R] -> [R, markov_rank]``)."""
        return self.model.markov_head.embed(token_ids)

    def markov_bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
        """``logit_scale * W2 m`` (``[R, markov_rank] -> [R, vocab]``)."""
        return self.model.markov_head.bias(markov_embed, self.logits_processor)

    def compute_confidence(
        self, head_hidden: torch.Tensor, markov_embed: torch.Tensor
    ) -> torch.Tensor:
        """Probability in (0, 1) that each drafted token is accepted given its prefix was."""
        assert self.model.confidence_head is not None
        return torch.sigmoid(self.model.confidence_head(head_hidden, markov_embed))

    # ----- loading -----

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors through :attr:`hf_to_vllm_mapper`, strictly.

        The stored dtypes must be what the model was built for: where they and the quantization
        config conflict, :func:`~vllm_dspark.checkpoint.quant_plan.resolve`'s finding is the error.
        A tensor with no parameter or loaded twice, a bad scale or a parameter left unfilled is a
        ``ValueError`` naming it. Returns the names of the parameters loaded (all of them).
        """
        load = _StrictLoad(self)
        try:
            AutoWeightsLoader(self).load_weights(load.routed(weights))
        except (AssertionError, RuntimeError, ValueError) as e:
            # A conflict between config and tensors is the cause of any loader error it brings.
            load.stored_plan(self._quant_plan, rest=True)
            raise load.refusal(e) from None
        self._quant_plan = load.stored_plan(self._quant_plan)
        if (stray := self._quant_plan.stray_warning()) is not None:
            logger.warning("%s: %s", self._drafter, stray)
        try:
            self._kv_k_scales = kv_scales.k_scales(load.kv_scales, self.config.num_hidden_layers)
        except FindingError as e:
            raise FindingError(*within(self._drafter, e.findings)) from None
        return load.complete()

    def process_weights_after_loading(self) -> None:
        # Runs after every layer's own post-load step; norms keep their weights (only linears are
        # repacked), so the context path can stack them now, outside any CUDA-graph capture.
        # The KV-cache scales go first: vLLM's MLA post-load step resets them, its context path reads them.
        if self._kv_k_scales is not None:
            self.model.set_kv_cache_scales(self._kv_k_scales)
        if runs_in_tree_k3_layers():
            self.model._build_fused_context_kv_metadata()
        else:
            self.model.stack_context_kv_norms()
        _log_linear_kernels(self)


def _with_context_kv(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each layer's ``kv_a_proj_with_mqa`` tensors again, as its shard of ``context_kv_proj``."""
    for name, tensor in weights:
        yield name, tensor
        if m := _KV_A_TENSOR.match(name):
            stacked = tensor.detach()
            stacked.shard_id = int(m.group(1))
            yield f"context_kv_proj.{m.group(2)}", stacked


class _Refused(FindingError):
    """A checkpoint tensor refused before any weight loader saw it (its message is final)."""


class _StrictLoad:
    """Which checkpoint tensor fills which parameter shard, checked as the tensors stream past."""

    def __init__(self, model: K3DSparkForCausalLM) -> None:
        self.config = model.config
        self.mapper: WeightsMapper = model.hf_to_vllm_mapper
        self.modules = dict(model.named_modules())
        self.params = dict(model.named_parameters())
        self.stored_modules = {spec.name for spec in checkpoint_modules(model.config)}
        self.drafter = model._drafter
        self.source: Iterator[tuple[str, torch.Tensor]] = iter(())
        self.dtypes: dict[str, str] = {}  # every stored tensor's safetensors dtype, as streamed
        self.filled: dict[str, set[int | None]] = defaultdict(set)
        self.current: tuple[str, torch.Tensor, str] | None = None
        # NVFP4 global scales by checkpoint module, and the suffix they are stored under.
        self.global_scales: dict[str, float] = {}
        self.global_scale_name = ""
        self.kv_scales: dict[str, torch.Tensor] = {}  # the draft layers' KV-cache scales, by key

    def routed(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` under their parameter names; one that fits no parameter shard once is refused."""
        self.source = iter(weights)
        for name, tensor in self.source:
            self.dtypes[name] = dtype_name(tensor.dtype) or str(tensor.dtype)
            if is_stray(name, self.config):
                continue  # warned about once, when the plan is resolved
            if kv_scales.is_kv_scale(name):
                # No parameter holds them (see K3DSparkModel.set_kv_cache_scales); checked once all are in.
                if name in self.kv_scales:
                    raise _Refused(
                        Finding(
                            f"checkpoint tensor {name!r} appears twice",
                            "use the shards and index written together",
                        )
                    )
                self.kv_scales[name] = tensor.detach().to("cpu", copy=True)
                continue
            module, _, param_name = name.rpartition(".")
            if module not in self.stored_modules:
                raise _Refused(
                    Finding(
                        f"checkpoint tensor {name!r} belongs to no module of this drafter (its "
                        f"config.json says num_hidden_layers={self.config.num_hidden_layers}, "
                        f"enable_confidence_head={self.config.enable_confidence_head})",
                        "use the config.json written with these weights",
                    )
                )
            if param_name in formats.GLOBAL_SCALE_SUFFIXES and tensor.numel() == 1:
                self.global_scales[module] = float(tensor)
                self.global_scale_name = param_name
            if formats.is_scale(param_name) and (bad := invalid_scale_count(tensor)):
                raise _Refused(
                    Finding(
                        f"{bad} of {tensor.numel()} scale values are NaN, infinite, zero or negative",
                        "re-quantize the BF16 checkpoint with `vllm-dspark quantize`",
                        f"checkpoint tensor {name!r}",
                    )
                )
            for target, data in self.mapper.apply(_with_context_kv([(name, tensor)])):
                if target not in self.params:
                    raise _Refused(_no_parameter(name, target, module, self.params))
                shard = getattr(data, "shard_id", None)
                if shard in self.filled[target]:
                    raise _Refused(
                        Finding(
                            f"checkpoint tensor {name!r} appears twice",
                            "use the shards and index written together",
                        )
                    )
                self.filled[target].add(shard)
                self.current = (name, tensor, target)
                yield target, data

    def stored_plan(self, built: QuantPlan, *, rest: bool = False) -> QuantPlan:
        """:func:`resolve` over the streamed dtypes (``rest``: all), which must be the ``built`` plan."""
        for name, tensor in self.source if rest else ():
            self.dtypes[name] = dtype_name(tensor.dtype) or str(tensor.dtype)
        try:
            plan = resolve(
                self.config, getattr(self.config, "quantization_config", None), self.dtypes
            )
        except QuantPlanError as e:
            raise FindingError(*within(self.drafter, e.findings)) from None
        stored = {name.rpartition(".")[0] for name in self.dtypes}
        expected = {name: fmt for name, fmt in built.modules.items() if name in stored}
        if plan.modules != expected:
            # Only a config_plan read leniently can differ: the tensors follow the strict reading.
            (module, _), *_ = sorted(set(plan.modules.items()) ^ set(expected.items()))
            raise FindingError(
                Finding(
                    f"{module} is stored as quantization_config reads under compressed-tensors' "
                    "rules, but the drafter was built reading its entries that match no module "
                    "as suffixes or globs",
                    "remove those entries, or write them as module names or 're:' regexes",
                    self.drafter,
                )
            )
        return plan

    def refusal(self, error: Exception) -> Exception:
        """``error`` from a weight loader, as one line naming the tensor that did not fit."""
        if isinstance(error, _Refused) or self.current is None:
            return error
        name, tensor, target = self.current
        param = self.params[target]
        return ValueError(
            f"checkpoint tensor {name!r} ({tensor.dtype}, {tuple(tensor.shape)}) does not fit parameter "
            f"{target!r} ({param.dtype}, {tuple(param.shape)}): {error}"
        )

    def complete(self) -> set[str]:
        """Every parameter's name once all its shards are filled; else a ``ValueError`` naming the rest.

        Fused NVFP4 shards with different global scales are refused too: vLLM would serve them wrong.
        """
        conflicts = fused_scale_conflicts(self.global_scales, self.global_scale_name)
        if conflicts:
            raise FindingError(conflicts[0])
        unfilled = []
        for name in self.params:
            module = self.modules[name.rpartition(".")[0]]
            if _dropped_after_loading(module, name.rpartition(".")[2]):
                continue
            fused = isinstance(module, MergedColumnParallelLinear)
            want = set(range(len(module.output_sizes))) if fused else {None}
            if self.filled[name] != want:
                shards = sorted(want - self.filled[name])
                missing = f" (missing shards {shards})" if len(want) > 1 else ""
                unfilled.append(name + missing)
        if unfilled:
            raise FindingError(
                Finding(
                    f"the checkpoint left these parameters unfilled: {', '.join(unfilled)}",
                    "the checkpoint is incomplete or its config.json does not describe it "
                    "(`vllm-dspark check` lists what is missing)",
                )
            )
        return set(self.filled)


def _dropped_after_loading(module: nn.Module, param: str) -> bool:
    """Whether vLLM registers ``param`` only to drop it if a legacy checkpoint fills it: ModelOpt
    W4A16 NVFP4's ``input_scale``, which its weight-only builds do not store."""
    spec = getattr(getattr(module, "quant_method", None), "spec", None)
    return param == "input_scale" and spec is not None and spec.activation is None


def _no_parameter(name: str, target: str, module: str, params: dict[str, Any]) -> Finding:
    """Why checkpoint tensor ``name`` has no parameter ``target``, and the fix."""
    path, _, param_name = target.rpartition(".")
    if f"{path}.weight_scale" in params:
        built = f"vLLM builds {module} quantized, without a {param_name!r} tensor"
    elif param_name.startswith(("weight_", "input_")):
        built = f"the checkpoint stores {module} quantized, but its quantization_config does not quantize it"
    else:
        built = f"{module} has no {param_name!r} in this model"
    return Finding(
        f"checkpoint tensor {name!r} has no parameter {target!r}: {built}",
        "use the config.json written with these weights",
    )
