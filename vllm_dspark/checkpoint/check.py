# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark check DIR``: a checkpoint verified from headers and scales before serving (docs/tools/quantize.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_dspark.checkpoint import formats, kv_scales, modelopt, quant_plan
from vllm_dspark.checkpoint.layout import (
    TARGET_HEADS,
    ModuleSpec,
    checkpoint_modules,
    stored_modules,
)
from vllm_dspark.checkpoint.st_io import DTYPES, StoredTensor, read_bytes
from vllm_dspark.checkpoint.store import (
    expected_tensors,
    human_bytes,
    human_params,
    read_checkpoint,
    shape_mismatches,
    shape_text,
    stored_tensor_specs,
)
from vllm_dspark.findings import Finding, FindingError, errors, os_error_finding, render
from vllm_dspark.finite import invalid_scale_values, stored_values

if TYPE_CHECKING:
    from vllm_dspark.config import K3DSparkConfig
    from vllm_dspark.fields import DrafterFields

_REQUANTIZE = "re-quantize the BF16 checkpoint with `vllm-dspark quantize`"


@dataclass
class CheckReport:
    """What ``vllm-dspark check`` found; ``ok`` when no finding is an error."""

    model_dir: str
    findings: list[Finding] = field(default_factory=list)
    quantized_modules: dict[str, str] = field(default_factory=dict)  # HF module name -> fmt
    config_groups: int = 0
    source: str = "none"  # whose quantization config: "compressed-tensors", "ModelOpt" or "none"
    summary: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[Finding]:
        return errors(self.findings)

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.problems

    def render(self) -> str:
        lines = [f"checked {self.model_dir}", *(f"  {line}" for line in self.summary)]
        lines += [f"WARNING: {render(warning)}" for warning in self.warnings]
        if self.ok:
            lines.append("OK: no problems found")
        else:
            lines.append(f"{len(self.problems)} problem(s):")
            lines += [f"  - {render(problem)}" for problem in self.problems]
        return "\n".join(lines)


def _tensor_problems(
    config: K3DSparkConfig | DrafterFields,
    quantized: dict[str, str],
    stored: dict[str, StoredTensor],
    stray: tuple[str, ...],
    encoding: str,
) -> list[Finding]:
    expected = expected_tensors(config, quantized, encoding)
    found = {k: t.shape for k, t in stored.items() if k not in stray}
    missing, misshaped, unexpected = shape_mismatches(found, expected)

    def what(key: str) -> str:
        module = key.rpartition(".")[0]
        return (
            f"the {quantized[module]} module {module}"
            if module in quantized
            else f"the unquantized module {module}"
        )

    problems = []
    for key in missing:
        fix = (
            _REQUANTIZE
            if key.rpartition(".")[0] in quantized
            else "use the shards written with this config.json"
        )
        problems.append(
            Finding(f"missing; {what(key)} needs it (shape {shape_text(expected[key])})", fix, key)
        )
    problems += [
        Finding(
            f"shape {found[key]}, but {what(key)} needs {shape_text(expected[key])}",
            "use the config.json written with these shards, or re-export them",
            key,
        )
        for key in misshaped
    ]
    for key, want in expected.items():
        if key in found and stored[key].dtype not in want.dtype_names:
            problems.append(
                Finding(
                    f"dtype {stored[key].dtype}, but {what(key)} stores it as "
                    f"{' or '.join(want.dtype_names)}",
                    _REQUANTIZE,
                    key,
                )
            )
    modules = {spec.name for spec in checkpoint_modules(config)}
    for key in sorted(unexpected):
        module = key.rpartition(".")[0]
        reason = (
            f"{module} is {quantized[module]} and does not store it"
            if module in quantized
            else f"{module} is not quantized by config.json"
            if module in modules
            else "no module of this config has it"
        )
        problems.append(
            Finding(
                f"unexpected tensor ({reason})",
                "remove it, or use the config.json written with these shards",
                key,
            )
        )
    return problems


def _scale_problems(
    specs: list[ModuleSpec],
    quantized: dict[str, str],
    stored: dict[str, StoredTensor],
    encoding: str,
) -> list[Finding]:
    problems = []
    global_scales: dict[str, float] = {}
    for spec in specs:
        fmt = quantized.get(spec.name)
        if fmt is None:
            continue
        for suffix, tensor_spec in stored_tensor_specs(fmt, spec.shape, encoding).items():
            key = f"{spec.name}.{suffix}"
            if not formats.is_scale(suffix) or key not in stored or tensor_spec.optional:
                continue  # a missing scale is already a missing-tensor problem; vLLM drops an optional one
            scale = stored[key]
            dtype = DTYPES[scale.dtype][1]  # its torch name
            if dtype is None:
                continue  # a dtype no tool reads: a dtype problem, named with the tensors'
            raw, numel = read_bytes(scale), math.prod(scale.shape)
            bad = invalid_scale_values(raw, dtype)
            if bad:
                problems.append(
                    Finding(
                        f"{bad} of {numel} scale values are NaN, infinite or not positive",
                        _REQUANTIZE,
                        key,
                    )
                )
            if suffix in formats.GLOBAL_SCALE_SUFFIXES and numel == 1:
                global_scales[spec.name] = float(stored_values(raw, dtype)[0])
    name = formats.GLOBAL_SCALE_SUFFIXES[encoding == modelopt.ENCODING]
    return problems + quant_plan.fused_scale_conflicts(global_scales, name)


