# SPDX-License-Identifier: Apache-2.0
"""What vLLM's ``dspark`` speculator drafted, against the reference drafter given the same inputs.

The steps are :class:`tests.support.dspark_e2e.Capture`'s: per drafting step, the aux hidden states vLLM
handed over, their positions, the rejected counts, the anchors and the drafted blocks. The reference
drafts from the context the speculator holds at that step: the aux hidden states of every accepted
position so far (each step adds its verified rows, rejected ones excluded), the anchor it was given,
at the position it was given.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_dspark.cpu_serving.engines import greedy_agreement, near_tie

# The engine's backbone runs in BF16 and the reference in FP32: their block states differ by up to
# ~4 % (relative L2); a wrong aux layer makes them differ by ~100 %.
HIDDEN_RTOL = 0.1


def contexts(steps: list[dict[str, Any]]) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Per captured step and request: the step's index, the request's row, and the aux states of
    positions ``0 .. anchor position - 1`` it drafts from, ``[1, T, taps * hidden]``."""
    history: dict[str, dict[int, torch.Tensor]] = {}
    for s, step in enumerate(steps):
        starts = step["query_start_loc"].tolist()
        for r, request in enumerate(step["req_ids"]):
            known = history.setdefault(request, {})
            for row in range(starts[r], starts[r + 1] - int(step["num_rejected"][r])):
                known[int(step["positions"][row])] = step["aux"][row]
            anchor_position = int(step["anchor_positions"][r])
            missing = [p for p in range(anchor_position) if p not in known]
            assert not missing, f"request {request}: no aux states captured for positions {missing}"
            yield s, r, torch.stack([known[p] for p in range(anchor_position)])[None]


@dataclass
class Block:
    """One drafted block: the engine's tokens and backbone states, and the reference's from the same inputs."""

    engine_tokens: list[int]
    engine_hidden: torch.Tensor  # [N, H]
    tokens: list[int]
    hidden: torch.Tensor  # [N, H]
    logits: torch.Tensor  # [N, V], Markov bias included


def reference_blocks(
    drafter_dir: Path, steps: list[dict[str, Any]], *, head_on_engine_states: bool = False
) -> list[Block]:
    """The engine's and the reference's block for every request of every captured step.

    With ``head_on_engine_states`` the reference's tokens and logits are its Markov head's greedy
    rollout over the engine's backbone states (which are still compared with the reference's): for a
    random drafter, whose top-2 logits often lie closer than the BF16 backbone's error moves them.
    """
    from vllm_dspark.ops.sampling import markov_rollout
    from vllm_dspark.reference.drafter import ReferenceDrafter

    reference = ReferenceDrafter.from_pretrained(drafter_dir)
    blocks = []
    for s, r, aux in contexts(steps):
        step = steps[s]
        anchor = step["anchors"][r : r + 1].long()
        out = reference.draft(aux, torch.arange(aux.shape[1])[None], anchor)
        head = out
        if head_on_engine_states:
            with torch.no_grad():
                head = markov_rollout(
                    reference.base_logits(step["hidden"][r][None]),
                    anchor,
                    reference.markov_embed,
                    reference.markov_bias,
                )
        blocks.append(
            Block(
                step["drafted"][r].tolist(),
                step["hidden"][r],
                head.tokens[0].tolist(),
                out.hidden[0],
                head.logits[0],
            )
        )
    return blocks


def agree(
    tokens: list[int], expected: list[int], top2: list[list[int]], gaps: list[float], tie: float
) -> int:
    """How many leading tokens equal ``expected`` before a near-tie resolved the other way; fails
    on a difference outside a near-tie."""
    agreed, verdict = greedy_agreement(tokens, expected, top2, gaps, tie)
    assert verdict != "differs", f"step {agreed}: {tokens} != {expected} (top-2 {top2[agreed]})"
    return agreed


def check_blocks(blocks: list[Block]) -> int:
    """Every engine block equals the reference's: tokens up to a near-tie, backbone states within
    :data:`HIDDEN_RTOL` (relative L2 per block). Returns the tokens compared."""
    top = [block.logits.topk(2, dim=-1) for block in blocks]
    tie = near_tie([g for t in top for g in (t.values[:, 0] - t.values[:, 1]).tolist()])
    compared = 0
    for i, (block, t) in enumerate(zip(blocks, top, strict=True)):
        error = float((block.engine_hidden - block.hidden).norm() / block.hidden.norm())
        assert error < HIDDEN_RTOL, (
            f"block {i}: backbone states differ from the reference's by {error:.1%}"
        )
        gaps = (t.values[:, 0] - t.values[:, 1]).tolist()
        compared += agree(block.engine_tokens, block.tokens, t.indices.tolist(), gaps, tie)
    return compared
