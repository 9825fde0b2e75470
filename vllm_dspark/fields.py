# SPDX-License-Identifier: Apache-2.0
"""The drafter's config.json contract: identity, required fields, defaults and validation, without transformers."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any, NoReturn

from vllm_dspark.findings import Finding, FindingError

# The latent the Kimi-K3 target stores per token in its MLA KV pages: kv_lora_rank 512 + rope 64.
K3_KV_LATENT_DIM = 576

# The only DSpark architecture vLLM does not rewrite to DeepSeek-V4's.
ARCHITECTURE = "K3DSparkModel"
# vLLM hard-codes this string to detect an MLA model (use_mla).
MODEL_TYPE = "k3_dspark"

# The MLA shape, which the draft's latent pages share with the target's cache.
MLA_FIELDS = (
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
# A model's geometry: what the tensors' shapes follow from.
GEOMETRY_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "vocab_size",
    *MLA_FIELDS,
)
# Fields a drafter's config.json must state: DeepseekV3Config would otherwise default them to its own
# (MoE model's) values, and the drafter would fail with dozens of shape errors, or load wrong.
REQUIRED_FIELDS = (
    *GEOMETRY_FIELDS,
    "max_position_embeddings",
    "rms_norm_eps",
    "target_hidden_size",
    "num_target_layers",
    "target_layer_ids",
    "mask_token_id",
    "markov_rank",
)

# What the tools that draft without vLLM (draft, eval, accept) use when config.json has no block_size;
# vLLM's block is num_speculative_tokens, which falls back to block_size only when unset.
DEFAULT_DRAFT_BLOCK = 7

DEFAULT_ROPE_THETA = 50000.0
YARN_REQUIRED_KEYS = ("factor", "original_max_position_embeddings")
YARN_DEFAULTS = {"beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


# Unset or null fields take these; DeepseekV3Config's MoE defaults are zeroed so vLLM sees a dense drafter.
DEFAULTS: dict[str, Any] = {
    "n_routed_experts": 0,
    "n_shared_experts": 0,
    "num_experts_per_tok": 0,
    "num_mtp_layers": 0,
    "mla_use_nope": False,
    "mla_use_output_gate": False,
    "mla_use_qk_norm": False,
    "dspark_bonus_anchor": False,
    "hidden_act": "silu",
    "target_kv_latent_dim": K3_KV_LATENT_DIM,
    "markov_head_type": "vanilla",
    "enable_confidence_head": False,
    "confidence_head_with_markov": False,
    "logit_scale": 1.0,
    "sample_from_anchor": True,
    # lightseekorg's drafter: one RMSNorm per target tap ahead of context_proj (TokenSpeed's kimi_k3_dspark.py).
    "fc_norm": False,
    # Which of the Kimi-K3 target's streams the taps read: the residual prefix, or AttnRes's mixture.
    "aux_hidden_stream": "prefix",
}

# Unset validated_context_len: this many YaRN original windows, where the published drafter's
# acceptance starts to fall (tokenspeed#1132: 5.62 at 4K, 1.0 at 131K; original window 32768).
VALIDATED_CONTEXT_WINDOWS = 3

AUX_HIDDEN_STREAMS = ("prefix", "attn_res")


def with_defaults(
    fields: Mapping[str, Any], rope_theta: float = DEFAULT_ROPE_THETA
) -> dict[str, Any]:
    """``fields`` with every unset or null default filled and the rope block normalised."""
    out = dict(fields)
    derived = {
        "num_key_value_heads": out.get("num_attention_heads"),
        "draft_vocab_size": out.get("vocab_size"),
    }
    for key, value in {**DEFAULTS, **derived}.items():
        if out.get(key) is None:
            out[key] = value
    # vLLM reads dspark_block_size where block_size is absent (DSparkSpeculatorConfig).
    out.setdefault("block_size", out.get("dspark_block_size"))
    out["rope_parameters"] = _normalise_rope(out.get("rope_parameters"), rope_theta)
    return out


def validated_context_len(raw: Mapping[str, Any]) -> int | None:
    """The context a drafter's acceptance holds to: ``validated_context_len``, else
    :data:`VALIDATED_CONTEXT_WINDOWS` × YaRN's ``original_max_position_embeddings`` (None without YaRN)."""
    if raw.get("validated_context_len") is not None:
        return raw["validated_context_len"]
    rope = raw.get("rope_parameters") or {}
    original = rope.get("original_max_position_embeddings") if isinstance(rope, Mapping) else None
    return None if original is None else VALIDATED_CONTEXT_WINDOWS * int(original)


