# SPDX-License-Identifier: Apache-2.0
"""``make demo``: the trained pair served through vLLM's ``dspark`` speculator on CPU, BF16 and FP8.

1. ``quantize`` the pair's drafter to FP8 (per-output-channel weight-only, compressed-tensors) and
   ``check`` the build;
2. serve the target through vLLM three times, in-process, under Triton's interpreter
   (:mod:`vllm_dspark.cpu_serving`): without speculation, with the BF16 drafter, with the FP8 build;
3. print what a user looks for: the target served (its architecture and path), drafted and accepted
   tokens per position from vLLM's own counters, τ (mean acceptance length, bonus token included),
   and last a verdict per drafter, naming the target: PASS when every prompt's greedy text equals no
   speculation's or parts from it at a near-tie (printed with its top-2 logprob gap), FAIL otherwise
   (exit status 1).

A target without a tokenizer (``train-pair --target kimi-k3``'s) has its sample shown as token ids.

The console shows only these steps and results; vLLM's logs, progress bars and everything else the
libraries write go to ``--out``/vllm.log. ``--out`` also gets ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vllm_dspark.tools.cli import ArgumentParser, add_out

RUNS = ("baseline", "bf16", "fp8")
LOG = "vllm.log"


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


@contextmanager
def console_only(log: Path) -> Iterator[Callable[[str], None]]:
    """File descriptors 1 and 2 go to ``log`` inside; yields the function that prints to the console.

    At the descriptor level, so that vLLM's log handler (bound to ``sys.stdout`` when vLLM is
    imported), tqdm's bars on ``sys.stderr`` and what C++ or Triton write directly all land in the log.
    """
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    console = os.fdopen(saved[1], "w", encoding="utf-8", closefd=False)
    with open(log, "w") as f:
        for fd in saved:
            os.dup2(f.fileno(), fd)

    def say(line: str = "") -> None:
        print(line, file=console, flush=True)

    try:
        yield say
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        console.close()
        for fd, dup in saved.items():
            os.dup2(dup, fd)
            os.close(dup)


def comparison(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per speculative run: each prompt's greedy agreement with the baseline (near-tie rule; where the
    text parts, the generated token's 1-based position and the baseline's top-2 gap there), the verdict
    (PASS unless a prompt differs) and vLLM's acceptance counts."""
    from vllm_dspark.cpu_serving.engines import acceptance, greedy_agreement, near_tie

    base = results["baseline"]["outputs"]
    cutoff = near_tie([g for o in base for g in o["gaps"]])
    rows = {}
    for run in RUNS[1:]:
        prompts = []
        for i, (o, b) in enumerate(zip(results[run]["outputs"], base, strict=True), 1):
            at, greedy = greedy_agreement(o["tokens"], b["tokens"], b["top2"], b["gaps"], cutoff)
            parted = greedy != "equal"
            prompts.append(
                {
                    "prompt": i,
                    "greedy": greedy,
                    "token": at + 1 if parted else None,
                    "gap": b["gaps"][at] if parted else None,
                }
            )
        found = {p["greedy"] for p in prompts}
        worst = next(g for g in ("differs", "near-tie", "equal") if g in found)
        rows[run] = {
            "greedy": worst,
            "verdict": "FAIL" if worst == "differs" else "PASS",
            "near_tie_cutoff": cutoff,
            "prompts": prompts,
            **acceptance(results[run]["counters"]),
        }
    return rows


def served_target(target: Path) -> str:
    """What the demo served: the target's architecture (its config.json's) and its path."""
    config = json.loads((target / "config.json").read_text())
    return f"{(config.get('architectures') or ['unknown architecture'])[0]} at {target}"


def verdict(run: str, row: dict[str, Any], target: str) -> str:
    """The run's verdict line: PASS or FAIL on ``target`` (:func:`served_target`), with each prompt
    whose text parts from no speculation's."""
    equal = sum(p["greedy"] == "equal" for p in row["prompts"])
    line = (
        f"{run}: {row['verdict']} (target {target}): {equal} of {len(row['prompts'])} prompts' "
        "greedy text equal to no speculation's"
    )
    cutoff = row["near_tie_cutoff"]
    for p in row["prompts"]:
        if p["greedy"] == "equal":
            continue
        relation = "<" if p["gap"] < cutoff else ">="
        # Under the cutoff yet differing: the token taken is neither of the top two.
        off_top2 = (
            ", neither of the top 2" if p["greedy"] == "differs" and p["gap"] < cutoff else ""
        )
        line += (
            f"; prompt {p['prompt']} {p['greedy']} at generated token {p['token']} "
            f"(top-2 logprob gap {p['gap']:.4f} {relation} cutoff {cutoff:.4f}{off_top2})"
        )
    return line


