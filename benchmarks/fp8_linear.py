# SPDX-License-Identifier: Apache-2.0
"""Quantized linears (FP8 W8A16 and W8A8, FP4 W4A16 and W4A4) on CPU at the drafter's real layer shapes.

Ways to run one compressed-tensors linear, at batch 1 and at a 7-token block:

- ``plugin FORMAT``, for every registered format: vLLM's own compressed-tensors scheme for it
  (``CompressedTensorsW8A16Fp8``, ``CompressedTensorsW8A8Fp8``, ``CompressedTensorsW4A4Fp4``,
  ``CompressedTensorsW4A4Mxfp4``) with the plugin's CPU kernels (``vllm_dspark.runtime.cpu_fp8``,
  ``cpu_fp4``) — what the served drafter runs on CPU: dequantised once at load, then (W8A8, W4A4)
  the input quantized per token, per tensor, per 128-group or per 16-block as on a GPU, then vLLM's
  CPU GEMM dispatch;
- ``bf16``: the same GEMM dispatch on the original BF16 weight (the baseline of every ratio);
- ``dequant-bf16``: plain ``F.linear`` on the weight dequantised to BF16;
- ``dequant-per-call``: dequantising the FP8 weight on every call, which is why the kernel does
  it once;
- ``bf16 copy``: the ``bf16`` layer built again from the same weight, the control: the same GEMM on
  another allocation, so its spread is what placement in memory alone does to a ratio here.

Each path is paired with the ``bf16`` baseline: a run takes their calls in turn for
:data:`CALL_SECONDS` (:func:`benchmarks.common.interleaved`), each side's figure its median call,
and the table gives the median ratio of the runs and its spread. Achieved bandwidth counts the BF16 weight bytes
each call streams (median time), next to a memory-copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.common import (
    MIN_PAIRS,
    add_pairing_arguments,
    format_table,
    interleaved,
    memcpy_bandwidth,
    paired_result,
    rounds,
    spread_text,
    write_result,
)
from vllm_dspark.checkpoint.layout import FP8_RECIPE, checkpoint_modules
from vllm_dspark.checkpoint.presets import preset_config, preset_config_json

CALL_SECONDS = 0.5  # each run takes a path's and the baseline's calls in turn for this long


def _shapes(preset: str) -> dict[str, tuple[int, int]]:
    """One (out, in) shape per FP8 module kind; gate and up are fused at runtime into one GEMM."""
    shapes: dict[str, tuple[int, int]] = {}
    for spec in checkpoint_modules(preset_config(preset)):
        if spec.kind in FP8_RECIPE and spec.kind not in shapes:
            shapes[spec.kind] = spec.shape
    gate = shapes.pop("mlp.gate_proj")
    shapes.pop("mlp.up_proj")
    shapes["mlp.gate_up_proj"] = (2 * gate[0], gate[1])
    return shapes


@contextmanager
def _bf16_drafter_config(preset: str) -> Iterator[None]:
    """vLLM's scheme reads the model dtype from the current VllmConfig: a BF16 drafter's config."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config

    import vllm_dspark
    from vllm_dspark.tools.vllm_load import ensure_single_process_runtime

    vllm_dspark.register()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(preset_config_json(preset)))
        model_config = ModelConfig(
            model=tmp, dtype="bfloat16", skip_tokenizer_init=True, runner="draft"
        )
        with set_current_vllm_config(VllmConfig(model_config=model_config)):
            ensure_single_process_runtime()
            yield


