# SPDX-License-Identifier: Apache-2.0
"""Latency of one drafted block of the reference drafter on this CPU, FP32 and BF16 compute.

One block = ``ReferenceDrafter.draft`` for one request in a decode step: the context path
(context_proj, every layer's KV latents) over the tokens verified since the previous block (at most
block_size + 1 = 8, the default ``--context-len``; earlier tokens' latents are already in the KV
cache), the 7-token block through all layers, lm_head, the sequential Markov rollout (W2 read once
per position) and the confidence head. At batch 1 this is a stream of the weights, so the figure
that matters is the time against streaming the same bytes once at memory-copy speed: each block is
paired with a memcpy timed right after it (:func:`benchmarks.common.paired`), scaled to the bytes
of weights one block reads. (A long ``--context-len`` measures prefill, which is compute-bound: 64
tokens through context_proj alone are ~33 GFLOP.)

What limits FP32 compute: the BLAS has no BF16 x FP32 GEMM, so each weight slab (16 MiB of FP32,
past the caches) is upcast into a scratch and multiplied from there: per weight 2 bytes read + 4
written + 4 read where BF16 compute moves 2, so at 7-8 rows, a memory-bound product, it cannot beat
about 5x streaming. On a shared machine each of the block's ~2k two-thread OpenMP regions also
waits whenever the other core is taken (one 14336x7168 FP32 linear: 329 ms on 2 threads, 113 ms on
1, 100 ms as two single-threaded halves, 48 ms in BF16, measured under load).

Weights are stored BF16 in both runs (the checkpoint's dtype; FP32 compute upcasts them per use),
so ``weight_bytes`` is the same for both. Run the ``k3`` preset (about 9 GiB resident) under
``flock /tmp/k3.lock`` on shared machines:

    flock /tmp/k3.lock python -m benchmarks reference [--model /tmp/k3] [--pairs 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    MIN_PAIRS,
    add_pairing_arguments,
    format_table,
    meets,
    paired,
    spread_text,
    timed,
    write_result,
)
from vllm_dspark.checkpoint.layout import TARGET_DIR
from vllm_dspark.checkpoint.presets import PRESETS, preset_config
from vllm_dspark.config import K3DSparkConfig
from vllm_dspark.reference.drafter import ReferenceDrafter
from vllm_dspark.reference.io import example_inputs


def weight_bytes_per_block(drafter: ReferenceDrafter) -> dict[str, int]:
    """Bytes of weights one block reads, by component, in the drafter's storage dtypes."""
    c = drafter.config
    n = c.draft_block_size

    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    layers = sum(size(p) for p in drafter.layers.parameters())
    # The context path reads every layer's kv_a_proj_with_mqa once more (vLLM's context_kv_proj).
    context = (
        size(drafter.context_proj.weight)
        + size(drafter.context_norm.weight)
        + sum(
            size(layer.self_attn.kv_a_proj_with_mqa.weight)
            + size(layer.self_attn.kv_a_layernorm.weight)
            for layer in drafter.layers
        )
    )
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    heads = size(drafter.lm_head.weight) + size(drafter.final_norm.weight)
    heads += (
        sum(size(p) for p in drafter.confidence_head.parameters())
        if drafter.confidence_head is not None
        else 0
    )
    return {
        "layers": layers,
        "context": context,
        "lm_head_and_norms": heads,
        "markov_w2_per_position": n * size(w2),  # one GEMV per drafted position
        "gathered_rows": n * (size(drafter.embed_tokens.weight[0]) + size(w1[0])),
    }


def _drafters(
    config: K3DSparkConfig, model_dir: Path | None, seed: int
) -> dict[str, ReferenceDrafter]:
    """FP32- and BF16-compute drafters sharing one set of BF16 weights."""
    if model_dir is not None:
        from vllm_dspark.checkpoint.store import load_drafter_state_dict, load_target_heads

        config, tensors = load_drafter_state_dict(model_dir, dtype=torch.bfloat16)
        embed, lm_head = load_target_heads(model_dir / TARGET_DIR, dtype=torch.bfloat16)
    else:
        from vllm_dspark.checkpoint_tools.make_random import random_drafter_tensors, random_lm_head

        tensors = dict(random_drafter_tensors(config, seed=seed))
        embed, lm_head = tensors["embed_tokens.weight"], random_lm_head(config, seed=seed)
    tensors.pop("embed_tokens.weight", None)
    return {
        name: ReferenceDrafter.from_state_dict(
            config, tensors, embed_tokens=embed, lm_head=lm_head, compute_dtype=dtype
        )
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    }