def exit_status(rows: dict[str, dict[str, Any]]) -> int:
    """1 when any run FAILs, else 0."""
    return int(any(r["verdict"] == "FAIL" for r in rows.values()))


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
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / LOG
    print(f"vLLM's logs and the tools' own output: {log}", flush=True)
    # Before vLLM loads, so that its logging set-up already writes into the log.
    with console_only(log) as say:
        return _demo(args, say, log)


def _demo(args: argparse.Namespace, say: Callable[[str], None], log: Path) -> int:
    """The three steps, printing through ``say``; the exit status."""
    from vllm_dspark import cpu_serving

    # Before vLLM loads: in-process engines, the interpreter runtime, a small KV cache.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cpu_serving.enable()
    from vllm_dspark.tools import cli

    fp8 = args.out / "drafter-fp8"
    say(f"\n=== 1/3 quantize {args.pair / 'drafter'} to FP8, then check it")
    argv_q = ["quantize", "--model-dir", str(args.pair / "drafter"), "--out", str(fp8)]
    rc = cli.main([*argv_q, "--quant-format", "fp8", "--overwrite"]) or cli.main(
        ["check", str(fp8)]
    )
    if rc:
        say(f"quantize or check failed (exit status {rc}); its output is in {log}")
        return rc
    report = json.loads((fp8 / "quantization_report.json").read_text())["overall"]
    say(
        f"quantize: {report['modules_quantized']} modules to fp8, "
        f"{report['bytes_before'] / 2**20:.1f} MiB -> {report['bytes_after'] / 2**20:.1f} MiB, "
        f"weight SNR mean {report['snr_db_mean']:.1f} dB; check: OK"
    )

    target = served_target(args.pair / "target")
    say(
        f"\n=== 2/3 serve the pair with vLLM's dspark speculator (CPU, Triton's interpreter): {target}"
    )

    from vllm_dspark.cpu_serving.pair import heldout_prompts, serve_pair

    models = {"target": args.pair / "target", "drafter": args.pair / "drafter", "drafter-fp8": fp8}
    prompts = heldout_prompts(args.pair, args.prompts, args.prompt_tokens)
    results = serve_pair(models, prompts, args.max_tokens, runs=RUNS, log=say)
    rows = comparison(results)

    say("\n=== 3/3 results")
    decode = _decoder(args.pair / "target")
    say(f"target: {target}")
    say(f"prompt 1: {decode(prompts[0])}")
    for run in RUNS:
        say(f"  {run:>8}: {decode(results[run]['outputs'][0]['tokens'])}")
    say(
        f"\n{len(prompts)} prompts x {args.max_tokens} tokens, greedy; vLLM's spec-decode counters; "
        "τ counts the bonus token. Greedy text: equal, or a near-tie (top-2 logprobs within a "
        "tenth of the median gap) resolved the other way.\n"
    )
    say(table(rows))
    from vllm_dspark.safety import staged

    with staged(args.out / "results.json", directory=False) as staging:
        document = {"target": target, "runs": results, "comparison": rows}
        staging.write_text(json.dumps(document, indent=1) + "\n")
    say(f"wrote {args.out / 'results.json'}\n")
    for run, row in rows.items():
        say(verdict(run, row, target))
    return exit_status(rows)


def _decoder(target: Path) -> Callable[[list[int]], str]:
    """Token ids to the text the target's tokenizer makes of them; the ids themselves for a target
    without one (``make-random --target kimi-k3``'s)."""
    if (
        not (target / "tokenizer.json").is_file()
        and not (target / "tokenizer_config.json").is_file()
    ):
        return lambda ids: f"token ids {ids}"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    return lambda ids: repr(tokenizer.decode(ids))


if __name__ == "__main__":
    from vllm_dspark.tools.cli import guarded

    sys.exit(guarded("make demo", lambda: main()))
