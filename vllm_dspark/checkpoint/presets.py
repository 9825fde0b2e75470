"""Named drafter configurations, as the ``config.json`` a checkpoint of that size carries.

``k3`` is Inferact/Kimi-K3-DSpark's config.json (revision cf6b824) key for key, in its order:
``json.dumps(doc, indent=2) + "\n"`` is the published file byte for byte (tests/data/published/).
The other presets keep its key set and order, change only sizes, and add what their geometry or
variant needs (``target_kv_latent_dim``, ``is_causal``, ``block_size``, ``fc_norm``, ...). ``tiny``
and ``small`` run in seconds on a CPU; every in_features is a multiple of 32 so the 4-bit group
formats apply to every linear. ``block5-small``, ``k31-small`` and ``fc-norm-small`` are the shapes
of the Block5, Kimi-K3.1-Pro preview and lightseekorg drafters at ``small``'s sizes.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_dspark.config import K3DSparkConfig

# Inferact/Kimi-K3-DSpark's config.json, revision cf6b824 (SHA-256 5a3c2f4f...f970), in its key order.
PUBLISHED_K3: dict[str, Any] = {
    "architectures": ["K3DSparkModel"],
    "model_type": "k3_dspark",
    "hidden_size": 7168,
    "intermediate_size": 14336,
    "num_hidden_layers": 5,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": False,
    "mla_use_output_gate": False,
    "vocab_size": 163840,
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 1048576,
    "rope_theta": 50000.0,
    "num_target_layers": 5,
    "target_hidden_size": 7168,
    "target_num_hidden_layers": 93,
    "target_layer_ids": [2, 23, 47, 71, 89],
    "mask_token_id": 163837,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
    "markov_rank": 256,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
    "tie_word_embeddings": False,
    "draft_vocab_size": 163840,
    "_torchspec_version": "0.1.0",
    "torch_dtype": "bfloat16",
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 32768,
        "rope_theta": 50000.0,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}
# safetensors metadata of the published model.safetensors.
PUBLISHED_METADATA = {"torchspec_version": "0.1.0"}

# A smaller vocabulary's special ids, from its end: the mask and pad at the published offsets.
_SPECIAL_FROM_END = {"bos_token_id": 8, "eos_token_id": 6, "mask_token_id": 3, "pad_token_id": 1}


def _config_json(**fields: Any) -> dict[str, Any]:
    """The published document with ``fields`` changed in place and any new ones appended."""
    cfg = copy.deepcopy(PUBLISHED_K3)
    vocab = fields.get("vocab_size", cfg["vocab_size"])
    for key, offset in _SPECIAL_FROM_END.items():
        cfg[key] = vocab - offset
    cfg.update(fields)
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    cfg["draft_vocab_size"] = cfg["vocab_size"]
    cfg["num_target_layers"] = len(cfg["target_layer_ids"])
    return cfg


_SMALL = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=5,
    num_attention_heads=4,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    vocab_size=4096,
    target_hidden_size=256,
    target_num_hidden_layers=12,
    target_layer_ids=[1, 3, 6, 8, 10],
    markov_rank=32,
    target_kv_latent_dim=96,
)

PRESETS: dict[str, dict[str, Any]] = {
    "k3": copy.deepcopy(PUBLISHED_K3),
    "small": _config_json(**_SMALL),
    "tiny": _config_json(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=32,
        vocab_size=512,
        target_hidden_size=64,
        target_num_hidden_layers=8,
        target_layer_ids=[1, 2, 4, 5, 6],
        markov_rank=8,
        target_kv_latent_dim=48,
    ),
    # Inferact/Kimi-K3-DSpark-Block5: 3 full-causal layers, 3 taps, Markov rank 512 (x 8 here), block 5.
    "block5-small": _config_json(
        **{**_SMALL, "num_hidden_layers": 3, "target_layer_ids": [1, 6, 10], "markov_rank": 64},
        is_causal=True,
        block_size=5,
    ),
    # Inferact/Kimi-K3.1-Pro-DSpark-preview: 5 full-causal layers, Markov rank 512, block 7, no embed_tokens.
    "k31-small": _config_json(**{**_SMALL, "markov_rank": 64}, is_causal=True, block_size=7),
    # lightseekorg/kimi-k3-dspark: per-tap fc_norm, taps from the target's AttnRes stream.
    "fc-norm-small": _config_json(**_SMALL, fc_norm=True, aux_hidden_stream="attn_res"),
    # k3's head geometry (FLASHINFER_MLA's head dims, the 576-wide latent) at a size two CPU cores
    # serve: 8 heads split at TP 4 and 8, and every FP8 linear keeps K >= 128 and 128-multiples of
    # N and K per rank there (Marlin, 128x128 blocks; tests/vllm/test_geometry.py reads both).
    "prod-geometry-small": _config_json(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        q_lora_rank=256,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        vocab_size=4096,
        target_hidden_size=256,
        target_num_hidden_layers=12,
        target_layer_ids=[1, 3, 6, 8, 10],
        markov_rank=32,
    ),
}
# Presets whose published counterpart ships no embed_tokens.weight (the embedding is the target's).
WITHOUT_EMBED_TOKENS = frozenset({"k31-small"})


def preset_config_json(name: str) -> dict[str, Any]:
    """A fresh copy of preset ``name``'s config.json dict."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


def preset_config(name: str, **overrides: Any) -> K3DSparkConfig:
    """``K3DSparkConfig`` of preset ``name``, with optional field overrides (for tests)."""
    from vllm_dspark.config import K3DSparkConfig

    cfg = preset_config_json(name)
    cfg.update(overrides)
    return K3DSparkConfig(**cfg)