GOALS = {"fp32": 3.0, "bf16": 2.0}  # a block within this many times streaming its weights once
_MEMCPY_BYTES = 1 << 28


def streaming(weight_bytes: int):
    """The baseline: a memcpy of ``_MEMCPY_BYTES``, its seconds scaled to ``weight_bytes`` read once
    (a copy moves its bytes twice: read and written)."""
    src = torch.empty(_MEMCPY_BYTES, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    copy = timed(lambda: dst.copy_(src))

    def run() -> dict[str, float]:
        seconds = copy()["seconds"]
        return {"seconds": seconds * weight_bytes / (2 * _MEMCPY_BYTES), "memcpy_seconds": seconds}

    return run


def run(
    preset: str,
    pairs: int = MIN_PAIRS,
    *,
    warmup: int = 1,
    model_dir: str | Path | None = None,
    context_len: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """Pair one block at ``preset`` (weights from ``model_dir`` if given, else random), FP32 and
    BF16 compute, with streaming its weights once."""
    config = preset_config(preset)
    drafters = _drafters(config, Path(model_dir) if model_dir is not None else None, seed)
    inputs = example_inputs(config, batch=1, context_len=context_len, seed=seed)
    components = weight_bytes_per_block(drafters["fp32"])
    weight_bytes = sum(components.values())
    baseline = streaming(weight_bytes)
    results = []
    for name, drafter in drafters.items():
        block = timed(
            lambda d=drafter: d.draft(
                inputs["aux_hidden_states"], inputs["context_positions"], inputs["anchor_ids"]
            )
        )
        with torch.inference_mode():
            result = paired(
                block, baseline, pairs=pairs, warmup=warmup, progress=f"{preset} {name}"
            )
        seconds = result["step_seconds"]["median"]
        results.append(
            {
                "compute": name,
                "goal_ratio": GOALS[name],
                "meets_goal": meets(result, GOALS[name]),
                "ms_per_token": seconds * 1e3 / config.draft_block_size,
                "weight_GBps": weight_bytes / seconds / 1e9,
                **result,
            }
        )
    return {
        "preset": preset,
        "block_size": config.draft_block_size,
        "context_len": context_len,
        "batch": 1,
        "threads": torch.get_num_threads(),
        "weight_storage_dtype": "bfloat16",
        "weight_bytes_per_block": weight_bytes,
        "weight_bytes_by_component": components,
        "memcpy_bytes": _MEMCPY_BYTES,
        "results": results,
    }


def table(payload: dict[str, Any]) -> str:
    rows = [
        {
            "compute": r["compute"].upper(),
            "block s: median (min–max)": spread_text(r["step_seconds"], ".3f"),
            "streaming s: median": r["baseline_seconds"]["median"],
            "ms/token": r["ms_per_token"],
            "weight GB/s": r["weight_GBps"],
            "vs streaming: median (min–max)": spread_text(r["ratio"], unit="×"),
            "goal (worst pair)": f"{r['goal_ratio']}×: {'met' if r['meets_goal'] else 'not met'}",
        }
        for r in payload["results"]
    ]
    pairs, warmup = payload["results"][0]["pairs"], payload["results"][0]["warmup"]
    return "\n".join(
        [
            format_table(rows, list(rows[0])),
            "",
            f"`{payload['preset']}` preset, batch 1, {payload['context_len']} context tokens, "
            f"{payload['weight_bytes_per_block'] / 1e9:.2f} GB of BF16 weights read per block, "
            f"{payload['threads']} threads; {pairs} pairs (block, memcpy) after {warmup} warm-up "
            "pair each.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.reference_latency",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", choices=list(PRESETS), default="k3")
    add_pairing_arguments(parser)
    parser.add_argument(
        "--context-len",
        type=int,
        default=8,
        help="context tokens projected with the block (default 8: one decode step's verified tokens)",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a drafter directory (e.g. from make-random, with target/) "
        "instead of fresh random weights",
    )
    args = parser.parse_args(argv)
    payload = run(
        args.preset,
        args.pairs,
        warmup=args.warmup,
        model_dir=args.model,
        context_len=args.context_len,
    )
    write_result("reference_latency", payload, table(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
