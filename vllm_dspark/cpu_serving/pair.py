# SPDX-License-Identifier: Apache-2.0
"""Serve a target and its drafter through vLLM's ``dspark`` speculator: no speculation, BF16 and FP8 drafters.

A pair directory is what ``vllm-dspark train-pair`` writes: ``target/``, ``drafter/`` and
``heldout_prompts.json``. ``python -m vllm_dspark.cpu_serving.pair --pair DIR --out DIR`` serves it
in one process (in-process engines, one after another) and writes ``results.json``: per engine,
the generated tokens, vLLM's spec-decode counters and the generate time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_dspark.cpu_serving import engines

BLOCK = 7  # the drafter's block_size: what num_speculative_tokens must be
# Each run: the drafter it serves (None: the target alone) and its extra speculative-config fields.
RUNS: dict[str, tuple[str | None, dict[str, str]]] = {
    "baseline": (None, {}),
    "bf16": ("drafter", {}),
    "fp8": ("drafter-fp8", {}),
    # A W8A8 build (fp8-dynamic): inputs quantized per token on the plugin's CPU kernel.
    "fp8-dynamic": ("drafter-fp8-dynamic", {}),
    # The same numerics in NVIDIA ModelOpt's layout (FP8_PER_CHANNEL_PER_TOKEN, excludes by checkpoint name).
    "modelopt": ("drafter-modelopt", {}),
    # A causal-block drafter of the same target (train-pair --causal --target-pair: Block5 / K3.1-Pro's kind).
    "causal": ("drafter-causal", {}),
    "probabilistic": (
        "drafter",
        {"draft_sample_method": "probabilistic", "rejection_sample_method": "block"},
    ),
}
# What serves unless asked: the pair as `train-pair` writes it and its FP8 build.
DEFAULT_RUNS = ("baseline", "bf16", "fp8", "probabilistic")
# An engine run hook: called with the run's name and its engine before generating, it returns the
# function that, after generating, gives what the run adds to its results.
Observer = Callable[[str, Any], Callable[[], dict[str, Any]]]


def heldout_prompts(pair: Path, count: int, tokens: int) -> list[list[int]]:
    """The first ``count`` held-out prompts of ``pair``, cut to ``tokens`` token ids each."""
    prompts = json.loads((pair / "heldout_prompts.json").read_text())["prompts"]
    return [p["token_ids"][:tokens] for p in prompts[:count]]


def sampling(run: str, prompts: int, max_tokens: int) -> list:
    """Greedy for every request, but in the probabilistic run only the first: the rest sample, seeded."""
    from vllm import SamplingParams

    def params(temperature: float = 0.0, seed: int | None = None, logprobs: int | None = None):
        return SamplingParams(
            temperature=temperature,
            seed=seed,
            max_tokens=max_tokens,
            ignore_eos=True,
            detokenize=False,
            logprobs=logprobs,
        )

    if run == "baseline":  # top-2 logprobs: the near-tie rule compares the others against them
        return [params(logprobs=2)] * prompts
    if run == "probabilistic":
        return [params()] + [params(0.8 + 0.2 * i, seed=1 + i) for i in range(prompts - 1)]
    return [params()] * prompts


def serve_pair(
    models: Mapping[str, Path],
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    runs: Sequence[str] = DEFAULT_RUNS,
    platform: str = "cpu",
    observe: Observer | None = None,
    log: Callable[[str], None] = lambda line: None,
    **options: Any,
) -> dict[str, dict[str, Any]]:
    """Each of ``runs`` on a fresh engine over ``models`` (``target`` and the drafters :data:`RUNS` name),
    started with ``options`` (:func:`.engines.engine`'s)."""
    requests = [{"prompt_token_ids": list(p)} for p in prompts]
    results: dict[str, dict[str, Any]] = {}
    for i, run in enumerate(runs, 1):
        drafter, extra = RUNS[run]
        config = None if drafter is None else engines.dspark_config(models[drafter], BLOCK, **extra)
        log(f"[{i}/{len(runs)}] {run}: starting an engine")

        def use(llm, run=run) -> dict[str, Any]:
            finish = observe(run, llm) if observe is not None else dict
            start = time.perf_counter()
            outputs = engines.outputs(
                llm.generate(requests, sampling(run, len(requests), max_tokens))
            )
            seconds = time.perf_counter() - start
            return {
                "outputs": outputs,
                "counters": engines.counters(llm),
                "generate_seconds": seconds,
                **finish(),
            }

        results[run] = engines.served(platform, models["target"], config, use, **options)
        log(f"[{i}/{len(runs)}] {run}: {results[run]['generate_seconds']:.1f} s generating")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--pair", type=Path, required=True, help="target/, drafter/, heldout_prompts.json"
    )
    parser.add_argument(
        "--fp8", type=Path, help="the drafter's FP8 build (default: PAIR/drafter-fp8)"
    )
    parser.add_argument("--out", type=Path, required=True, help="where results.json goes")
    parser.add_argument("--platform", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=10)
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(DEFAULT_RUNS))
    args = parser.parse_args(argv)
    if args.platform == "cpu":
        from vllm_dspark.cpu_serving import enable

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        enable()
    models = {
        "target": args.pair / "target",
        "drafter": args.pair / "drafter",
        "drafter-fp8": args.fp8 or args.pair / "drafter-fp8",
        "drafter-fp8-dynamic": args.pair / "drafter-fp8-dynamic",
        "drafter-modelopt": args.pair / "drafter-modelopt",
        "drafter-causal": args.pair / "drafter-causal",
    }
    prompts = heldout_prompts(args.pair, args.prompts, args.prompt_tokens)
    results = serve_pair(
        models,
        prompts,
        args.max_tokens,
        runs=args.runs,
        platform=args.platform,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {
        "platform": args.platform,
        "block": BLOCK,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
    }
    (args.out / "results.json").write_text(json.dumps({**settings, **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
