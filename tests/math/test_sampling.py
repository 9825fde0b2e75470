# SPDX-License-Identifier: Apache-2.0
"""The Markov rollout as a pure function, on a synthetic head whose behaviour is known exactly."""

from __future__ import annotations

import pytest
import torch

from vllm_dspark.ops.sampling import gumbel_noise, markov_rollout

V = 16


def successor_head(strength: float = 5.0):
    """A Markov head whose bias favours token ``(prev + 1) % V`` by ``strength``."""
    w1 = torch.eye(V)  # W1[t] = one-hot(t), r = V
    w2 = strength * torch.roll(torch.eye(V), shifts=1, dims=0)  # bias[(t + 1) % V] = strength
    return (lambda ids: w1[ids]), (lambda m: m @ w2.T)


def test_greedy_rollout_chains_through_the_markov_bias() -> None:
    embed, bias = successor_head()
    anchors = torch.tensor([3, 15])
    out = markov_rollout(torch.zeros(2, 5, V), anchors, embed, bias)
    assert out.tokens.tolist() == [[4, 5, 6, 7, 8], [0, 1, 2, 3, 4]]
    assert out.markov_embeds.shape == (2, 5, V)
    assert torch.equal(out.markov_embeds[:, 0], embed(anchors))
    assert torch.equal(out.logits[0, 2], bias(embed(torch.tensor(5))))
    # Base logits still count: a strong base preference overrides the bias at position 1.
    base = torch.zeros(2, 5, V)
    base[:, 1, 9] = 10.0
    assert markov_rollout(base, anchors, embed, bias).tokens[0].tolist() == [4, 9, 10, 11, 12]


def test_forced_prev_is_teacher_forcing() -> None:
    embed, bias = successor_head()
    anchors = torch.tensor([3])
    forced = torch.tensor([[3, 10, 10, 0, 7]])  # forced[:, 0] is the anchor
    out = markov_rollout(torch.zeros(1, 5, V), anchors, embed, bias, forced_prev=forced)
    assert out.tokens.tolist() == [[4, 11, 11, 1, 8]]
    assert torch.equal(out.markov_embeds[0], embed(forced[0]))


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    embed, bias = successor_head(strength=0.0)
    base = torch.randn(4, 6, V, generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([1, 2, 3, 4])
    seeds = torch.tensor([100, 101, 102, 103])

    def run(idx, s, t=1.0):
        return markov_rollout(base[idx], anchors[idx], embed, bias, temperature=t, seeds=s).tokens

    first = run([0, 1, 2, 3], seeds)
    assert torch.equal(first, run([0, 1, 2, 3], seeds))
    assert not torch.equal(first, run([0, 1, 2, 3], seeds + 1000))
    # A request's draft depends on its own seed only, not on its batch slot or neighbours.
    assert torch.equal(run([2], seeds[2:3])[0], first[2])
    assert torch.equal(run([3, 2], torch.tensor([7, 102]))[1], first[2])
    # Per-request temperature: 0 is greedy whatever the seed.
    mixed = run([0, 1, 2, 3], seeds, torch.tensor([0.0, 1.0, 0.0, 1.0]))
    assert torch.equal(mixed[0], base[0].argmax(-1)) and torch.equal(mixed[2], base[2].argmax(-1))
    assert torch.equal(mixed[1], first[1])


def test_draws_are_keyed_by_position() -> None:
    embed, bias = successor_head(strength=0.0)
    base = torch.zeros(1, 4, V)

    def at(start):
        return markov_rollout(
            base,
            torch.tensor([0]),
            embed,
            bias,
            temperature=1.0,
            seeds=torch.tensor([5]),
            positions=torch.arange(start, start + 4)[None],
        ).tokens

    assert torch.equal(at(100), at(100))
    assert not torch.equal(at(100), at(200))
    assert torch.equal(at(100)[0, 1:], at(101)[0, :3])  # the same position draws the same noise
    assert not torch.equal(gumbel_noise(5, 100, V), gumbel_noise(5, 101, V))


def test_sampling_follows_the_tempered_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2])
    embed, bias = (lambda ids: torch.zeros(ids.shape[0], 1)), (lambda m: torch.zeros(m.shape[0], 3))
    n = 3000
    base = probs.log().expand(n, 1, 3)
    seeds = torch.arange(n)
    tokens = markov_rollout(
        base, torch.zeros(n, dtype=torch.long), embed, bias, temperature=1.0, seeds=seeds
    ).tokens
    freq = torch.bincount(tokens.flatten(), minlength=3) / n
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)
    # T = 0.5 squares the probabilities before renormalising.
    tokens = markov_rollout(
        base, torch.zeros(n, dtype=torch.long), embed, bias, temperature=0.5, seeds=seeds
    ).tokens
    sharpened = probs**2 / (probs**2).sum()
    torch.testing.assert_close(
        torch.bincount(tokens.flatten(), minlength=3) / n, sharpened, atol=0.03, rtol=0
    )


def test_rollout_argument_errors() -> None:
    embed, bias = successor_head()
    base = torch.zeros(2, 3, V)
    with pytest.raises(ValueError, match="needs per-request seeds"):
        markov_rollout(base, torch.tensor([0, 1]), embed, bias, temperature=1.0)
    with pytest.raises(ValueError, match=r"temperature must be"):
        markov_rollout(
            base, torch.tensor([0, 1]), embed, bias, temperature=torch.tensor([0.0, -1.0])
        )
    with pytest.raises(ValueError, match=r"forced_prev must be \[B, N\] = \[2, 3\]"):
        markov_rollout(
            base, torch.tensor([0, 1]), embed, bias, forced_prev=torch.zeros(2, 2, dtype=torch.long)
        )
    with pytest.raises(ValueError, match=r"anchor_ids must be \[B\]"):
        markov_rollout(base, torch.tensor([0]), embed, bias)
