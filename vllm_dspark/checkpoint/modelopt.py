# SPDX-License-Identifier: Apache-2.0
"""NVIDIA ModelOpt's encoding of the formats: its quantization config and its tensors (docs/encodings.md).

ModelOpt's FP8, FP8_PER_CHANNEL_PER_TOKEN, NVFP4 and W4A16_NVFP4 are the numerics of the formats
whose :attr:`~vllm_dspark.checkpoint.formats.QuantFormat.modelopt_algo` names them (fp8-static,
fp8-dynamic, nvfp4-w4a4, nvfp4), under ModelOpt's own tensor names and scale conventions. The math
is ModelOpt 0.47's export (``modelopt/torch/export/quant_utils.py``, ``qtensor/nvfp4_tensor.py``)
as its drafter quantizer (NVIDIA/Model-Optimizer PR #2027) runs it: weight amax only, activation
amax fixed at 448.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_dspark.checkpoint import formats
from vllm_dspark.checkpoint.formats import (
    CALIBRATION_FREE_INPUT_AMAX,
    SCALE_DTYPES,
    TensorSpec,
    no_grad,
)

if TYPE_CHECKING:
    import torch

ENCODING = "modelopt"
HF_QUANT_CONFIG = "hf_quant_config.json"  # where ModelOpt (and vLLM, failing config.json) reads it
# vLLM reads hf_quant_config.json only from the producer named "modelopt"; the layout is 0.47.0's.
PRODUCER = {"name": "modelopt", "version": "0.47.0"}
# vLLM's ModelOptFp8Config / ModelOptNvFp4Config.get_min_capability() (the compute capability, major *
# 10 + minor, they declare): FP8 from sm_80, though its Marlin kernel would run on sm_75.
MIN_CAPABILITY = {"FP8": 80, "FP8_PER_CHANNEL_PER_TOKEN": 80, "NVFP4": 75, "W4A16_NVFP4": 75}
# Values per NVFP4 block scale: ops.act_quant's NVFP4_BLOCK, known here without its torch import.
NVFP4_BLOCK = formats.NVFP4.group_size
# Magnitudes rounding up to the next code; a tie goes down except at 0.75, 1.75 and 3.5 (ties to even).
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def algos() -> dict[str, str]:
    """``{quant_algo: format}`` for every format ModelOpt writes."""
    return {f.modelopt_algo: f.name for f in formats.REGISTRY.values() if f.modelopt_algo}


def is_modelopt(quantization_config: Mapping[str, Any]) -> bool:
    """Whether a ``quantization_config`` (or hf_quant_config.json) is ModelOpt's, by vLLM's own test."""
    method = str(quantization_config.get("quant_method", ""))
    producer = quantization_config.get("producer")
    return method.lower().startswith("modelopt") or (
        isinstance(producer, dict) and producer.get("name") == "modelopt"
    )


@dataclass(frozen=True)
class Config:
    """A parsed ModelOpt config: the one format of every linear, and the excludes that keep some BF16."""

    fmt: str
    excludes: tuple[str, ...]

    @classmethod
    def parse(cls, quantization_config: Mapping[str, Any]) -> Config:
        """config.json's flat block or hf_quant_config.json's ``quantization``; ``ValueError`` naming the field."""
        nested = quantization_config.get("quantization")
        qc = nested if isinstance(nested, Mapping) else quantization_config
        # vLLM reads config.json's "ignore" first (ModelOpt writes both), hf_quant_config's "exclude_modules".
        excludes = qc.get("ignore", qc.get("exclude_modules", []))
        algo = str(qc.get("quant_algo") or "").upper()
        if algo not in algos():
            raise ValueError(
                f"ModelOpt quant_algo is {qc.get('quant_algo')!r}; the drafter serves "
                + ", ".join(f"{a} ({fmt})" for a, fmt in algos().items())
            )
        if qc.get("kv_cache_quant_algo") is not None:
            raise ValueError(
                f"kv_cache_quant_algo is {qc['kv_cache_quant_algo']!r}, but the drafter's latent "
                "lives in the target's KV cache, whose dtype the target sets"
            )
        fmt = algos()[algo]
        group = qc.get("group_size", NVFP4_BLOCK)
        if formats.get(fmt).group_size == NVFP4_BLOCK and group != NVFP4_BLOCK:
            raise ValueError(f"group_size is {group!r}; {algo} quantizes groups of 16")
        if not isinstance(excludes, list) or not all(isinstance(e, str) for e in excludes):
            raise ValueError(f"exclude_modules must be a list of names, found {excludes!r}")
        return cls(fmt, tuple(excludes))

    def excluded_by(self, names: Iterable[str]) -> str | None:
        """The first exclude entry naming one of ``names`` (exactly or as an fnmatch glob), or None."""
        names = list(names)
        return next(
            (e for e in self.excludes if any(n == e or fnmatch.fnmatchcase(n, e) for n in names)),
            None,
        )


def quantization_config(fmt: str, excludes: Sequence[str]) -> dict[str, Any]:
    """config.json's ``quantization_config`` for a ModelOpt build, keys in ModelOpt's order."""
    algo = formats.get(fmt).modelopt_algo
    if algo is None:
        raise ValueError(
            f"ModelOpt has no encoding of {fmt}; it writes "
            + ", ".join(f"{f} ({a})" for a, f in algos().items())
        )
    block: dict[str, Any] = {"quant_algo": algo, "kv_cache_quant_algo": None}
    if formats.get(fmt).group_size == NVFP4_BLOCK:
        block["group_size"] = NVFP4_BLOCK
    block["exclude_modules"] = list(excludes)
    method = "modelopt_fp4" if "NVFP4" in algo else "modelopt"
    return {**block, "quant_method": method, "ignore": list(excludes)}


def hf_quant_config(qc: Mapping[str, Any]) -> dict[str, Any]:
    """hf_quant_config.json for config.json's ``quantization_config`` ``qc``."""
    keep = ("quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules")
    return {"producer": dict(PRODUCER), "quantization": {k: qc[k] for k in keep if k in qc}}