class KVLatent:
    """What a drafter config implies beyond its stated fields: the per-token latent, the block."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    block_size: int | None

    @property
    def kv_latent_dim(self) -> int:
        """Elements per token in the MLA latent cache: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def causal(self) -> bool:
        """Whether the block attends causally: ``is_causal``, else ``dflash_config.causal``, else not,
        as vLLM's ``_dflash_layer_causal`` resolves it (K3 drafters have no ``layer_types``)."""
        return block_is_causal(self)

    @property
    def draft_block_size(self) -> int:
        """The block drafted without vLLM: ``block_size`` when stated, else :data:`DEFAULT_DRAFT_BLOCK`."""
        return self.block_size or DEFAULT_DRAFT_BLOCK


def block_is_causal(c: Any) -> bool:
    """:attr:`KVLatent.causal` of any config-like object (vLLM's resolution order)."""
    explicit = getattr(c, "is_causal", None)
    if explicit is not None:
        return bool(explicit)
    override = (getattr(c, "dflash_config", None) or {}).get("causal")
    return bool(override) if override is not None else False


class DrafterFields(KVLatent, types.SimpleNamespace):
    """A validated config.json as attributes: what the checkpoint tools need, without transformers."""


def parse_fields(raw: Mapping[str, Any]) -> DrafterFields:
    """``raw`` (a drafter's config.json) checked and defaulted as ``K3DSparkConfig`` does it."""
    check_identity(raw)
    fields = DrafterFields(**with_defaults(raw, raw.get("rope_theta", DEFAULT_ROPE_THETA)))
    fields.rope_theta = float(fields.rope_parameters["rope_theta"])
    validate_config(fields)
    return fields


def _normalise_rope(rope: Mapping[str, Any] | None, rope_theta: float) -> dict[str, Any]:
    """Fill rope defaults and refuse an incomplete YaRN block before transformers sees it.

    transformers would raise a bare ``KeyError`` from deep inside its validator.
    """
    if rope is None:
        return {"rope_type": "default", "rope_theta": float(rope_theta)}
    if not isinstance(rope, Mapping):
        _fail(
            "rope_parameters",
            f"must be a JSON object, got {type(rope).__name__}",
            'use {"rope_type": "yarn", ...} as the published checkpoint does, or leave it out',
            prefix="",
        )
    rope = dict(rope)
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", float(rope_theta))
    if rope["rope_type"] == "yarn":
        missing = [k for k in YARN_REQUIRED_KEYS if rope.get(k) is None]
        if missing:
            _fail(
                "rope_parameters",
                f"YaRN needs {', '.join(missing)}",
                'the Kimi-K3 drafter uses {"rope_type": "yarn", "factor": 32.0, '
                '"original_max_position_embeddings": 32768, "rope_theta": 50000.0, "beta_fast": 32, '
                '"beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}',
                prefix="",
            )
        if float(rope["factor"]) < 1.0:
            _fail(
                "rope_parameters.factor",
                f"must be >= 1 for YaRN, got {rope['factor']}",
                "use the factor the checkpoint was trained with (32.0 for Kimi-K3)",
                prefix="",
            )
        for key, value in YARN_DEFAULTS.items():
            rope.setdefault(key, value)
    elif rope["rope_type"] != "default":
        _fail(
            "rope_parameters.rope_type",
            f"{rope['rope_type']!r} is not supported by the K3 DSpark drafter",
            "use 'yarn' (as the published checkpoint does) or 'default'",
            prefix="",
        )
    return rope


def _fail(field: str, problem: str, fix: str, *, prefix: str = "K3DSparkConfig.") -> NoReturn:
    raise FindingError(Finding(problem, fix, f"{prefix}{field}"))


