# SPDX-License-Identifier: Apache-2.0
"""Load a drafter directory through vLLM's own ``dspark`` loading path, outside an engine.

``load_with_vllm`` does what ``DSparkSpeculator.load_draft_model`` does — vLLM's
``load_dspark_model``: the real draft ``VllmConfig``, the draft's quant config, ``get_model``
(``initialize_model`` -> ``load_weights`` -> per-layer post-processing ->
``process_weights_after_loading``) and the aliasing of the target's embedding and lm_head — so a
checkpoint can be proven loadable, and the loaded model's hooks inspected, on any machine. The demo
and the tests use it.

It stands in for only what an engine would provide and a CPU machine lacks:

- vLLM's V1-model-runner check is skipped while the configs are built: ``dspark`` runs only in the
  V2 GPU model runner, and the check would refuse a config for which no runner is ever made here;
- the target is :class:`TargetHeads`, holding only what the drafter shares with it
  (``model.embed_tokens`` and ``lm_head`` as vLLM's own layers, from the drafter's ``target/``
  heads file), and its config is a small DeepSeek-V3 MLA config of the drafter's target geometry
  (:func:`write_target_config`, into a temporary folder: a loader never writes into a checkpoint)
  unless a real target config directory is given.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vllm_dspark.compat import without_v1_runner_check
from vllm_dspark.config import K3DSparkConfig

TARGET_HEADS = Path("target") / "model.safetensors"


def write_target_config(drafter: K3DSparkConfig, out_dir: str | Path) -> Path:
    """A DeepSeek-V3 (MLA) target config.json with the geometry ``drafter`` expects of its target.

    Hidden size, depth and vocabulary come from the drafter's ``target_*`` fields; the MLA shape is
    the drafter's own, so the target's latent cache and the draft's agree (576 for Kimi-K3).
    """
    from transformers import DeepseekV3Config

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = DeepseekV3Config(
        vocab_size=drafter.vocab_size,
        hidden_size=drafter.target_hidden_size,
        intermediate_size=2 * drafter.target_hidden_size,
        moe_intermediate_size=drafter.target_hidden_size // 2,
        num_hidden_layers=drafter.target_num_hidden_layers,
        num_attention_heads=drafter.num_attention_heads,
        num_key_value_heads=drafter.num_attention_heads,
        q_lora_rank=drafter.q_lora_rank,
        kv_lora_rank=drafter.kv_lora_rank,
        qk_rope_head_dim=drafter.qk_rope_head_dim,
        qk_nope_head_dim=drafter.qk_nope_head_dim,
        v_head_dim=drafter.v_head_dim,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        max_position_embeddings=4096,
    )
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(out_dir)
    return out_dir


def engine_config(
    target_dir: str | Path,
    draft_dir: str | Path,
    *,
    dtype: str = "float32",
    tensor_parallel_size: int = 1,
    **speculative: Any,
):
    """The real ``VllmConfig`` of serving ``target_dir`` with ``draft_dir`` as its dspark drafter."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(target_dir),
        skip_tokenizer_init=True,
        dtype=dtype,
        max_model_len=256,
        enforce_eager=True,
        tensor_parallel_size=tensor_parallel_size,
        speculative_config={"method": "dspark", "model": str(draft_dir), **speculative},
    )
    with without_v1_runner_check():
        return args.create_engine_config()


class _Inner(nn.Module):
    pass


class TargetHeads(nn.Module):
    """The parts of the target the drafter shares, as vLLM's own layers: ``model.embed_tokens``, ``lm_head``."""

    def __init__(self, heads_file: str | Path, dtype: torch.dtype) -> None:
        super().__init__()
        from safetensors.torch import load_file
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            VocabParallelEmbedding,
        )

        from vllm_dspark.checkpoint.store import TARGET_EMBED_KEY, TARGET_LM_HEAD_KEY

        heads = load_file(str(heads_file))
        vocab, hidden = heads[TARGET_EMBED_KEY].shape
        self.model = _Inner()
        self.model.embed_tokens = VocabParallelEmbedding(vocab, hidden, params_dtype=dtype)
        self.lm_head = ParallelLMHead(vocab, hidden, params_dtype=dtype)
        for layer, key in (
            (self.model.embed_tokens, TARGET_EMBED_KEY),
            (self.lm_head, TARGET_LM_HEAD_KEY),
        ):
            layer.weight_loader(layer.weight, heads[key])
            layer.quant_method.process_weights_after_loading(layer)


@dataclass
class Served:
    """A drafter loaded by vLLM's ``load_dspark_model`` next to the target heads it shares."""

    model: Any  # vllm_dspark.model.K3DSparkForCausalLM
    vllm_config: Any
    target: TargetHeads


def load_with_vllm(
    draft_dir: str | Path,
    *,
    target_dir: str | Path | None = None,
    dtype: str = "float32",
    heads_file: str | Path | None = None,
    tensor_parallel_size: int = 1,
    **speculative: Any,
) -> Served:
    """Build and load ``draft_dir`` through vLLM's ``load_dspark_model``; raises whatever it raises.

    ``target_dir`` is a target config directory (default: one written next to the drafter's heads
    by :func:`write_target_config`); ``heads_file`` the shared heads (default ``draft_dir/target``). With
    ``tensor_parallel_size`` > 1 the caller has set up vLLM's process groups of that size (one process per rank).
    """
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.spec_decode.dspark.utils import load_dspark_model

    import vllm_dspark
    from vllm_dspark.checkpoint.store import load_config, stored_tensors
    from vllm_dspark.cpu_runtime import ensure_single_process_runtime

    vllm_dspark.register()
    draft_dir = Path(draft_dir)
    config = load_config(draft_dir)
    stored_tensors(
        draft_dir
    )  # a missing or truncated shard is one ValueError naming it, not a loader traceback
    with tempfile.TemporaryDirectory(prefix="vllm-dspark-target-") as stand_in:
        if target_dir is None:
            target_dir = write_target_config(config, stand_in)
        vllm_config = engine_config(
            target_dir,
            draft_dir,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            **speculative,
        )
        with set_current_vllm_config(vllm_config), without_v1_runner_check():
            ensure_single_process_runtime()
            target = TargetHeads(
                heads_file or draft_dir / TARGET_HEADS, vllm_config.model_config.dtype
            )
            model = load_dspark_model(target, vllm_config)
    return Served(model, vllm_config, target)
