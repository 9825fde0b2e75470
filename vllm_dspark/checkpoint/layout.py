# SPDX-License-Identifier: Apache-2.0
"""The on-disk layout every part reads: module names, HF keys and shapes, quantizable kinds and fused groups,
as the published checkpoint has them (68 tensors for the real config)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from vllm_dspark.config import K3DSparkConfig

Role = Literal["linear", "norm", "embedding"]

# Where a drafter directory keeps the target's shared embedding and lm_head (make-random writes it).
TARGET_DIR = "target"
TARGET_HEADS = f"{TARGET_DIR}/model.safetensors"

# Modules inside every ``layers.{i}`` block, in checkpoint order.
LAYER_KINDS: tuple[str, ...] = (
    "input_layernorm",
    "self_attn.q_a_proj",
    "self_attn.q_a_layernorm",
    "self_attn.q_b_proj",
    "self_attn.kv_a_proj_with_mqa",
    "self_attn.kv_a_layernorm",
    "self_attn.kv_b_proj",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)

# Modules outside the layers. ``embed_tokens`` is the target's embedding, shipped in the drafter
# checkpoint for convenience; the served model shares the target's instead of loading it.
# ``fc_norm`` (one RMSNorm per target tap, ``fc_norm.{i}``) exists only where config.json says fc_norm.
GLOBAL_KINDS: tuple[str, ...] = (
    "embed_tokens",
    "fc_norm",
    "context_proj",
    "context_norm",
    "final_norm",
    "markov_head.markov_w1",
    "markov_head.markov_w2",
    "confidence_head.proj",
)

# Linear modules that a weight-only format can hold. Everything else (norms, embeddings, the
# Markov head that runs once per drafted position, the fp32 confidence head) stays BF16.
QUANTIZABLE_KINDS: tuple[str, ...] = (
    "context_proj",
    "self_attn.q_a_proj",
    "self_attn.q_b_proj",
    "self_attn.kv_a_proj_with_mqa",
    "self_attn.kv_b_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


# The formats, by ``--quant-format`` name, one line each (``formats.REGISTRY`` holds one
# class per name; the command line reads this without importing torch).
QUANT_FORMATS: dict[str, str] = {
    "fp8": "fp8 per-channel: E4M3 per output channel",
    "fp8-dynamic": "fp8-dynamic: W8A8, fp8 weights, E4M3 inputs per token (dynamic)",
    "fp8-static": "fp8-static: W8A8, E4M3 per tensor, static input_scale",
    "fp8-block": "fp8-block: W8A8, E4M3 per 128x128 weight block, inputs per 128-group (dynamic)",
    "mxfp4": "mxfp4: E2M1, groups of 32, E8M0 scales",
    "nvfp4": "nvfp4: E2M1, groups of 16, E4M3 scales + a global scale",
    "nvfp4-w4a4": "nvfp4-w4a4: W4A4, nvfp4 weights and inputs (static input global scale)",
}
# What ``quantize`` writes beside the checkpoint: REPORT_NAME.json and REPORT_NAME.md.
REPORT_NAME = "quantization_report"


def why_unquantized(kind: str) -> str:
    """Why a kind outside :data:`QUANTIZABLE_KINDS` stays BF16, as a clause."""
    if kind == "markov_head.markov_w2":
        return "the Markov head's bias reaches every drafted token's logits, and vLLM builds it without a quant config"
    if kind == "confidence_head.proj":
        return "the confidence head runs in fp32 and decides draft lengths"
    if kind in ("embed_tokens", "markov_head.markov_w1"):
        return "it is an embedding table (a row lookup, not a matmul)"
    return "it is a norm (tiny, and it sets the scale of everything after it)"


# vLLM fuses these checkpoint modules into one runtime layer, so each group must share one
# quantization decision (and, for NVFP4, one global scale).
FUSED_GROUPS: dict[str, tuple[str, ...]] = {
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "self_attn.fused_qkv_a_proj": ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
}
# vLLM's K3 drafter builds ``context_kv_proj`` by stacking every layer's kv_a_proj_with_mqa, so
# this fused group spans all layers: one NVFP4 global scale for every layer's q_a and kv_a.
_CROSS_LAYER_FUSED = "self_attn.fused_qkv_a_proj"

# The modules quantized in the published FP8 build (its --include-layers).
FP8_RECIPE: tuple[str, ...] = (
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "self_attn.o_proj",
    "self_attn.q_b_proj",
    "context_proj",
)

# vLLM's MLA absorbs these into the query and output: their dequantized weight is used and their
# input is never quantized, so a W8A8 format quantizes only their weights.
ABSORBED_KINDS: tuple[str, ...] = ("self_attn.kv_b_proj",)

# Named --include-layers choices: the published build's set, and ModelOpt's (every linear but the heads).
MODULE_SETS: dict[str, tuple[str, ...]] = {"recipe": FP8_RECIPE, "modelopt": QUANTIZABLE_KINDS}

# Tensors a checkpoint may leave out: Kimi-K3.1-Pro-DSpark-preview ships no embedding (the target's is used).
OPTIONAL_KEYS = frozenset({"embed_tokens.weight"})

_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_TAP_RE = re.compile(r"^fc_norm\.\d+$")


@dataclass(frozen=True)
class ModuleSpec:
    """One checkpoint module: ``name`` is the HF prefix of its tensors (``layers.0.mlp.up_proj``)."""

    name: str
    kind: str
    role: Role
    shape: tuple[
        int, ...
    ]  # weight shape: (out, in) for linears, (n,) for norms, (rows, dim) for embeddings
    bias: bool = False

    @property
    def layer(self) -> int | None:
        m = _LAYER_RE.match(self.name)
        return int(m.group(1)) if m else None

    @property
    def quantizable(self) -> bool:
        return self.kind in QUANTIZABLE_KINDS


def module_kind(name: str) -> str:
    """Index-agnostic kind of a module name: ``layers.3.mlp.up_proj`` -> ``mlp.up_proj``.

    Also accepts vLLM runtime names (``model.layers.96.mlp.up_proj``, ``model.context_proj``).
    """
    if name.startswith("model."):
        name = name[len("model.") :]
    if _TAP_RE.match(name):
        return "fc_norm"
    m = _LAYER_RE.match(name)
    return m.group(2) if m else name


def runtime_name(spec: ModuleSpec, start_layer_id: int, prefix: str = "model") -> str:
    """The name vLLM gives checkpoint module ``spec``: draft layers are numbered after the target's."""
    if spec.layer is None:
        return f"{prefix}.{spec.name}"
    return f"{prefix}.layers.{start_layer_id + spec.layer}.{spec.kind}"


