# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark eval``: measure a quantized drafter's drift from its FP32 reference."""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import vllm_dspark.drift as drift_pkg
from vllm_dspark.checkpoint.layout import FP8_RECIPE, QUANT_FORMATS
from vllm_dspark.drift import DEFAULT_REGIMES, REGIMES, SELF_CHECK, default_variants
from vllm_dspark.findings import Finding, FindingError
from vllm_dspark.safety import check_output, staged
from vllm_dspark.tools.cli import ArgumentParser, add_model, add_out, add_shared

DEFAULT_SWEEP: tuple[int, ...] = (
    1 << 10,
    1 << 12,
    1 << 14,
    1 << 15,
    1 << 16,
    1 << 17,
    1 << 18,
    1 << 19,
    1023 << 10,
)


def parse_position(text: str) -> int:
    """``4096``, ``4k`` (x1024) or ``1M`` (x1024^2) -> an int position."""
    m = re.fullmatch(r"(\d+)([kKmM]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a position (e.g. 4096, 32k, 1M)")
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20}[m.group(2).lower()]


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="vllm-dspark eval",
        description="Measure how far BF16 / quantized builds of a K3 DSpark drafter drift from its FP32 "
        "reference on identical inputs, with 95 % bootstrap CIs. Writes results.json, results.md and "
        "PNG plots into --out. The reference's logits are kept on disk under $TMPDIR while it runs "
        "(4.6 MB per block and regime at the real vocabulary).",
        epilog=drift_pkg.METHOD,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model(parser, "the unquantized drafter directory (the reference)", type=str)
    parser.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help=f"bf16, {', '.join(QUANT_FORMATS)} (quantized on the fly), {SELF_CHECK} (self-check), "
        "or checkpoint directories (default: bf16 and every format)",
    )
    parser.add_argument(
        "--regimes",
        nargs="+",
        default=list(DEFAULT_REGIMES),
        choices=list(REGIMES),
        help="aux hidden-state regimes (default: " + " ".join(DEFAULT_REGIMES) + "); real runs "
        "the target model given as --target over the corpus",
    )
    parser.add_argument(
        "--blocks", type=int, default=1024, help="blocks per regime and position (default 1024)"
    )
    add_out(parser, "results directory")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--positions",
        nargs="*",
        type=parse_position,
        default=None,
        help="anchor positions to sweep (e.g. 1k 32k 128k 1M); with no values: "
        + " ".join(str(p) for p in DEFAULT_SWEEP)
        + ". The base position --context-len is always run.",
    )
    parser.add_argument(
        "--corpus",
        default=None,
        help="token stream: .npy / .json / .txt token ids, or a text file with --tokenizer "
        "(default: a small built-in corpus, byte-level ids)",
    )
    parser.add_argument(
        "--tokenizer", default=None, help="Hugging Face tokenizer directory for a text --corpus"
    )
    parser.add_argument(
        "--context-len", type=int, default=32, help="context tokens before each block (default 32)"
    )
    parser.add_argument(
        "--target",
        default=None,
        help="the target's directory (shared embedding and lm_head; default MODEL/target); the "
        "real regime needs the full target model here",
    )
    parser.add_argument(
        "--include-layers",
        nargs="+",
        default=list(FP8_RECIPE),
        help="module kinds quantized by the on-the-fly formats (default: the published FP8 "
        "build's: " + " ".join(FP8_RECIPE) + ")",
    )
    parser.add_argument(
        "--batch-size", type=int, default=32, help="blocks per forward pass (default 32)"
    )
    parser.add_argument(
        "--resamples", type=int, default=1000, help="bootstrap resamples (default 1000)"
    )
    add_shared(parser, seed=True, progress=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.variants = args.variants or list(default_variants())
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise FindingError(
            Finding("--device cuda, but torch sees no CUDA device", "use --device cpu")
        )
    from vllm_dspark.drift.harness import EvalSpec, run
    from vllm_dspark.drift.report import ceiling_summary, write_report

    positions = () if args.positions is None else tuple(args.positions or DEFAULT_SWEEP)
    spec = EvalSpec(
        model=args.model,
        variants=tuple(args.variants),
        regimes=tuple(dict.fromkeys(args.regimes)),
        blocks=args.blocks,
        batch_size=args.batch_size,
        context_len=args.context_len,
        positions=positions,
        seed=args.seed,
        device=args.device,
        corpus=args.corpus,
        tokenizer=args.tokenizer,
        target=args.target,
        include_layers=tuple(args.include_layers),
        resamples=args.resamples,
        progress=not args.no_progress,
    )
    out = Path(args.out)
    checkpoints = [
        v for v in args.variants if Path(v).exists()
    ]  # not the built-in names (bf16, fp8, ...)
    check_output(
        out, [args.model, *checkpoints, args.corpus, args.tokenizer, args.target], flag="--out"
    )
    if out.exists() and not out.is_dir():
        raise FindingError(
            Finding(f"--out {out} exists and is not a directory", "pass a results directory")
        )
    # Staged from the start: an unwritable --out fails now, not after the run, and an interrupted or
    # failed run leaves no truncated results.json.
    with staged(out, directory=True, merge=True) as staging:
        t0 = time.perf_counter()
        results = run(spec)
        results["timing"]["total_s"] = time.perf_counter() - t0
        files = [out / f.name for f in write_report(results, staging)]
    print(ceiling_summary(results))
    print("\n".join(f"wrote {f}" for f in files))
    return 0


if __name__ == "__main__":
    from vllm_dspark.tools.cli import main as cli_main

    sys.exit(cli_main(["eval", *sys.argv[1:]]))
