# SPDX-License-Identifier: Apache-2.0
"""Which checkpoint module is stored in which format: the one quantization plan every tool and loader
asks, and the normalized config vLLM gets (docs/encodings.md)."""

from __future__ import annotations

import fnmatch
import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_dspark.checkpoint import formats, modelopt, quant_config
from vllm_dspark.checkpoint.layout import (
    FUSED_GROUPS,
    QUANTIZABLE_KINDS,
    ModuleSpec,
    checkpoint_modules,
    fused_module_groups,
    kind_regex,
    runtime_name,
    why_unquantized,
)
from vllm_dspark.findings import Finding, FindingError

if TYPE_CHECKING:
    import torch

    from vllm_dspark.config import K3DSparkConfig

_FIX_SHARDS = (
    "use the config.json written with these shards, or re-quantize the BF16 checkpoint with "
    "`vllm-dspark quantize`"
)
FLOAT_DTYPES = (
    "BF16",
    "F16",
    "F32",
)  # what an unquantized tensor may be stored in (the published drafter: BF16)
_GLOB_CHARS = frozenset("*?[")
# fnmatch.translate's output around the regex it builds
_FNMATCH_WRAPPER = re.compile(r"\(\?s:(.*)\)\\Z", re.S)
_KV_A_KIND = "self_attn.kv_a_proj_with_mqa"


class QuantPlanError(FindingError):
    """quantization_config and the stored tensors conflict; the finding names the module and the fix."""


@dataclass(frozen=True)
class QuantPlan:
    """``modules``: checkpoint module -> format of every quantized module (the rest are stored BF16)."""

    modules: dict[str, str] = field(default_factory=dict)
    # Whose tensor names and scale conventions the quantized modules use: "compressed-tensors" or "modelopt".
    encoding: str = "compressed-tensors"
    # Set when the config is outside the spec but the tensors are unambiguous.
    warning: Finding | None = None
    stray: tuple[str, ...] = ()  # stored tensors the served model drops (see :func:`is_stray`)

    def stray_warning(self) -> Finding | None:
        """The one warning about :attr:`stray` tensors, or None."""
        if not self.stray:
            return None
        return Finding(
            f"skipping {len(self.stray)} stored tensor(s) the drafter does not use "
            f"({', '.join(self.stray[:4])}{', ...' if len(self.stray) > 4 else ''}): the lm_head is "
            "the target's, and a confidence head is only built with enable_confidence_head",
            "nothing to do; remove them to save space",
            severity="warning",
        )

    def warnings(self) -> list[Finding]:
        """:attr:`warning` and :meth:`stray_warning`, where set."""
        return [w for w in (self.warning, self.stray_warning()) if w is not None]


def is_stray(key: str, config: K3DSparkConfig) -> bool:
    """Whether stored tensor ``key`` is one vLLM's in-tree class drops: the target's ``lm_head`` copied into
    the drafter's shards, or ``confidence_head.*`` of a drafter built without one."""
    return key.startswith("lm_head.") or (
        not config.enable_confidence_head and key.startswith("confidence_head.")
    )


# ----- what the tensors say -----


_Stored = (
    tuple[str, ...] | str | None
)  # the formats a module's tensors can be, None (float) or "?" (none)


def _stored_format(dtypes: Mapping[str, str]) -> _Stored:
    """The formats a module's ``{suffix: safetensors dtype}`` can be; None for float, "?" for none."""
    found = tuple(fmt.name for fmt in formats.REGISTRY.values() if fmt.identify(dtypes))
    if found:
        return found
    return None if "weight_packed" not in dtypes and dtypes.get("weight") in FLOAT_DTYPES else "?"


def _shown(stored: tuple[str, ...] | None) -> str | None:
    """How to name what a module's tensors hold: formats storing the same tensors (fp8 and its W8A8
    siblings) differ only in the config, so the tensors are named by the first, the weight-only one."""
    return None if stored is None else stored[0]


def _stored_plan(specs: list[ModuleSpec], dtypes: Mapping[str, str]) -> dict[str, _Stored]:
    by_module: dict[str, dict[str, str]] = {}
    for key, dtype in dtypes.items():
        module, _, suffix = key.rpartition(".")
        by_module.setdefault(module, {})[suffix] = dtype
    return {
        s.name: _stored_format(modelopt.canonical_dtypes(by_module.get(s.name, {}))) for s in specs
    }


