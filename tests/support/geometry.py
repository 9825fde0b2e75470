# SPDX-License-Identifier: Apache-2.0
"""The drafters' FP8 linears as vLLM builds them, and their shapes on one TP rank.

The plugin's and vLLM's in-tree drafter differ only in ``context_proj``: the plugin's is
column-parallel (split by output rows, its output all-gathered), kept whole where a rank's rows
would cut a weight-scale block (``runtime.model.shards_context_proj``); in-tree's is replicated.

Shared by ``tests/vllm/test_geometry.py`` (each wheel's kernel constraints, import level) and
``tests/tools/test_draft_bytes.py`` (which checks this table against the models it builds).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any
from unittest import mock

PLUGIN, IN_TREE = "plugin", "in-tree"
VARIANTS = (PLUGIN, IN_TREE)


@dataclass(frozen=True)
class Linear:
    """One runtime linear: its vLLM layer class, output sizes (one per merged shard), input size,
    and whether it is built with ``disable_tp`` (whole on every rank whatever its class)."""

    cls: type
    output_sizes: tuple[int, ...]
    input_size: int
    disable_tp: bool = False

    @property
    def split(self) -> bool:
        """Whether vLLM splits it across TP ranks."""
        from vllm.model_executor.layers.linear import ReplicatedLinear

        return not self.disable_tp and not issubclass(self.cls, ReplicatedLinear)

    def on_rank(self, tp: int) -> tuple[tuple[int, ...], int]:
        """``(output partition sizes, input size)`` on one of ``tp`` ranks, by vLLM's split rules."""
        from vllm.distributed.utils import divide
        from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

        if not self.split:
            return self.output_sizes, self.input_size
        if issubclass(self.cls, ColumnParallelLinear):
            return tuple(divide(n, tp) for n in self.output_sizes), self.input_size
        if issubclass(self.cls, RowParallelLinear):
            return self.output_sizes, divide(self.input_size, tp)
        return self.output_sizes, self.input_size


def fp8_linears(c: Any, variant: str) -> dict[str, Linear]:
    """``variant``'s linears of the FP8 build (``layout.FP8_RECIPE``) by runtime name under ``model.``
    (layer 0), as built at TP 1 (see :func:`at_tp` for a TP size's keep-whole rule)."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )

    assert variant in VARIANTS, variant
    qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
    context_proj_cls = ColumnParallelLinear if variant == PLUGIN else ReplicatedLinear
    return {
        "context_proj": Linear(
            context_proj_cls, (c.hidden_size,), c.target_hidden_size * c.num_target_layers
        ),
        "layers.0.self_attn.q_b_proj": Linear(
            ColumnParallelLinear, (c.num_attention_heads * qk_head_dim,), c.q_lora_rank
        ),
        "layers.0.self_attn.o_proj": Linear(
            RowParallelLinear, (c.hidden_size,), c.num_attention_heads * c.v_head_dim
        ),
        "layers.0.mlp.gate_up_proj": Linear(
            MergedColumnParallelLinear, (c.intermediate_size,) * 2, c.hidden_size
        ),
        "layers.0.mlp.down_proj": Linear(RowParallelLinear, (c.hidden_size,), c.intermediate_size),
    }


def at_tp(c: Any, variant: str, fmt: str, tp: int) -> dict[str, Linear]:
    """:func:`fp8_linears` as ``variant`` builds them at ``tp`` for quant format ``fmt``: the plugin's
    ``context_proj`` with ``disable_tp`` where the model's own rule keeps it whole."""
    from vllm_dspark.runtime import model

    linears = fp8_linears(c, variant)
    if variant == PLUGIN:
        # The model's rule reads vLLM's TP world size; here it is the size being checked.
        with mock.patch.object(model, "get_tensor_model_parallel_world_size", return_value=tp):
            shards = model.shards_context_proj(c, fmt)
        linears["context_proj"] = replace(linears["context_proj"], disable_tp=not shards)
    return linears
