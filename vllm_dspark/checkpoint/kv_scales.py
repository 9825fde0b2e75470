# SPDX-License-Identifier: Apache-2.0
"""The draft layers' FP8 KV-cache scales on disk, in compressed-tensors' layout.

A compressed-tensors checkpoint with a quantized KV cache declares ``quantization_config.kv_cache_scheme``
(8-bit float, one static symmetric scale per tensor) and stores each attention's ``self_attn.k_scale``
and ``self_attn.v_scale``, which vLLM's loader maps onto the attention layer's ``k_scale`` /
``v_scale`` (``maybe_remap_kv_scale_name``). An MLA layer caches one latent, so only ``k_scale``
is read; ``v_scale`` is written equal to it, as vLLM duplicates a lone scale.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm_dspark.checkpoint.formats import TensorSpec
from vllm_dspark.findings import Finding, FindingError

if TYPE_CHECKING:
    import torch

# compressed-tensors' QuantizationArgs of a static per-tensor FP8 KV cache (what vLLM accepts).
KV_CACHE_SCHEME: dict[str, Any] = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "strategy": "tensor",
    "dynamic": False,
    "group_size": None,
    "observer": "minmax",
}
SHARD_NAME = "kv_cache_scales.safetensors"
_KEY = re.compile(r"^layers\.(\d+)\.self_attn\.([kv])_scale$")
FIX = "re-calibrate with `vllm-dspark quantize --kv-cache-scheme fp8`"


def scale_keys(layer: int) -> tuple[str, str]:
    """The checkpoint keys of draft layer ``layer``'s KV-cache scales: ``(k_scale, v_scale)``."""
    return f"layers.{layer}.self_attn.k_scale", f"layers.{layer}.self_attn.v_scale"


def tensor_specs(num_layers: int) -> dict[str, TensorSpec]:
    """``{key: TensorSpec}`` of the KV-cache scales a drafter may store: optional, one fp32 value each."""
    spec = TensorSpec("F32", (), also=("BF16", "F16"), optional=True)
    return {key: spec for layer in range(num_layers) for key in scale_keys(layer)}


def kv_scale_layer(key: str) -> int | None:
    """The draft layer whose KV-cache scale checkpoint tensor ``key`` is, or None for any other tensor."""
    m = _KEY.match(key)
    return int(m.group(1)) if m else None


def is_kv_scale(key: str) -> bool:
    """Whether checkpoint tensor ``key`` is a draft layer's KV-cache scale."""
    return kv_scale_layer(key) is not None


def k_scales(tensors: Mapping[str, torch.Tensor], num_layers: int) -> torch.Tensor | None:
    """``[num_layers]`` fp32 ``k_scale`` per draft layer from the checkpoint's scale tensors, or None
    if it stores none; one missing, not one value, or not finite and positive is a ``ValueError``."""
    import torch

    from vllm_dspark.finite import invalid_scale_count

    found = {k: t for k, t in tensors.items() if is_kv_scale(k)}
    if not found:
        return None
    scales = []
    for layer in range(num_layers):
        key = scale_keys(layer)[0]
        tensor = found.get(key)
        if tensor is None or tensor.numel() != 1:
            raise FindingError(
                Finding(
                    f"the checkpoint stores KV-cache scales, but {key} is "
                    + (
                        "missing"
                        if tensor is None
                        else f"of shape {tuple(tensor.shape)}, not one value"
                    ),
                    FIX,
                )
            )
        if invalid_scale_count(tensor):
            raise FindingError(
                Finding(f"{key} is {float(tensor)}: NaN, infinite, zero or negative", FIX)
            )
        scales.append(tensor.float().reshape(()))
    extra = sorted(k for k in found if kv_scale_layer(k) >= num_layers)
    if extra:
        raise FindingError(
            Finding(
                f"KV-cache scale {extra[0]} names a layer the drafter does not have "
                f"(num_hidden_layers={num_layers})",
                "use the config.json written with these shards",
            )
        )
    return torch.stack(scales)