def _check_storage(specs: list[ModuleSpec], stored: dict[str, _Stored]) -> None:
    """Refuse tensors that no config could make servable: quantized non-linears, split fused layers."""
    for spec in specs:
        fmt = stored[spec.name]
        if fmt not in (None, "?") and spec.kind not in QUANTIZABLE_KINDS:
            raise QuantPlanError(
                Finding(
                    f"{spec.name} is stored as {_shown(fmt)}, but {why_unquantized(spec.kind)}, so "
                    "the drafter runs it unquantized",
                    "re-quantize the BF16 checkpoint with `vllm-dspark quantize`, which keeps it BF16",
                )
            )
    for fused, members in fused_module_groups(s.name for s in specs).items():
        found = {m: stored[m] for m in members if stored[m] != "?"}
        if len(set(found.values())) > 1:
            split = ", ".join(f"{m} as {_shown(f) or 'BF16'}" for m, f in found.items())
            stacked = fused.startswith("self_attn.")
            why = " (context_kv_proj stacks every layer's kv_a_proj_with_mqa)" if stacked else ""
            raise QuantPlanError(
                Finding(
                    f"the shards store {split}, but vLLM fuses them into one layer, which takes "
                    f"one scheme{why}",
                    "re-quantize the BF16 checkpoint with `vllm-dspark quantize`, which quantizes "
                    "all of them or none",
                    fused,
                )
            )


def fused_scale_conflicts(global_scales: Mapping[str, float], name: str) -> list[Finding]:
    """One finding per fused layer whose members' NVFP4 global scales (``name``) differ: vLLM applies
    the largest to the whole layer without rescaling the block scales, so the rest dequantize wrong."""
    found = []
    for fused, members in fused_module_groups(global_scales).items():
        if len({global_scales[m] for m in members}) > 1:
            listed = ", ".join(f"{m}={global_scales[m]:.6g}" for m in members)
            found.append(
                Finding(
                    f"NVFP4 {name} differs across the fused modules ({listed}), but vLLM applies "
                    "one global scale to the fused layer (without rescaling the block scales)",
                    "re-quantize the BF16 checkpoint with `vllm-dspark quantize`, which gives "
                    "fused modules a shared global scale",
                    fused,
                )
            )
    return found


# ----- what the config says -----


@functools.cache
def _stand_in(role: str) -> torch.nn.Module:
    """A module of the class a checkpoint module has in the model, for compressed-tensors' class matching."""
    import torch  # only a config entry naming a class needs it

    if role == "linear":
        return torch.nn.Linear(1, 1, bias=False, device="meta")
    if role == "embedding":
        return torch.nn.Embedding(1, 1, device="meta")

    class RMSNorm(torch.nn.Module):
        """Stands in for a norm when matching class targets (models name their norm classes ``*RMSNorm``)."""

    return RMSNorm()


@functools.cache
def _class_names(role: str) -> frozenset[str]:
    """The class names compressed-tensors matches a module of ``role`` by: its stand-in's torch classes."""
    import torch

    return frozenset(
        c.__name__ for c in type(_stand_in(role)).__mro__ if issubclass(c, torch.nn.Module)
    )


def is_match(name: str, role: str, entry: str) -> bool:
    """compressed-tensors' ``is_match(name, module, entry)`` for a module of ``role``, without
    importing it (its import pulls in transformers): a ``re:`` entry is ``re.match``-ed against the
    name, any other equals the name or one of the module's class names (``Linear``)."""
    if entry.startswith("re:"):
        return re.match(entry.removeprefix("re:"), name) is not None
    return entry == name or entry in _class_names(role)


def _names(spec: ModuleSpec, start_layer_id: int | None) -> list[str]:
    """Every name a config entry may use for ``spec``: checkpoint, ``model.``, runtime and fused names."""
    bases = [spec.name]
    if spec.layer is not None and start_layer_id is not None:
        bases.append(f"layers.{start_layer_id + spec.layer}.{spec.kind}")
    for fused, members in FUSED_GROUPS.items():
        if spec.kind in members:
            bases += [b.removesuffix(spec.kind) + fused for b in bases]
    if spec.kind == _KV_A_KIND:
        bases.append("context_kv_proj")
    return [*bases, *(f"model.{b}" for b in bases)]


def _lenient(entry: str) -> tuple[str, str] | None:
    """``(regex, rewrite)``: how an entry that matches nothing was meant, or None if it was meant literally."""
    if entry.startswith("re:"):
        pattern = entry.removeprefix("re:")
        anchored = pattern.startswith(("^", ".*"))
        return None if anchored else (f".*(?:{pattern}).*", f"re:.*(?:{pattern})")
    if _GLOB_CHARS & set(entry):
        regex = fnmatch.translate(entry)
        return regex, f"re:{_FNMATCH_WRAPPER.fullmatch(regex)[1]}$"
    # A suffix is read at any layer index (``layers.``/``model.`` names never get here: every suffix
    # of a module name that starts so is a module name too, so such an entry is not dead).
    return rf"(?:.*\.)?{re.escape(entry)}$", kind_regex(entry)


