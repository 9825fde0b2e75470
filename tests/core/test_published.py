# SPDX-License-Identifier: Apache-2.0
"""The published drafters' config.json documents (tests/data/published/, sources in SOURCES.json):
the plugin accepts every document vLLM's own ``K3DSparkConfig`` accepts, unless vLLM would serve it
wrong, and then it says why."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from vllm_dspark.checkpoint.presets import preset_config_json
from vllm_dspark.config import K3DSparkConfig
from vllm_dspark.fields import parse_fields

PUBLISHED = Path(__file__).parents[1] / "data" / "published"
SOURCES = json.loads((PUBLISHED / "SOURCES.json").read_text())
BASE = "Inferact--Kimi-K3-DSpark.config.json"


def _doc(name: str) -> dict:
    return json.loads((PUBLISHED / name).read_text())


def _base(**changes) -> dict:
    doc = _doc(BASE)
    for key, value in changes.items():
        if value is None:
            doc.pop(key)
        else:
            doc[key] = value
    return doc


# Every published document, then edge variants of the base one.
ACCEPTED: dict[str, dict] = {name: _doc(name) for name in SOURCES}
ACCEPTED |= {
    "explicit block_size 7": _base(block_size=7),
    "dspark_block_size 5": _base(dspark_block_size=5),
    "dflash_config causal": _base(dflash_config={"causal": True}),
    "is_causal false": _base(is_causal=False),
    "explicit defaults": _base(hidden_act="silu", logit_scale=1.0, sample_from_anchor=True),
    "metadata only": _base(transformers_version="5.2.0", _name_or_path="/ckpt", use_cache=True),
    "no num_key_value_heads": _base(num_key_value_heads=None),
    "no draft_vocab_size": _base(draft_vocab_size=None),
    "no confidence head": _base(enable_confidence_head=False, confidence_head_with_markov=False),
    "rope without type key": _base(
        rope_parameters={"type": "yarn", **_doc(BASE)["rope_parameters"]}
    ),
}

# Documents vLLM's class accepts but the drafter would be served wrong from: the plugin refuses
# them, and its one line names the field (the words below).
SERVED_WRONG: dict[str, tuple[dict, list[str]]] = {
    "gelu MLP": (_base(hidden_act="gelu"), ["hidden_act", "silu"]),
    "rnn Markov head": (_base(markov_head_type="rnn"), ["markov_head_type", "vanilla"]),
    "sliding-window layers": (_base(dflash_config={"use_swa": True}), ["use_swa"]),
    "unknown aux stream": (_base(aux_hidden_stream="mtp"), ["aux_hidden_stream"]),
    "fill-in layout": (_base(sample_from_anchor=False), ["sample_from_anchor"]),
    "latent the target lacks": (_base(kv_lora_rank=448), ["kv_lora_rank", "576"]),
    "tap past the target": (_base(target_layer_ids=[2, 23, 47, 71, 93]), ["target_layer_ids"]),
    "no mask token": (_base(mask_token_id=None), ["mask_token_id"]),
}


def test_base_document_is_the_published_bytes_and_the_k3_preset() -> None:
    raw = (PUBLISHED / BASE).read_bytes()
    meta = SOURCES[BASE]
    assert len(raw) == meta["bytes"] and hashlib.sha256(raw).hexdigest() == meta["sha256"]
    assert (json.dumps(preset_config_json("k3"), indent=2) + "\n").encode() == raw
    assert not {"block_size", "hidden_act", "logit_scale"} & set(json.loads(raw))


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_plugin_accepts(name: str) -> None:
    doc = ACCEPTED[name]
    config, fields = K3DSparkConfig(**doc), parse_fields(doc)
    assert (
        config.draft_block_size
        == fields.draft_block_size
        == doc.get("block_size", doc.get("dspark_block_size", 7))
    )
    assert (
        config.causal
        == fields.causal
        == bool(doc.get("is_causal", (doc.get("dflash_config") or {}).get("causal", False)))
    )


@pytest.mark.parametrize("name", list(SERVED_WRONG))
def test_plugin_refuses_what_it_would_serve_wrong_by_name(name: str) -> None:
    doc, words = SERVED_WRONG[name]
    for parse in (lambda d: K3DSparkConfig(**d), parse_fields):
        with pytest.raises(ValueError) as info:
            parse(doc)
        assert all(w in str(info.value) for w in words), str(info.value)


def _vllm_class() -> type:
    from vllm.transformers_utils.configs.k3_dspark import K3DSparkConfig as VllmK3DSparkConfig

    return VllmK3DSparkConfig


@pytest.mark.vllm_api
@pytest.mark.parametrize("name", list(ACCEPTED) + list(SERVED_WRONG))
def test_no_regression_against_vllms_own_config_class(name: str) -> None:
    """Where vLLM's class accepts a document the plugin does too, but for the served-wrong list."""
    doc = ACCEPTED[name] if name in ACCEPTED else SERVED_WRONG[name][0]
    try:
        upstream = _vllm_class()(**doc)
    except ValueError:
        upstream = None
    if name in ACCEPTED:
        assert upstream is not None, f"vLLM refuses {name}: move it to a refused table"
        ours = K3DSparkConfig(**doc)
        # The fields vLLM's dspark path reads agree.
        for field in ("num_hidden_layers", "target_layer_ids", "draft_vocab_size", "q_lora_rank"):
            assert getattr(ours, field) == getattr(upstream, field), field
        assert getattr(ours, "block_size", None) == getattr(upstream, "block_size", None) or (
            getattr(upstream, "block_size", None) is None and "dspark_block_size" in doc
        )
    else:
        assert upstream is not None, f"vLLM refuses {name} too: it belongs in neither table"


@pytest.mark.vllm_api
@pytest.mark.parametrize("name", list(SOURCES))
def test_published_documents_parse_through_vllms_config_path(name: str, tmp_path) -> None:
    from vllm.transformers_utils.config import get_config

    import vllm_dspark

    vllm_dspark.register()
    (tmp_path / "config.json").write_bytes((PUBLISHED / name).read_bytes())
    hf = get_config(str(tmp_path), trust_remote_code=False)
    assert type(hf) is K3DSparkConfig
    assert hf.block_size == _doc(name).get("block_size")


@pytest.mark.vllm_api
@pytest.mark.parametrize("name", list(SOURCES))
def test_vllm_resolves_the_draft_attention_causality_from_the_plugin_config(name: str) -> None:
    """vLLM's dspark loader sets ``use_non_causal`` from this function; it must agree with ours."""
    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal

    config = K3DSparkConfig(**_doc(name))
    assert dflash_has_any_non_causal(config) is (not config.causal)