def kind_regex(kind: str) -> str:
    """A compressed-tensors ``re:`` pattern matching ``kind`` at any layer index and any prefix.

    Index-agnostic on purpose: vLLM renumbers draft layers after the target's (93-97 for K3), so
    names such as ``layers.0.mlp.up_proj`` would never match at runtime.
    """
    escaped = re.escape(kind)
    if kind in LAYER_KINDS:
        return rf"re:.*layers\.\d+\.{escaped}$"
    return rf"re:(.*\.)?{escaped}$"


def checkpoint_modules(config: "K3DSparkConfig") -> list[ModuleSpec]:
    """Every module with weights that a checkpoint for ``config`` holds, in checkpoint order."""
    c = config
    h = c.hidden_size
    heads = c.num_attention_heads
    latent = c.kv_latent_dim
    per_layer: dict[str, tuple[Role, tuple[int, ...]]] = {
        "input_layernorm": ("norm", (h,)),
        "self_attn.q_a_proj": ("linear", (c.q_lora_rank, h)),
        "self_attn.q_a_layernorm": ("norm", (c.q_lora_rank,)),
        "self_attn.q_b_proj": (
            "linear",
            (heads * (c.qk_nope_head_dim + c.qk_rope_head_dim), c.q_lora_rank),
        ),
        "self_attn.kv_a_proj_with_mqa": ("linear", (latent, h)),
        "self_attn.kv_a_layernorm": ("norm", (c.kv_lora_rank,)),
        "self_attn.kv_b_proj": (
            "linear",
            (heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        ),
        "self_attn.o_proj": ("linear", (h, heads * c.v_head_dim)),
        "post_attention_layernorm": ("norm", (h,)),
        "mlp.gate_proj": ("linear", (c.intermediate_size, h)),
        "mlp.up_proj": ("linear", (c.intermediate_size, h)),
        "mlp.down_proj": ("linear", (h, c.intermediate_size)),
    }
    assert tuple(per_layer) == LAYER_KINDS
    confidence_in = h + (c.markov_rank if c.confidence_head_with_markov else 0)
    globals_: dict[str, tuple[Role, tuple[int, ...], bool]] = {
        "embed_tokens": ("embedding", (c.vocab_size, h), False),
        "fc_norm": ("norm", (c.target_hidden_size,), False),
        "context_proj": ("linear", (h, c.target_hidden_size * c.num_target_layers), False),
        "context_norm": ("norm", (h,), False),
        "final_norm": ("norm", (h,), False),
        "markov_head.markov_w1": ("embedding", (c.vocab_size, c.markov_rank), False),
        "markov_head.markov_w2": ("linear", (c.draft_vocab_size, c.markov_rank), False),
        "confidence_head.proj": ("linear", (1, confidence_in), True),
    }
    assert tuple(globals_) == GLOBAL_KINDS
    specs = [ModuleSpec("embed_tokens", "embed_tokens", *globals_["embed_tokens"])]
    if c.fc_norm:
        specs += [
            ModuleSpec(f"fc_norm.{i}", "fc_norm", *globals_["fc_norm"])
            for i in range(c.num_target_layers)
        ]
    specs += [ModuleSpec(k, k, *globals_[k]) for k in ("context_proj", "context_norm")]
    for i in range(c.num_hidden_layers):
        specs += [
            ModuleSpec(f"layers.{i}.{k}", k, role, shape) for k, (role, shape) in per_layer.items()
        ]
    tail = ["final_norm", "markov_head.markov_w1", "markov_head.markov_w2"]
    if c.enable_confidence_head:
        tail.append("confidence_head.proj")
    specs += [ModuleSpec(k, k, *globals_[k]) for k in tail]
    return specs


def stored_modules(config: "K3DSparkConfig", keys: Iterable[str]) -> list[ModuleSpec]:
    """:func:`checkpoint_modules` less the optional ones whose weight is not among ``keys``."""
    keys = set(keys)
    return [
        s
        for s in checkpoint_modules(config)
        if f"{s.name}.weight" in keys or f"{s.name}.weight" not in OPTIONAL_KEYS
    ]


def tensor_shapes(config: "K3DSparkConfig") -> dict[str, tuple[int, ...]]:
    """``{key: shape}`` of the unquantized (BF16) checkpoint for ``config``."""
    shapes: dict[str, tuple[int, ...]] = {}
    for spec in checkpoint_modules(config):
        shapes[f"{spec.name}.weight"] = spec.shape
        if spec.bias:
            shapes[f"{spec.name}.bias"] = (spec.shape[0],)
    return shapes


def validate_fused_decision(quantized_kinds: set[str]) -> None:
    """Raise ``ValueError`` if a fused group would get two different quantization decisions."""
    for fused, members in FUSED_GROUPS.items():
        chosen = [m for m in members if m in quantized_kinds]
        if chosen and len(chosen) != len(members):
            missing = [m for m in members if m not in quantized_kinds]
            raise ValueError(
                f"{' and '.join(members)} are fused into {fused} at runtime and must be quantized together: "
                f"{', '.join(chosen)} is quantized but {', '.join(missing)} is not. "
                f"Include both or neither."
            )


def fused_module_groups(module_names: Iterable[str]) -> dict[str, list[str]]:
    """``{runtime fused layer: its checkpoint modules}`` for the modules vLLM fuses into one layer.

    Each group takes one quantization decision and, for NVFP4, one global scale. gate_proj and
    up_proj pair up per layer (``layers.3.mlp.gate_up_proj``); q_a_proj and kv_a_proj_with_mqa form
    one group across all layers (``self_attn.fused_qkv_a_proj``), because the K3 drafter's
    context_kv_proj stacks every layer's kv_a_proj_with_mqa into one more fused layer.
    """
    groups: dict[str, list[str]] = {}
    for name in module_names:
        kind = module_kind(name)
        for fused, members in FUSED_GROUPS.items():
            if kind in members:
                key = (
                    fused if fused == _CROSS_LAYER_FUSED else name[: len(name) - len(kind)] + fused
                )
                groups.setdefault(key, []).append(name)
    return {fused: names for fused, names in groups.items() if len(names) > 1}
