# SPDX-License-Identifier: Apache-2.0
"""The single-process vLLM runtime state that building vLLM layers outside an engine needs.

vLLM's parallel layers read the tensor-parallel group when they create their parameters, and its
CPU model runner turns ``torch.accelerator`` cache calls into no-ops before it loads a model. The
tests, the demo and the benchmarks build the drafter's layers without an engine (a CPU engine runs
vLLM's ``dspark`` speculator only under Triton's interpreter), so they set up the same state, once, here.
"""

from __future__ import annotations


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
