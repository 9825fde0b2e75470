# SPDX-License-Identifier: Apache-2.0
"""The drift metrics against hand computations on small, hand-made distributions."""

import math

import numpy as np
import pytest
import torch

from vllm_dspark.drift import metrics


def _logits(*probs: float) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


def test_divergences_match_hand_computation():
    p, q = (0.5, 0.3, 0.2), (0.4, 0.4, 0.2)
    d = metrics.token_divergence(_logits(*p), _logits(*q))
    assert d.overlap.item() == pytest.approx(0.4 + 0.3 + 0.2)  # Σ min(p, q) = 1 − TV, TV = 0.1
    assert d.kl.item() == pytest.approx(0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4))
    assert d.reverse_kl.item() == pytest.approx(
        0.4 * math.log(0.4 / 0.5) + 0.4 * math.log(0.4 / 0.3)
    )


def test_divergences_of_identical_distributions_are_exact():
    logits = torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(0))
    d = metrics.token_divergence(logits, logits.clone())
    assert d.overlap.shape == (3, 7)
    assert torch.all(d.kl == 0) and torch.all(d.reverse_kl == 0)
    assert torch.allclose(d.overlap, torch.ones(3, 7, dtype=torch.float64))


def test_divergences_are_shift_invariant_and_disjoint_support_gives_zero_overlap():
    # Logits are defined up to a constant; a shift must not count as drift.
    base = torch.tensor([2.0, -1.0, 0.5])
    assert metrics.token_divergence(base, base + 7.0).kl.item() == pytest.approx(0.0, abs=1e-12)
    far = metrics.token_divergence(torch.tensor([0.0, -1e4]), torch.tensor([-1e4, 0.0]))
    assert far.overlap.item() == pytest.approx(0.0, abs=1e-12)


def test_divergences_refuse_mismatched_shapes():
    with pytest.raises(ValueError, match="shapes differ"):
        metrics.token_divergence(torch.zeros(2, 5), torch.zeros(2, 6))


