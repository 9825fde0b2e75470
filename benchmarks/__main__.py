# SPDX-License-Identifier: Apache-2.0
"""``python -m benchmarks NAME [ARGS]``: every benchmark prints a table and writes JSON + markdown
to benchmarks/results/. ``python -m benchmarks all`` runs each at its default (real-shape) size."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS: dict[str, tuple[str, str]] = {
    "reference": ("benchmarks.reference_latency", "reference drafter: one 7-token block, FP32 and BF16, GB/s vs memcpy"),
    "fp8-linear": ("benchmarks.fp8_linear", "FP8 weight-only linear on CPU: plugin kernel vs dequantised BF16 vs BF16"),
    "quantizer": ("benchmarks.quantizer", "quantizer throughput and peak RSS vs a plain safetensors copy"),
    "drift": ("benchmarks.drift", "drift harness at real shapes: table, plots, blocks per second"),
    "register": ("benchmarks.register_overhead", "plugin import + register() cost per vLLM process"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, BENCHMARKS))
        print("usage: python -m benchmarks {all,readme," + ",".join(BENCHMARKS) + "} [ARGS]\n")
        print("\n".join(f"  {k:<{width}}  {h}" for k, (_, h) in BENCHMARKS.items()))
        print(f"  {'readme':<{width}}  regenerate README.md's benchmark section from benchmarks/results/")
        return 0
    if argv[0] == "readme":
        from benchmarks.readme import main as readme_main

        return readme_main(argv[1:])
    names = list(BENCHMARKS) if argv[0] == "all" else [argv[0]]
    for name in names:
        if name not in BENCHMARKS:
            print(f"unknown benchmark {name!r}; choose from all, {', '.join(BENCHMARKS)}", file=sys.stderr)
            return 2
        print(f"== {name}")
        rc = importlib.import_module(BENCHMARKS[name][0]).main(argv[1:] if argv[0] != "all" else [])
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