def check_checkpoint(model_dir: str | Path) -> CheckReport:
    """Verify a drafter checkpoint; never raises for a bad checkpoint, each violation is a problem."""
    model_dir = Path(model_dir)
    report = CheckReport(str(model_dir))
    try:
        checkpoint = read_checkpoint(model_dir, fields_only=True)
    except FindingError as e:
        report.findings += e.findings
        return report
    except OSError as e:
        report.findings.append(os_error_finding(e))
        return report
    config, stored = checkpoint.config, checkpoint.stored
    specs = stored_modules(config, stored)
    size = sum(t.nbytes for t in stored.values())
    block = (
        f"block {config.block_size}"
        if config.block_size
        else f"no block_size (vLLM drafts num_speculative_tokens; the tools draft {config.draft_block_size})"
    )
    report.summary.append(
        f"K3 DSpark drafter: {config.num_hidden_layers} layers, hidden_size {config.hidden_size}, "
        f"{len(specs)} modules with weights; {'causal' if config.causal else 'non-causal'} {block}"
        + ("; per-tap fc_norm" if config.fc_norm else "")
        + (
            ""
            if "embed_tokens.weight" in stored
            else "; no embed_tokens.weight (the target's embedding is used)"
        )
    )
    report.summary.append(
        f"{len(stored)} tensors in {len({t.path for t in stored.values()})} shard(s): "
        f"{human_bytes(size)}"
    )
    target = model_dir / TARGET_HEADS
    if target.is_file():
        report.summary.append(f"target heads (shared embedding and lm_head): {target}")

    qc: dict[str, Any] | None = checkpoint.quantization_config
    quantized, stray = _check_quantization(report, config, qc, stored)
    if quantized is None:
        return report  # an unreadable quantization_config says nothing about the tensors
    if qc is None and not quantized:
        params = sum(math.prod(t.shape) for t in stored.values())
        report.summary.append(
            f"not quantized (no quantization_config); {human_params(params)} params"
        )
    else:
        _summarize_quantization(report, quantized, specs)
    report.quantized_modules = quantized
    encoding = modelopt.ENCODING if report.source == "ModelOpt" else "compressed-tensors"
    report.findings += _scale_problems(specs, quantized, stored, encoding)
    report.findings += _tensor_problems(config, quantized, stored, stray, encoding)
    report.findings += _kv_scale_problems(report, config, stored)
    return report


def _kv_scale_problems(
    report: CheckReport, config: K3DSparkConfig | DrafterFields, stored: dict[str, StoredTensor]
) -> list[Finding]:
    """The draft layers' KV-cache scales, if stored: one per layer, each finite and positive; summarized."""
    keys = sorted(k for k in stored if kv_scales.is_kv_scale(k))
    if not keys:
        return []
    problems, values = [], []
    for layer in range(config.num_hidden_layers):
        for key in kv_scales.scale_keys(layer):
            if key not in stored:
                problems.append(
                    Finding(
                        "missing; the other draft layers store KV-cache scales", kv_scales.FIX, key
                    )
                )
                continue
            dtype = DTYPES[stored[key].dtype][1]
            raw = read_bytes(stored[key])
            if dtype is None or math.prod(stored[key].shape) != 1:
                continue  # a dtype or shape problem, named with the tensors'
            if invalid_scale_values(raw, dtype):
                problems.append(Finding("NaN, infinite or not positive", kv_scales.FIX, key))
            elif key.endswith("k_scale"):
                values.append(float(stored_values(raw, dtype)[0]))
    if len(values) == config.num_hidden_layers:
        report.summary.append(
            "fp8 KV-cache k_scale per draft layer: " + ", ".join(f"{v:.4g}" for v in values)
        )
    return problems


def _check_quantization(
    report: CheckReport, config: Any, qc: dict[str, Any] | None, stored: dict[str, StoredTensor]
) -> tuple[dict[str, str] | None, tuple[str, ...]]:
    """Resolve the quantization plan into ``report``: ``({module: fmt} to check the tensors against, strays)``.

    When the plan is refused, the tensors are checked against what ``qc`` says (None if it is unreadable).
    """
    report.config_groups = len((qc or {}).get("config_groups") or {})
    report.source = (
        "none" if qc is None else "ModelOpt" if modelopt.is_modelopt(qc) else "compressed-tensors"
    )
    try:
        plan = quant_plan.resolve(config, qc, {key: t.dtype for key, t in stored.items()})
    except quant_plan.QuantPlanError as e:
        report.findings += e.findings
        stray = tuple(k for k in stored if quant_plan.is_stray(k, config))
        linears = {spec.name for spec in checkpoint_modules(config) if spec.role == "linear"}
        try:
            said = quant_plan.declared(config, qc) if qc is not None else {}
            return {m: fmt for m, fmt in said.items() if m in linears}, stray
        except quant_plan.QuantPlanError:
            return None, stray
    report.findings += plan.warnings()
    return plan.modules, plan.stray


def _config_shape(report: CheckReport) -> str:
    if report.source == "ModelOpt":
        return "ModelOpt"
    return f"{report.config_groups} config group(s)"


def _summarize_quantization(
    report: CheckReport, quantized: dict[str, str], specs: list[ModuleSpec]
) -> None:
    fmts = sorted(set(quantized.values()))
    quantized_params = sum(math.prod(s.shape) for s in specs if s.name in quantized)
    dense_params = sum(math.prod(s.shape) + (s.shape[0] if s.bias else 0) for s in specs)
    report.summary.append(
        f"quantization_config: {_config_shape(report)}, format {', '.join(fmts) or 'none'}: "
        f"{len(quantized)} quantized modules ({human_params(quantized_params)} of {human_params(dense_params)} "
        f"params, {100 * quantized_params / max(dense_params, 1):.0f} %), {len(specs) - len(quantized)} unquantized "
        "modules"
    )
