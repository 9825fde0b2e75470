# SPDX-License-Identifier: Apache-2.0
"""Drafters in every format: the FP32 reference, and BF16-computed variants (formats made on the fly
or quantized checkpoints) checked to be builds of it; what ``eval`` and ``accept`` compare."""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_dspark.checkpoint import formats, quant_config
from vllm_dspark.checkpoint.layout import (
    ABSORBED_KINDS,
    FP8_RECIPE,
    TARGET_DIR,
    checkpoint_modules,
    fused_module_groups,
    module_kind,
    tensor_shapes,
)
from vllm_dspark.checkpoint.store import (
    input_quantizers,
    load_drafter_state_dict,
    load_target_heads,
    resolve_checkpoint,
)
from vllm_dspark.config import K3DSparkConfig
from vllm_dspark.drift import builtin_variants, on_the_fly_variants
from vllm_dspark.findings import Finding, FindingError
from vllm_dspark.reference.drafter import ReferenceDrafter


@dataclass
class Heads:
    embed: torch.Tensor
    lm_head: torch.Tensor


def load_reference(
    model: str, *, target: str | None = None, device: str = "cpu"
) -> tuple[K3DSparkConfig, ReferenceDrafter, Heads]:
    """The FP32 reference, refusing a quantized ``--model`` (it would not be a reference);
    ``target``: where the shared heads are (default ``model/target``)."""
    if resolve_checkpoint(model).modules:
        raise ValueError(
            f"{model} is quantized; --model must be the unquantized drafter the reference is built "
            "from. Pass quantized checkpoints as --variants."
        )
    config, state_dict = load_drafter_state_dict(model, dtype=None)
    state_dict.pop(
        "embed_tokens.weight", None
    )  # the target's embedding is used; free the drafter's copy now
    embed, lm_head = load_target_heads(target or str(Path(model) / TARGET_DIR), dtype=None)
    heads = Heads(embed.to(device), lm_head.to(device))
    reference = ReferenceDrafter.from_state_dict(
        config,
        state_dict,
        embed_tokens=heads.embed,
        lm_head=heads.lm_head,
        compute_dtype=torch.float32,
        device=device,
    )
    return config, reference, heads


def quantize_on_the_fly(
    state_dict: dict[str, torch.Tensor], config: K3DSparkConfig, fmt: str, include: Sequence[str]
) -> list[str]:
    """Replace, in place, each included linear's weight by its ``fmt`` round trip; returns the modules.

    Fused groups (gate/up per layer; q_a/kv_a across layers) share one scale where vLLM fuses them
    under one (NVFP4's global scale, fp8-static's per-tensor scale), as the quantizer writes.
    """
    kinds = quant_config.validate_include_kinds(include, fmt, config)
    quant = formats.get(fmt)
    modules = [s.name for s in checkpoint_modules(config) if s.kind in kinds]
    global_scales: dict[str, torch.Tensor] = {}
    if quant.fused_shares_scale:
        for members in fused_module_groups(modules).values():
            scale = quant.shared_global_scale(state_dict[f"{m}.weight"] for m in members)
            global_scales.update(dict.fromkeys(members, scale))
    for name in modules:
        key = f"{name}.weight"
        weight = state_dict[key]
        state_dict[key] = quant.fake_quantize(weight, global_scale=global_scales.get(name)).to(
            weight.dtype
        )
    return modules


def variant_label(name: str) -> str:
    return name if name in builtin_variants() else Path(name).name


def check_same_model(
    name: str,
    state_dict: dict[str, torch.Tensor],
    quantized: Container[str],
    reference: ReferenceDrafter,
) -> None:
    """Refuse a variant whose unquantized tensors (modules not in ``quantized``) differ from the reference's.

    Compared in the variant's loaded dtype, to which both sides were cast the same way.
    """
    ours = reference.state_dict()
    differ = [
        key
        for key, tensor in state_dict.items()
        if key.rpartition(".")[0] not in quantized
        and key in ours
        and not torch.equal(tensor, ours[key].to(tensor.device, tensor.dtype))
    ]
    if differ:
        raise FindingError(
            Finding(
                f"variant {name} is not a build of the reference: {len(differ)} unquantized tensor(s) differ "
                f"from the reference's ({', '.join(differ[:3])}{', ...' if len(differ) > 3 else ''})",
                "quantize the --model checkpoint itself, or pass the --model it was quantized from",
            )
        )


def load_variant(
    name: str,
    model: str,
    config: K3DSparkConfig,
    heads: Heads,
    reference: ReferenceDrafter,
    *,
    include_layers: Sequence[str] = FP8_RECIPE,
    device: str = "cpu",
) -> tuple[ReferenceDrafter, str]:
    """Variant ``name`` of the drafter in ``model`` (a format made on the fly, or a checkpoint
    directory), BF16-computed, and a description of where its weights came from."""
    if name in on_the_fly_variants():
        _, state_dict = load_drafter_state_dict(model, dtype=torch.bfloat16)
        state_dict.pop("embed_tokens.weight", None)
        source = f"{model} in BF16"
        if name != "bf16":
            modules = quantize_on_the_fly(state_dict, config, name, include_layers)
            source = f"{model}, {len(modules)} modules quantized to {name} on the fly, dequantized to BF16"
    elif Path(name).is_dir():
        variant_config, state_dict = load_drafter_state_dict(name, dtype=torch.bfloat16)
        state_dict.pop("embed_tokens.weight", None)
        if tensor_shapes(variant_config) != tensor_shapes(config):
            raise ValueError(
                f"variant {name} is not a build of {model}: its config implies different shapes"
            )
        plan = resolve_checkpoint(name)
        check_same_model(name, state_dict, plan.modules, reference)
        stored = sorted(set(plan.modules.values()))
        source = f"checkpoint {name} ({'quantized: ' + ', '.join(stored) if stored else 'unquantized'}), in BF16"
    else:
        raise ValueError(
            f"unknown variant {name!r}: use one of {', '.join(builtin_variants())} "
            "or a checkpoint directory"
        )
    drafter = ReferenceDrafter.from_state_dict(
        config,
        state_dict,
        embed_tokens=heads.embed,
        lm_head=heads.lm_head,
        compute_dtype=torch.bfloat16,
        device=device,
    )
    if name in on_the_fly_variants() and name != "bf16":
        _quantize_inputs(drafter, name, modules)
    elif Path(name).is_dir():
        drafter.quantize_inputs(input_quantizers(name))
    return drafter, source


def _quantize_inputs(drafter: ReferenceDrafter, fmt: str, modules: Sequence[str]) -> None:
    """Give an on-the-fly W8A8 / W4A4 variant's linears the input quantization its build would have:
    the format's scheme and calibration-free static scale (absorbed modules excepted, as served)."""
    quant = formats.get(fmt)
    if quant.activation is None:
        return
    (scale,) = quant.input_scales().values() or (None,)
    scale = None if scale is None else scale.float().reshape(())
    drafter.quantize_inputs(
        {m: (quant.activation, scale) for m in modules if module_kind(m) not in ABSORBED_KINDS}
    )
