# SPDX-License-Identifier: Apache-2.0
"""The FP8 latent KV round trip and its calibration (:mod:`vllm_dspark.ops.kv_fp8`) against E4M3's
definition: x / k_scale rounded to nearest E4M3 and saturated at ±448, read back times k_scale."""

from __future__ import annotations

import pytest
import torch

from vllm_dspark.ops.kv_fp8 import (
    E4M3_MAX,
    calibrated_scale,
    dequantize_latent,
    latent_amax,
    latent_round_trip,
    quantize_latent,
)


def _latents() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(3, 2, 5, 576, generator=g) * torch.tensor([0.5, 4.0, 40.0])[:, None, None, None]
    ).to(torch.bfloat16)


def test_the_round_trip_is_e4m3_of_x_over_the_scale_times_the_scale() -> None:
    x = _latents()[1]
    scale = torch.tensor(0.0625)
    stored = quantize_latent(x, scale)
    assert stored.dtype == torch.float8_e4m3fn
    # Exact powers of two: dividing and multiplying by them is exact, so only E4M3 rounding remains.
    want = (x.float() * 16).to(torch.float8_e4m3fn).float() / 16
    assert torch.equal(dequantize_latent(stored, scale, torch.float32), want)
    assert torch.equal(latent_round_trip(x, scale), want.to(x.dtype))
    assert latent_round_trip(x, scale).dtype == x.dtype


def test_values_beyond_448_scales_saturate_instead_of_becoming_nan() -> None:
    x = torch.tensor([1000.0, -1000.0, 448.0, 3.0])
    back = latent_round_trip(x, 1.0)
    assert back.tolist() == [448.0, -448.0, 448.0, 3.0]


def test_calibration_puts_each_layers_amax_on_448() -> None:
    latents = _latents()
    amax = latent_amax(latents)
    assert amax.tolist() == [float(latents[i].float().abs().max()) for i in range(3)]
    scales = calibrated_scale(amax)
    torch.testing.assert_close(scales, amax / 448, rtol=0, atol=0)
    for layer, scale in zip(latents, scales):
        stored = quantize_latent(layer, scale).float()
        assert float(stored.abs().max()) == pytest.approx(E4M3_MAX, rel=2**-4)
        # Within E4M3's half-ulp (2^-4 relative) where no value falls below its normal range.
        back = latent_round_trip(layer.float(), scale)
        normal = layer.float().abs() >= scale * 2**-6
        rel = ((back - layer.float()).abs() / layer.float().abs())[normal]
        assert float(rel.max()) <= 2**-4


def test_an_all_zero_layer_keeps_scale_one() -> None:
    assert calibrated_scale(torch.tensor([0.0, 896.0])).tolist() == [1.0, 2.0]


def test_scale_one_flushes_small_latents_that_a_calibrated_scale_keeps() -> None:
    """Why calibration matters: below E4M3's smallest subnormal (2^-9) a latent stored at scale 1.0 is 0."""
    x = torch.full((8,), 2.0**-11)
    assert latent_round_trip(x, 1.0).abs().max() == 0
    assert torch.equal(latent_round_trip(x, calibrated_scale(latent_amax(x[None]))[0]), x)
