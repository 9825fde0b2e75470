# SPDX-License-Identifier: Apache-2.0
"""NaN or Inf in weights, scales or inputs is refused by name, never computed on.

Scales are judged on their stored bytes with numpy (``vllm-dspark check`` reads them without torch);
torch tensors go through the same rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_dspark.findings import Finding, FindingError

if TYPE_CHECKING:
    import numpy as np
    import torch

# E8M0 (MXFP4's scale exponent, stored as U8) encodes NaN as 255.
_E8M0_NAN = 255
# Scales in an FP8 format may be zero (NVFP4's group scale of an all-zero group); any other must be positive.
_FP8 = ("float8_e4m3fn", "float8_e5m2")


def require_finite(tensor: torch.Tensor, name: str, fix: str) -> None:
    """Raise ``ValueError`` naming ``name`` if ``tensor`` holds NaN or Inf."""
    if tensor.is_floating_point():
        import torch

        bad = tensor.numel() - int(torch.isfinite(tensor).sum())
        if bad:
            raise FindingError(
                Finding(f"{bad} of {tensor.numel()} values are NaN or infinite", fix, name)
            )


def stored_values(data: bytes | bytearray | memoryview, dtype: str) -> np.ndarray:
    """The values of a tensor of ``dtype`` (torch's name: ``bfloat16``, numpy's where it has one)
    whose bytes are ``data`` (little-endian), flat, in numpy: bfloat16 and FP8 from their bits
    (numpy has no such types), exactly."""
    import numpy as np

    if dtype == "bfloat16":  # the upper half of a float32
        return (np.frombuffer(data, "<u2").astype(np.uint32) << 16).view(np.float32)
    if dtype == "float8_e5m2":  # the upper half of a float16
        return (np.frombuffer(data, np.uint8).astype(np.uint16) << 8).view(np.float16)
    if dtype == "float8_e4m3fn":
        # Sign and magnitude moved into float16's bits, times 2^8, subnormals included; E4M3 has no
        # infinity, and its one NaN magnitude (0x7F) would read as 480.
        bits = np.frombuffer(data, np.uint8).astype(np.uint16)
        half = ((bits & 0x7F) << 7) | ((bits & 0x80) << 8)
        values = half.view(np.float16).astype(np.float32) * 256
        values[(bits & 0x7F) == 0x7F] = np.nan
        return values
    return np.frombuffer(data, np.dtype(dtype).newbyteorder("<"))


def invalid_scale_values(data: bytes | bytearray | memoryview, dtype: str) -> int:
    """How many entries of a quantization scale of ``dtype`` (as :func:`stored_values` takes it) whose
    bytes are ``data`` cannot dequantize a weight.

    The dtype says the kind: ``uint8`` is MXFP4's E8M0 exponent (255 encodes NaN); FP8 is NVFP4's
    per-group scale (zero is valid for an all-zero group); any other float scale (FP8 channel,
    NVFP4 global) must be finite and positive.
    """
    import numpy as np

    values = stored_values(data, dtype)
    if dtype == "uint8":
        return int(np.count_nonzero(values == _E8M0_NAN))
    with np.errstate(invalid="ignore"):
        positive = values >= 0 if dtype in _FP8 else values > 0
        return int(np.count_nonzero(~np.isfinite(values) | ~positive))


def invalid_scale_count(scale: torch.Tensor) -> int:
    """:func:`invalid_scale_values` of a scale tensor."""
    import torch

    raw = scale.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return invalid_scale_values(raw, str(scale.dtype).removeprefix("torch."))
