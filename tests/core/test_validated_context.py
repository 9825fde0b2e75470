# SPDX-License-Identifier: Apache-2.0
"""The drafter's optional ``validated_context_len``: stated, or 3 × YaRN's original window; a bad
value is refused by name, by the config class and by the transformers-free field parser alike."""

from __future__ import annotations

import pytest

from vllm_dspark.checkpoint.presets import preset_config_json
from vllm_dspark.config import K3DSparkConfig
from vllm_dspark.fields import parse_fields, validated_context_len
from vllm_dspark.findings import FindingError


def test_unset_it_is_three_original_windows_and_stated_it_is_the_stated() -> None:
    raw = preset_config_json("tiny")
    assert validated_context_len(raw) == 3 * 32768
    assert validated_context_len(dict(raw, validated_context_len=4096)) == 4096
    plain = dict(raw, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    assert validated_context_len(plain) is None
    assert validated_context_len(K3DSparkConfig(**raw).to_dict()) == 3 * 32768
    assert K3DSparkConfig(**dict(raw, validated_context_len=4096)).validated_context_len == 4096


@pytest.mark.parametrize("bad", [0, -1, 1.5, "long", True])
def test_a_bad_value_is_refused_by_name(bad) -> None:
    raw = dict(preset_config_json("tiny"), validated_context_len=bad)
    for build in (lambda: K3DSparkConfig(**raw), lambda: parse_fields(raw)):
        with pytest.raises(FindingError, match="validated_context_len: must be a positive number"):
            build()
