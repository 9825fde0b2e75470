# SPDX-License-Identifier: Apache-2.0
"""Every benchmark by name: its module, the arguments of the run whose results are committed, and
the docs/benchmarks.md heading of its table. ``python -m benchmarks`` and the README generator read this."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    module: str
    help: str
    result: str  # benchmarks/results/<result>.{json,md}
    heading: str  # docs/benchmarks.md's heading for the result
    args: tuple[
        str, ...
    ] = ()  # what makes the committed run; arguments given on the command line follow
    in_all: bool = True


DRIFT_POSITIONS = (
    "--name",
    "drift_positions",
    "--regimes",
    "heavy",
    "--variants",
    "bf16",
    "fp8",
    "--positions",
    "4k",
    "32k",
    "128k",
    "1000k",
    "--blocks",
    "512",
)

BENCHMARKS: dict[str, Benchmark] = {
    "reference": Benchmark(
        "benchmarks.reference_latency",
        "reference drafter: one 7-token block, FP32 and BF16, paired with streaming its weights",
        "reference_latency",
        "Reference drafter, one 7-token block at real shapes (`k3` preset)",
    ),
    "fp8-linear": Benchmark(
        "benchmarks.fp8_linear",
        "FP8 weight-only linear on CPU: plugin kernel vs dequantised BF16, each paired with BF16",
        "fp8_linear",
        "FP8 weight-only linear on CPU at the real layer shapes",
    ),
    "quantizer": Benchmark(
        "benchmarks.quantizer",
        "quantizer wall time and peak RSS, paired with a plain safetensors copy (k3: ~4 min)",
        "quantizer",
        "Quantizer throughput and peak memory (`k3` preset)",
    ),
    "drift-speed": Benchmark(
        "benchmarks.drift_speed",
        "drift harness: each variant's pass paired with the FP32 reference's, one batch of 64 blocks",
        "drift_speed",
        "Drift harness throughput at real shapes (`k3` preset)",
    ),
    "register": Benchmark(
        "benchmarks.register_overhead",
        "plugin import + register() per vLLM process, paired with importing vLLM",
        "register_overhead",
        "Plugin cost per vLLM process",
    ),
    "check": Benchmark(
        "benchmarks.check_startup",
        "`vllm-dspark check` on the trained pair's drafter, whole process, next to `import torch` and a bare interpreter",
        "check_startup",
        "`vllm-dspark check` start to finish on the trained pair's drafter",
    ),
    "draft-bytes": Benchmark(
        "benchmarks.draft_bytes",
        "draft weight bytes per TP rank per draft step at TP 16, built on meta: plugin (context_proj column-parallel) vs in-tree",
        "draft_bytes",
        "Draft weight bytes per rank per draft step at TP 16 (`k3`, built on the meta device)",
        in_all=False,  # a size, not a speed: deterministic, outside the speed suite
    ),
    "e2e-cpu": Benchmark(
        "benchmarks.e2e_cpu",
        "vLLM's dspark speculator end to end on CPU (Triton interpreter): counters, tok/s",
        "e2e_cpu",
        "vLLM's `dspark` speculator end to end on CPU (the trained pair, Triton interpreter)",
        in_all=False,
    ),
    "pair": Benchmark(
        "benchmarks.pair",
        "the trained pair: measured acceptance per format next to drift in the real regime",
        "pair",
        "The trained pair: measured acceptance length per format, drift next to it",
        in_all=False,
    ),
    "draft-kv": Benchmark(
        "benchmarks.draft_kv",
        "the trained pair: measured τ with the draft's KV cache in BF16, FP8 at k_scale 1.0 and FP8 calibrated",
        "draft_kv",
        "The trained pair: measured acceptance with the draft KV cache in BF16 and FP8 E4M3",
        in_all=False,
    ),
    "drift": Benchmark(
        "benchmarks.drift",
        "drift report at real shapes: table with CIs under 2 pp, plots (an hour or more)",
        "drift",
        "Cost benchmark: the drift report at real shapes (`k3` preset, random weights)",
        in_all=False,
    ),
    "drift-positions": Benchmark(
        "benchmarks.drift",
        "drift through the YaRN range: anchors at 4k .. 1000k, heavy regime (an hour or more)",
        "drift_positions",
        "Cost benchmark: drift through the YaRN range (`k3`, random weights)",
        args=DRIFT_POSITIONS,
        in_all=False,
    ),
    "context-sweep": Benchmark(
        "benchmarks.context_sweep",
        "the trained pair: measured τ against context length (32 .. 2048 tokens of real text), break-even length",
        "context_sweep",
        "The trained pair: measured acceptance against context length",
        in_all=False,
    ),
}
