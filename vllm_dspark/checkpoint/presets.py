# SPDX-License-Identifier: Apache-2.0
"""Named drafter configurations, as the ``config.json`` a checkpoint of that size carries.

``k3`` is the published Kimi-K3-DSpark config (3.56 B params counting the shared embedding).
``tiny`` and ``small`` keep its structure (5 aux target layers, MLA, Markov and confidence heads,
block of 7) at sizes that run in seconds on a CPU; every in_features is a multiple of 32 so the
4-bit group formats apply to every linear.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_dspark.config import K3DSparkConfig

_YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "original_max_position_embeddings": 32768,
    "rope_theta": 50000.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _config_json(**sizes: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["K3DSparkModel"],
        "model_type": "k3_dspark",
        "_torchspec_version": "0.1.0",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,
        "rope_parameters": dict(_YARN),
        "max_position_embeddings": 1048576,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "block_size": 7,
        "logit_scale": 1.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    cfg.update(sizes)
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    cfg["draft_vocab_size"] = cfg["vocab_size"]
    cfg["num_target_layers"] = len(cfg["target_layer_ids"])
    return cfg


PRESETS: dict[str, dict[str, Any]] = {
    "k3": _config_json(
        hidden_size=7168,
        intermediate_size=14336,
        num_hidden_layers=5,
        num_attention_heads=64,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        vocab_size=163840,
        target_hidden_size=7168,
        target_num_hidden_layers=93,
        target_layer_ids=[2, 23, 47, 71, 89],
        mask_token_id=163837,
        markov_rank=256,
    ),
    "small": _config_json(
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
        target_kv_latent_dim=96,
        mask_token_id=4093,
        markov_rank=32,
    ),
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
        target_kv_latent_dim=48,
        mask_token_id=509,
        markov_rank=8,
    ),
}


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