@dataclass
class _Config:
    """A parsed quantization_config: targets in group order with their format, and the ignore list."""

    targets: list[tuple[str, str]]  # (entry, fmt)
    ignore: list[str]

    @classmethod
    def parse(cls, quantization_config: Mapping[str, Any]) -> _Config:
        own = quant_config.own_group_formats(quantization_config)
        if own is not None:  # as `vllm-dspark quantize` writes it: read without compressed-tensors
            groups = quantization_config["config_groups"]
            targets = [(t, own[g]) for g in groups for t in groups[g]["targets"]]
            return cls(targets, list(quantization_config["ignore"]))
        try:
            group_formats = quant_config.group_formats(dict(quantization_config))
            qc = quant_config.parse_quantization_config(dict(quantization_config))
        except ValueError as e:
            raise QuantPlanError(
                Finding(
                    str(e),
                    "write it as `vllm-dspark quantize` does: compressed-tensors, one "
                    "config group per registered format",
                    "quantization_config",
                )
            ) from None
        targets = [
            (t, group_formats[g]) for g, scheme in qc.config_groups.items() for t in scheme.targets
        ]
        return cls(targets, list(qc.ignore or []))

    def plan(
        self, specs: list[ModuleSpec], start_layer_id: int | None, lenient: Mapping[str, str]
    ) -> dict[str, tuple[str | None, str | None]]:
        """``{module: (fmt or None, why)}``; ``lenient`` maps entries to the regex read in their place."""

        def hits(entry: str, names: list[str], stand_in: str) -> bool:
            if entry in lenient:
                return any(re.fullmatch(lenient[entry], n) for n in names)
            return any(is_match(n, stand_in, entry) for n in names)

        out = {}
        for spec in specs:
            names, stand_in = _names(spec, start_layer_id), spec.role
            target = next(((t, fmt) for t, fmt in self.targets if hits(t, names, stand_in)), None)
            ignored = next((i for i in self.ignore if hits(i, names, stand_in)), None)
            if ignored is not None:
                out[spec.name] = (None, f"ignore {ignored!r}")
            elif target is not None:
                out[spec.name] = (target[1], f"target {target[0]!r}")
            else:
                out[spec.name] = (None, "no target matches it")
        return out

    def dead_entries(self, specs: list[ModuleSpec], start_layer_id: int | None) -> list[str]:
        """Entries that match no module under compressed-tensors' rules, in config order."""
        entries = dict.fromkeys([t for t, _ in self.targets] + self.ignore)
        for spec in specs:
            names, stand_in = _names(spec, start_layer_id), spec.role
            for entry in [e for e in entries if any(is_match(n, stand_in, e) for n in names)]:
                del entries[entry]
        return list(entries)


@dataclass
class _ModelOptConfig:
    """A parsed ModelOpt config: every linear in its one format unless an exclude entry names it."""

    parsed: modelopt.Config

    @classmethod
    def parse(cls, quantization_config: Mapping[str, Any]) -> _ModelOptConfig:
        try:
            return cls(modelopt.Config.parse(quantization_config))
        except ValueError as e:
            raise QuantPlanError(
                Finding(
                    str(e),
                    "quantize the BF16 checkpoint with ModelOpt's drafter quantizer or "
                    "`vllm-dspark quantize --export modelopt`",
                    "quantization_config",
                )
            ) from None

    def plan(
        self, specs: list[ModuleSpec], start_layer_id: int | None, lenient: Mapping[str, str]
    ) -> dict[str, tuple[str | None, str | None]]:
        """``{module: (fmt or None, why)}``; ModelOpt's globs need no lenient reading."""
        algo = formats.get(self.parsed.fmt).modelopt_algo
        out: dict[str, tuple[str | None, str | None]] = {}
        for spec in specs:
            entry = self.parsed.excluded_by(_names(spec, start_layer_id))
            if spec.role != "linear":
                out[spec.name] = (None, "ModelOpt quantizes linears only")
            elif entry is not None:
                out[spec.name] = (None, f"exclude {entry!r}")
            else:
                out[spec.name] = (self.parsed.fmt, f"quant_algo {algo}, not excluded")
        return out

    def dead_entries(self, specs: list[ModuleSpec], start_layer_id: int | None) -> list[str]:
        return []  # ModelOpt excludes norms and embeddings by name too: an unused entry is no mistake


