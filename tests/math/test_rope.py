# SPDX-License-Identifier: Apache-2.0
"""RoPE: DeepSeek-YaRN frequencies, cos/sin magnitude and softmax scale against formulas written out
here independently (float64, scalar math), and the GPT-J interleaved rotation."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_dspark.checkpoint.presets import preset_config
from vllm_dspark.ops.rope import (
    RotaryEmbedding,
    apply_rotary_interleaved,
    cos_sin_scale,
    inverse_frequencies,
    softmax_scale,
)

K3_ROPE = preset_config("k3").rope_parameters


def _mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn_inv_freq_reference(rope: dict, dim: int) -> list[float]:
    """YaRN (Peng et al.) as DeepSeek applies it, one rotary pair at a time."""
    base, factor = rope["rope_theta"], rope["factor"]
    orig = rope["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        # the dim whose wavelength 2*pi*base^(2d/dim) fits `rotations` times into the original context
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rope["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(rope["beta_slow"])), dim - 1)
    out = []
    for i in range(dim // 2):
        extrapolated = 1.0 / base ** (2 * i / dim)
        interpolated = extrapolated / factor
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep extrapolation, 1: interpolate
        out.append(interpolated * ramp + extrapolated * (1 - ramp))
    return out


@pytest.mark.parametrize("dim", [16, 64])
def test_yarn_inverse_frequencies_match_the_formula(dim: int) -> None:
    ours = inverse_frequencies(K3_ROPE, dim).double()
    reference = torch.tensor(_yarn_inv_freq_reference(K3_ROPE, dim), dtype=torch.float64)
    torch.testing.assert_close(ours, reference, rtol=2e-6, atol=0)
    # The high-frequency pairs extrapolate (unchanged), the low-frequency ones interpolate by `factor`.
    plain = inverse_frequencies(
        {"rope_type": "default", "rope_theta": K3_ROPE["rope_theta"]}, dim
    ).double()
    assert ours[0] == plain[0]
    torch.testing.assert_close(ours[-1], plain[-1] / K3_ROPE["factor"], rtol=1e-6, atol=0)


def test_default_rope_is_plain_rope() -> None:
    ours = inverse_frequencies({"rope_type": "default", "rope_theta": 10000.0}, 8)
    torch.testing.assert_close(ours, torch.tensor([10000.0 ** (-i / 8) for i in (0, 2, 4, 6)]))
    assert cos_sin_scale({"rope_type": "default", "rope_theta": 1.0}) == 1.0
    assert softmax_scale(192, {"rope_type": "default", "rope_theta": 1.0}) == 192**-0.5


def test_softmax_scale_and_cos_sin_magnitude() -> None:
    qk_head_dim = 128 + 64
    m = 0.1 * 1.0 * math.log(32.0) + 1.0
    assert softmax_scale(qk_head_dim, K3_ROPE) == pytest.approx(
        qk_head_dim**-0.5 * m * m, rel=1e-12
    )
    # K3 has mscale == mscale_all_dim, so cos/sin keep unit magnitude; otherwise the ratio applies.
    assert cos_sin_scale(K3_ROPE) == 1.0
    skewed = dict(K3_ROPE, mscale=1.0, mscale_all_dim=0.5)
    assert cos_sin_scale(skewed) == pytest.approx(_mscale(32, 1.0) / _mscale(32, 0.5), rel=1e-12)
    assert softmax_scale(qk_head_dim, skewed) == pytest.approx(
        qk_head_dim**-0.5 * _mscale(32, 0.5) ** 2, rel=1e-12
    )
    # attention_factor == 1.0 selects DeepSeek llama-scaling in vLLM, which keeps the plain scale.
    assert softmax_scale(qk_head_dim, dict(K3_ROPE, attention_factor=1.0)) == qk_head_dim**-0.5


def test_gptj_interleaved_rotation() -> None:
    dim = 16
    rope = RotaryEmbedding.from_rope_parameters(K3_ROPE, dim)
    # Angles are fp32 products (as in vLLM's cos/sin table), exact to ~1e-7 relative: positions up
    # to a few thousand keep the comparison with float64 angles within the tolerance below.
    positions = torch.tensor([0, 3, 1000, 4095])
    x = torch.randn(
        4, 2, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )  # [T, heads, dim]
    y = rope(x, positions).double()
    inv = torch.tensor(_yarn_inv_freq_reference(K3_ROPE, dim), dtype=torch.float64)
    for t, pos in enumerate(positions.tolist()):
        for i in range(dim // 2):
            # Pair (2i, 2i+1) is one complex number rotated by pos * inv_freq[i].
            angle = pos * inv[i].item()
            z = complex(x[t, 0, 2 * i], x[t, 0, 2 * i + 1]) * complex(
                math.cos(angle), math.sin(angle)
            )
            assert y[t, 0, 2 * i].item() == pytest.approx(z.real, abs=1e-3 * max(1.0, abs(z)))
            assert y[t, 0, 2 * i + 1].item() == pytest.approx(z.imag, abs=1e-3 * max(1.0, abs(z)))
    assert torch.equal(rope(x, torch.zeros(4, dtype=torch.long)), x)


def test_rotation_scores_depend_on_relative_position_only() -> None:
    rope = RotaryEmbedding.from_rope_parameters(K3_ROPE, 64)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(64, generator=g), torch.randn(64, generator=g)
    tol = 1e-3 * float(q.norm() * k.norm())

    def score(pq: int, pk: int) -> float:
        rq = rope(q[None], torch.tensor([pq]))[0]
        rk = rope(k[None], torch.tensor([pk]))[0]
        return float(rq @ rk)

    assert score(10, 3) == pytest.approx(score(5007, 5000), abs=tol)
    assert abs(score(10, 3) - score(10, 4)) > tol


def test_apply_rotary_keeps_dtype_and_rotates_in_fp32() -> None:
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    cos, sin = torch.ones(3, 4), torch.zeros(3, 4)
    assert apply_rotary_interleaved(x, cos, sin).dtype == torch.bfloat16
    assert torch.equal(apply_rotary_interleaved(x, cos, sin), x)
