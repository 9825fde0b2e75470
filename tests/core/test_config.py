# SPDX-License-Identifier: Apache-2.0
"""K3DSparkConfig: the presets are valid, and every field the drafter cannot honour is refused
with a message that names the field and the fix."""

from __future__ import annotations

import json

import pytest

from vllm_dspark.checkpoint.layout import tensor_shapes
from vllm_dspark.checkpoint.presets import PRESETS, preset_config, preset_config_json
from vllm_dspark.config import K3DSparkConfig
from vllm_dspark.fields import DEFAULTS, REQUIRED_FIELDS, parse_fields


def _with(**changes):
    cfg = preset_config_json("k3")
    for key, value in changes.items():
        if value is _DROP:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return cfg


_DROP = object()


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_are_valid_and_round_trip(name: str) -> None:
    config = preset_config(name)
    assert config.model_type == "k3_dspark"
    assert config.architectures == ["K3DSparkModel"]
    again = K3DSparkConfig(**json.loads(config.to_json_string()))
    assert again.to_dict() == config.to_dict()


def test_k3_preset_is_the_published_drafter() -> None:
    c = preset_config("k3")
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads) == (
        7168,
        14336,
        5,
        64,
    )
    assert (
        c.q_lora_rank,
        c.kv_lora_rank,
        c.qk_nope_head_dim,
        c.qk_rope_head_dim,
        c.v_head_dim,
    ) == (1536, 512, 128, 64, 128)
    assert c.kv_latent_dim == 576 and c.vocab_size == c.draft_vocab_size == 163840
    assert c.target_layer_ids == [2, 23, 47, 71, 89] and c.target_num_hidden_layers == 93
    assert (c.markov_rank, c.mask_token_id, c.block_size, c.draft_block_size) == (
        256,
        163837,
        None,  # the published config states no block: vLLM drafts num_speculative_tokens
        7,
    )
    assert c.enable_confidence_head and c.confidence_head_with_markov
    rope = c.rope_parameters
    assert (
        rope["rope_type"],
        rope["factor"],
        rope["original_max_position_embeddings"],
        rope["rope_theta"],
    ) == ("yarn", 32.0, 32768, 50000.0)
    # The published checkpoint: 68 tensors, 3.56 B params counting the shared embedding.
    shapes = tensor_shapes(c)
    assert len(shapes) == 68
    total = sum(int.__mul__(*s) if len(s) == 2 else s[0] for s in shapes.values())
    assert round(total / 1e9, 2) == 3.56


# (field changes, words the message must contain)
INVALID = [
    ({"kv_lora_rank": 448}, ["kv_lora_rank", "576", "target_kv_latent_dim"]),
    ({"qk_rope_head_dim": 32}, ["kv_lora_rank", "544", "576"]),
    ({"target_kv_latent_dim": 640}, ["kv_lora_rank", "640"]),
    ({"target_layer_ids": []}, ["target_layer_ids", "non-empty"]),
    (
        {"target_layer_ids": [2, 23, 47, 71]},
        ["num_target_layers", "4 entries", "set num_target_layers to 4"],
    ),
    ({"num_target_layers": 4}, ["num_target_layers", "5 entries"]),
    ({"target_layer_ids": [2, 23, 47, 89, 71]}, ["target_layer_ids", "strictly increasing"]),
    (
        {"target_layer_ids": [2, 23, 47, 71, 93]},
        ["target_layer_ids", "93", "target_num_hidden_layers"],
    ),
    ({"markov_rank": _DROP}, ["markov_rank", "missing", "256"]),
    ({"markov_rank": 0}, ["markov_rank"]),
    ({"mask_token_id": _DROP}, ["mask_token_id", "missing", "163837"]),
    ({"mask_token_id": 163840}, ["mask_token_id", "outside the vocabulary"]),
    (
        {"draft_vocab_size": 32000},
        ["draft_vocab_size", "vocab_size", "shares the target's embedding"],
    ),
    ({"block_size": 0}, ["block_size", ">= 1"]),
    ({"block_size": True}, ["block_size", "leave it out"]),
    ({"dspark_block_size": -1}, ["block_size", ">= 1"]),
    (
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0}},
        ["rope_parameters", "factor", "original_max_position_embeddings"],
    ),
    (
        {"rope_parameters": {"rope_type": "yarn", "factor": 32.0}},
        ["original_max_position_embeddings"],
    ),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, ["rope_type", "llama3", "yarn"]),
    ({"num_key_value_heads": 1}, ["num_key_value_heads", "num_attention_heads"]),
    ({"q_lora_rank": None}, ["q_lora_rank", "1536"]),
    ({"hidden_act": "gelu"}, ["hidden_act", "silu"]),
    ({"markov_head_type": "rnn"}, ["markov_head_type", "vanilla"]),
    ({"sample_from_anchor": False}, ["sample_from_anchor"]),
    ({"mla_use_qk_norm": True}, ["mla_use_qk_norm"]),
    ({"dspark_bonus_anchor": True}, ["dspark_bonus_anchor"]),
    ({"is_causal": "yes"}, ["is_causal", "true or false"]),
    ({"dflash_config": {"use_swa": True}}, ["dflash_config.use_swa", "sliding-window"]),
    ({"layer_types": ["sliding_attention"] * 5}, ["layer_types", "sliding-window"]),
    ({"dflash_config": [1]}, ["dflash_config", "JSON object"]),
    ({"fc_norm": "true"}, ["fc_norm", "true or false"]),
    ({"aux_hidden_stream": "mtp"}, ["aux_hidden_stream", "'attn_res'"]),
    ({"enable_confidence_head": False}, ["confidence_head_with_markov", "enable_confidence_head"]),
    ({"logit_scale": 0.0}, ["logit_scale"]),
    ({"target_hidden_size": _DROP}, ["target_hidden_size", "7168"]),
    ({"hidden_size": "7168"}, ["hidden_size", "int"]),
]


