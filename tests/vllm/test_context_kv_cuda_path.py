# SPDX-License-Identifier: Apache-2.0
"""The context-KV path CUDA runs writes the pages the torch path CI runs writes.

On CUDA (``compat.runs_in_tree_k3_layers()``) the drafter binds the in-tree K3 drafter's fused
context-KV methods and builds their metadata after loading; they launch ``rms_norm`` with a
``[layers, kv_lora_rank]`` weight, ``rotary_embedding`` on the model-dtype ``k_pe`` against the fp32
cos/sin table, and ``concat_and_cache_mla_grouped`` with the layers' KV-cache scales. Here the platform
reports CUDA and those three ops are torch references of their kernels (``tests/support/cuda_ops.py``),
so that upstream code runs unchanged on CPU, over the layers a CPU build serves (the plugin's torch
layer; with Triton, vLLM's Kimi-K3 MLA layer as the CPU engine runs it, BF16 only). Its pages must equal the torch path's byte for byte: a BF16
cache and an FP8 E4M3 cache with a different ``k_scale`` != 1 per layer, one slot tensor or one per
layer (distinct or aliased), with padding slots.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.cuda_ops import fake_cuda
from tests.support.vllm_drafter import bind_caches, load_drafter, make_batch, run_block

pytestmark = [pytest.mark.vllm_api, pytest.mark.usefixtures("one_torch_thread")]

# One layer's scale is small enough that some latents saturate E4M3 (|x| / k_scale > 448).
K_SCALES = (2.0**-10, 0.5, 2.0, 1.25, 3.0)
SENTINEL = {"auto": -7.0, "fp8": 0x7F}  # 0x7F is an E4M3 NaN, which no saturated latent becomes


def _slot_mappings(
    slots: torch.Tensor, num_layers: int, num_slots: int
) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """The speculator's forms: one tensor for all layers, one per layer, and one tensor listed per layer."""
    generator = torch.Generator().manual_seed(3)
    per_layer = []
    for _ in range(num_layers):
        moved = torch.randperm(num_slots, generator=generator)[slots.clamp(min=0)]
        per_layer.append(torch.where(slots >= 0, moved, slots))
    return {"tensor": slots, "per_layer": per_layer, "aliased": [slots] * num_layers}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_in_tree_context_path_writes_the_torch_paths_pages(
    kv_cache_dtype: str, tiny_checkpoint: Path, tiny_mla_target: Path, monkeypatch
) -> None:
    from vllm.platforms import current_platform

    from vllm_dspark.compat import bind_upstream_context_kv
    from vllm_dspark.findings import FindingError

    cache_option = {} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}
    try:
        served = load_drafter(tiny_mla_target, tiny_checkpoint, dtype="bfloat16", **cache_option)
    except FindingError:
        from vllm_dspark.runtime import attention  # imported by the load, with the Triton it saw

        if kv_cache_dtype == "auto" or not (current_platform.is_cpu() and attention.HAS_TRITON):
            raise
        pytest.skip(
            "the layers built are the CPU engine's (Triton), which take a model-dtype cache only"
        )
    model = served.model
    attentions = [layer.self_attn for layer in model.model.layers]
    if kv_cache_dtype != "auto":
        # Where vLLM's loader puts a checkpoint's KV-cache scales.
        assert len(attentions) <= len(K_SCALES)
        for attn, scale in zip(attentions, K_SCALES):
            attn._k_scale.fill_(scale)
    batch = make_batch(model.config)
    # Padding rows (slot -1) inside and after the requests' rows, as CUDA-graph padding leaves them.
    pad, zero, rows = torch.tensor([-1]), torch.tensor([0]), batch.context_lens[0]
    slots = torch.cat([batch.context_slots[:rows], pad, batch.context_slots[rows:], pad, pad])
    positions = batch.context_positions
    positions = torch.cat([positions[:rows], zero, positions[rows:], zero, zero])
    aux = torch.randn(len(slots), batch.aux.shape[-1], generator=torch.Generator().manual_seed(4))
    context = model.combine_hidden_states(aux.to(torch.bfloat16))
    num_blocks = int(batch.block_table.max()) + 1
    mappings = _slot_mappings(slots, len(attentions), num_blocks * batch.block_size)
    cache_dtype = torch.bfloat16 if kv_cache_dtype == "auto" else torch.uint8  # as vLLM allocates

    def pages() -> list[torch.Tensor]:
        shape = (num_blocks, batch.block_size, attentions[0].head_size)
        return [torch.full(shape, SENTINEL[kv_cache_dtype], dtype=cache_dtype) for _ in attentions]

    def write(caches: list[torch.Tensor], mapping) -> None:
        for attn, cache in zip(attentions, caches):
            attn.bind_kv_cache(cache)
        model.precompute_and_store_context_kv(context, positions, mapping)

    torch_pages = {form: pages() for form in mappings}
    for form, mapping in mappings.items():
        write(torch_pages[form], mapping)

    cuda_pages = {form: pages() for form in mappings}
    insert = fake_cuda(monkeypatch, [cache for caches in cuda_pages.values() for cache in caches])
    # What the model does when built on CUDA, then after loading.
    bind_upstream_context_kv(
        model.model, served.vllm_config.scheduler_config.max_num_batched_tokens
    )
    model.process_weights_after_loading()
    for form, mapping in mappings.items():
        write(cuda_pages[form], mapping)
    assert insert.launches == len(mappings)  # every form took the grouped insert

    for form in mappings:
        for layer, (mine, theirs) in enumerate(zip(torch_pages[form], cuda_pages[form])):
            written = (theirs != SENTINEL[kv_cache_dtype]).any(dim=-1)
            assert int(written.sum()) == int((slots >= 0).sum()), (form, layer)
            assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)), (form, layer)


def test_torch_path_attends_over_fp8_pages_as_over_bf16_ones(
    tiny_checkpoint: Path, tiny_mla_target: Path
) -> None:
    """The torch layer's FP8 read dequantizes with k_scale: a drafted block within E4M3 rounding of BF16's."""
    from vllm_dspark.runtime.attention import TorchLatentAttention

    outputs = {}
    for kv_cache_dtype, cache_dtype in (("auto", torch.bfloat16), ("fp8", torch.uint8)):
        cache_option = {} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}
        served = load_drafter(tiny_mla_target, tiny_checkpoint, dtype="bfloat16", **cache_option)
        model = served.model
        if not isinstance(model.model.layers[0].self_attn, TorchLatentAttention):
            pytest.skip("the layers built are the CPU engine's (Triton), not the torch layer")
        for layer, scale in zip(model.model.layers, K_SCALES[1:]):
            layer.self_attn._k_scale.fill_(scale)  # unsaturating scales, read back by the fp8 layer
        batch = make_batch(model.config)
        bind_caches(model, batch, cache_dtype)
        context = model.combine_hidden_states(batch.aux.to(torch.bfloat16))
        model.precompute_and_store_context_kv(context, batch.context_positions, batch.context_slots)
        outputs[kv_cache_dtype] = run_block(served, batch).float()
    error = (outputs["fp8"] - outputs["auto"]).norm() / outputs["auto"].norm()
    # Measured 0.09 (E4M3 keeps 3 mantissa bits); read without k_scale, 0.73.
    assert 0 < error < 0.25, error
