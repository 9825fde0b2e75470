# SPDX-License-Identifier: Apache-2.0
"""The drafter's FP8 linears as vLLM builds them, and their shapes on one TP rank.

Shared by ``tests/vllm/test_geometry.py`` (each wheel's kernel constraints, import level) and
``tests/tools/test_draft_bytes.py`` (which checks this table against the models it builds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Linear:
    """One runtime linear: its vLLM layer class, output sizes (one per merged shard) and input size."""

    cls: type
    output_sizes: tuple[int, ...]
    input_size: int

    def on_rank(self, tp: int) -> tuple[tuple[int, ...], int]:
        """``(output partition sizes, input size)`` on one of ``tp`` ranks, by vLLM's split rules."""
        from vllm.distributed.utils import divide
        from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

        if issubclass(self.cls, ColumnParallelLinear):
            return tuple(divide(n, tp) for n in self.output_sizes), self.input_size
        if issubclass(self.cls, RowParallelLinear):
            return self.output_sizes, divide(self.input_size, tp)
        return self.output_sizes, self.input_size


def fp8_linears(c: Any) -> dict[str, Linear]:
    """The linears of the FP8 build (``layout.FP8_RECIPE``) by runtime name under ``model.`` (layer 0)."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )

    qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
    return {
        "context_proj": Linear(
            ReplicatedLinear, (c.hidden_size,), c.target_hidden_size * c.num_target_layers
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