def test_acceptance_ceiling_composes_positions_with_the_bonus_token():
    assert metrics.acceptance_ceiling(np.ones(7)) == pytest.approx(8.0)
    assert metrics.acceptance_ceiling(np.zeros(7)) == pytest.approx(1.0)
    assert metrics.acceptance_ceiling([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert metrics.acceptance_ceiling([0.9, 0.8, 0.5]) == pytest.approx(1 + 0.9 + 0.72 + 0.36)
    # Leading axes are independent rows.
    np.testing.assert_allclose(
        metrics.acceptance_ceiling(np.array([[1, 1], [0.5, 0.5]])), [3.0, 1.75]
    )


def test_prefix_run_length_stops_at_the_first_mismatch():
    agree = np.array([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(metrics.prefix_run_length(agree), [3, 1, 5])


def test_flips_use_the_reference_per_block_median():
    ref = np.array([[0.1, 0.5, 0.9], [0.2, 0.3, 0.4]])
    var = np.array([[0.6, 0.4, 0.8], [0.2, 0.35, 0.1]])
    # block 0: median 0.5 -> ref F F T, var T F T; block 1: median 0.3 -> ref F F T, var F T F
    np.testing.assert_array_equal(metrics.flips_vs_block_median(ref, var), [[1, 0, 0], [0, 1, 1]])


def test_pearson_r_matches_numpy():
    rng = np.random.default_rng(0)
    x, y = rng.random(50), rng.random(50)
    assert metrics.pearson_r(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1])
    assert np.isnan(metrics.pearson_r(np.ones(5), x[:5]))


def test_bootstrap_point_value_and_interval():
    rng = np.random.default_rng(1)
    n = 400
    data = (rng.random(n) < 0.8).astype(float)
    idx = metrics.bootstrap_indices(n, 2000, seed=0)
    est = metrics.estimate(lambda a: a.mean(1), [data], idx)
    assert est.value == pytest.approx(data.mean())
    assert est.lo < est.value < est.hi
    # The percentile interval of a mean is close to the normal one, 1.96 * sd / sqrt(n).
    normal = 1.96 * data.std() / math.sqrt(n)
    assert (est.hi - est.lo) / 2 == pytest.approx(normal, rel=0.2)
    constant = metrics.estimate(lambda a: a.mean(1), [np.full(n, 0.3)], idx)
    assert constant.lo == pytest.approx(0.3) and constant.hi == pytest.approx(0.3)


def test_bootstrap_resamples_whole_blocks_together():
    # Two arrays resampled with the same rows keep their pairing: r stays exactly 1.
    x = np.arange(20.0).reshape(10, 2)
    idx = metrics.bootstrap_indices(10, 200, seed=3)
    est = metrics.estimate(
        lambda a, b: metrics.pearson_r(a.reshape(len(a), -1), b.reshape(len(b), -1)),
        [x, 2 * x + 1],
        idx,
    )
    assert est.value == pytest.approx(1.0) and est.lo == pytest.approx(1.0)


def _records(rng, blocks=64, n=7):
    return metrics.BlockRecords(
        tf_agree=rng.random((blocks, n)) < 0.9,
        rollout_agree=rng.random((blocks, n)) < 0.8,
        overlap=rng.uniform(0.8, 1.0, (blocks, n)),
        kl=rng.exponential(0.01, (blocks, n)),
        reverse_kl=rng.exponential(0.01, (blocks, n)),
        ref_conf=rng.random((blocks, n)),
        var_conf=rng.random((blocks, n)),
    )


def test_summarize_equals_direct_computation():
    rng = np.random.default_rng(2)
    rec = _records(rng)
    s = metrics.summarize(rec, metrics.bootstrap_indices(64, 300, seed=0))
    ro = rec.rollout_agree.astype(float)
    assert s["greedy_agreement"]["value"] == pytest.approx(rec.tf_agree.mean())
    assert s["rollout_agreement"]["value"] == pytest.approx(ro.mean())
    assert s["one_minus_tv"]["value"] == pytest.approx(rec.overlap.mean())
    assert s["kl_mean"]["value"] == pytest.approx(rec.kl.mean())
    assert s["kl_p99"]["value"] == pytest.approx(np.quantile(rec.kl, 0.99))
    assert s["reverse_kl_mean"]["value"] == pytest.approx(rec.reverse_kl.mean())
    assert s["confidence_r"]["value"] == pytest.approx(
        np.corrcoef(rec.ref_conf.ravel(), rec.var_conf.ravel())[0, 1]
    )
    flips = metrics.flips_vs_block_median(rec.ref_conf, rec.var_conf)
    assert s["sched_flip_rate"]["value"] == pytest.approx(flips.mean())
    a = ro.mean(0)
    assert s["ceiling"]["value"] == pytest.approx(1 + sum(np.prod(a[: k + 1]) for k in range(7)))
    per_block_tv = [1 + sum(np.prod(o[: k + 1]) for k in range(7)) for o in rec.overlap]
    assert s["ceiling_tv"]["value"] == pytest.approx(np.mean(per_block_tv))
    assert s["prefix_length"]["value"] == pytest.approx(metrics.prefix_run_length(ro).mean())
    assert [e["value"] for e in s["per_position"]["rollout_agreement"]] == pytest.approx(list(a))
    for key in ("greedy_agreement", "ceiling", "kl_p99", "confidence_r"):
        assert s[key]["lo"] <= s[key]["value"] <= s[key]["hi"]
    assert s["num_blocks"] == 64 and s["num_tokens"] == 64 * 7


def test_summarize_without_confidence_head_reports_nan():
    rng = np.random.default_rng(4)
    rec = _records(rng, blocks=8)
    rec.ref_conf[:] = np.nan
    rec.var_conf[:] = np.nan
    s = metrics.summarize(rec, metrics.bootstrap_indices(8, 50, seed=0))
    assert math.isnan(s["confidence_r"]["value"]) and math.isnan(s["sched_flip_rate"]["value"])
    assert not math.isnan(s["ceiling"]["value"])


def test_auc_is_the_mann_whitney_statistic():
    """AUC = P(score of a positive > score of a negative), ties counting half."""
    scores = np.array([0.1, 0.4, 0.35, 0.8, 0.4])
    labels = np.array([False, False, True, True, True])
    pairs = [(p, n) for p in scores[labels] for n in scores[~labels]]
    expected = np.mean([1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs])
    assert metrics.auc(scores, labels) == pytest.approx(expected)
    assert metrics.auc(scores, ~labels) == pytest.approx(1 - expected)
    assert np.isnan(metrics.auc(scores, np.zeros(5, dtype=bool)))
