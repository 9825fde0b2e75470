#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Kimi-K3 with the DSpark drafter through vLLM's offline Python API (``vllm.LLM``).

One node, tensor-parallel across its GPUs (8 x H200, or a 4 x GB300 tray). The draft attention
backend follows the GPU: FLASHINFER_MLA on compute capability 10.x, TRITON_MLA on 9.x. Sampling
(temperature > 0) uses probabilistic drafting with block verification; temperature 0 uses greedy
drafting, where block verification would be a no-op.

    python examples/offline_quickstart.py --tensor-parallel-size 8 --temperature 1.0

With the plugin installed, vLLM runs ``vllm-dspark doctor``'s config checks while it builds the
speculative config, so a wrong setting fails here, before the target's weights load.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from itertools import zip_longest
from typing import Any

PROMPTS = [
    "Prove that there are infinitely many primes.",
    "Write a Python function that merges two sorted lists in linear time.",
    "Summarise the causes of the French Revolution in five bullet points.",
]


def build_speculative_config(
    drafter: str, attention_backend: str, temperature: float
) -> dict[str, Any]:
    """The DSpark speculative config for sampling (T > 0) or greedy (T = 0) clients."""
    config: dict[str, Any] = {
        "method": "dspark",
        "model": drafter,
        "num_speculative_tokens": 7,  # the drafter's block_size
        "attention_backend": attention_backend,
    }
    if temperature > 0:
        config |= {"draft_sample_method": "probabilistic", "rejection_sample_method": "block"}
    else:
        config["draft_sample_method"] = "greedy"
    return config


def acceptance(metrics: Sequence[Any]) -> dict[str, Any]:
    """Mean acceptance length and per-position rates from ``LLM.get_metrics()``."""
    totals: dict[str, float] = {}
    per_pos: list[float] = []
    for m in metrics:
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [
                a + b for a, b in zip_longest(per_pos, m.values, fillvalue=0.0)
            ]  # summed over engines
        elif m.name.startswith("vllm:spec_decode_"):
            totals[m.name] = totals.get(m.name, 0.0) + m.value
    drafts = totals.get("vllm:spec_decode_num_drafts", 0.0)
    accepted = totals.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    return {
        "num_drafts": drafts,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
        "per_position_acceptance_rate": [v / drafts for v in per_pos] if drafts else [],
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="moonshotai/Kimi-K3", help="the target (default %(default)s)")
    p.add_argument(
        "--drafter",
        default="Inferact/Kimi-K3-DSpark",
        help="the DSpark drafter (default %(default)s)",
    )
    p.add_argument("--tensor-parallel-size", type=int, default=8)
    p.add_argument(
        "--attention-backend", help="draft attention backend (default: by this GPU's capability)"
    )
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=512)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from vllm import LLM, SamplingParams

    from vllm_dspark.doctor.checks import recommended_attention_backend
    from vllm_dspark.doctor.facts import machine_facts

    backend = args.attention_backend or recommended_attention_backend(machine_facts())
    llm = LLM(
        model=args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        speculative_config=build_speculative_config(args.drafter, backend, args.temperature),
        trust_remote_code=True,
        disable_log_stats=False,  # keeps the speculative-decoding counters that get_metrics() reads
    )
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for output in llm.generate(PROMPTS, params):
        print(f"--- {output.prompt!r}\n{output.outputs[0].text}\n")
    stats = acceptance(llm.get_metrics())
    print(
        f"drafts: {stats['num_drafts']:.0f}  mean acceptance length: {stats['mean_acceptance_length']}"
    )
    print("per-position acceptance:", [round(r, 3) for r in stats["per_position_acceptance_rate"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