def _parse(quantization_config: Mapping[str, Any]) -> _Config | _ModelOptConfig:
    """The config's reader: ModelOpt's or compressed-tensors'."""
    if modelopt.is_modelopt(quantization_config):
        return _ModelOptConfig.parse(quantization_config)
    return _Config.parse(quantization_config)


def config_formats(quantization_config: Mapping[str, Any]) -> tuple[str, set[str]]:
    """``(encoding, formats)`` a quantization config names, read without its checkpoint (what vLLM
    needs kernels for). Raises :class:`QuantPlanError` for a config no reader takes."""
    parsed = _parse(quantization_config)
    if isinstance(parsed, _ModelOptConfig):
        return modelopt.ENCODING, {parsed.parsed.fmt}
    return "compressed-tensors", {fmt for _, fmt in parsed.targets}


def _disagreement(spec: ModuleSpec, stored: str | None, said: str | None, why: str) -> Finding:
    """The conflict between ``stored`` (:func:`_shown`) and what the config ``said``, with its fix."""
    if stored is None:
        if spec.kind not in QUANTIZABLE_KINDS:
            return Finding(
                f"{spec.name}: quantization_config quantizes it as {said} ({why}), but "
                f"{why_unquantized(spec.kind)}, so it is stored BF16 and must stay so",
                f"add {spec.name!r} to quantization_config's ignore",
            )
        return Finding(
            f"{spec.name} is stored BF16, but quantization_config quantizes it as {said} ({why})",
            f"add {spec.name!r} to its ignore list, or {_FIX_SHARDS}",
        )
    if said is None:
        return Finding(
            f"{spec.name} is stored as {stored}, but quantization_config leaves it unquantized ({why})",
            _FIX_SHARDS,
        )
    return Finding(
        f"{spec.name} is stored as {stored}, but quantization_config says {said} ({why})",
        _FIX_SHARDS,
    )


def resolve(
    config: K3DSparkConfig, quantization_config: Mapping[str, Any] | None, dtypes: Mapping[str, str]
) -> QuantPlan:
    """The quantization plan of a checkpoint: ``dtypes`` is ``{tensor key: safetensors dtype}`` from its headers.

    Raises :class:`QuantPlanError` when config and tensors conflict (see the module docstring).
    """
    specs = checkpoint_modules(config)
    stray = tuple(sorted(k for k in dtypes if is_stray(k, config)))
    stored = _stored_plan(specs, {k: v for k, v in dtypes.items() if k not in stray})
    _check_storage(specs, stored)
    known = {name: fmt for name, fmt in stored.items() if fmt != "?"}
    quantized = {name: fmt for name, fmt in known.items() if fmt is not None}
    if quantization_config is None:
        if quantized:
            name, fmt = next(iter(quantized.items()))
            raise QuantPlanError(
                Finding(
                    f"{name} is stored as {_shown(fmt)} ({len(quantized)} quantized modules), but "
                    "config.json has no quantization_config",
                    _FIX_SHARDS,
                )
            )
        return QuantPlan(stray=stray)

    parsed = _parse(quantization_config)
    encoding = modelopt.ENCODING if isinstance(parsed, _ModelOptConfig) else "compressed-tensors"
    start = getattr(config, "target_num_hidden_layers", None)

    def reading(lenient: Mapping[str, str]) -> tuple[dict[str, str], list[Finding]]:
        """The plan as the config reads (``lenient`` entries as regexes), and its conflicts with the tensors."""
        said = parsed.plan(specs, start, lenient)
        conflicts = [
            _disagreement(s, _shown(known[s.name]), *said[s.name])
            for s in specs
            if s.name in known and not _agrees(known[s.name], said[s.name][0], encoding)
        ]
        return {name: said[name][0] for name in quantized}, conflicts

    modules, strict = reading({})
    warning = None
    if strict:
        readings = {
            e: r for e in parsed.dead_entries(specs, start) if (r := _lenient(e)) is not None
        }
        # Served as the lenient reading says, if that agrees with the tensors (none: the same conflicts).
        modules, conflicts = reading({e: regex for e, (regex, _) in readings.items()})
        if conflicts:
            more = f" (and {len(strict) - 1} more module(s))" if len(strict) > 1 else ""
            raise QuantPlanError(
                Finding(
                    f"quantization_config and the stored tensors disagree: {strict[0].problem}{more}",
                    strict[0].fix,
                )
            )
        warning = _rewrite_warning(readings, [n for s in specs for n in _names(s, start)])
    return QuantPlan(modules, encoding=encoding, warning=warning, stray=stray)


