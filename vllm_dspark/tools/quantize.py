# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark quantize``: a drafter to a quantized format, in the compressed-tensors layout vLLM loads or ModelOpt's."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_dspark.checkpoint.layout import (
    FP8_RECIPE,
    MODULE_SETS,
    QUANT_FORMATS,
    QUANTIZABLE_KINDS,
    REPORT_NAME,
)
from vllm_dspark.tools.cli import ArgumentParser, add_model, add_out, add_shared


def registered_format(name: str) -> str:
    """``name`` if a format of that name is registered (formats load only once a name is given)."""
    from vllm_dspark.checkpoint import formats

    try:
        return formats.get(name).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="vllm-dspark quantize",
        description="Quantize a K3 DSpark drafter checkpoint (weight-only, W8A8 or W4A4), in the "
        "compressed-tensors format vLLM loads or ModelOpt's. Non-included tensors are copied bit-identical; a report "
        f"({REPORT_NAME}.json/.md) gives params quantized, sizes and weight SNR.",
        epilog="No weight or activation calibration; SmoothQuant is off on purpose (why: "
        "docs/tools/quantize.md). --kv-cache-scheme fp8 calibrates the draft's KV-cache scales.",
    )
    # qstream's underscore spellings (--model_dir) still parse: ArgumentParser takes both.
    add_model(parser, "the BF16 drafter checkpoint directory")
    add_out(parser, "where to write the quantized checkpoint", "--output-dir")
    parser.add_argument(
        "--quant-format",
        required=True,
        type=registered_format,
        metavar="{" + ",".join(QUANT_FORMATS) + "}",
        help="; ".join(QUANT_FORMATS.values()),
    )
    parser.add_argument(
        "--include-layers",
        nargs="+",
        default=list(FP8_RECIPE),
        metavar="KIND",
        help=f"module kinds to quantize, index-agnostic (default, the published FP8 build: "
        f"{' '.join(FP8_RECIPE)}); quantizable: {' '.join(QUANTIZABLE_KINDS)}; or a named set: "
        f"{' '.join(MODULE_SETS)} (ModelOpt's: every linear but the heads)",
    )
    parser.add_argument(
        "--export",
        default="compressed-tensors",
        choices=("compressed-tensors", "modelopt"),
        help="the layout written (default compressed-tensors); modelopt writes NVIDIA ModelOpt's "
        "tensors, config and hf_quant_config.json, for fp8-static (FP8), fp8-dynamic "
        "(FP8_PER_CHANNEL_PER_TOKEN), nvfp4-w4a4 (NVFP4) and nvfp4 (W4A16_NVFP4)",
    )
    parser.add_argument(
        "--kv-cache-scheme",
        choices=("fp8",),
        default=None,
        help="also write each draft layer's static FP8 KV-cache scale (amax / 448 of its context "
        "latents), in compressed-tensors' kv_cache_scheme layout",
    )
    parser.add_argument(
        "--kv-calibration",
        type=Path,
        default=None,
        metavar="PATH",
        help="--kv-cache-scheme's aux states: a target model directory (run over the package's "
        "corpus) or a .safetensors file holding aux_hidden_states [N, T, W] and optionally "
        "positions [N, T] (default: MODEL/../target, train-pair's layout)",
    )
    parser.add_argument(
        "--device", default="cpu", choices=("cpu", "cuda"), help="where to quantize (default cpu)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="threads streaming row chunks (default: one per core)",
    )
    add_shared(parser, overwrite=True, progress=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from vllm_dspark.checkpoint.store import human_bytes, human_params
    from vllm_dspark.checkpoint_tools.quantize import quantize_checkpoint

    report = quantize_checkpoint(
        args.model,
        args.out,
        args.quant_format,
        args.include_layers,
        device=args.device,
        workers=args.workers,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        export=args.export,
        kv_cache_scheme=args.kv_cache_scheme,
        kv_calibration=args.kv_calibration,
    )
    o = report["overall"]
    print(
        f"quantized {o['modules_quantized']} modules to {args.quant_format}: {human_params(o['params_quantized'])} of "
        f"{human_params(o['params_total'])} params ({100 * o['fraction_quantized']:.0f} %), "
        f"{human_bytes(o['bytes_before'])} -> {human_bytes(o['bytes_after'])}, weight SNR mean {o['snr_db_mean']:.1f} dB "
        f"(min {o['snr_db_min']:.1f}), {o['seconds']:.1f} s; wrote {args.out}"
    )
    if "kv_cache" in report:
        scales = ", ".join(f"{s:.4g}" for s in report["kv_cache"]["k_scales"])
        print(f"fp8 KV-cache k_scale per draft layer: {scales} ({report['kv_cache']['source']})")
    return 0


if __name__ == "__main__":
    from vllm_dspark.tools.cli import main as cli_main

    sys.exit(cli_main(["quantize", *sys.argv[1:]]))
