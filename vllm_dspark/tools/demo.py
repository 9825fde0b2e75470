# SPDX-License-Identifier: Apache-2.0
"""``make demo``: the trained pair served through vLLM's ``dspark`` speculator on CPU, BF16 and FP8.

1. ``quantize`` the pair's drafter to FP8 (per-output-channel weight-only, compressed-tensors) and
   ``check`` the build;
2. serve the target through vLLM three times, in-process, under Triton's interpreter
   (:mod:`vllm_dspark.cpu_serving`): without speculation, with the BF16 drafter, with the FP8 build;
3. print what a user looks for: greedy text equal with and without speculation, drafted and accepted
   tokens per position from vLLM's own counters, and τ (mean acceptance length, bonus token
   included); then the quantize / check summary. ``--out`` also gets ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from vllm_dspark.tools.cli import ArgumentParser, add_out

RUNS = ("baseline", "bf16", "fp8")


def _step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m vllm_dspark.tools.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--pair",
        type=Path,
        required=True,
        help="a train-pair directory: target/, drafter/, heldout_prompts.json",
    )
    add_out(parser, "demo output directory (default demo-out)", required=False, default="demo-out")
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts (default 4)")
    parser.add_argument("--prompt-tokens", type=int, default=24, help="tokens per prompt")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt")
    return parser


def comparison(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per speculative run: greedy agreement with the baseline (near-tie rule) and vLLM's acceptance."""
    from vllm_dspark.cpu_serving.engines import acceptance, greedy_agreement, near_tie

    base = results["baseline"]["outputs"]
    tie = near_tie([g for o in base for g in o["gaps"]])
    rows = {}
    for run in RUNS[1:]:
        verdicts = [
            greedy_agreement(o["tokens"], b["tokens"], b["top2"], b["gaps"], tie)[1]
            for o, b in zip(results[run]["outputs"], base, strict=True)
        ]
        worst = (
            "differs"
            if "differs" in verdicts
            else "near-tie"
            if "near-tie" in verdicts
            else "equal"
        )
        rows[run] = {"greedy": worst, **acceptance(results[run]["counters"])}
    return rows


def table(rows: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| drafter | greedy text vs no speculation | drafts | accepted per position (1..7) | τ |",
        "|---|---|---|---|---|",
    ]
    for run, r in rows.items():
        per_position = " ".join(str(a) for a in r["accepted_per_position"]) or "-"
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
        lines.append(f"| {run} | {r['greedy']} | {r['drafts']} | {per_position} | {tau} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("target", "drafter", "heldout_prompts.json"):
        if not (args.pair / name).exists():
            raise ValueError(
                f"--pair {args.pair} has no {name}; pass a `vllm-dspark train-pair` directory "
                "(the repository's is tests/data/pair)"
            )
    from vllm_dspark.doctor.torch_builds import refuse_mismatched_torch_builds

    refuse_mismatched_torch_builds()  # before transformers and vLLM load
    from vllm_dspark import cpu_serving

    # Before vLLM loads: in-process engines, the interpreter runtime, a small KV cache.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cpu_serving.enable()
    from vllm_dspark.tools import cli

    args.out.mkdir(parents=True, exist_ok=True)
    fp8 = args.out / "drafter-fp8"
    _step(f"1/3 quantize {args.pair / 'drafter'} to FP8, then check it")
    argv_q = ["quantize", "--model-dir", str(args.pair / "drafter"), "--out", str(fp8)]
    rc = cli.main([*argv_q, "--quant-format", "fp8", "--overwrite"]) or cli.main(
        ["check", str(fp8)]
    )
    if rc:
        return rc

    _step("2/3 serve the pair with vLLM's dspark speculator (CPU, Triton's interpreter)")
    from transformers import AutoTokenizer

    from vllm_dspark.cpu_serving.pair import heldout_prompts, serve_pair

    models = {"target": args.pair / "target", "drafter": args.pair / "drafter", "drafter-fp8": fp8}
    prompts = heldout_prompts(args.pair, args.prompts, args.prompt_tokens)
    results = serve_pair(models, prompts, args.max_tokens, runs=RUNS, log=print)
    rows = comparison(results)

    _step("3/3 results")
    tokenizer = AutoTokenizer.from_pretrained(str(args.pair / "target"))
    print(f"prompt 1: {tokenizer.decode(prompts[0])!r}")
    for run in RUNS:
        print(f"  {run:>8}: {tokenizer.decode(results[run]['outputs'][0]['tokens'])!r}")
    print(
        f"\n{len(prompts)} prompts x {args.max_tokens} tokens, greedy; vLLM's spec-decode counters; "
        "τ counts the bonus token. Greedy text: equal, or a near-tie (top-2 logprobs within a "
        "tenth of the median gap) resolved the other way.\n"
    )
    print(table(rows))
    report = json.loads((fp8 / "quantization_report.json").read_text())["overall"]
    print(
        f"\nquantize: {report['modules_quantized']} modules to fp8, "
        f"{report['bytes_before'] / 2**20:.1f} MiB -> {report['bytes_after'] / 2**20:.1f} MiB, "
        f"weight SNR mean {report['snr_db_mean']:.1f} dB; check: OK"
    )
    from vllm_dspark.safety import staged

    with staged(args.out / "results.json", directory=False) as staging:
        staging.write_text(json.dumps({"runs": results, "comparison": rows}, indent=1) + "\n")
    print(f"wrote {args.out / 'results.json'}")
    return 1 if any(r["greedy"] == "differs" for r in rows.values()) else 0


if __name__ == "__main__":
    from vllm_dspark.tools.cli import guarded

    sys.exit(guarded("make demo", lambda: main()))
