# SPDX-License-Identifier: Apache-2.0
"""The verification functions: greedy's accepted prefix, and block verification's losslessness.

Lossless means the emitted stream has the target's distribution whatever the drafter proposes. The
test decodes many sequences from a Markov target with a different Markov drafter, speculatively, and
compares the joint distribution of their first tokens with the target's by a chi-square test.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from vllm_dspark.ops.verify import adaptive_budget, block_verify, greedy_verify

V, N, LENGTH, SAMPLES = 3, 3, 3, 40_000
# chi-square critical value, df = V**LENGTH - 1 = 26, alpha = 0.001 (standard tables).
CHI2_CRIT_26_0001 = 54.052


def test_greedy_accepts_the_matching_prefix():
    logits = torch.zeros(2, 4, 5)
    argmax = torch.tensor([[1, 2, 3, 4], [0, 1, 2, 3]])
    logits.scatter_(-1, argmax[..., None], 1.0)
    drafts = torch.tensor([[1, 2, 0], [0, 1, 2]])
    out = greedy_verify(logits, drafts)
    assert out.num_accepted.tolist() == [2, 3]
    assert out.next_token.tolist() == [3, 3]  # the correction at position 2; the bonus


def test_an_empty_block_emits_the_target_token():
    """An adaptive budget of 0 verifies no draft: the target's own token follows."""
    probs = torch.tensor([[[0.0, 1.0, 0.0]]])
    none = torch.zeros(1, 0, dtype=torch.long)
    for out in (
        greedy_verify(probs, none),
        block_verify(probs, probs[:, :0], none, torch.ones(1, 0), torch.zeros(1, 3)),
    ):
        assert out.num_accepted.tolist() == [0] and out.next_token.tolist() == [1]


def test_verify_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"\[B, N \+ 1, V\]"):
        greedy_verify(torch.zeros(1, 3, 5), torch.zeros(1, 3, dtype=torch.long))


def _chains(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(2.0 * torch.randn(V, V, generator=g), -1).double()
    draft = torch.softmax(2.0 * torch.randn(V, V, generator=g), -1).double()
    return target, draft


def _speculative_decode(target: torch.Tensor, draft: torch.Tensor, greedy: bool) -> torch.Tensor:
    """``[SAMPLES, LENGTH]`` tokens decoded from state 0 by drafting N tokens then verifying."""
    g = torch.Generator().manual_seed(1)
    out = torch.full((SAMPLES, LENGTH + N + 1), -1)
    filled = torch.zeros(SAMPLES, dtype=torch.long)
    last = torch.zeros(SAMPLES, dtype=torch.long)
    rows = torch.arange(SAMPLES)
    while bool((filled < LENGTH).any()):
        prev, drafts, q, p = last, [], [], []
        for _ in range(N):
            q.append(draft[prev])
            p.append(target[prev])
            prev = torch.multinomial(draft[prev], 1, generator=g)[:, 0]
            drafts.append(prev)
        p.append(target[prev])
        drafts, q, p = torch.stack(drafts, 1), torch.stack(q, 1), torch.stack(p, 1)
        if greedy:
            verdict = greedy_verify(p.log(), drafts)
        else:
            uniforms = 1.0 - torch.rand(SAMPLES, N, generator=g, dtype=torch.float64)
            gumbel = -torch.log(-torch.log(uniforms.new_empty(SAMPLES, V).uniform_(generator=g)))
            verdict = block_verify(p, q, drafts, uniforms, gumbel)
        emitted = torch.cat([drafts, drafts[:, :1]], 1)
        emitted[rows, verdict.num_accepted] = verdict.next_token
        active = filled < LENGTH
        for i in range(N + 1):
            keep = (i <= verdict.num_accepted) & active
            out[rows[keep], filled[keep] + i] = emitted[keep, i]
        last = emitted[rows, verdict.num_accepted]
        filled = torch.where(active, filled + verdict.num_accepted + 1, filled)
    return out[:, :LENGTH]


def _joint(chain: torch.Tensor) -> dict[tuple[int, ...], float]:
    joint = {}
    for seq in itertools.product(range(V), repeat=LENGTH):
        prob, prev = 1.0, 0
        for t in seq:
            prob, prev = prob * float(chain[prev, t]), t
        joint[seq] = prob
    return joint


def _chi_square(tokens: torch.Tensor, joint: dict[tuple[int, ...], float]) -> float:
    codes = (tokens * torch.tensor([V**k for k in reversed(range(LENGTH))])).sum(1)
    counts = torch.bincount(codes, minlength=V**LENGTH).double()
    expected = torch.tensor([joint[s] for s in itertools.product(range(V), repeat=LENGTH)])
    expected = expected * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def test_block_verification_emits_the_target_distribution():
    target, draft = _chains(0)
    tokens = _speculative_decode(target, draft, greedy=False)
    stat = _chi_square(tokens, _joint(target))
    assert stat < CHI2_CRIT_26_0001, f"chi-square {stat:.1f} against the target's distribution"
    # Power: the drafter's own distribution, at this sample size, is told apart from the target's.
    assert _chi_square(tokens, _joint(draft)) > 10 * CHI2_CRIT_26_0001


def test_block_verification_keeps_more_than_the_first_rejection():
    """Block verification may keep drafts past a position that alone would have been rejected;
    with the drafter equal to the target it keeps every draft."""
    target, _ = _chains(0)
    g = torch.Generator().manual_seed(3)
    drafts = torch.multinomial(target[0].expand(1000, V), N, replacement=True, generator=g)
    probs = target[0].expand(1000, N + 1, V)
    uniforms = torch.rand(1000, N, generator=g, dtype=torch.float64).clamp_min(1e-12)
    verdict = block_verify(probs, probs[:, :N], drafts, uniforms, torch.zeros(1000, V))
    assert bool((verdict.num_accepted == N).all())


def test_greedy_speculation_is_the_greedy_decode():
    target, draft = _chains(2)
    tokens = _speculative_decode(target, draft, greedy=True)
    expected, prev = [], 0
    for _ in range(LENGTH):
        prev = int(target[prev].argmax())
        expected.append(prev)
    assert (tokens == torch.tensor(expected)).all()


def test_adaptive_budget_trades_expected_tokens_for_cost():
    """The budget maximizes (1 + Σ_{k<B} Π_{j≤k} c_j) / (1 + cost (1 + B)), as vLLM's adaptive
    verification does with its profiled costs."""
    sure, hopeless = torch.ones(7), torch.full((7,), 1e-3)
    assert adaptive_budget(sure, 0.1) == 7
    assert adaptive_budget(hopeless, 0.1) == 0
    conf = torch.tensor([0.9, 0.8, 0.5, 0.3, 0.2, 0.1, 0.1])
    budgets = [adaptive_budget(conf, cost) for cost in (0.0, 0.05, 0.2, 1.0)]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] == 7 and budgets[-1] < 7
    survival = torch.cumprod(conf.double(), 0)
    ratios = [(1 + survival[:b].sum()) / (1 + 0.2 * (1 + b)) for b in range(8)]
    assert budgets[2] == int(torch.stack(ratios).argmax())