# The plugin's class, and the transformers-free parse the checkpoint tools use (quantize).
PARSERS = {"K3DSparkConfig": lambda raw: K3DSparkConfig(**raw), "parse_fields": parse_fields}


@pytest.mark.parametrize("parse", list(PARSERS))
@pytest.mark.parametrize(
    "changes,words", INVALID, ids=[next(iter(c)) + "-" + str(i) for i, (c, _) in enumerate(INVALID)]
)
def test_invalid_field_is_refused_with_a_named_fix(changes, words, parse) -> None:
    field, value = next(iter(changes.items()))
    if parse == "parse_fields" and field in REQUIRED_FIELDS and value in (_DROP, None):
        words = [f"required field(s) {field} missing"]  # refused before any default applies
    with pytest.raises(ValueError) as info:
        PARSERS[parse](_with(**changes))
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    assert "Fix" in message or "rope_parameters" in message


@pytest.mark.parametrize("name", list(PRESETS))
def test_fields_without_transformers_are_the_configs_own(name: str) -> None:
    """``parse_fields`` sees every field and default the plugin's class does, so the same layout."""
    raw = preset_config_json(name)
    derived = {
        "num_key_value_heads": raw["num_attention_heads"],
        "draft_vocab_size": raw["vocab_size"],
    }
    for key, default in {**DEFAULTS, **derived}.items():
        if raw.get(key) == default:
            del raw[key]  # left to the defaults
    config, fields = K3DSparkConfig(**raw), parse_fields(raw)
    for key, value in vars(fields).items():
        if key != "torch_dtype":  # transformers turns the string into a torch.dtype
            assert getattr(config, key) == value, key
    assert fields.kv_latent_dim == config.kv_latent_dim
    assert tensor_shapes(fields) == tensor_shapes(config)


def test_default_latent_is_the_targets_576() -> None:
    cfg = _with(target_kv_latent_dim=_DROP)
    assert K3DSparkConfig(**cfg).target_kv_latent_dim == 576


@pytest.mark.vllm_api
def test_config_json_resolves_to_this_class_through_autoconfig_and_vllm(tmp_path) -> None:
    from transformers import AutoConfig
    from vllm.transformers_utils.config import get_config

    import vllm_dspark

    vllm_dspark.register()
    (tmp_path / "config.json").write_text(json.dumps(preset_config_json("tiny")))
    assert type(AutoConfig.from_pretrained(tmp_path)) is K3DSparkConfig
    hf = get_config(str(tmp_path), trust_remote_code=False)
    assert type(hf) is K3DSparkConfig and hf.markov_rank == 8


@pytest.mark.vllm_api
def test_malformed_config_json_fails_with_the_field_named(tmp_path) -> None:
    from vllm.transformers_utils.config import get_config

    import vllm_dspark

    vllm_dspark.register()
    cfg = preset_config_json("tiny")
    del cfg["markov_rank"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="markov_rank"):
        get_config(str(tmp_path), trust_remote_code=False)
