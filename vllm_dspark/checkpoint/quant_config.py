# SPDX-License-Identifier: Apache-2.0
"""``quantization_config``: which module kinds a format may take, writing the block, and reading one back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vllm_dspark.checkpoint.formats import ACTIVATION_FIELDS, REGISTRY, WEIGHT_FIELDS, get
from vllm_dspark.checkpoint.layout import (
    GLOBAL_KINDS,
    LAYER_KINDS,
    MODULE_SETS,
    QUANTIZABLE_KINDS,
    checkpoint_modules,
    kind_regex,
    validate_fused_decision,
    why_unquantized,
)

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    from vllm_dspark.config import K3DSparkConfig


# ----- writing -----


def validate_include_kinds(
    include_kinds: Sequence[str], fmt: str, config: "K3DSparkConfig"
) -> tuple[str, ...]:
    """The included kinds in checkpoint order (a named set expanded); ``ValueError`` naming the fix for any bad choice."""
    kinds = list(dict.fromkeys(k for n in include_kinds for k in MODULE_SETS.get(n, (n,))))
    if not kinds:
        raise ValueError(f"--include-layers is empty; choose from: {' '.join(QUANTIZABLE_KINDS)}")
    unknown = [k for k in kinds if k not in LAYER_KINDS and k not in GLOBAL_KINDS]
    if unknown:
        raise ValueError(
            f"unknown layer name(s) in --include-layers: {', '.join(map(repr, unknown))}. Layer names are "
            f"index-agnostic module kinds; valid ones: {' '.join(QUANTIZABLE_KINDS)}, or a named set: "
            f"{' '.join(MODULE_SETS)}"
        )
    specs = {s.kind: s for s in checkpoint_modules(config)}
    refused = [k for k in kinds if k not in QUANTIZABLE_KINDS]
    if refused:
        reasons = "; ".join(f"{k!r}: {why_unquantized(k)}" for k in refused)
        raise ValueError(
            f"{', '.join(map(repr, refused))} cannot be quantized (they stay bit-identical BF16): {reasons}. "
            f"Quantizable layers: {' '.join(QUANTIZABLE_KINDS)}"
        )
    validate_fused_decision(set(kinds))
    bad = [
        f"{k}: {p}" for k in kinds if k in specs and (p := get(fmt).shape_problem(specs[k].shape))
    ]
    if bad:
        raise ValueError(f"{'; '.join(bad)}. Leave those layers out of --include-layers")
    return tuple(k for k in QUANTIZABLE_KINDS if k in kinds)


def quantization_config(
    fmt: str, include_kinds: Sequence[str], config: "K3DSparkConfig"
) -> dict[str, Any]:
    """The ``quantization_config`` block of config.json for quantizing ``include_kinds`` to ``fmt``.

    One config group whose targets are index-agnostic ``re:`` patterns of the included kinds, and
    an ignore list with a pattern for every other module kind that has weights: vLLM renumbers
    the draft layers after the target's (``model.layers.93...``), so per-layer names would miss.
    """
    kinds = validate_include_kinds(include_kinds, fmt, config)
    present = dict.fromkeys(spec.kind for spec in checkpoint_modules(config))
    return compressed_tensors_config(
        {fmt: [kind_regex(k) for k in kinds]},
        ignore=[kind_regex(k) for k in present if k not in kinds],
    )


def compressed_tensors_config(
    targets: Mapping[str, Sequence[str]], *, ignore: Sequence[str]
) -> dict[str, Any]:
    """A ``quantization_config`` dict: one config group per format in ``targets`` ({fmt: target entries}).

    Written without compressed-tensors (its import pulls in transformers: seconds); its parser fills
    every field left out with its default, and the tests check the result equals its own dump.
    """
    groups = {
        f"group_{i}": get(fmt).config_group(entries)
        for i, (fmt, entries) in enumerate(targets.items())
    }
    return {
        "quant_method": "compressed-tensors",
        "format": next(iter(groups.values()))["format"] if len(groups) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": list(ignore),
    }


# ----- reading -----


def own_group_formats(quantization_config: Mapping[str, Any]) -> dict[str, str] | None:
    """``{config group name: fmt}`` of a ``quantization_config`` exactly as
    :func:`compressed_tensors_config` writes it (`vllm-dspark quantize`'s), read without
    compressed-tensors; None for any other, which :func:`group_formats` reads."""
    groups = quantization_config.get("config_groups")
    ignore = quantization_config.get("ignore")
    if not isinstance(groups, Mapping) or not groups or not isinstance(ignore, list):
        return None
    found: dict[str, str] = {}
    targets: dict[str, list[str]] = {}
    for name, group in groups.items():
        if not isinstance(group, Mapping) or not isinstance(group.get("targets"), list):
            return None
        fmt = next(
            (f for f in REGISTRY.values() if f.config_group(group["targets"]) == group), None
        )
        if fmt is None or fmt.name in targets:
            return None
        found[name] = fmt.name
        targets[fmt.name] = list(group["targets"])
    rebuilt = compressed_tensors_config(targets, ignore=ignore)
    return found if rebuilt == dict(quantization_config) else None


def _group_format(scheme: QuantizationScheme, top_format: str | None) -> str:
    """Which registered format a config group is; ``ValueError`` if none."""
    if scheme.output_activations is not None:
        raise ValueError(
            "the config group quantizes output activations, which no vLLM linear kernel does"
        )
    w = scheme.weights
    if w is None:
        raise ValueError("the config group has no weight quantization")
    for fmt in REGISTRY.values():
        if fmt.matches(w, scheme.input_activations):
            stored_as = scheme.format or top_format
            if stored_as not in fmt.format_strings:
                raise ValueError(
                    f"the config group is {fmt.name} but its format is {stored_as!r}; vLLM loads {fmt.name} only as "
                    f"{' or '.join(fmt.format_strings)}"
                )
            return fmt.name
    a = scheme.input_activations
    inputs = "none" if a is None else ", ".join(f"{f}={getattr(a, f)!r}" for f in ACTIVATION_FIELDS)
    raise ValueError(
        f"unsupported scheme (weights: {', '.join(f'{f}={getattr(w, f)!r}' for f in WEIGHT_FIELDS)}; "
        f"input activations: {inputs}); supported: "
        + "; ".join(fmt.description for fmt in REGISTRY.values())
    )


def parse_quantization_config(quantization_config: dict[str, Any]) -> QuantizationConfig:
    """compressed-tensors' model of a ``quantization_config`` dict; ``ValueError`` unless it is compressed-tensors."""
    if quantization_config.get("quant_method") != "compressed-tensors":
        raise ValueError(
            f"quant_method is {quantization_config.get('quant_method')!r}; only 'compressed-tensors' is supported"
        )
    from compressed_tensors.quantization import QuantizationConfig

    return QuantizationConfig.model_validate(quantization_config)


def group_formats(quantization_config: dict[str, Any]) -> dict[str, str]:
    """``{config group name: fmt}``; ``ValueError`` for a group that is no registered format."""
    qc = parse_quantization_config(quantization_config)
    formats = {}
    for name, scheme in qc.config_groups.items():
        try:
            formats[name] = _group_format(scheme, qc.format)
        except ValueError as e:
            raise ValueError(f"config group {name!r}: {e}") from None
    return formats


def format_of(quantization_config: dict[str, Any]) -> str:
    """The one format a ``quantization_config`` stores its weights in."""
    found = set(group_formats(quantization_config).values())
    if len(found) != 1:
        raise ValueError(
            f"expected one weight format across config groups, found {sorted(found) or 'none'}"
        )
    return found.pop()
