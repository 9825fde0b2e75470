# SPDX-License-Identifier: Apache-2.0
"""Torch references of the vLLM CUDA ops the in-tree K3 drafter's context-KV path launches, and a fake-CUDA set-up.

Each reference has its op's ``vllm._custom_ops`` signature and in-place contract and follows its CUDA
kernel (``csrc/layernorm_kernels.cu``, ``pos_encoding_kernels.cu``, ``cache_kernels.cu``), with vLLM's own
torch reference of the math where it has one: ``vllm.ir.ops.rms_norm``'s native implementation and
``ApplyRotaryEmb.forward_static``.
"""

from __future__ import annotations

import pytest
import torch

# cache_kernels.cu's Fp8KVCacheDataType by kv_cache_dtype string ("fp8" is E4M3 on CUDA).
_FP8_FORMATS = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """``out = rms_norm(input) * weight``; a ``[G, D]`` weight normalizes row group ``g`` of ``input`` with row ``g``."""
    # The kernel's math, as the native op's: fp32 statistics, the row cast to the input dtype, times the weight.
    from vllm import ir

    native = ir.ops.rms_norm.impls["native"].impl_fn
    hidden = input.shape[-1]
    weights = weight.view(-1, hidden)
    rows = input.reshape(weights.shape[0], -1, hidden)
    normed = torch.stack([native(x, w, epsilon) for x, w in zip(rows, weights)])
    out.copy_(normed.view_as(out))


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    rope_dim_offset: int = 0,
    inverse: bool = False,
) -> None:
    """Rotate ``query`` (and ``key``) in place at ``positions``: the first ``cos_sin_cache.size(1)`` dims of each head."""
    # The kernel reads cos/sin in the table's own dtype (fp32 for Kimi-K3's MLA), computes in fp32 and
    # rounds once to the query's dtype.
    from vllm.model_executor.layers.rotary_embedding.common import ApplyRotaryEmb

    assert rope_dim_offset == 0 and not inverse, "the context-KV path uses neither"
    cos, sin = cos_sin_cache.index_select(0, positions.flatten()).chunk(2, dim=-1)
    rot_dim = cos_sin_cache.shape[1]
    for x in (query, key) if key is not None else (query,):
        heads = x.view(positions.numel(), -1, head_size)
        heads[..., :rot_dim] = ApplyRotaryEmb.forward_static(
            heads[..., :rot_dim], cos, sin, is_neox, enable_fp32_compute=True
        )


class ConcatAndCacheMLAGrouped:
    """``concat_and_cache_mla_grouped`` over CPU caches: the kernel finds each layer's cache by its base pointer."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        self.caches = {cache.data_ptr(): cache for cache in caches}
        self.launches = 0

    def __call__(
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache_ptrs: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_size: int,
        block_stride: int,
        entry_stride: int,
        kv_scales: torch.Tensor | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        """Write ``[kv_c[l, t] | k_pe[l, t]]`` at ``slot_mapping[l, t]`` of layer ``l``'s cache; slots < 0 are padding."""
        self.launches += 1
        width = kv_c.shape[-1] + k_pe.shape[-1]
        latents = torch.cat([kv_c, k_pe], dim=-1)
        for layer, ptr in enumerate(kv_cache_ptrs.tolist()):
            cache = self.caches[ptr]
            pages = cache.as_strided(
                (cache.numel() // block_stride, block_size, width), (block_stride, entry_stride, 1)
            )
            slots = slot_mapping[layer]
            valid = slots >= 0
            latent = latents[layer][valid]
            if kv_cache_dtype == "auto":
                assert latent.dtype == cache.dtype, "the auto insert is a raw copy"
            else:
                assert kv_scales is not None, f"a {kv_cache_dtype} insert needs the layers' scales"
                # x / scale in fp32, saturated to the format's finite range (__NV_SATFINITE).
                fmt = _FP8_FORMATS[kv_cache_dtype]
                finite = torch.finfo(fmt)  # torch's cast saturates too, but does not document it
                latent = (
                    (latent.float() / kv_scales[layer].float())
                    .clamp(finite.min, finite.max)
                    .to(fmt)
                    .view(cache.dtype)
                )
            pages[slots[valid] // block_size, slots[valid] % block_size] = latent


def fake_cuda(
    monkeypatch: pytest.MonkeyPatch, caches: list[torch.Tensor]
) -> ConcatAndCacheMLAGrouped:
    """Report CUDA and run the context-KV kernels as the references above over ``caches``; returns the insert."""
    from vllm import _custom_ops
    from vllm.platforms import current_platform
    from vllm.v1.worker import workspace

    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    monkeypatch.setattr(_custom_ops, "rms_norm", rms_norm)
    monkeypatch.setattr(_custom_ops, "rotary_embedding", rotary_embedding)
    insert = ConcatAndCacheMLAGrouped(caches)
    monkeypatch.setattr(_custom_ops, "concat_and_cache_mla_grouped", insert)
    # A CPU build of torch cannot say whether a graph is being captured (none is); a GPU worker
    # sets up vLLM's workspace at start-up.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    if not workspace.is_workspace_manager_initialized():
        workspace.init_workspace_manager(torch.device("cpu"))
    return insert
