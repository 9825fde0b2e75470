# SPDX-License-Identifier: Apache-2.0
"""The weight-only formats a drafter can be quantized to: one :class:`QuantFormat` per format.

Everything numeric comes from compressed-tensors (preset schemes, qparam helpers, compressors),
imported where it is used, as torch is: what a format stores (its :class:`TensorSpec`, in
safetensors dtype names) is read without either, by ``vllm-dspark check``. A format also states its
preset's weight args as plain data (checked against the preset in the tests), so the FP8 path plans,
quantizes and writes its config without compressed-tensors; a format chooses its scheme, declares
the tensors it stores per module, and recognises its own config groups and stored tensors.
:data:`REGISTRY` holds them by name; every tool asks it, so a new format is one registered class.
The math runs in row chunks (:func:`quantize_weight` and friends) so a large projection never needs
the whole float32 weight as scratch. Which modules one quantizes is
:mod:`vllm_dspark.checkpoint.quant_plan`'s; the ``quantization_config`` block,
:mod:`vllm_dspark.checkpoint.quant_config`'s.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from vllm_dspark.checkpoint.layout import QUANT_FORMATS
from vllm_dspark.checkpoint.st_io import dtype_name, torch_dtype, torch_name

if TYPE_CHECKING:
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from vllm_dspark.ops.act_quant import ActScheme

_P = ParamSpec("_P")
_R = TypeVar("_R")

# Rows per chunk hold about this many weights: the chunk stays in cache across compressed-tensors'
# elementwise passes, and the FP4 packer's [rows, K, 8] float scratch stays small.
_CHUNK_ELEMENTS = 1 << 18


# A tensor of one value is stored as [1] (compressed-tensors, ModelOpt's FP8) or as [] (AutoFP8, ModelOpt's
# NVFP4): vLLM's parameters load either into their one-element shape ("AutoFP8 scales do not have a shape").
ONE_VALUE_SHAPES: tuple[tuple[int, ...], ...] = ((1,), ())
# The float dtypes a scale is stored in beside float32, the one it is written in: vLLM's float32 scale
# parameters copy them in exactly.
SCALE_DTYPES = ("BF16", "F16")


def no_grad(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``@torch.no_grad()`` that imports torch when ``fn`` runs: what a format stores (its
    :class:`TensorSpec`) is read without torch, by ``vllm-dspark check``."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        import torch

        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper


@dataclass(frozen=True)
class TensorSpec:
    """dtype and shape of one stored tensor, as written; ``also`` lists dtypes other producers write.

    dtypes are safetensors names (``F8_E4M3``); :attr:`dtype` is the written one as a torch dtype.
    A one-value tensor (a per-tensor scale) is stored as [1] or as []: :attr:`shapes` names both,
    :meth:`fits` takes both, and :meth:`conform` gives any of them this spec's own :attr:`shape` (and
    any of :attr:`dtype_names` its :attr:`dtype`). An ``optional`` tensor is one vLLM takes when
    stored and does without (nothing computes with it; writers leave it out).
    """

    dtype_name: str
    shape: tuple[int, ...]
    also: tuple[str, ...] = ()
    optional: bool = False

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype it is written in (imports torch)."""
        return torch_dtype(self.dtype_name)

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """Every shape a checkpoint may store it in: :attr:`shape` first."""
        if self.shape in ONE_VALUE_SHAPES:
            return (self.shape, *(s for s in ONE_VALUE_SHAPES if s != self.shape))
        return (self.shape,)

    @property
    def dtype_names(self) -> tuple[str, ...]:
        """Every dtype a checkpoint may store it in: the written one first."""
        return (self.dtype_name, *self.also)

    def fits(self, shape: Sequence[int]) -> bool:
        """Whether a stored tensor of ``shape`` is this one (vLLM loads it)."""
        return tuple(shape) in self.shapes

    def shape_text(self) -> str:
        """``(1,) or ()``: the shapes :meth:`fits` takes, for a message."""
        return " or ".join(str(s) for s in self.shapes)

    def conform(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, stored in any of :attr:`shapes` and :attr:`dtypes`, as vLLM's parameter holds it:
        in :attr:`shape` and :attr:`dtype` (a BF16 scale computes as the float32 scale of its value)."""
        if tuple(tensor.shape) != self.shape and self.fits(tensor.shape):
            tensor = tensor.reshape(self.shape)
        return tensor.to(self.dtype) if dtype_name(tensor.dtype) in self.also else tensor


WEIGHT_FIELDS = (
    "num_bits",
    "type",
    "strategy",
    "group_size",
    "block_structure",
    "symmetric",
    "dynamic",
    "scale_dtype",
)
# The input-activation args a config group must share with an activation-quantized format.
ACTIVATION_FIELDS = ("num_bits", "type", "strategy", "group_size", "symmetric", "dynamic")
# A calibration-free build fixes the activations' amax here, as ModelOpt's drafter quantizer does:
# FP8's static input_scale is then 1.0, NVFP4's input global scale 6.0.
CALIBRATION_FREE_INPUT_AMAX = 448.0


class QuantFormat:
    """One format: its compressed-tensors scheme, the tensors it stores per module, how it quantizes inputs."""

    name: str  # the --quant-format value and the eval variant name
    preset: (
        str  # the compressed-tensors preset whose weight args it takes (input activations dropped)
    )
    format_strings: tuple[str, ...]  # the compressed-tensors format labels vLLM loads it from
    description: str  # one line for --help and error messages
    # The weight args a config group must share with the scheme to be this format.
    contract = WEIGHT_FIELDS
    has_global_scale = False
    # Whether vLLM fuses shards under one scale (NVFP4's global scale, FP8's per-tensor weight scale),
    # so the quantizer gives a fused group one: see :meth:`shared_global_scale`.
    fused_shares_scale = False
    # Its quantizer runs compressed-tensors' torch.compile'd rounding, which must run eager.
    compiled_kernels = True
    num_bits: int  # the preset's weight args, as data (checked against the preset in the tests)
    strategy: str  # the preset's weight strategy: "channel", "group" or "tensor"
    group_size: int | None = None  # input columns per scale; None for a whole row or tensor
    block: tuple[int, int] | None = None  # (rows, columns) per weight scale of a block format
    scale_dtype: str | None = None  # a stored scale dtype the scheme names; None: float
    # How vLLM quantizes the input, as :attr:`activation`'s arguments; None: weight-only (W*A16).
    activation_args: tuple[str, int | None] | None = None
    input_args: dict[str, Any] | None = None  # the preset's input activation args, as data
    modelopt_algo: str | None = None  # ModelOpt's quant_algo for the same numerics, if it has one
    # What vLLM 0.33/0.34 compute for it on NVIDIA GPUs, from each compute capability (major * 10 +
    # minor) up: None is this format's own numerics, else how it differs. The first entry is the
    # oldest GPU vLLM has a kernel for (the scheme's get_min_capability; tests/vllm checks it).
    cuda_kernels: tuple[tuple[int, str | None], ...] = ((75, None),)

    @functools.cached_property
    def activation(self) -> ActScheme | None:
        """How vLLM quantizes the input (computed in torch, imported here); None: weight-only (W*A16)."""
        from vllm_dspark.ops.act_quant import ActScheme

        return None if self.activation_args is None else ActScheme(*self.activation_args)

    @functools.cached_property
    def scheme(self) -> QuantizationScheme:
        """The compressed-tensors scheme (targets filled in by :func:`compressed_tensors_config`)."""
        import torch
        from compressed_tensors.compressors.format import infer_module_format
        from compressed_tensors.quantization import preset_name_to_scheme

        scheme = preset_name_to_scheme(self.preset, targets=[])
        if self.activation is None:
            scheme = scheme.model_copy(update={"input_activations": None})
        scheme.format = infer_module_format(torch.nn.Linear, scheme)
        return scheme

    def config_group(self, targets: Sequence[str]) -> dict[str, Any]:
        """This format's config group for ``targets``, as compressed-tensors reads it: the weight args
        that differ from its defaults (library-free; the tests check it validates to :attr:`scheme`)."""
        weights = {
            "num_bits": self.num_bits,
            "type": "float",
            "symmetric": True,
            "strategy": self.strategy,
            "group_size": self.group_size,
            "block_structure": None if self.block is None else list(self.block),
            "dynamic": False,
            "scale_dtype": None
            if self.scale_dtype is None
            else f"torch.{torch_name(self.scale_dtype)}",
        }
        return {
            "targets": list(targets),
            "weights": weights,
            "input_activations": self.input_args,  # None: weight-only, said outright
            "output_activations": None,
            "format": self.format_strings[0],
        }

    @property
    def compressor(self) -> type[BaseCompressor]:
        from compressed_tensors.compressors import BaseCompressor

        return BaseCompressor.get_value_from_registry(self.scheme.format)

    def tensor_specs(self, shape: tuple[int, int]) -> dict[str, TensorSpec]:
        """``{suffix: TensorSpec}`` of the tensors that replace a [N, K] ``weight``: what vLLM's scheme loads."""
        raise NotImplementedError

    def identify(self, dtypes: Mapping[str, str]) -> bool:
        """Whether a module's stored ``{suffix: safetensors dtype}`` are this format's tensors."""
        raise NotImplementedError

    def shape_problem(self, shape: tuple[int, int]) -> str | None:
        """Why a [N, K] weight cannot take this format (its groups or blocks do not divide it), or None."""
        n, k = shape
        if self.block is not None and (n % self.block[0] or k % self.block[1]):
            return f"{self.name} quantizes {self.block[0]}x{self.block[1]} blocks, which do not tile [{n}, {k}]"
        if self.group_size is not None and k % self.group_size:
            return f"{self.name} quantizes groups of {self.group_size} input columns, which do not divide {k}"
        return None

    def matches(self, weights: QuantizationArgs, inputs: QuantizationArgs | None) -> bool:
        """Whether a config group's weight and input-activation args are this format's."""
        ours = self.scheme.input_activations
        if (inputs is None) != (ours is None):
            return False
        return all(
            getattr(weights, f) == getattr(self.scheme.weights, f) for f in self.contract
        ) and (
            inputs is None or all(getattr(inputs, f) == getattr(ours, f) for f in ACTIVATION_FIELDS)
        )

    def input_scales(self) -> dict[str, torch.Tensor]:
        """The static input scale tensors a calibration-free build stores (``{}`` for dynamic or none)."""
        return {}

    def input_quantizer(
        self, read: Callable[[str], torch.Tensor]
    ) -> tuple[ActScheme, torch.Tensor | None] | None:
        """How a module's input is quantized: its scheme and the stored scale it reads (``read(suffix)``)."""
        if self.activation is None:
            return None
        (suffix,) = self.input_scales() or (None,)
        return self.activation, None if suffix is None else read(suffix).float().reshape(())

    def shared_global_scale(self, weights: Iterable[torch.Tensor]) -> torch.Tensor | None:
        """The one global scale weights that vLLM fuses must share; None for a format without one."""
        return None

    def quantize(
        self, weight: torch.Tensor, global_scale: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        return quantize_weight(weight, self.name, global_scale=global_scale)

    def fake_quantize(
        self, weight: torch.Tensor, global_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        return fake_quantize_weight(weight, self.name, global_scale=global_scale)

    def dequantize(
        self, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int]
    ) -> torch.Tensor:
        return dequantize_weight(dict(tensors), self.name, shape)

    def served_weight(
        self, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int]
    ) -> torch.Tensor:
        """float32 [N, K] as vLLM's kernels see it (what the reference drafter runs); :meth:`dequantize`'s."""
        return self.dequantize(tensors, shape)

    def snr_db(self, weight: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> float:
        return weight_snr_db(weight, dict(tensors), self.name)

    @property
    def row_block(self) -> int:
        """Rows per scale row: a block format's block height, else 1 (a chunk must hold whole blocks)."""
        return self.block[0] if self.block else 1

    @property
    def row_separable(self) -> bool:
        """Whether rows quantize independently (given any global scale): a weight may stream in row chunks."""
        return self.strategy != "tensor"

    def quantize_with_error(
        self, weight: torch.Tensor, global_scale: torch.Tensor | None = None
    ) -> tuple[dict[str, torch.Tensor], float, float]:
        """:meth:`quantize` plus the sums |W|^2 and |W - dequant(Q)|^2 that make its SNR."""
        parts = self.quantize(weight, global_scale=global_scale)
        return (parts, *_error_sums(weight, parts, self.name))


# An NVFP4 weight's per-tensor global scale: compressed-tensors' name, then ModelOpt's.
GLOBAL_SCALE_SUFFIXES = ("weight_global_scale", "weight_scale_2")


def is_scale(suffix: str) -> bool:
    """Whether a stored tensor suffix is a scale (``weight_scale``, ModelOpt's ``weight_scale_2``, ...)."""
    return suffix.endswith("scale") or suffix.endswith("scale_2")


REGISTRY: dict[str, QuantFormat] = {}


def register(cls: type[QuantFormat]) -> type[QuantFormat]:
    """Class decorator: add a format to :data:`REGISTRY` under its ``name``."""
    REGISTRY[cls.name] = cls()
    return cls


def get(name: str) -> QuantFormat:
    """The registered format ``name``; ``ValueError`` naming the choices for any other."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown quant format {name!r}; choose one of {', '.join(REGISTRY)}"
        ) from None


def names() -> tuple[str, ...]:
    """The registered formats' names, in registration order."""
    return tuple(REGISTRY)


@register
class FP8(QuantFormat):
    """E4M3, symmetric, one scale per output channel: weight f8e4m3 [N,K], weight_scale f32 [N,1]."""

    name = "fp8"
    # No weight-only per-channel FP8 preset: FP8_DYNAMIC's weights are exactly that.
    preset = "FP8_DYNAMIC"
    # compressed-tensors labels weight-only FP8 "naive-quantized"; older exports say "float-quantized".
    format_strings = ("naive-quantized", "float-quantized")
    description = QUANT_FORMATS["fp8"]
    num_bits, strategy = 8, "channel"
    compiled_kernels = False  # fp8_channel_quantize is plain torch
    # fp8 scales are plain floats: scale_dtype is not part of its contract.
    contract = tuple(f for f in WEIGHT_FIELDS if f != "scale_dtype")

    def tensor_specs(self, shape: tuple[int, int]) -> dict[str, TensorSpec]:
        n, k = shape
        # Written in fp32 (what vLLM's scale parameter holds); bf16/fp16 scales also load.
        return {
            "weight": TensorSpec("F8_E4M3", (n, k)),
            "weight_scale": TensorSpec("F32", (n, 1), also=SCALE_DTYPES),
        }

    def identify(self, dtypes: Mapping[str, str]) -> bool:
        return dtypes.get("weight") == "F8_E4M3" and "input_scale" not in dtypes

    def quantize_with_error(
        self, weight: torch.Tensor, global_scale: torch.Tensor | None = None
    ) -> tuple[dict[str, torch.Tensor], float, float]:
        if self.strategy != "channel":
            return super().quantize_with_error(weight, global_scale)
        _check_weight(weight, self.name)
        return fp8_channel_quantize(weight)


# The preset's input args as compressed-tensors writes them (checked against the presets in the tests).
_FP8_INPUTS = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}


@register
class FP8Dynamic(FP8):
    """W8A8: FP8's per-channel weights, inputs E4M3 per token, scaled dynamically (llm-compressor's FP8_DYNAMIC)."""

    name = "fp8-dynamic"
    preset = "FP8_DYNAMIC"
    format_strings = ("float-quantized",)
    description = QUANT_FORMATS["fp8-dynamic"]
    activation_args = ("fp8_token", None)
    input_args = {**_FP8_INPUTS, "strategy": "token", "dynamic": True}
    modelopt_algo = "FP8_PER_CHANNEL_PER_TOKEN"
    # Below sm_89 vLLM's compressed-tensors config picks its W8A16 scheme instead (no FP8 GEMM).
    cuda_kernels = ((75, "weight-only, inputs unquantized (Marlin W8A16)"), (89, None))


@register
class FP8Static(QuantFormat):
    """W8A8: one E4M3 weight scale per tensor and a static input_scale [1] (compressed-tensors' FP8)."""

    name = "fp8-static"
    preset = "FP8"
    format_strings = ("float-quantized",)
    description = QUANT_FORMATS["fp8-static"]
    num_bits, strategy = 8, "tensor"
    compiled_kernels = False
    contract = FP8.contract
    activation_args = ("fp8_tensor", None)
    fused_shares_scale = True  # vLLM requantizes fused shards to their largest scale otherwise
    input_args = {
        **_FP8_INPUTS,
        "strategy": "tensor",
        "dynamic": False,
        "observer": "static_minmax",
    }
    modelopt_algo = "FP8"
    cuda_kernels = FP8Dynamic.cuda_kernels

    def tensor_specs(self, shape: tuple[int, int]) -> dict[str, TensorSpec]:
        scalar = TensorSpec("F32", (1,), also=SCALE_DTYPES)
        return {
            "weight": TensorSpec("F8_E4M3", shape),
            "weight_scale": scalar,
            "input_scale": scalar,
        }

    def identify(self, dtypes: Mapping[str, str]) -> bool:
        return dtypes.get("weight") == "F8_E4M3" and "input_scale" in dtypes

    def input_scales(self) -> dict[str, torch.Tensor]:
        import torch

        return {"input_scale": torch.tensor([CALIBRATION_FREE_INPUT_AMAX / 448.0])}

    def shared_global_scale(self, weights: Iterable[torch.Tensor]) -> torch.Tensor:
        """The one weight scale a fused group shares: its largest magnitude / 448."""
        import torch

        # The per-tensor scale of the two extremes is the scale of everything between them.
        return _scales(torch.stack(_value_range(weights))[None], self.name, None)

    def quantize(
        self, weight: torch.Tensor, global_scale: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        if global_scale is None:
            return quantize_weight(weight, self.name)
        _check_weight(weight, self.name)
        state = {"weight": weight.float(), "weight_scale": global_scale.float().reshape(1)}
        return {**self.compressor.compress(state, self.scheme), **self.input_scales()}

    def fake_quantize(
        self, weight: torch.Tensor, global_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        if global_scale is None:
            return fake_quantize_weight(weight, self.name)
        from compressed_tensors.quantization.lifecycle.forward import fake_quantize

        return fake_quantize(
            weight.float(), global_scale.float().reshape(1), None, self.scheme.weights
        )


@register
class FP8Block(FP8):
    """W8A8: an E4M3 weight scale per 128x128 block, inputs per 128-group dynamically (FP8_BLOCK)."""

    name = "fp8-block"
    preset = "FP8_BLOCK"
    format_strings = ("float-quantized",)
    description = QUANT_FORMATS["fp8-block"]
    strategy, block = "block", (128, 128)
    activation_args = ("fp8_group", 128)
    input_args = {**_FP8_INPUTS, "strategy": "group", "group_size": 128, "dynamic": True}
    # Block kernels (CUTLASS) start at sm_90; below, vLLM's kernel list reaches Marlin first.
    cuda_kernels = ((75, "weight-only, inputs unquantized (Marlin)"), (90, None))

    def tensor_specs(self, shape: tuple[int, int]) -> dict[str, TensorSpec]:
        n, k = shape
        (r, c), specs = self.block, super().tensor_specs(shape)
        return {
            **specs,
            "weight_scale": TensorSpec("F32", (-(-n // r), -(-k // c)), also=SCALE_DTYPES),
        }


class _FP4(QuantFormat):
    """E2M1 codes packed two per byte, one scale per group of input columns."""

    num_bits = 4
    scale_dtype: str

    def tensor_specs(self, shape: tuple[int, int]) -> dict[str, TensorSpec]:
        n, k = shape
        specs = {
            "weight_packed": TensorSpec("U8", (n, k // 2)),
            "weight_scale": TensorSpec(self.scale_dtype, (n, k // self.group_size)),
        }
        if self.has_global_scale:
            specs["weight_global_scale"] = TensorSpec("F32", (1,), also=SCALE_DTYPES)
        return specs


@register
class MXFP4(_FP4):
    """E2M1 in groups of 32, E8M0 scales: weight_packed u8 [N,K/2], weight_scale u8 [N,K/32]."""

    name = "mxfp4"
    preset = "MXFP4A16"
    format_strings = ("mxfp4-pack-quantized",)
    description = QUANT_FORMATS["mxfp4"]
    strategy, group_size = "group", 32
    scale_dtype = "U8"
    # vLLM builds it with MXFP4 input keys: Marlin ignores them; Humming (sm_90) quantizes inputs to
    # FP8; FlashInfer's CuTe-DSL kernel (sm_100+, where installed) to MXFP4.
    cuda_kernels = (
        (80, None),
        (90, "with inputs quantized to FP8 per token (Humming)"),
        (100, "with inputs quantized to MXFP4 (FlashInfer, where installed)"),
    )

    def identify(self, dtypes: Mapping[str, str]) -> bool:
        return (
            "weight_packed" in dtypes
            and "weight_global_scale" not in dtypes
            and dtypes.get("weight_scale") == "U8"
        )


@register
class NVFP4(_FP4):
    """E2M1 in groups of 16, E4M3 scales [N,K/16] and one f32 weight_global_scale [1] per tensor."""

    name = "nvfp4"
    preset = "NVFP4A16"
    format_strings = ("nvfp4-pack-quantized",)
    description = QUANT_FORMATS["nvfp4"]
    strategy, group_size = "tensor_group", 16
    scale_dtype = "F8_E4M3"
    has_global_scale = fused_shares_scale = True
    modelopt_algo = "W4A16_NVFP4"

    def identify(self, dtypes: Mapping[str, str]) -> bool:
        return (
            "weight_packed" in dtypes
            and "weight_global_scale" in dtypes
            and ("input_global_scale" in dtypes) == (self.activation_args is not None)
        )

    def served_weight(
        self, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int]
    ) -> torch.Tensor:
        from vllm_dspark.ops.fp4 import dequantize_nvfp4

        # vLLM multiplies by 1 / global scale in float32; compressed-tensors' decompressor rounds to BF16.
        multiplier = 1.0 / tensors["weight_global_scale"].float().max()
        return dequantize_nvfp4(tensors["weight_packed"], tensors["weight_scale"], multiplier)

    def fake_quantize(
        self, weight: torch.Tensor, global_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        # As served, not as compressed-tensors' fake_quantize rounds it.
        return self.served_weight(self.quantize(weight, global_scale), tuple(weight.shape))

    def shared_global_scale(self, weights: Iterable[torch.Tensor]) -> torch.Tensor:
        """vLLM applies one global scale to a fused layer: from the largest magnitude of all its shards.

        That is llmcompressor's ``update_fused_layer_weight_global_scales`` (the minimum of the
        shards' own global scales).
        """
        from compressed_tensors.quantization.utils import generate_gparam

        lo, hi = _value_range(weights)
        return generate_gparam(lo, hi)


@register
class NVFP4W4A4(NVFP4):
    """W4A4: NVFP4's weights, and inputs NVFP4 too under a static input_global_scale [1] (NVFP4)."""

    name = "nvfp4-w4a4"
    preset = "NVFP4"
    description = QUANT_FORMATS["nvfp4-w4a4"]
    activation_args = ("nvfp4", None)
    modelopt_algo = "NVFP4"
    # FP4 GEMMs start at sm_100; below, Humming (sm_90) takes FP8 inputs and Marlin none.
    cuda_kernels = (
        (75, "weight-only, inputs unquantized (Marlin)"),
        (90, "with inputs quantized to FP8 per token, not NVFP4 (Humming)"),
        (100, None),
    )
    input_args = {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "strategy": "tensor_group",
        "group_size": 16,
        "dynamic": "local",
        "scale_dtype": "torch.float8_e4m3fn",
        "observer": "static_minmax",
    }

    def tensor_specs(self, shape: tuple[int, int]) -> dict[str, TensorSpec]:
        return {
            **super().tensor_specs(shape),
            "input_global_scale": TensorSpec("F32", (1,), also=SCALE_DTYPES),
        }

    def input_scales(self) -> dict[str, torch.Tensor]:
        import torch

        from vllm_dspark.ops.act_quant import FP4_MAX

        return {"input_global_scale": torch.tensor([448.0 * FP4_MAX / CALIBRATION_FREE_INPUT_AMAX])}


def _value_range(weights: Iterable[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 minimum and maximum over all of ``weights`` (a fused group's shards)."""
    import torch

    lo, hi = zip(*(torch.aminmax(w.detach()) for w in weights))
    return torch.stack(lo).min().float(), torch.stack(hi).max().float()


def _scheme(fmt: str) -> QuantizationScheme:
    return get(fmt).scheme


def _compressor(fmt: str) -> type[BaseCompressor]:
    return get(fmt).compressor


def _row_chunks(rows: int, cols: int, align: int = 1) -> Iterable[slice]:
    """Row slices of about :data:`_CHUNK_ELEMENTS` weights, each a multiple of ``align`` rows (a scale block)."""
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1) // align) * align
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


def _check_weight(weight: torch.Tensor, fmt: str) -> None:
    if weight.ndim != 2:
        raise ValueError(f"expected a 2-D [out, in] weight, got shape {tuple(weight.shape)}")
    problem = get(fmt).shape_problem(tuple(weight.shape))
    if problem is not None:
        raise ValueError(problem)


def _scales(x: torch.Tensor, fmt: str, global_scale: torch.Tensor | None) -> torch.Tensor:
    import torch
    from compressed_tensors.quantization.utils import (
        calculate_qparams,
        compute_dynamic_scales_and_zp,
    )

    args = _scheme(fmt).weights
    if args.strategy == "channel":
        scale, _ = calculate_qparams(x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True), args)
    elif args.strategy == "block":
        # A ragged edge block takes the extremes of the values it has (padding with zeros is neutral:
        # calculate_qparams widens every range to include zero).
        r, c = args.block_structure
        padded = torch.nn.functional.pad(x, (0, -x.shape[1] % c, 0, -x.shape[0] % r))
        blocks = padded.unflatten(1, (-1, c)).unflatten(0, (-1, r))
        scale, _ = calculate_qparams(blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3)), args)
    else:
        scale, _ = compute_dynamic_scales_and_zp(x, args, module=None, global_scale=global_scale)
    return scale


def _global_scale(
    weight: torch.Tensor, fmt: str, global_scale: torch.Tensor | None
) -> torch.Tensor | None:
    """Validate ``weight`` for ``fmt`` and return the global scale it quantizes with, if its format has one."""
    import torch

    _check_weight(weight, fmt)
    if global_scale is not None and not get(fmt).has_global_scale:
        having = " and ".join(f.name for f in REGISTRY.values() if f.has_global_scale)
        raise ValueError(f"only {having} have a global scale, not {fmt}")
    if global_scale is None and get(fmt).has_global_scale:
        global_scale = get(fmt).shared_global_scale([weight])
    if global_scale is not None:
        global_scale = global_scale.to(device=weight.device, dtype=torch.float32).reshape(1)
    return global_scale


@no_grad
def quantize_weight(
    weight: torch.Tensor, fmt: str, *, global_scale: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Quantize a [N, K] weight to ``fmt``: ``{suffix: tensor}`` as in :meth:`QuantFormat.tensor_specs`.

    Runs on ``weight``'s device. ``global_scale`` (nvfp4 only) is the fused group's shared scale
    from :meth:`QuantFormat.shared_global_scale`; by default the weight's own.
    """
    import torch

    global_scale = _global_scale(weight, fmt, global_scale)
    scheme, compressor = _scheme(fmt), _compressor(fmt)
    pieces: list[dict[str, torch.Tensor]] = []
    # compressed-tensors' FP4 rounding is a torch.compile'd function: compiling it costs seconds per
    # new shape, is unsafe from several threads (--workers), and is no faster than eager here.
    with torch.compiler.set_stance("force_eager"):
        for rows, x, scale in _chunk_scales(weight, fmt, global_scale):
            state = {"weight": x, "weight_scale": scale}
            if global_scale is not None:
                state["weight_global_scale"] = global_scale
            pieces.append(compressor.compress(state, scheme))
    shared = {"weight_global_scale"} | ({"weight_scale"} if not get(fmt).row_separable else set())
    out = {
        suffix: torch.cat([p[suffix] for p in pieces])
        for suffix in pieces[0]
        if suffix not in shared
    }
    out.update({suffix: pieces[0][suffix] for suffix in pieces[0] if suffix in shared})
    if global_scale is not None:
        out["weight_global_scale"] = global_scale
    return {**out, **get(fmt).input_scales()}


def _chunk_scales(
    weight: torch.Tensor, fmt: str, global_scale: torch.Tensor | None
) -> Iterable[tuple[slice, torch.Tensor, torch.Tensor]]:
    """``(rows, float32 chunk, its scales)`` per row chunk; a per-tensor scale is the whole weight's."""
    f = get(fmt)
    whole = None if f.row_separable else _scales(weight.float(), fmt, global_scale)
    for rows in _row_chunks(*weight.shape, align=f.row_block):
        x = weight[rows].float()
        yield rows, x, whole if whole is not None else _scales(x, fmt, global_scale)


@no_grad
def fake_quantize_weight(
    weight: torch.Tensor, fmt: str, *, global_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 [N, K]: ``weight`` as ``fmt`` represents it, without building the packed tensors.

    compressed-tensors' ``fake_quantize`` with the scales :func:`quantize_weight` stores. In BF16 it
    equals ``dequantize_weight(quantize_weight(weight))`` bit for bit (tested), without FP4 packing.
    """
    import torch

    global_scale = _global_scale(weight, fmt, global_scale)
    args = _scheme(fmt).weights
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    out = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    with torch.compiler.set_stance("force_eager"):
        for rows, x, scale in _chunk_scales(weight, fmt, global_scale):
            out[rows] = fake_quantize(x, scale, None, args, global_scale=global_scale)
    return out


@no_grad
def dequantize_weight(
    tensors: dict[str, torch.Tensor], fmt: str, shape: tuple[int, int]
) -> torch.Tensor:
    """float32 [N, K] weight back from ``tensors`` (suffix -> tensor), by compressed-tensors' decompressor."""
    import torch

    if get(fmt).block:
        # Its decompressor reads a one-column [N/128, 1] block scale as a channel scale: say the args.
        from compressed_tensors.quantization.lifecycle.forward import dequantize

        args = _scheme(fmt).weights
        weight = dequantize(
            tensors["weight"], tensors["weight_scale"], None, args, dtype=torch.float32
        )
    else:
        weight = _compressor(fmt).decompress(dict(tensors), _scheme(fmt))["weight"]
    if tuple(weight.shape) != tuple(shape):
        raise ValueError(
            f"{fmt} tensors decompress to {tuple(weight.shape)}, expected {tuple(shape)}"
        )
    return weight.float()


def _error_sums(
    weight: torch.Tensor, tensors: dict[str, torch.Tensor], fmt: str
) -> tuple[float, float]:
    """|W|^2 and |W - dequant(Q)|^2 of a quantized weight, dequantized chunk by chunk."""
    import torch

    signal = noise = 0.0
    r = get(fmt).row_block
    for rows in _row_chunks(*weight.shape, align=r):
        # Per-row tensors are 2-D (a block format's scales one row per r rows); global and per-tensor
        # scales are 1-D and serve every chunk.
        scale_rows = slice(rows.start // r, -(-rows.stop // r))
        chunk = {
            s: t if t.dim() < 2 else t[scale_rows] if s == "weight_scale" else t[rows]
            for s, t in tensors.items()
        }
        ref = weight[rows].float().flatten()
        diff = (
            ref - dequantize_weight(chunk, fmt, (rows.stop - rows.start, weight.shape[1])).flatten()
        )
        # BLAS dot products accumulate blockwise: float32 is exact enough for a dB figure.
        signal += float(torch.dot(ref, ref))
        noise += float(torch.dot(diff, diff))
    return signal, noise


def snr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise), infinite for an exact quantization."""
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


@no_grad
def weight_snr_db(weight: torch.Tensor, tensors: dict[str, torch.Tensor], fmt: str) -> float:
    """10 log10(|W|^2 / |W - dequant(Q)|^2) of a quantized weight, dequantized chunk by chunk."""
    return snr_db(*_error_sums(weight, tensors, fmt))


_FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_F32_EPS = 2.0**-23  # torch.finfo(torch.float32).eps


def _e4m3_to_float(q: torch.Tensor) -> torch.Tensor:
    """float32 values of e4m3 ``q``: its bits moved into float16's, times 2^8 (exact, subnormals
    included); torch's own e4m3 -> float cast is an elementwise loop several times slower."""
    import torch

    bits = q.view(torch.uint8).to(torch.int16)
    half = bits.bitwise_and(0x7F).bitwise_left_shift_(7)
    half.bitwise_or_(bits.bitwise_and_(0x80).bitwise_left_shift_(8))
    return half.view(torch.float16).float().mul_(256.0)


@no_grad
def fp8_channel_quantize(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], float, float]:
    """:meth:`FP8.quantize_with_error`: compressed-tensors' channel-wise FP8 math, fused.

    Bit-identical to ``calculate_qparams`` + the naive compressor (tested): scale = amax / 448
    (eps where zero), q = e4m3(clamp(W / scale)); the error is against its dequantization,
    float32(q) * scale. Per row chunk, so every pass runs on data still in cache.
    """
    import torch

    n, k = weight.shape
    q = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=weight.device)
    scale = torch.empty((n, 1), dtype=torch.float32, device=weight.device)
    signal = noise = 0.0
    for rows in _row_chunks(n, k):
        x = weight[rows].float()
        amax = torch.maximum(x.amax(dim=1, keepdim=True), x.amin(dim=1, keepdim=True).neg_())
        s = amax.clamp_min_(0).div_(_FP8_MAX)
        s.masked_fill_(s == 0, _F32_EPS)
        scale[rows] = s
        flat = x.view(-1)
        signal += float(torch.dot(flat, flat))
        q[rows] = torch.div(x, s).clamp_(-_FP8_MAX, _FP8_MAX)
        err = _e4m3_to_float(q[rows]).mul_(s).sub_(x).view(-1)
        noise += float(torch.dot(err, err))
    return {"weight": q, "weight_scale": scale}, signal, noise