def validate_config(c: Any) -> None:
    """Raise :class:`FindingError` naming the field and the fix for anything the drafter cannot honour."""
    for field in ("mla_use_nope", "mla_use_output_gate", "mla_use_qk_norm", "dspark_bonus_anchor"):
        if getattr(c, field, False):
            _fail(
                field,
                "is set, but the MLA DSpark drafter has no such variant",
                f"remove {field} or set it to false",
            )
    for field in (f for f in GEOMETRY_FIELDS if f != "q_lora_rank"):  # its own fix, below
        value = getattr(c, field, None)
        if not isinstance(value, int) or value < 1:
            _fail(
                field,
                f"must be a positive integer, got {value!r}",
                f"set {field} as in the checkpoint it describes",
            )
    if c.q_lora_rank is None or c.q_lora_rank < 1:
        _fail(
            "q_lora_rank",
            f"must be a positive integer, got {c.q_lora_rank!r}",
            "the drafter always has a low-rank query path (1536 for Kimi-K3)",
        )
    if c.num_key_value_heads != c.num_attention_heads:
        _fail(
            "num_key_value_heads",
            f"{c.num_key_value_heads} != num_attention_heads {c.num_attention_heads}",
            "MLA has one KV head per query head after up-projection; set them equal",
        )
    if c.qk_rope_head_dim % 2:
        _fail(
            "qk_rope_head_dim",
            f"must be even for rotary embedding, got {c.qk_rope_head_dim}",
            "use an even size (64)",
        )
    if c.kv_latent_dim != c.target_kv_latent_dim:
        _fail(
            "kv_lora_rank",
            f"kv_lora_rank {c.kv_lora_rank} + qk_rope_head_dim {c.qk_rope_head_dim} = "
            f"{c.kv_latent_dim}, but the target's MLA cache holds {c.target_kv_latent_dim} elements per token",
            "the draft's KV pages live in the target's cache, so match the target (512 + 64 = 576 for Kimi-K3), "
            "or set target_kv_latent_dim to the target's latent size",
        )
    if c.hidden_act != "silu":
        _fail(
            "hidden_act",
            f"{c.hidden_act!r} is not supported",
            "the drafter's MLP is SwiGLU: set hidden_act to 'silu'",
        )

    ids = getattr(c, "target_layer_ids", None)
    if (
        not ids
        or not isinstance(ids, (list, tuple))
        or not all(isinstance(i, int) and i >= 0 for i in ids)
    ):
        _fail(
            "target_layer_ids",
            f"must be a non-empty list of target layer indices, got {ids!r}",
            "list the target layers whose outputs feed context_proj, e.g. [2, 23, 47, 71, 89] for Kimi-K3",
        )
    if list(ids) != sorted(set(ids)):
        _fail(
            "target_layer_ids",
            f"{list(ids)} must be strictly increasing",
            "vLLM hands the aux hidden states over in ascending layer order; sort them and drop duplicates",
        )
    num_target_layers = getattr(c, "num_target_layers", None)
    if num_target_layers != len(ids):
        _fail(
            "num_target_layers",
            f"is {num_target_layers!r} but target_layer_ids has {len(ids)} entries",
            f"set num_target_layers to {len(ids)}",
        )
    target_depth = getattr(c, "target_num_hidden_layers", None)
    if target_depth is not None and max(ids) >= target_depth:
        _fail(
            "target_layer_ids",
            f"layer {max(ids)} does not exist in a target of {target_depth} layers",
            "use indices below target_num_hidden_layers",
        )
    target_hidden = getattr(c, "target_hidden_size", None)
    if not isinstance(target_hidden, int) or target_hidden < 1:
        _fail(
            "target_hidden_size",
            f"must be a positive integer, got {target_hidden!r}",
            "set it to the target's hidden size (7168 for Kimi-K3)",
        )

    markov_rank = getattr(c, "markov_rank", None)
    if not isinstance(markov_rank, int) or markov_rank < 1:
        _fail(
            "markov_rank",
            f"is missing or not a positive integer ({markov_rank!r})",
            "set the rank of the Markov head's markov_w1/markov_w2 (256 for Kimi-K3)",
        )
    if c.markov_head_type != "vanilla":
        _fail(
            "markov_head_type",
            f"{c.markov_head_type!r} is not supported",
            "only the 'vanilla' low-rank head (bias = W2 W1[prev]) is implemented",
        )

    mask = getattr(c, "mask_token_id", None)
    if mask is None:
        _fail(
            "mask_token_id",
            "is missing",
            "set the id of the mask token that fills the block after the anchor "
            "(163837 for Kimi-K3)",
        )
    if not isinstance(mask, int) or not 0 <= mask < c.vocab_size:
        _fail(
            "mask_token_id",
            f"{mask!r} is outside the vocabulary [0, {c.vocab_size})",
            "use an id in the vocabulary",
        )
    if c.draft_vocab_size != c.vocab_size:
        _fail(
            "draft_vocab_size",
            f"{c.draft_vocab_size} != vocab_size {c.vocab_size}",
            "the drafter shares the target's embedding and lm_head, so its vocabulary must equal the target's",
        )

    if c.block_size is not None and (
        not isinstance(c.block_size, int) or isinstance(c.block_size, bool) or c.block_size < 1
    ):
        _fail(
            "block_size",
            f"must be an integer >= 1, got {c.block_size!r}",
            "set the number of tokens drafted per parallel pass (7 for Kimi-K3), or leave it out "
            "as the published checkpoint does (vLLM then drafts num_speculative_tokens)",
        )
    if not c.sample_from_anchor:
        _fail(
            "sample_from_anchor",
            "is false (fill-in layout)",
            "the K3 drafter drafts from the anchor: remove sample_from_anchor or set it to true",
        )
    _validate_attention_pattern(c)
    if not isinstance(c.fc_norm, bool):
        _fail(
            "fc_norm",
            f"must be true or false, got {c.fc_norm!r}",
            "set it as the checkpoint has it",
        )
    if c.aux_hidden_stream not in AUX_HIDDEN_STREAMS:
        _fail(
            "aux_hidden_stream",
            f"{c.aux_hidden_stream!r} is not a stream the Kimi-K3 target provides",
            "use 'prefix' (the residual stream, the default) or 'attn_res' (AttnRes's mixture)",
        )
    if c.confidence_head_with_markov and not c.enable_confidence_head:
        _fail(
            "confidence_head_with_markov",
            "is true but enable_confidence_head is false",
            "enable the confidence head or drop confidence_head_with_markov",
        )
    if not isinstance(c.logit_scale, (int, float)) or not c.logit_scale > 0:
        _fail(
            "logit_scale",
            f"must be a positive number, got {c.logit_scale!r}",
            "use 1.0 unless the checkpoint says otherwise",
        )
    # Optional with no stored default (validated_context_len() derives it).
    limit = getattr(c, "validated_context_len", None)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        _fail(
            "validated_context_len",
            f"must be a positive number of tokens, got {limit!r}",
            "set the longest context you measured acceptance at, or leave it out",
        )
    if c.max_position_embeddings < 1:
        _fail(
            "max_position_embeddings",
            f"must be positive, got {c.max_position_embeddings}",
            "use 1048576 for Kimi-K3",
        )


