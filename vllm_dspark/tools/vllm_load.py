# SPDX-License-Identifier: Apache-2.0
"""Load a drafter directory through vLLM's own ``dspark`` loading path, outside an engine.

``load_with_vllm`` runs vLLM's ``load_dspark_model`` (the draft ``VllmConfig``, its quant config,
``get_model`` and the aliasing of the target's embedding and lm_head), so a checkpoint can be proven
loadable and its hooks inspected on any machine. It stands in only for what a CPU machine lacks: the
V1-runner check is skipped (``dspark`` runs only in the V2 GPU runner), the target is
:class:`TargetHeads` (just the shared embedding and lm_head), and the target config is a small
DeepSeek-V3 MLA config of the drafter's target geometry, written to a temporary folder.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vllm_dspark.checkpoint.layout import TARGET_HEADS
from vllm_dspark.checkpoint.save import write_target_config
from vllm_dspark.checkpoint.store import load_config, load_target_heads
from vllm_dspark.compat import configs_without_an_engine
from vllm_dspark.cpu_serving.engines import cpu_attention_config


def ensure_single_process_runtime() -> None:
    """A world of one (TP=1, PP=1, gloo) and the CPU runner's accelerator no-ops; idempotent."""
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from vllm.utils.network_utils import get_open_port

    from vllm_dspark.compat import set_torch_accelerator_to_noop

    set_torch_accelerator_to_noop()
    if not model_parallel_is_initialized():
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}",
        )
        initialize_model_parallel(1, 1)


def engine_config(
    target_dir: str | Path,
    draft_dir: str | Path,
    *,
    dtype: str = "float32",
    tensor_parallel_size: int = 1,
    **speculative: Any,
):
    """The real ``VllmConfig`` of serving ``target_dir`` with ``draft_dir`` as its dspark drafter;
    ``num_speculative_tokens`` defaults to the drafter's block (``block_size``, else 7)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    speculative.setdefault("num_speculative_tokens", load_config(draft_dir).draft_block_size)
    # On CPU, float32 needs vLLM's reference MLA path on every host (AMX_MLA loads only bfloat16).
    attention = cpu_attention_config(dtype) if current_platform.is_cpu() else {}
    args = EngineArgs(
        model=str(target_dir),
        skip_tokenizer_init=True,
        dtype=dtype,
        max_model_len=256,
        enforce_eager=True,
        tensor_parallel_size=tensor_parallel_size,
        speculative_config={"method": "dspark", "model": str(draft_dir), **speculative},
        attention_config=attention,
    )
    with configs_without_an_engine():
        return args.create_engine_config()


class _Inner(nn.Module):
    pass


class TargetHeads(nn.Module):
    """The parts of the target the drafter shares, as vLLM's own layers: ``model.embed_tokens``, ``lm_head``."""

    def __init__(self, heads_file: str | Path, dtype: torch.dtype) -> None:
        super().__init__()
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            VocabParallelEmbedding,
        )

        embed, lm_head = load_target_heads(heads_file)
        vocab, hidden = embed.shape
        self.model = _Inner()
        self.model.embed_tokens = VocabParallelEmbedding(vocab, hidden, params_dtype=dtype)
        self.lm_head = ParallelLMHead(vocab, hidden, params_dtype=dtype)
        for layer, weight in ((self.model.embed_tokens, embed), (self.lm_head, lm_head)):
            layer.weight_loader(layer.weight, weight)
            layer.quant_method.process_weights_after_loading(layer)


@dataclass
class Served:
    """A drafter loaded by vLLM's ``load_dspark_model`` next to the target heads it shares."""

    model: Any  # vllm_dspark.runtime.model.K3DSparkForCausalLM
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
        with set_current_vllm_config(vllm_config), configs_without_an_engine():
            ensure_single_process_runtime()
            target = TargetHeads(
                heads_file or draft_dir / TARGET_HEADS, vllm_config.model_config.dtype
            )
            model = load_dspark_model(target, vllm_config)
    return Served(model, vllm_config, target)
