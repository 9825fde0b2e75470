# SPDX-License-Identifier: Apache-2.0
"""``make demo``: the whole job end to end on an embedded default, on any machine.

1. ``make-random``: a random drafter of the ``small`` preset in the real on-disk layout;
2. ``quantize``: its FP8 build (per-output-channel weight-only, compressed-tensors), with a report;
3. ``check``: structural verification of that build;
4. loading both through vLLM's own ``dspark`` loading path and listing each linear's quant method;
5. ``eval``: the drift table of BF16 / FP8 / MXFP4 / NVFP4 against the FP32 reference.

Each step is the same command a user would run; the demo only chains them.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from vllm_dspark.checkpoint.layout import module_kind
from vllm_dspark.tools.cli import ArgumentParser


def _step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def _quant_summary(model) -> dict[str, list[str]]:
    """Module kinds grouped by the quantization the loaded model actually runs them with."""
    from vllm.model_executor.layers.linear import LinearBase

    kinds: dict[str, set[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            scheme = getattr(module, "scheme", None)
            how = (
                type(scheme).__name__ if scheme is not None else type(module.quant_method).__name__
            )
            kinds.setdefault(how, set()).add(module_kind(name))
    return {how: sorted(k) for how, k in kinds.items()}


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m vllm_dspark.tools.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("demo-out"))
    parser.add_argument("--preset", default="small")
    parser.add_argument(
        "--blocks", type=int, default=128, help="blocks per regime in the drift table"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from vllm_dspark.tools import cli

    drafter, fp8 = args.out / "drafter", args.out / "drafter-fp8"
    _step(f"1/5 make-random --preset {args.preset} --out {drafter}")
    # The demo owns its output folder: a rerun replaces it.
    rc = cli.main(
        [
            "make-random",
            "--preset",
            args.preset,
            "--out",
            str(drafter),
            "--seed",
            str(args.seed),
            "--overwrite",
        ]
    )
    if rc:
        return rc

    _step(f"2/5 quantize --quant-format fp8 --output-dir {fp8}")
    rc = cli.main(
        [
            "quantize",
            "--model-dir",
            str(drafter),
            "--output-dir",
            str(fp8),
            "--quant-format",
            "fp8",
            "--overwrite",
        ]
    )
    if rc:
        return rc

    _step(f"3/5 check {fp8}")
    rc = cli.main(["check", str(fp8)])
    if rc:
        return rc

    _step("4/5 load through vLLM's dspark loader (load_dspark_model -> get_model -> load_weights)")
    from vllm_dspark.tools.vllm_load import load_with_vllm

    for path in (drafter, fp8):
        served = load_with_vllm(path, dtype="bfloat16")
        counts = Counter(type(p).__name__ for p in served.model.parameters())
        print(
            f"{path.name}: {type(served.model).__name__}, draft layers "
            f"{[layer.self_attn.layer_name for layer in served.model.model.layers]}, "
            f"{sum(counts.values())} parameters"
        )
        for how, kinds in _quant_summary(served.model).items():
            print(f"  {how}: {', '.join(kinds)}")

    _step(f"5/5 eval: drift from the FP32 reference ({args.blocks} blocks per regime)")
    return cli.main(
        [
            "eval",
            "--model",
            str(drafter),
            "--regimes",
            "gauss",
            "heavy",
            "boot",
            "--blocks",
            str(args.blocks),
            "--out",
            str(args.out / "eval"),
            "--seed",
            str(args.seed),
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