def _validate_attention_pattern(c: Any) -> None:
    """Refuse the attention variants vLLM's resolver knows but the K3 drafter does not implement."""
    explicit = getattr(c, "is_causal", None)
    if explicit is not None and not isinstance(explicit, bool):
        _fail(
            "is_causal",
            f"must be true or false, got {explicit!r}",
            "set it as the checkpoint has it",
        )
    dflash = getattr(c, "dflash_config", None)
    if dflash is not None and not isinstance(dflash, Mapping):
        _fail(
            "dflash_config", f"must be a JSON object, got {dflash!r}", "remove it or fix its value"
        )
    if (dflash or {}).get("use_swa") or any(
        t != "full_attention" for t in getattr(c, "layer_types", None) or ()
    ):
        _fail(
            "dflash_config.use_swa" if (dflash or {}).get("use_swa") else "layer_types",
            "asks for sliding-window draft layers",
            "the K3 DSpark drafter attends over the full context: remove the sliding-window setting",
        )


def check_identity(raw: Mapping[str, Any]) -> None:
    """Refuse a config.json that is not a K3 DSpark drafter's, or that leaves a required field out."""
    architectures, model_type = raw.get("architectures"), raw.get("model_type")
    if architectures != [ARCHITECTURE] or model_type != MODEL_TYPE:
        raise FindingError(
            Finding(
                f"architectures {architectures!r} and model_type {model_type!r} are not a K3 DSpark "
                f'drafter\'s (["{ARCHITECTURE}"] and "{MODEL_TYPE}")',
                "point at a K3 DSpark drafter checkpoint, or correct those fields",
            )
        )
    missing = [field for field in REQUIRED_FIELDS if raw.get(field) is None]
    if missing:
        raise FindingError(
            Finding(
                f"required field(s) {', '.join(missing)} missing; they are never defaulted",
                "use the config.json the checkpoint was written with",
            )
        )
