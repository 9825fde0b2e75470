# SPDX-License-Identifier: Apache-2.0
"""The doctor inside vLLM: :func:`install_speculative_config_hook` runs the checks whenever vLLM
builds a speculative config for a K3 DSpark drafter, before the target loads."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_dspark.compat import wrap_create_speculative_config
from vllm_dspark.doctor.checks import (
    check_checkpoint_findings,
    check_drafter_config,
    check_vllm_version,
    diagnose,
    is_k3_drafter,
)
from vllm_dspark.doctor.facts import (
    AUX_STREAM_ENV,
    engine_facts,
    read_drafter_config,
    resolve_drafter,
    serving_machine,
    vllm_schema,
)
from vllm_dspark.findings import Finding, errors, render, render_table

# The env var that turns the serving-time hook off (the CLI always runs).
DISABLE_ENV = "VLLM_DSPARK_DOCTOR"


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
        return path, read_drafter_config(path)
    except ValueError:
        return None, None  # vLLM's own config loading reports it


def enforce(findings: Sequence[Finding], log: Any) -> None:
    """Log warnings and notes; raise ``ValueError`` listing the errors, if any."""
    for f in findings:
        if f.severity == "warning":
            log.warning("vllm_dspark doctor: %s", render(f))
        elif f.severity == "note":
            log.info("vllm_dspark doctor: %s: %s", f.where, f.problem)
    bad = errors(findings)
    if bad:
        raise ValueError(
            "vllm_dspark doctor: this --speculative-config would fail after the target loads, or draft garbage:\n"
            + render_table(bad)
            + f"\n(`vllm-dspark doctor` runs every check; {DISABLE_ENV}=0 skips this one at serve time.)"
        )


def install_speculative_config_hook() -> None:
    """Run :func:`diagnose` whenever vLLM builds a speculative config for a K3 DSpark drafter.

    Through :func:`vllm_dspark.compat.wrap_create_speculative_config`: once per engine, before the
    target loads, the one place that sees both the speculative config and the engine flags it
    interacts with (``--kv-cache-dtype``, cudagraph mode, LoRA, PP). Idempotent, and a no-op until
    vLLM's ``arg_utils`` is imported, so ``register()`` calls it on every call.
    """
    wrap_create_speculative_config(_checked)


def _checked(original: Callable[..., Any]) -> Callable[..., Any]:
    """``create_speculative_config`` that runs the checks around ``original``."""

    def create_speculative_config(
        self: Any, target_model_config: Any, target_parallel_config: Any
    ) -> Any:
        if os.environ.get(DISABLE_ENV, "1").lower() in ("0", "false", "off"):
            return original(self, target_model_config, target_parallel_config)
        spec = _merged_spec(self)
        path, drafter = _local_drafter(spec) if spec else (None, None)
        if spec and is_k3_drafter(drafter):  # before vLLM loads the draft config
            _run_hook_checks(self, spec, drafter, path, target_model_config)
        result = original(self, target_model_config, target_parallel_config)
        draft_model_config = getattr(result, "draft_model_config", None)
        if spec and drafter is None and draft_model_config is not None:
            # A drafter that is not on local disk yet (vLLM just fetched its config): check it now.
            resolved = draft_model_config.hf_config.to_dict()
            if is_k3_drafter(resolved):
                _run_hook_checks(self, spec, resolved, None, target_model_config)
        return result

    return create_speculative_config


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
    schema = vllm_schema()
    # register() logs and skips on a vLLM the version policy refuses; a K3 drafter stops here.
    findings = check_vllm_version(schema.version) + diagnose(
        spec,
        drafter=drafter,
        engine=engine_facts(engine_args, target_model_config),
        machine=serving_machine(),
        target=target,
        schema=schema,
    )
    if path is not None and not check_drafter_config(drafter):
        # The checkpoint itself (shards, quantization plan, tensors) from headers and scales only.
        findings += check_checkpoint_findings(path)
    enforce(findings, init_logger("vllm.vllm_dspark"))
    if drafter.get("aux_hidden_stream") == "attn_res":
        # Before the target loads and its workers start: they inherit the environment.
        os.environ.setdefault(AUX_STREAM_ENV, "1")
