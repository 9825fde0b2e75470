# SPDX-License-Identifier: Apache-2.0
"""The doctor's context checks: the served length against the drafter's validated context, what
``speculative_config.max_model_len`` really does on the installed vLLM, and YaRN's consistency.

Pure functions of the speculative-config dict, the drafter's and target's ``config.json`` dicts, the
engine facts and the vLLM version; which build caps the server is :mod:`vllm_dspark.compat`'s data.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_dspark.compat import DRAFT_LIMITS_SERVER_LEN, draft_limits_server_len
from vllm_dspark.doctor.facts import EngineFacts
from vllm_dspark.fields import VALIDATED_CONTEXT_WINDOWS, YARN_DEFAULTS, validated_context_len
from vllm_dspark.findings import Finding


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _rope(drafter: Mapping[str, Any]) -> Mapping[str, Any]:
    rope = drafter.get("rope_parameters") or drafter.get("rope_scaling") or {}
    return rope if isinstance(rope, Mapping) else {}


def rope_type(drafter: Mapping[str, Any]) -> str:
    """The drafter's RoPE type as vLLM names it (``default`` when its config has none)."""
    rope = _rope(drafter)
    return str(rope.get("rope_type", rope.get("type", "default")))


def requested_len(engine: EngineFacts, target: Mapping[str, Any] | None) -> tuple[int | None, str]:
    """The max_model_len asked for, and where it comes from: --max-model-len, else the target's
    ``max_position_embeddings`` (None: neither is known)."""
    if _positive_int(engine.max_model_len):
        return engine.max_model_len, "--max-model-len"
    text = (target or {}).get("text_config") or target or {}
    length = _positive_int(text.get("max_position_embeddings"))
    return length, "the target's max_position_embeddings"


def served_len(
    spec: Mapping[str, Any],
    drafter: Mapping[str, Any],
    engine: EngineFacts,
    target: Mapping[str, Any] | None,
    version: str | None,
) -> int | None:
    """The max_model_len vLLM ``version`` will serve: the one asked for, lowered to the draft's
    (``speculative_config.max_model_len``, else its ``max_position_embeddings``) where that build caps it."""
    asked, _ = requested_len(engine, target)
    if asked is None or version is None or not draft_limits_server_len(version, rope_type(drafter)):
        return asked
    draft = _positive_int(spec.get("max_model_len")) or _positive_int(
        drafter.get("max_position_embeddings")
    )
    return asked if draft is None else min(asked, draft)


def check_validated_context(
    spec: Mapping[str, Any],
    drafter: Mapping[str, Any],
    engine: EngineFacts,
    target: Mapping[str, Any] | None,
    version: str | None,
) -> list[Finding]:
    """A served length past the context the drafter's acceptance was validated to (a warning)."""
    limit = validated_context_len(drafter)
    served = served_len(spec, drafter, engine, target, version)
    if not _positive_int(limit) or served is None or served <= limit:
        return []
    where = (
        "its validated_context_len"
        if drafter.get("validated_context_len") is not None
        else f"{VALIDATED_CONTEXT_WINDOWS} × its YaRN original_max_position_embeddings, the default"
    )
    return [
        Finding(
            f"max_model_len {served} is past the drafter's validated context {limit} ({where}): "
            "acceptance falls toward 1 beyond it (the published drafter: τ 5.6 at 4K, 1.0 at 131K) "
            "while every step still pays for drafting",
            f"serve with --max-model-len {limit}, or measure acceptance at your lengths "
            "(`vllm-dspark accept --context-sweep`) and set validated_context_len in config.json",
            "max_model_len",
            "warning",
        )
    ]


