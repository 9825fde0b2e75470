# SPDX-License-Identifier: Apache-2.0
"""Ways real compressed-tensors builds write the ``quantization_config`` of one set of quantized tensors.

Each encoding rewrites the targets and ignore list of a build made by ``vllm-dspark quantize`` (whose
own encoding is index-agnostic ``re:`` patterns) so that it describes the same stored tensors the way
another exporter would. ``SERVED`` are read as compressed-tensors defines them; ``WARNED`` are outside
that spec but the tensors say what was meant; ``REFUSED`` really contradict the tensors.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from vllm_dspark.checkpoint.layout import checkpoint_modules, kind_regex
from vllm_dspark.config import K3DSparkConfig

# (config.json, quantized kinds) -> (targets, ignore)
Encoding = Callable[[dict, list[str]], tuple[list[str], list[str]]]


def _specs(config: dict):
    return checkpoint_modules(
        K3DSparkConfig(**{k: v for k, v in config.items() if k != "quantization_config"})
    )


def _names(
    config: dict,
    kinds: list[str],
    *,
    quantized: bool,
    prefix: str = "",
    runtime: bool = False,
    linears_only: bool = False,
) -> list[str]:
    start = config["target_num_hidden_layers"]
    out = []
    for s in _specs(config):
        if (s.kind in kinds) != quantized or (linears_only and s.role != "linear"):
            continue
        out.append(
            prefix
            + (f"layers.{start + s.layer}.{s.kind}" if runtime and s.layer is not None else s.name)
        )
    return out


def literal(config, kinds):
    return _names(config, kinds, quantized=True), _names(config, kinds, quantized=False)


def model_prefix(config, kinds):
    return (
        _names(config, kinds, quantized=True, prefix="model."),
        _names(config, kinds, quantized=False, prefix="model."),
    )


def runtime_index(config, kinds):
    return (
        _names(config, kinds, quantized=True, prefix="model.", runtime=True),
        _names(config, kinds, quantized=False, prefix="model.", runtime=True),
    )


def linear_class_with_ignore(config, kinds):
    return ["Linear"], _names(config, kinds, quantized=False)


def linear_class_ignore_linears_and_lm_head(config, kinds):
    return ["Linear"], [*_names(config, kinds, quantized=False, linears_only=True), "lm_head"]


def regex_targets_literal_ignore(config, kinds):
    return [kind_regex(k) for k in kinds], _names(config, kinds, quantized=False)


def literal_targets_no_ignore(config, kinds):
    return _names(config, kinds, quantized=True), []


def broad_targets_overlapping_ignore(config, kinds):
    # Every projection, with the unquantized ones ignored: compressed-tensors lets ignore win.
    return [r"re:.*proj$", r"re:.*_w2$"], _names(config, kinds, quantized=False)


def include_layer_suffixes(config, kinds):
    # As the card's command line writes them (--include-layers mlp.gate_proj ...): no module has these names.
    return list(kinds), ["lm_head"]


def quantizes_a_bf16_module(config, kinds):
    targets, ignore = regex_targets_literal_ignore(config, kinds)
    ignore.remove("layers.0.self_attn.kv_b_proj")
    return [*targets, kind_regex("self_attn.kv_b_proj")], ignore


def leaves_an_fp8_module_out(config, kinds):
    targets, ignore = literal(config, kinds)
    targets.remove("layers.1.mlp.down_proj")
    return targets, [*ignore, "layers.1.mlp.down_proj"]


def splits_a_fused_pair(config, kinds):
    targets, ignore = literal(config, kinds)
    targets.remove("layers.0.mlp.up_proj")
    return targets, ignore


def linear_class_quantizes_the_markov_head(config, kinds):
    targets, ignore = linear_class_with_ignore(config, kinds)
    return targets, [name for name in ignore if name != "markov_head.markov_w2"]


def quantizes_a_norm(config, kinds):
    targets, ignore = literal(config, kinds)
    ignore.remove("final_norm")
    return [*targets, "final_norm"], ignore


SERVED: dict[str, Encoding] = {
    "literal": literal,
    "model-prefix": model_prefix,
    "runtime-index": runtime_index,
    "linear-class": linear_class_with_ignore,
    "linear-class-lm-head": linear_class_ignore_linears_and_lm_head,
    "regex-targets": regex_targets_literal_ignore,
    "literal-no-ignore": literal_targets_no_ignore,
    "broad-overlap": broad_targets_overlapping_ignore,
}
WARNED: dict[str, Encoding] = {"include-layer-suffixes": include_layer_suffixes}
REFUSED: dict[str, tuple[Encoding, str]] = {
    "quantizes-bf16": (quantizes_a_bf16_module, "layers.0.self_attn.kv_b_proj"),
    "leaves-fp8-out": (leaves_an_fp8_module_out, "layers.1.mlp.down_proj"),
    "splits-fused": (splits_a_fused_pair, "layers.0.mlp.up_proj"),
    "markov-head": (linear_class_quantizes_the_markov_head, "markov_head.markov_w2"),
    "norm": (quantizes_a_norm, "final_norm"),
}


def encoded(source: Path, dest: Path, encoding: Encoding, kinds: list[str]) -> Path:
    """A copy of build ``source`` (weights linked) whose quantization_config is written as ``encoding``."""
    dest.mkdir(parents=True)
    for path in source.iterdir():
        if path.name != "config.json":
            (dest / path.name).symlink_to(path.resolve(), target_is_directory=path.is_dir())
    config = json.loads((source / "config.json").read_text())
    qc = config["quantization_config"]
    (group,) = qc["config_groups"].values()
    group["targets"], qc["ignore"] = encoding(config, kinds)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest
