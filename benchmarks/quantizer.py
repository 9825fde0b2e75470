# SPDX-License-Identifier: Apache-2.0
"""Quantizer wall time and peak RSS, paired with a plain safetensors copy of the same checkpoint.

The two alternate (quantize, copy, quantize, copy, ...; :func:`benchmarks.common.paired`), each
timed as a whole process, as a user runs it (interpreter start and imports included; its own peak
RSS): the copy loads every shard with ``safetensors.torch.load_file`` and writes it back with
``save_file``; the quantizer is the ``vllm-dspark quantize`` command. Both carry the target's shared heads
(``target/``) and the JSON files along. Throughput is GB of drafter input tensors per wall second,
the same numerator for both, so the ratio is the cost of quantizing, SNR measurement included.
Then ``vllm-dspark check`` verifies the last output. Goal: the worst pair within 1.3x.

The ``k3`` preset (6.6 GiB of BF16 input, random weights at the real shapes; the shared drafter in
``/tmp/k3``, written in about a minute if missing) needs ~32 GiB of free disk (input with its
target heads, one quantized output, one copy) and takes ~5 minutes on two cores; run it under
``flock /tmp/k3.lock`` on shared machines:

    flock /tmp/k3.lock python -m benchmarks quantizer [--model /tmp/k3] [--pairs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import (
    MIN_PAIRS,
    add_drafter_arguments,
    add_pairing_arguments,
    existing_dir,
    format_table,
    meets,
    paired,
    preset_drafter,
    spread_text,
    whole_process,
    write_result,
)
from vllm_dspark.checkpoint.layout import QUANT_FORMATS


def _copy(model_dir: Path, out_dir: Path) -> None:
    """The baseline: a plain safetensors round trip of every shard (the target's shared heads in
    ``target/`` too, which the quantizer also copies along), plus the small files."""
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True)
    for path in sorted(model_dir.iterdir()):
        if path.is_dir():
            _copy(path, out_dir / path.name)
        elif path.suffix == ".safetensors":
            save_file(load_file(path), out_dir / path.name, metadata={"format": "pt"})
        else:
            shutil.copy2(path, out_dir / path.name)


GOAL = 1.3  # quantize within this many times a copy, worst pair


def _fresh(argv: list[str], out_dir: Path):
    """``argv`` as a whole process, writing into an emptied ``out_dir`` (the last one stays)."""
    measure = whole_process(argv)

    def run() -> dict[str, Any]:
        shutil.rmtree(out_dir, ignore_errors=True)
        return measure()

    return run


def _quantize_command(model_dir: Path, out_dir: Path, fmt: str, workers: int) -> list[str]:
    """``vllm-dspark quantize``, the installed command beside this interpreter."""
    script = Path(sys.executable).with_name("vllm-dspark")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "vllm_dspark.tools.cli"]
    return [*command, "quantize", "--model-dir", str(model_dir), "--out", str(out_dir),
            "--quant-format", fmt, "--workers", str(workers)]  # fmt: skip


def run(
    preset: str = "k3",
    fmt: str = "fp8",
    workers: int | None = None,
    *,
    model_dir: str | Path | None = None,
    work_dir: str | Path | None = None,
    pairs: int = MIN_PAIRS,
    warmup: int = 1,
) -> dict[str, Any]:
    """Pair quantize with copy on ``model_dir`` (default: the preset's shared random drafter)."""
    from vllm_dspark.checkpoint.check import check_checkpoint
    from vllm_dspark.checkpoint.layout import checkpoint_modules
    from vllm_dspark.checkpoint.store import load_config, stored_tensors

    workers = len(os.sched_getaffinity(0)) if workers is None else workers
    model_dir = preset_drafter(None if model_dir is None else Path(model_dir), preset)
    with tempfile.TemporaryDirectory(prefix="bench-quantizer-", dir=work_dir) as tmp:
        tmp = Path(tmp)
        stored = stored_tensors(model_dir)
        input_bytes = sum(t.nbytes for t in stored.values())
        quantized = tmp / "quantized"
        result = paired(
            _fresh(_quantize_command(model_dir, quantized, fmt, workers), quantized),
            _fresh(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.quantizer",
                    "--copy",
                    str(model_dir),
                    str(tmp / "copy"),
                ],
                tmp / "copy",
            ),
            pairs=pairs,
            warmup=warmup,
            progress=f"quantizer {preset}",
        )
        shutil.rmtree(tmp / "copy")
        report = json.loads((quantized / "quantization_report.json").read_text())
        check = check_checkpoint(quantized)
        modules = len(checkpoint_modules(load_config(quantized)))
    for r in result["runs"]:
        for step in (r["step"], r["baseline"]):
            step["input_gb_per_s"] = input_bytes / step["seconds"] / 1e9
    timed = [r for r in result["runs"] if not r["warmup"]]
    return {
        "preset": preset,
        "format": fmt,
        "workers": workers,
        "input_bytes": input_bytes,
        "largest_tensor_bytes": max(t.nbytes for t in stored.values()),
        "goal_ratio": GOAL,
        "meets_goal": meets(result, GOAL),
        "quantize_vs_copy": result["ratio"],
        "quantize_peak_rss_bytes": max(r["step"]["peak_rss_bytes"] for r in timed),
        "copy_peak_rss_bytes": max(r["baseline"]["peak_rss_bytes"] for r in timed),
        **result,
        "quantization": report["overall"],
        "check": {
            "ok": check.ok,
            "problems": [str(p) for p in check.problems],
            "config_groups": check.config_groups,
            "quantized_modules": len(check.quantized_modules),
            "ignored_modules": modules - len(check.quantized_modules),
        },
    }


