# SPDX-License-Identifier: Apache-2.0
"""``K3DSparkConfig``: the drafter's config as vLLM's DeepSeek-V3 (MLA) config logic reads it; every field the
model cannot honour is refused at load, by name (:mod:`vllm_dspark.fields`)."""

from __future__ import annotations

from typing import Any

from huggingface_hub.errors import StrictDataclassError
from transformers import DeepseekV3Config

from vllm_dspark.fields import (
    DEFAULT_ROPE_THETA,
    MODEL_TYPE,
    KVLatent,
    validate_config,
    with_defaults,
)
from vllm_dspark.findings import Finding, FindingError


class K3DSparkConfig(KVLatent, DeepseekV3Config):
    """Configuration of a K3 DSpark drafter (``architectures: ["K3DSparkModel"]``).

    Fields beyond ``DeepseekV3Config``'s, as in the published checkpoint's ``config.json``:
    ``target_hidden_size``, ``num_target_layers``, ``target_num_hidden_layers``,
    ``target_layer_ids``, ``mask_token_id``, ``markov_rank``, ``markov_head_type``,
    ``enable_confidence_head``, ``confidence_head_with_markov``, ``block_size``, ``logit_scale``,
    ``draft_vocab_size`` and, optionally, ``target_kv_latent_dim`` (the per-token latent the
    target's MLA cache holds; 576 for Kimi-K3) and ``validated_context_len`` (the context, in tokens,
    its acceptance was measured to hold to; unset: 3 × YaRN's ``original_max_position_embeddings``).
    """

    model_type = MODEL_TYPE
    has_no_defaults_at_init = True

    def __init__(self, rope_theta: float = DEFAULT_ROPE_THETA, **kwargs: Any) -> None:
        try:
            super().__init__(**with_defaults(kwargs, rope_theta))
        except StrictDataclassError as e:
            # transformers' strict dataclass validation: re-raise as the finding callers expect,
            # keeping its message, which names the field and the type it wanted.
            raise FindingError(
                Finding(str(e), "correct that field in config.json", "K3DSparkConfig")
            ) from None
        self.rope_theta = float(self.rope_parameters["rope_theta"])
        validate_config(self)


def register_config() -> None:
    """Make ``k3_dspark`` resolve to this class in vLLM's config registry and in AutoConfig."""
    from transformers import AutoConfig

    from vllm_dspark.compat import register_config_class

    register_config_class("k3_dspark", K3DSparkConfig)
    AutoConfig.register("k3_dspark", K3DSparkConfig, exist_ok=True)
