# SPDX-License-Identifier: Apache-2.0
"""A small MLA target and its K3 DSpark drafter, trained from scratch on CPU: the sizes of a run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PairSizes:
    """Every size and step count of a run; the defaults make the committed pair."""

    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 256
    target_layers: int = 7
    heads: int = 2
    q_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    draft_layers: int = 2
    seq_len: int = 128
    batch_size: int = 8
    anchors: int = 8
    target_steps: int = 1600
    drafter_steps: int = 800
    lr: float = 3e-3
    num_prompts: int = 64
    prompt_tokens: int = 48
    check_prompts: int = 16
    check_tokens: int = 32
    max_files: int = 0  # 0: every file
    # One thread: the numbers do not depend on the core count, and on a busy machine it runs faster
    # than two threads that wait on each other at every op.
    threads: int = 1