def check_speculative_max_model_len(
    spec: Mapping[str, Any],
    drafter: Mapping[str, Any],
    engine: EngineFacts,
    target: Mapping[str, Any] | None,
    version: str | None,
) -> list[Finding]:
    """What ``speculative_config.max_model_len`` (or the draft's own length) does on vLLM ``version``:
    refused, a cap on the whole server, or ignored. No build skips speculation per sequence."""
    where = "speculative_config.max_model_len"
    raw = spec.get("max_model_len")
    asked, source = requested_len(engine, target)
    draft_len = _positive_int(drafter.get("max_position_embeddings"))
    rope = rope_type(drafter)
    caps = version is not None and draft_limits_server_len(version, rope)
    if raw is None:
        if caps and draft_len and asked and draft_len < asked:
            return [
                Finding(
                    f"on vLLM {version} the drafter's max_position_embeddings {draft_len} lowers the "
                    f"whole server's max_model_len from {asked} ({source}) to {draft_len}: its "
                    f"{rope} RoPE does not share the target's positions",
                    f"serve with --max-model-len {draft_len}, or use a drafter built for {asked} tokens",
                    "max_model_len",
                )
            ]
        return []
    length = _positive_int(raw)
    if length is None:
        return [Finding(f"must be a positive integer, got {raw!r}", "fix it or drop it", where)]
    if draft_len and length > draft_len:
        return [
            Finding(
                f"{length} is above the drafter's max_position_embeddings {draft_len}; vLLM refuses it",
                f"drop it (it skips no sequence), or set at most {draft_len}",
                where,
            )
        ]
    if asked and length > asked:
        return [
            Finding(
                f"{length} is above the server's max_model_len {asked} ({source}); vLLM refuses it",
                "drop it (it skips no sequence)",
                where,
            )
        ]
    if caps:
        if asked is not None and length >= asked:
            return []
        asked_text = f"below the {asked} asked for ({source})" if asked else "for every request"
        return [
            Finding(
                f"on vLLM {version} it lowers the whole server's max_model_len to {length}, "
                f"{asked_text}: the V2 model runner cannot skip speculation per sequence",
                "drop it and serve with --max-model-len"
                + (f" {asked}" if asked else "")
                + f"; or, if {length} is meant, say --max-model-len {length}",
                where,
            )
        ]
    if version is None:
        return []
    why = (
        f"the drafter's {rope} RoPE shares the target's positions"
        if DRAFT_LIMITS_SERVER_LEN.applies_to(version)
        else "this build never applies it to the server or the dspark speculator"
    )
    return [
        Finding(
            f"ignored on vLLM {version} ({why}): speculation runs at every length up to "
            f"{asked or 'max_model_len'}",
            "drop it; cap the server with --max-model-len if long requests should not speculate",
            where,
            "warning",
        )
    ]


def _yarn(drafter: Mapping[str, Any]) -> dict[str, Any] | None:
    """The drafter's YaRN block with vLLM's defaults filled; None without a complete one (the
    drafter-config check names an incomplete block)."""
    rope = _rope(drafter)
    factor, original = rope.get("factor"), rope.get("original_max_position_embeddings")
    if rope_type(drafter) != "yarn" or not isinstance(factor, (int, float)):
        return None
    return {**YARN_DEFAULTS, **rope, "rope_type": "yarn"} if _positive_int(original) else None


def check_yarn(drafter: Mapping[str, Any]) -> list[Finding]:
    """YaRN's ``max_position_embeddings`` against ``original_max_position_embeddings × factor``."""
    rope, mpe = _yarn(drafter), drafter.get("max_position_embeddings")
    if rope is None or not _positive_int(mpe):
        return []
    original, factor = rope["original_max_position_embeddings"], rope["factor"]
    stretched = round(original * factor)
    if mpe == stretched:
        return []
    return [
        Finding(
            f"max_position_embeddings {mpe} != original_max_position_embeddings {original} × "
            f"factor {factor:g} = {stretched}: vLLM bounds the draft's length by the first, "
            "while YaRN stretches its frequencies for the second",
            f"set max_position_embeddings to {stretched}, or factor to {mpe / original:g}",
            "rope_parameters",
            "warning",
        )
    ]


def yarn_summary(drafter: Mapping[str, Any]) -> str | None:
    """The drafter's YaRN window and the effective softmax scale its attention uses, in one line."""
    from vllm_dspark.ops.rope import (
        cos_sin_scale,
        softmax_scale,
        yarn_mscale,
    )  # torch: not at --help

    rope = _yarn(drafter)
    dims = [drafter.get(k) for k in ("qk_nope_head_dim", "qk_rope_head_dim")]
    if rope is None or not all(_positive_int(d) for d in dims):
        return None
    head_dim = sum(dims)
    scale = softmax_scale(head_dim, rope)
    mscale = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
    return (
        f"YaRN {rope['original_max_position_embeddings']} × {rope['factor']:g}: softmax scale "
        f"{scale:.6g} = {head_dim}^-0.5 × {scale * head_dim**0.5:.4f} (mscale_all_dim {mscale:.4f}), "
        f"cos/sin × {cos_sin_scale(rope):.4f}"
    )


def check_context(
    spec: Mapping[str, Any],
    drafter: Mapping[str, Any],
    engine: EngineFacts,
    target: Mapping[str, Any] | None,
    version: str | None,
) -> list[Finding]:
    """The three context checks of a K3 DSpark drafter."""
    return (
        check_speculative_max_model_len(spec, drafter, engine, target, version)
        + check_validated_context(spec, drafter, engine, target, version)
        + check_yarn(drafter)
    )
