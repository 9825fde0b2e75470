# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark accept``: a drafter's measured acceptance against its target, per format.

Real speculative decoding on CPU: the target (transformers, FP32, with its KV cache) verifies each
block that the reference drafter drafts from the target's own aux hidden states (the residual stream
entering layer ``target_layer_ids + 1``, as vLLM collects them, rounded to BF16 as vLLM hands them
over). Greedy keeps the drafted prefix equal to the target's argmax; ``--temperature 1`` samples the
drafts and runs vLLM 0.33's block verification (:mod:`vllm_dspark.ops.verify`). ``--scheduled`` adds
vLLM's adaptive verification, the confidence head choosing how many drafts the target verifies.
τ counts the bonus token; every figure has a 95 % bootstrap CI over prompts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from vllm_dspark.drift import builtin_variants, default_variants
from vllm_dspark.safety import check_output, staged
from vllm_dspark.tools.cli import ArgumentParser, add_out, add_shared


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="vllm-dspark accept",
        description=__doc__.split("\n\n", 1)[1] if "\n\n" in __doc__ else __doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--target", type=Path, required=True, help="the target model directory")
    parser.add_argument(
        "--drafter", type=Path, required=True, help="the unquantized drafter directory"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help="fp32 (the reference), bf16, the registered formats (quantized on the fly) or "
        "checkpoint directories (default: bf16 and every format)",
    )
    parser.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help=".json (strings or token-id lists), .jsonl, or a text file cut into windows "
        "(default: the drift corpus, cut into windows)",
    )
    parser.add_argument("--num-prompts", type=int, default=16, help="windows cut from a text file")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per window")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens decoded per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, choices=[0.0, 1.0])
    parser.add_argument(
        "--scheduled",
        action="store_true",
        help="also run adaptive verification: the confidence head picks each step's verify budget",
    )
    parser.add_argument(
        "--token-cost",
        type=float,
        default=0.1,
        help="--scheduled's cost of one verified token relative to a step's fixed cost (default 0.1)",
    )
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples")
    parser.add_argument(
        "--draft-kv",
        choices=("bf16", "fp8"),
        default="bf16",
        help="the draft's KV cache: bf16 (the model dtype) or fp8 (E4M3 latents, as vLLM's fp8 MLA "
        "cache stores them, with the per-layer k_scale the variant's checkpoint stores, else 1.0; "
        "the output says which)",
    )
    sweep = parser.add_argument_group(
        "context sweep",
        "τ against context length, prompts padded with real text (--prompts: a text file)",
    )
    sweep.add_argument(
        "--context-sweep",
        type=int,
        nargs="+",
        metavar="LENGTH",
        help="measure τ at these context lengths instead of the per-format table (default "
        "variant: bf16); writes context_sweep.{json,md} and tau_vs_context.png",
    )
    cost = sweep.add_mutually_exclusive_group()
    cost.add_argument(
        "--step-cost",
        type=float,
        nargs=2,
        metavar=("FIXED", "PER_TOKEN"),
        help="a speculative step's time over a plain one's: FIXED + PER_TOKEN × context "
        "(default: the tokenspeed#1132 prior, K3 DSpark on MI355X)",
    )
    cost.add_argument(
        "--step-cost-through",
        type=float,
        nargs=2,
        metavar=("CONTEXT", "RATIO"),
        help="the step-cost line through one measured (context, ratio) point, FIXED 1",
    )
    add_out(parser, "results directory")
    add_shared(parser, seed=True, progress=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.variants = args.variants or (["bf16"] if args.context_sweep else list(default_variants()))
    unknown = [v for v in args.variants if v not in builtin_variants() and not Path(v).is_dir()]
    if unknown:
        raise ValueError(
            f"unknown variant(s) {', '.join(map(repr, unknown))}: use "
            f"{', '.join(builtin_variants())} or checkpoint directories"
        )
    if args.max_tokens < 1 or args.num_prompts < 2 or args.prompt_len < 1 or args.resamples < 1:
        raise ValueError(
            "--max-tokens, --prompt-len and --resamples must be >= 1, --num-prompts >= 2"
        )
    checkpoints = [v for v in args.variants if Path(v).is_dir()]
    check_output(args.out, [args.target, args.drafter, args.prompts, *checkpoints], flag="--out")
    from vllm_dspark.drift.acceptance import AcceptSpec, run, summary_lines, write_report

    spec = AcceptSpec(
        target=args.target,
        drafter=args.drafter,
        variants=tuple(args.variants),
        prompts=args.prompts,
        num_prompts=args.num_prompts,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        scheduled=args.scheduled,
        token_cost=args.token_cost,
        seed=args.seed,
        resamples=args.resamples,
        progress=not args.no_progress,
        draft_kv=args.draft_kv,
    )
    if args.context_sweep:
        return _context_sweep(args, spec)
    with staged(args.out, directory=True, merge=True) as staging:
        t0 = time.perf_counter()
        results = run(spec)
        results["timing"]["total_s"] = time.perf_counter() - t0
        files = [args.out / f.name for f in write_report(results, staging)]
    print("\n".join(summary_lines(results)))
    print("\n".join(f"wrote {f}" for f in files))
    return 0


def _context_sweep(args: argparse.Namespace, spec) -> int:
    """``--context-sweep``: τ per length and the break-even length under the step-cost model."""
    from vllm_dspark.drift import context_sweep
    from vllm_dspark.ops.speculation_cost import TOKENSPEED_K3_MI355X, StepCost

    if min(args.context_sweep) < 1:
        raise ValueError("--context-sweep lengths must be >= 1")
    if args.step_cost:
        cost, source = StepCost(*args.step_cost), "--step-cost"
    elif args.step_cost_through:
        context, ratio = args.step_cost_through
        cost, source = StepCost.through(int(context), ratio), "--step-cost-through"
    else:
        cost, source = TOKENSPEED_K3_MI355X, "the tokenspeed#1132 prior (K3 DSpark, MI355X)"
    print(f"step cost: {source}: {cost.fixed:g} + {cost.per_context_token:.3g} × context")
    sweep = context_sweep.SweepSpec(spec, tuple(sorted(set(args.context_sweep))), cost, source)
    with staged(args.out, directory=True, merge=True) as staging:
        t0 = time.perf_counter()
        results = context_sweep.run(sweep)
        results["timing"]["total_s"] = time.perf_counter() - t0
        files = [args.out / f.name for f in context_sweep.write_report(results, staging)]
    print("\n".join(context_sweep.summary_lines(results)))
    print("\n".join(f"wrote {f}" for f in files))
    return 0


if __name__ == "__main__":
    from vllm_dspark.tools.cli import main as cli_main

    sys.exit(cli_main(["accept", *sys.argv[1:]]))
