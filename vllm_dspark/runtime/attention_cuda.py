# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The K3 DSpark draft layers' attention in an engine: vLLM's Kimi-K3 MLA layer.

Imported by :func:`vllm_dspark.runtime.attention.build_latent_attention` only where an engine can run it (CUDA,
ROCm, or CPU with Triton through :mod:`vllm_dspark.runtime.attention_cpu`): the Kimi-K3 MLA module pulls in
its fused-kernel wrappers and cute-dsl at module level.
"""

from __future__ import annotations

import torch
from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention

from vllm_dspark.compat import kv_cache_scale


class K3DSparkMLA(MultiHeadLatentAttention):
    """``MultiHeadLatentAttention`` plus the context-latent insert the drafter's precompute needs."""

    def store_latent(
        self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Write ``[kv_c_normed | k_pe]`` (``[T, kv_lora_rank]``, ``[T, 1, rope]``) at ``slot_mapping [T]``.

        Through the backend's own insert, so the cache dtype (bf16 or fp8 with this layer's
        KV-cache scale) and page layout are whatever the attention kernels read.
        """
        self.impl.do_kv_cache_update(
            kv_c_normed,
            k_pe,
            self.kv_cache,
            slot_mapping,
            self.kv_cache_dtype,
            kv_cache_scale(self),
        )
