# SPDX-License-Identifier: Apache-2.0
"""benchmarks/reference_latency.py at the tiny preset: the run completes, its byte accounting is the
checkpoint's arithmetic, its baseline is a memcpy scaled to those bytes, and main() hands a table to
write_result (intercepted: no result files)."""

from __future__ import annotations

import math

import pytest

import benchmarks.reference_latency as bench
from vllm_dspark.checkpoint.layout import tensor_shapes
from vllm_dspark.checkpoint.presets import preset_config


def test_run_reports_times_and_bytes_streamed(monkeypatch) -> None:
    monkeypatch.setattr(bench, "_MEMCPY_BYTES", 1 << 20)  # a 256 MiB copy is the slow part
    result = bench.run("tiny", 1, warmup=0, context_len=8)
    config = preset_config("tiny")
    shapes = tensor_shapes(config)
    bf16 = 2
    layer_bytes = bf16 * sum(math.prod(s) for k, s in shapes.items() if k.startswith("layers."))
    components = result["weight_bytes_by_component"]
    assert components["layers"] == layer_bytes
    assert (
        components["markov_w2_per_position"]
        == config.draft_block_size * bf16 * config.vocab_size * config.markov_rank
    )
    assert components["context"] == bf16 * (
        math.prod(shapes["context_proj.weight"])
        + config.hidden_size
        + sum(
            math.prod(shapes[f"layers.{i}.self_attn.kv_a_proj_with_mqa.weight"])
            + config.kv_lora_rank
            for i in range(config.num_hidden_layers)
        )
    )
    assert result["weight_bytes_per_block"] == sum(components.values())
    assert [r["compute"] for r in result["results"]] == ["fp32", "bf16"]
    for row in result["results"]:
        (pair,) = row["runs"]
        assert pair["step"]["seconds"] > 0
        assert pair["baseline"]["seconds"] == pytest.approx(
            pair["baseline"]["memcpy_seconds"] * result["weight_bytes_per_block"] / (2 << 20)
        )
        assert (
            row["weight_GBps"] == result["weight_bytes_per_block"] / pair["step"]["seconds"] / 1e9
        )


def test_main_writes_one_result(monkeypatch) -> None:
    written = {}
    monkeypatch.setattr(bench, "_MEMCPY_BYTES", 1 << 20)
    monkeypatch.setattr(
        bench, "write_result", lambda name, payload, table: written.update(name=name, table=table)
    )
    argv = ["--preset", "tiny", "--pairs", "1", "--warmup", "0", "--context-len", "8"]
    assert bench.main(argv) == 0
    assert written["name"] == "reference_latency"
    assert "| compute | block s: median (min–max) |" in written["table"]
    assert "| BF16 |" in written["table"] and "`tiny` preset" in written["table"]
