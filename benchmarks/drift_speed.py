# SPDX-License-Identifier: Apache-2.0
"""Drift-harness throughput at real shapes: each variant's pass paired with the FP32 reference's.

``vllm-dspark eval`` runs the FP32 reference once per block and then every variant in BF16 compute
(quantized variants dequantized to BF16 at load), so its cost is those two kinds of pass. Here
they alternate on the same batch of blocks (variant, reference, variant, reference, ...;
:func:`benchmarks.common.paired`), each pass exactly as the harness runs it: backbone, Markov
rollout, confidence, and for a variant the teacher-forced rollout and the divergences against the
reference's logits. One variant is held at a time beside the reference, as in the harness. A
variant's load (quantizing on the fly) is a one-off cost, timed once and shown for context. Every
format's pass is the same BF16 compute on weights dequantized at load, so the committed run pairs
``bf16`` and ``fp8``; ``--variants`` adds ``mxfp4`` / ``nvfp4`` (their loads take minutes at k3).

The ``k3`` preset holds up to ~17 GiB; on shared machines run it under the k3 lock:

    flock /tmp/k3.lock python -m benchmarks drift-speed [--model /tmp/k3]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.common import (
    add_drafter_arguments,
    add_pairing_arguments,
    format_table,
    paired,
    preset_drafter,
    spread_text,
    timed,
    write_result,
)
from vllm_dspark.drift.harness import (
    Batch,
    EvalSpec,
    ReferenceCell,
    batches,
    make_blocks,
    reference_cell,
    validate,
    variant_cell,
)
from vllm_dspark.drift.variants import load_reference, load_variant
from vllm_dspark.reference.drafter import ReferenceDrafter
from vllm_dspark.safety import spill_dir

REGIME = "heavy"  # synthetic aux states: no causal boot pass to build them, same cost per block


def _variant_pass(
    variant: ReferenceDrafter, name: str, ref: ReferenceCell, batch: Batch, bar: tqdm
) -> Callable[[], Any]:
    """One pass of ``variant`` over ``batch`` as the harness runs it, against the reference's logits."""
    return lambda: variant_cell(variant, ref, iter([batch]), bar, name, absorbed=True)


def run(
    model: Path,
    variants: tuple[str, ...],
    *,
    batch_size: int,
    context_len: int,
    pairs: int,
    warmup: int,
    seed: int = 0,
) -> dict[str, Any]:
    """Pair each variant's pass with the reference's on one batch of ``batch_size`` blocks."""
    spec = EvalSpec(
        model=str(model),
        variants=variants,
        regimes=(REGIME,),
        blocks=batch_size,
        batch_size=batch_size,
        context_len=context_len,
        seed=seed,
        progress=False,
    )
    start = time.perf_counter()
    config, reference, heads = load_reference(spec.model)
    validate(spec, config)
    load_reference_s = time.perf_counter() - start
    blocks = make_blocks(spec, config, reference)
    (batch,) = batches(spec, config, blocks, REGIME, spec.all_positions()[0])
    quiet = tqdm(disable=True)
    shape = (batch_size, config.draft_block_size, config.vocab_size)
    rows = []
    with spill_dir() as spill, torch.inference_mode():

        def reference_pass(name: str = "timed.npy"):
            return reference_cell(reference, iter([batch]), spill / name, shape, quiet)

        ref = reference_pass("reference.npy")  # what every variant pass compares with
        for name in variants:
            start = time.perf_counter()
            variant, source = load_variant(name, spec.model, config, heads, reference)
            load_s = time.perf_counter() - start
            result = paired(
                timed(_variant_pass(variant, name, ref, batch, quiet)),
                timed(reference_pass),
                pairs=pairs,
                warmup=warmup,
                progress=f"drift-speed {name}",
            )
            rows.append(
                {
                    "variant": name,
                    "source": source,
                    "load_s": load_s,
                    "variant_blocks_per_s": batch_size / result["step_seconds"]["median"],
                    "reference_blocks_per_s": batch_size / result["baseline_seconds"]["median"],
                    **result,
                }
            )
            del variant
            gc.collect()
        del ref  # unmap the spill file before its directory goes
    return {
        "model": str(model),
        "regime": REGIME,
        "batch_size": batch_size,
        "context_len": context_len,
        "block_size": config.draft_block_size,
        "load_reference_s": load_reference_s,
        "results": rows,
    }


def table(payload: dict[str, Any], preset: str) -> str:
    rows = [
        {
            "variant (BF16 compute)": r["variant"],
            "load s (once)": r["load_s"],
            "variant pass s: median (min–max)": spread_text(r["step_seconds"], ".3g"),
            "reference pass s: median (min–max)": spread_text(r["baseline_seconds"], ".3g"),
            "variant blocks/s": r["variant_blocks_per_s"],
            "reference blocks/s": r["reference_blocks_per_s"],
            "time vs reference: median (min–max)": spread_text(r["ratio"], unit="×"),
        }
        for r in payload["results"]
    ]
    first = payload["results"][0]
    return "\n".join(
        [
            format_table(rows, list(rows[0])),
            "",
            f"`{preset}` preset, one batch of {payload['batch_size']} blocks ({payload['regime']} "
            f"regime, context {payload['context_len']} tokens) per pass; {first['pairs']} pairs "
            f"(variant pass, FP32 reference pass) after {first['warmup']} warm-up pair per variant. "
            "Load s includes quantizing on the fly.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks drift-speed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_drafter_arguments(parser)
    parser.add_argument("--variants", nargs="+", default=["bf16", "fp8"])
    parser.add_argument(
        "--batch-size", type=int, default=64, help="blocks per pass (default 64, as `eval`)"
    )
    parser.add_argument("--context-len", type=int, default=32)
    add_pairing_arguments(parser, per=" per variant")
    args = parser.parse_args(argv)
    payload = run(
        preset_drafter(args.model, args.preset),
        tuple(args.variants),
        batch_size=args.batch_size,
        context_len=args.context_len,
        pairs=args.pairs,
        warmup=args.warmup,
    )
    payload["preset"] = args.preset
    write_result("drift_speed", payload, table(payload, args.preset))
    return 0


if __name__ == "__main__":
    sys.exit(main())