def _plugin_layer(weight: torch.Tensor, fmt: str) -> tuple[torch.nn.Module, object]:
    """``weight`` quantized to ``fmt``, in a layer built, loaded and finalised by the scheme vLLM's
    compressed-tensors config picks for it, as the model does."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_dspark.checkpoint import formats, quant_config
    from vllm_dspark.runtime import cpu_fp4, cpu_fp8

    cpu_fp8.install()
    cpu_fp4.install()
    n, k = weight.shape
    q = formats.get(fmt).quantize(weight)
    config = CompressedTensorsConfig.from_config(
        quant_config.compressed_tensors_config({fmt: ["re:.*"]}, ignore=[])
    )
    # vLLM builds and loads a model under its dtype as torch's default; the scheme reads it.
    with set_default_torch_dtype(torch.bfloat16):
        scheme = config.get_scheme(torch.nn.Linear(k, n, device="meta"), layer_name="linear")
        layer = torch.nn.Module()
        scheme.create_weights(
            layer,
            input_size_per_partition=k,
            output_partition_sizes=[n],
            input_size=k,
            output_size=n,
            params_dtype=torch.bfloat16,
            weight_loader=default_weight_loader,
        )
        for suffix, tensor in q.items():
            getattr(layer, suffix).data.copy_(tensor.view(getattr(layer, suffix).shape))
        scheme.process_weights_after_loading(layer)
    return layer, scheme


def _bf16_layer(weight: torch.Tensor) -> torch.nn.Module:
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    return layer


def run(
    preset: str = "k3", pairs: int = MIN_PAIRS, warmup: int = 1, tokens: tuple[int, ...] = (1, 7)
) -> dict:
    from vllm.model_executor.layers.utils import cpu_unquantized_gemm

    from vllm_dspark.checkpoint import formats
    from vllm_dspark.checkpoint.formats import dequantize_weight, quantize_weight

    torch.manual_seed(0)
    bandwidth = memcpy_bandwidth()
    rows = []
    for kind, (n, k) in _shapes(preset).items():
        weight = (torch.randn(n, k) * k**-0.5).to(torch.bfloat16)
        q = quantize_weight(weight, "fp8")
        w_fp8, scale = q["weight"], q["weight_scale"]
        dequantised = dequantize_weight(q, "fp8", (n, k)).to(torch.bfloat16)
        # fp8-block's 128x128 blocks tile the real shapes, not every smoke preset's.
        plugin = {
            fmt: _plugin_layer(weight, fmt)
            for fmt in formats.names()
            if formats.get(fmt).shape_problem((n, k)) is None
        }
        bf16, copy = _bf16_layer(weight), _bf16_layer(weight)
        weight_bytes = n * k * 2
        for t in tokens:
            x = torch.randn(t, k).to(torch.bfloat16)
            paths = {
                **{
                    f"plugin {fmt}": lambda fmt=fmt: plugin[fmt][1].apply_weights(
                        plugin[fmt][0], x, None
                    )
                    for fmt in plugin
                },
                "bf16": lambda: cpu_unquantized_gemm(bf16, x, bf16.weight, None),
                "bf16 copy": lambda: cpu_unquantized_gemm(copy, x, copy.weight, None),
                "dequant-bf16": lambda: torch.nn.functional.linear(x, dequantised),
                "dequant-per-call": lambda: torch.nn.functional.linear(
                    x, (w_fp8.to(torch.float32) * scale.to(torch.float32)).to(torch.bfloat16)
                ),
            }
            with torch.inference_mode():
                ref = paths["dequant-bf16"]().float()
                err = (paths["plugin fp8"]().float() - ref).norm() / ref.norm()
                results = {
                    name: paired_result(
                        rounds(
                            interleaved({"step": fn, "baseline": paths["bf16"]}, CALL_SECONDS),
                            "baseline",
                            pairs=pairs,
                            warmup=warmup,
                        )
                    )
                    for name, fn in paths.items()
                    if name != "bf16"
                }
            # The baseline's own row: its seconds over every pair above.
            bf16_seconds = sorted(
                r["baseline"]["seconds"]
                for result in results.values()
                for r in result["runs"]
                if not r["warmup"]
            )
            for name, result in [("bf16", None), *results.items()]:
                seconds = (
                    bf16_seconds[len(bf16_seconds) // 2]
                    if result is None
                    else result["step_seconds"]["median"]
                )
                rows.append(
                    {
                        "module": kind,
                        "shape": f"{n}x{k}",
                        "tokens": t,
                        "path": name,
                        "ms": 1e3 * seconds,
                        "vs bf16": "1"
                        if result is None
                        else spread_text(result["ratio"], unit="×"),
                        "GB/s": weight_bytes / seconds / 1e9,
                        "memcpy GB/s": bandwidth,
                        "plugin rel. error vs dequant-bf16": float(err),
                        "paired": result,
                    }
                )
    return {"preset": preset, "pairs": pairs, "memcpy_gbps": bandwidth, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks fp8-linear",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--preset", default="k3", help="layer shapes of this preset (default: the real k3)"
    )
    add_pairing_arguments(parser, per=" per path")
    args = parser.parse_args(argv)
    with _bf16_drafter_config(args.preset):
        result = run(args.preset, args.pairs, args.warmup)
    table = format_table(
        result["rows"],
        ["module", "shape", "tokens", "path", "ms", "vs bf16", "GB/s", "memcpy GB/s"],
    ) + (
        f"\n\nms: median; vs bf16: median (min–max) of {args.pairs} pairs (path, bf16) after "
        f"{args.warmup} warm-up pair, each pair the two paths' calls taken in turn for "
        f"{1e3 * CALL_SECONDS:.0f} ms, each side's median call; bf16's own ms: the median of its "
        "runs in every pair."
    )
    write_result("fp8_linear", result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