def table(result: dict[str, Any]) -> str:
    from vllm_dspark.checkpoint.store import human_bytes, human_params

    gb = result["input_bytes"] / 1e9
    timed = [r for r in result["runs"] if not r["warmup"]]
    rows = []
    for side, label, ratio in (
        ("baseline", "safetensors copy (load_file + save_file)", "1"),
        (
            "step",
            f"vllm-dspark quantize {result['format']} (--workers {result['workers']})",
            spread_text(result["ratio"], unit="×"),
        ),
    ):
        seconds = result[f"{side}_seconds"]
        rows.append(
            {
                "step": label,
                "seconds: median (min–max)": spread_text(seconds, ".4g"),
                "input GB/s (median)": gb / seconds["median"],
                "peak RSS GiB (max)": max(r[side]["peak_rss_bytes"] for r in timed) / 2**30,
                "time vs copy: median (min–max)": ratio,
            }
        )
    q, c = result["quantization"], result["check"]
    return "\n".join(
        [
            format_table(rows, list(rows[0])),
            "",
            f"{result['pairs']} pairs (quantize, copy) after {result['warmup']} warm-up pair, "
            f"each timed as a whole process (interpreter start and imports included); goal {result['goal_ratio']}× in the worst pair: "
            f"{'met' if result['meets_goal'] else 'not met'}. "
            f"`{result['preset']}` preset: {human_params(q['params_quantized'])} of {human_params(q['params_total'])} params "
            f"quantized, {human_bytes(q['bytes_before'])} -> {human_bytes(q['bytes_after'])}, weight SNR mean "
            f"{q['snr_db_mean']:.1f} dB (min {q['snr_db_min']:.1f}); largest tensor {human_bytes(result['largest_tensor_bytes'])}; "
            f"check: {'OK' if c['ok'] else 'PROBLEMS'}, {c['config_groups']} config group, "
            f"{c['quantized_modules']} quantized and {c['ignored_modules']} ignored modules.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--copy"]:  # the baseline, run as its own process
        _copy(Path(argv[1]), Path(argv[2]))
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.quantizer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_drafter_arguments(parser)
    parser.add_argument("--format", choices=list(QUANT_FORMATS), default="fp8")
    parser.add_argument(
        "--workers", type=int, default=None, help="quantize --workers (default: one per core)"
    )
    add_pairing_arguments(parser)
    parser.add_argument(
        "--work-dir",
        type=existing_dir,
        default=None,
        help="scratch directory (default: the system temp dir)",
    )
    args = parser.parse_args(argv)
    result = run(
        args.preset,
        args.format,
        args.workers,
        model_dir=args.model,
        work_dir=args.work_dir,
        pairs=args.pairs,
        warmup=args.warmup,
    )
    write_result("quantizer", result, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