def config_plan(config: K3DSparkConfig, quantization_config: Mapping[str, Any] | None) -> QuantPlan:
    """The plan to build a drafter by before its tensors are read: the config's reading, lenient
    (with :func:`resolve`'s warning) where entries that match nothing change it.

    Modules vLLM cannot serve so are built as it can: norms and heads unquantized, a fused layer in
    its quantized member's format. :func:`resolve` over the stored dtypes then refuses such a config.
    """
    if quantization_config is None:
        return QuantPlan()
    specs = checkpoint_modules(config)
    parsed = _parse(quantization_config)
    encoding = modelopt.ENCODING if isinstance(parsed, _ModelOptConfig) else "compressed-tensors"
    start = getattr(config, "target_num_hidden_layers", None)
    readings = {e: r for e in parsed.dead_entries(specs, start) if (r := _lenient(e)) is not None}
    strict, lenient = (
        {name: fmt for name, (fmt, _) in parsed.plan(specs, start, regexes).items()}
        for regexes in ({}, {e: regex for e, (regex, _) in readings.items()})
    )
    warning = None
    if lenient != strict:
        warning = _rewrite_warning(readings, [n for s in specs for n in _names(s, start)])
    modules = {s.name: lenient[s.name] for s in specs if lenient[s.name] and s.quantizable}
    for members in fused_module_groups(lenient).values():
        fmt = next((modules[m] for m in members if m in modules), None)
        modules.update(dict.fromkeys(members, fmt) if fmt else {})
    return QuantPlan(modules, encoding=encoding, warning=warning)


def _rewrite_warning(readings: Mapping[str, tuple[str, str]], names: list[str]) -> Finding:
    """The warning that lenient ``readings`` (``{entry: (regex, rewrite)}``) served the build, naming the
    rewrite of each entry that matches one of ``names``."""
    listed = ", ".join(
        f"{json.dumps(e)} -> {json.dumps(rewrite)}"
        for e, (regex, rewrite) in readings.items()
        if any(re.fullmatch(regex, n) for n in names)
    )
    return Finding(
        "quantization_config has entries that match no module under compressed-tensors' "
        "rules (exact module names or 're:' regexes); read as suffixes or globs they "
        "describe the stored tensors, so the drafter is served as stored",
        f"rewrite them: {listed}",
        severity="warning",
    )


def _agrees(stored: tuple[str, ...] | None, said: str | None, encoding: str) -> bool:
    if stored is None or said is None:
        return stored is None and said is None
    also = modelopt.ALSO_STORED_AS.get(said) if encoding == modelopt.ENCODING else None
    return said in stored or also in stored


def declared(config: K3DSparkConfig, quantization_config: Mapping[str, Any]) -> dict[str, str]:
    """``{module: fmt}`` that ``quantization_config`` alone quantizes, read strictly (what the tensors must hold)."""
    said = _parse(quantization_config).plan(
        checkpoint_modules(config), getattr(config, "target_num_hidden_layers", None), {}
    )
    return {name: fmt for name, (fmt, _) in said.items() if fmt is not None}


def vllm_quantization_config(
    plan: QuantPlan, config: K3DSparkConfig, *, start_layer_id: int, prefix: str = "model"
) -> dict[str, Any] | None:
    """The config vLLM serves ``plan`` with, naming modules by their runtime names. None if nothing is quantized.

    compressed-tensors: one config group per format, exact runtime names of the quantized modules
    (vLLM's fused layers match through their shards with ``packed_modules_mapping``), no ignore list,
    no class targets. ModelOpt: its one quant_algo, excluding the exact runtime names of the rest.
    """
    if not plan.modules:
        return None
    specs = checkpoint_modules(config)
    if plan.encoding == modelopt.ENCODING:
        (fmt,) = set(plan.modules.values())
        bf16 = [
            runtime_name(s, start_layer_id, prefix)
            for s in specs
            if s.role == "linear" and s.name not in plan.modules
        ]
        return modelopt.quantization_config(fmt, bf16)
    targets: dict[str, list[str]] = {}
    for spec in specs:
        if spec.name in plan.modules:
            targets.setdefault(plan.modules[spec.name], []).append(
                runtime_name(spec, start_layer_id, prefix)
            )
    return quant_config.compressed_tensors_config(targets, ignore=[])