def exclude_entries(names: Iterable[str]) -> list[str]:
    """How ModelOpt's export spells the excludes of checkpoint modules ``names``: each name and ``*name``,
    plus its fused aliases ``*qkv_proj`` / ``*gate_up_proj`` when every member is excluded somewhere."""
    names = sorted(names)
    entries = [e for n in names for e in (n, f"*{n}")]
    aliases = {
        "*gate_up_proj": ("gate_proj", "up_proj"),
        "*qkv_proj": ("q_proj", "k_proj", "v_proj"),
    }
    entries += [
        alias
        for alias, members in aliases.items()
        if all(any(m in n for n in names) for m in members)
    ]
    return entries


# ----- tensors -----


def tensor_specs(fmt: str, shape: tuple[int, int]) -> dict[str, TensorSpec]:
    """``{suffix: TensorSpec}`` ModelOpt stores for a [N, K] weight in ``fmt``.

    Per-tensor scales as 0.47 writes them: [1] for FP8, [] for NVFP4 (either loads, see
    :attr:`TensorSpec.shapes`); every scale but NVFP4's E4M3 block scales also loads from BF16 or F16.
    W4A16 NVFP4 may hold older exports' ``input_scale`` (optional: vLLM loads it and drops it).
    """
    n, k = shape
    scalar = TensorSpec("F32", (1,), also=SCALE_DTYPES)
    if fmt == "fp8-static":
        return {
            "weight": TensorSpec("F8_E4M3", (n, k)),
            "weight_scale": scalar,
            "input_scale": scalar,
        }
    if fmt == "fp8-dynamic":
        return {
            "weight": TensorSpec("F8_E4M3", (n, k)),
            "weight_scale": TensorSpec("F32", (n,), also=SCALE_DTYPES),
        }
    specs = {
        "weight": TensorSpec("U8", (n, k // 2)),
        "weight_scale": TensorSpec("F8_E4M3", (n, k // NVFP4_BLOCK)),
        "weight_scale_2": TensorSpec("F32", (), also=SCALE_DTYPES),
    }
    weight_only = formats.get(fmt).activation_args is None
    specs["input_scale"] = TensorSpec("F32", (), also=SCALE_DTYPES, optional=weight_only)
    return specs


# What a module's tensors may read as (by :func:`canonical_dtypes`) beside its own format: older
# W4A16 NVFP4 exports keep an input_scale, which vLLM registers for them only to drop it after loading
# (its ModelOpt linear method's _DropInputScale), so their tensors are W4A4's.
ALSO_STORED_AS = {"nvfp4": "nvfp4-w4a4"}


def canonical_dtypes(dtypes: Mapping[str, str]) -> dict[str, str]:
    """A module's stored ``{suffix: dtype}`` under compressed-tensors' names, for format identification.

    Only NVFP4 names differ: ModelOpt's packed ``weight`` is U8 and its global scale ``weight_scale_2``.
    """
    if dtypes.get("weight") != "U8" or "weight_scale_2" not in dtypes:
        return dict(dtypes)
    rename = {
        "weight": "weight_packed",
        "weight_scale_2": "weight_global_scale",
        "input_scale": "input_global_scale",
    }
    return {rename.get(s, s): d for s, d in dtypes.items()}


def input_scale(fmt: str, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The scale :mod:`vllm_dspark.ops.act_quant` takes for the module's input: FP8's ``input_scale``
    as stored, NVFP4's global scale as its reciprocal (vLLM's ``input_global_scale_inv``)."""
    if "input_scale" not in tensors:
        return None
    scale = tensors["input_scale"].float().reshape(())
    return 1.0 / scale if fmt == "nvfp4-w4a4" else scale


@no_grad
def quantize(
    weight: torch.Tensor, fmt: str, *, amax: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """ModelOpt's export of a [N, K] ``weight`` in ``fmt``: ``{suffix: tensor}`` as :func:`tensor_specs`.

    ``amax``: the per-tensor amax a fused group shares (FP8 weight scale, NVFP4 ``weight_scale_2``);
    by default the weight's own. Bit-identical to ModelOpt 0.47 (tests/checkpoint/test_modelopt.py).
    """
    import torch

    from vllm_dspark.ops.act_quant import FP4_MAX, FP8_MAX

    formats._check_weight(weight, fmt)
    w = weight.detach()
    if fmt == "fp8-dynamic":
        s = w.abs().amax(dim=1).float() / FP8_MAX
        s = torch.where(s == 0, torch.ones_like(s), s)  # ModelOpt sanitizes a zero amax to maxbound
        return {"weight": (w / s[:, None]).to(torch.float8_e4m3fn), "weight_scale": s}
    amax = (w.abs().amax() if amax is None else amax).float()
    if fmt == "fp8-static":
        s = (torch.where(amax == 0, FP8_MAX, amax) / FP8_MAX).reshape(1)
        return {
            "weight": (w / s).to(torch.float8_e4m3fn),
            "weight_scale": s,
            "input_scale": torch.tensor([CALIBRATION_FREE_INPUT_AMAX / FP8_MAX]),
        }
    n, k = w.shape
    s2 = (amax / (FP4_MAX * FP8_MAX)).reshape(())
    blocks = w.view(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    s = blocks.abs().amax(dim=-1).float() / (FP4_MAX * s2)
    s = torch.where(s == 0, torch.ones_like(s), s)
    s8 = s.clamp(min=2**-9, max=FP8_MAX).to(torch.float8_e4m3fn)
    x = (blocks / (s8.float() * s2).unsqueeze(-1)).reshape(n, k)
    code = torch.searchsorted(torch.tensor(_E2M1_BOUNDS), x.abs().contiguous()).to(torch.uint8)
    code += ((x.abs() == 0.75) | (x.abs() == 1.75) | (x.abs() == 3.5)).to(torch.uint8)
    code |= (x < 0).to(torch.uint8) << 3
    out = {"weight": (code[:, 1::2] << 4) | code[:, 0::2], "weight_scale": s8, "weight_scale_2": s2}
    if formats.get(fmt).activation_args is not None:
        out["input_scale"] = torch.tensor(CALIBRATION_FREE_INPUT_AMAX / (FP4_MAX * FP8_MAX))
    return out


def group_amax(weights: Iterable[torch.Tensor]) -> torch.Tensor:
    """The amax a fused group's shards share, so vLLM's one per-tensor scale fits them all."""
    import torch

    return torch.stack([w.detach().abs().amax().float() for w in weights]).max()


@no_grad
def dequantize(
    tensors: Mapping[str, torch.Tensor], fmt: str, shape: tuple[int, int]
) -> torch.Tensor:
    """float32 [N, K] weight from ModelOpt's ``tensors``, as its ``dequantize`` (and vLLM) compute it."""
    from vllm_dspark.ops.fp4 import dequantize_nvfp4

    n, k = shape
    if fmt in ("fp8-static", "fp8-dynamic"):
        scale = tensors["weight_scale"].float()
        return tensors["weight"].float() * scale.reshape((n, 1) if fmt == "fp8-dynamic" else ())
    return dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
