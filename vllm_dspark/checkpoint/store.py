# SPDX-License-Identifier: Apache-2.0
"""Reading drafter directories: config.json, shard headers, tensors and the target's shared heads, each
mismatch with the config named before any weight is read (writing is :mod:`vllm_dspark.checkpoint.save`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_dspark.checkpoint import formats, kv_scales, modelopt
from vllm_dspark.checkpoint.formats import TensorSpec
from vllm_dspark.checkpoint.layout import (
    ABSORBED_KINDS,
    OPTIONAL_KEYS,
    checkpoint_modules,
    module_kind,
    stored_modules,
)
from vllm_dspark.checkpoint.quant_plan import QuantPlan, QuantPlanError, is_stray, resolve
from vllm_dspark.checkpoint.st_io import (
    StoredTensor,
    TensorReader,
    read_header,
    read_tensor,
)
from vllm_dspark.fields import DrafterFields, check_identity, parse_fields
from vllm_dspark.findings import Finding, FindingError, within
from vllm_dspark.finite import invalid_scale_count

if TYPE_CHECKING:
    import torch

    from vllm_dspark.config import K3DSparkConfig
    from vllm_dspark.ops.act_quant import ActScheme

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
TARGET_EMBED_KEY = "model.embed_tokens.weight"
TARGET_LM_HEAD_KEY = "lm_head.weight"
# The heads as each target family's checkpoint names them: DeepSeek-V3-style causal LMs at the top
# level; Kimi-K3 (``KimiK3ForConditionalGeneration``) under its ``language_model.``, the prefix its
# vLLM loader hands to the text model (vllm/models/kimi_k3/nvidia/model.py).
TARGET_HEAD_KEYS = (
    (TARGET_EMBED_KEY, TARGET_LM_HEAD_KEY),
    ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight"),
)

_LOG = logging.getLogger(__name__)
_MAX_LISTED_PROBLEMS = 12


def human_params(n: int) -> str:
    """``2.19 B`` / ``3.40 M``: parameter counts at the scale they are read."""
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def human_bytes(n: int) -> str:
    """``4.60 GiB`` / ``0.27 MiB``."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"


# ----- config.json -----


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    """The raw ``config.json`` of ``model_dir`` as a dict, with a clear error if absent or malformed."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FindingError(
            Finding(
                f"{model_dir} is not a directory",
                f"pass the drafter checkpoint directory (the one holding {CONFIG_NAME} and the "
                "safetensors shards)",
            )
        )
    path = model_dir / CONFIG_NAME
    if not path.is_file():
        raise FindingError(
            Finding(
                f"{model_dir} has no {CONFIG_NAME}",
                f"copy the drafter's {CONFIG_NAME} next to its shards, or write a fresh checkpoint "
                "with `vllm-dspark make-random`",
            )
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise FindingError(
            Finding(
                f"{path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}",
                "repair the file (a trailing comma or a truncated copy is the usual cause)",
            )
        ) from None
    except UnicodeDecodeError as e:
        raise FindingError(
            Finding(
                f"{path} is not UTF-8 text ({e.reason} at byte {e.start})",
                "use the checkpoint's own config.json",
            )
        ) from None
    if not isinstance(raw, dict):
        raise FindingError(
            Finding(
                f"{path} must hold a JSON object, found a {type(raw).__name__}",
                "use the checkpoint's own config.json",
            )
        )
    qc = raw.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise FindingError(
            Finding(
                "quantization_config must be a JSON object (a compressed-tensors config), found a "
                f"{type(qc).__name__}",
                "use the config.json `vllm-dspark quantize` wrote",
                str(path),
            )
        )
    return raw


def read_quantization_config(
    model_dir: str | Path, raw: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The drafter's quantization config: config.json's, else hf_quant_config.json's (older ModelOpt
    exports keep it only there, and vLLM reads it from there too)."""
    if raw.get("quantization_config") is not None:
        return raw["quantization_config"]
    path = Path(model_dir) / modelopt.HF_QUANT_CONFIG
    if not path.is_file():
        return None
    try:
        qc = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FindingError(
            Finding(f"{path} is not valid JSON ({e})", "use the file the checkpoint came with")
        ) from None
    if not isinstance(qc, dict) or not modelopt.is_modelopt(qc):
        raise FindingError(
            Finding(
                f'{path} is not a ModelOpt quantization config (no producer "modelopt")',
                "use the file the checkpoint came with, or remove it for a BF16 checkpoint",
            )
        )
    return qc


def load_config(model_dir: str | Path) -> K3DSparkConfig:
    """The ``K3DSparkConfig`` of ``model_dir``; every problem is a ``ValueError`` naming the file."""
    return _parse_config(read_config_json(model_dir), Path(model_dir) / CONFIG_NAME)


def _parse_config(
    raw: dict[str, Any], path: Path, *, fields_only: bool = False
) -> K3DSparkConfig | DrafterFields:
    """``raw`` (the config.json at ``path``) as a validated ``K3DSparkConfig`` (or its fields alone)."""
    try:
        if fields_only:
            return parse_fields(raw)
        check_identity(raw)
        from vllm_dspark.config import K3DSparkConfig  # transformers: seconds to import

        return K3DSparkConfig(**raw)
    except FindingError as e:
        raise FindingError(*within(str(path), e.findings)) from None
    except (ValueError, TypeError, KeyError) as e:  # raised by transformers itself
        raise FindingError(
            Finding(str(e), "correct that field in config.json", str(path))
        ) from None


def _describe(config: K3DSparkConfig) -> str:
    return (
        f"hidden_size={config.hidden_size}, num_hidden_layers={config.num_hidden_layers}, "
        f"intermediate_size={config.intermediate_size}, num_attention_heads={config.num_attention_heads}, "
        f"vocab_size={config.vocab_size}"
    )


# ----- expected tensors -----


def expected_tensors(
    config: K3DSparkConfig,
    quantized: Mapping[str, str] | None = None,
    encoding: str = "compressed-tensors",
) -> dict[str, TensorSpec]:
    """``{key: TensorSpec}`` a checkpoint for ``config`` must hold; ``quantized`` maps module -> format.

    An unquantized tensor is BF16 (F16 and F32 also load); a quantized module holds its format's
    tensors (packed codes and scales) in ``encoding``'s names instead of ``weight``.
    """
    quantized = quantized or {}
    expected: dict[str, TensorSpec] = {}
    for spec in checkpoint_modules(config):
        fmt = quantized.get(spec.name)
        if fmt is None:
            expected[f"{spec.name}.weight"] = _float_tensor(spec.shape)
        else:
            for suffix, tensor in stored_tensor_specs(fmt, spec.shape, encoding).items():
                expected[f"{spec.name}.{suffix}"] = tensor
        if spec.bias:
            expected[f"{spec.name}.bias"] = _float_tensor((spec.shape[0],))
    # vLLM loads an attention layer's KV-cache scales whatever the quantization config says.
    expected.update(kv_scales.tensor_specs(config.num_hidden_layers))
    return expected


def stored_tensor_specs(
    fmt: str, shape: tuple[int, ...], encoding: str = "compressed-tensors"
) -> dict[str, TensorSpec]:
    """``{suffix: TensorSpec}`` a module quantized to ``fmt`` stores in ``encoding``."""
    if encoding == modelopt.ENCODING:
        return modelopt.tensor_specs(fmt, shape)
    return formats.get(fmt).tensor_specs(shape)


def _float_tensor(shape: tuple[int, ...]) -> TensorSpec:
    return TensorSpec("BF16", shape, also=("F16", "F32"))


# What a key must hold: one shape, or a TensorSpec (whose one-value tensors take [1] and [] alike).
_Expected = tuple[int, ...] | TensorSpec


def _fits(shape: tuple[int, ...], want: _Expected) -> bool:
    return want.fits(shape) if isinstance(want, TensorSpec) else tuple(shape) == tuple(want)


def _optional(want: _Expected) -> bool:
    return isinstance(want, TensorSpec) and want.optional


def shape_text(want: _Expected) -> str:
    """The shape(s) ``want`` takes, for a message: ``(64, 1)``, ``(1,) or ()``."""
    return want.shape_text() if isinstance(want, TensorSpec) else str(tuple(want))


def shape_mismatches(
    found: Mapping[str, tuple[int, ...]], expected: Mapping[str, _Expected]
) -> tuple[list[str], list[str], list[str]]:
    """The ``(missing, mis-shaped, unexpected)`` keys of ``found`` against ``expected``."""
    missing = [
        key
        for key in expected
        if key not in found and key not in OPTIONAL_KEYS and not _optional(expected[key])
    ]
    misshaped = [key for key in expected if key in found and not _fits(found[key], expected[key])]
    return missing, misshaped, [key for key in found if key not in expected]


def validate_tensor_shapes(
    found: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, _Expected],
    *,
    source: str,
    config: K3DSparkConfig,
) -> None:
    """Raise one ``ValueError`` listing every missing, unexpected and mis-shaped tensor."""
    missing, misshaped, unexpected = shape_mismatches(found, expected)
    problems = [
        f"missing tensor {key!r} (expected shape {shape_text(expected[key])})" for key in missing
    ]
    problems += [
        f"tensor {key!r} has shape {tuple(found[key])}, expected shape {shape_text(expected[key])}"
        for key in misshaped
    ]
    problems += [
        f"unexpected tensor {key!r} with shape {tuple(found[key])} (no such tensor in a drafter with this "
        "config)"
        for key in unexpected
    ]
    if not problems:
        return
    listed = problems[:_MAX_LISTED_PROBLEMS]
    if len(problems) > len(listed):
        listed.append(f"... and {len(problems) - len(listed)} more")
    # compressed-tensors names a quantized weight's tensors weight_packed, weight_scale, weight_global_scale, ...
    quantized_extra = [k for k in unexpected if k.rsplit(".", 1)[-1].startswith("weight_")]
    if quantized_extra:
        fix = (
            f"the shards hold quantized tensors ({quantized_extra[0]}, ...) that config.json's "
            "quantization_config does not describe: use the config.json written with these shards"
        )
    elif missing and not misshaped and not unexpected:
        fix = (
            "the checkpoint is incomplete: check that every shard listed in the index was copied, "
            "or re-export it"
        )
    else:
        fix = (
            "config.json and the shards disagree: use the config.json these shards were written with "
            "(the shapes follow hidden_size, num_hidden_layers, intermediate_size, the MLA ranks, vocab_size "
            "and markov_rank), or re-export the checkpoint"
        )
    raise FindingError(
        Finding(
            f"{source} does not match its config.json ({_describe(config)}):\n  - "
            + "\n  - ".join(listed),
            fix,
        )
    )


# ----- reading safetensors -----


def _weight_map(model_dir: Path) -> dict[str, Path]:
    """``{key: file}`` as the directory declares it: the index's weight_map, or the single file's keys."""
    index_path = model_dir / INDEX_NAME
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
            odd = [f"{k}: {v!r}" for k, v in weight_map.items() if not isinstance(v, str)]
            if odd:
                raise TypeError(
                    f"weight_map entries must name shard files, got {', '.join(odd[:3])}"
                )
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise FindingError(
                Finding(
                    f"{index_path} is malformed ({e})",
                    'it must be a JSON object with a "weight_map" of {"tensor name": "shard file '
                    'name"}',
                )
            ) from None
        missing_files = sorted({f for f in weight_map.values() if not (model_dir / f).is_file()})
        if missing_files:
            raise FindingError(
                Finding(
                    f"{index_path} lists shard(s) {', '.join(missing_files)}, which do not exist "
                    f"in {model_dir}",
                    "copy every shard of the checkpoint",
                )
            )
        return {key: model_dir / name for key, name in weight_map.items()}
    # Without an index vLLM loads every *.safetensors file of the directory, whatever its name.
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FindingError(
            Finding(
                f"{model_dir} holds no weights ({SINGLE_FILE_NAME}, *.safetensors or {INDEX_NAME})",
                "pass the directory the checkpoint was downloaded or exported to",
            )
        )
    weight_map: dict[str, Path] = {}
    for path in files:
        for key in read_header(path):
            if key in weight_map:
                raise FindingError(
                    Finding(
                        f"tensor {key!r} is in both {weight_map[key].name} and {path.name}, and "
                        f"{model_dir} has no {INDEX_NAME} to say which one counts",
                        "remove the stale file, or copy the index that came with the shards",
                    )
                )
            weight_map[key] = path
    return weight_map


def stored_tensors(model_dir: str | Path) -> dict[str, StoredTensor]:
    """``{key: StoredTensor}`` of a drafter directory, from its headers, checked against its index.

    ``ValueError`` naming the file and the fix for a missing, corrupt or truncated shard or an
    index that disagrees with its shards.
    """
    weight_map = _weight_map(Path(model_dir))
    headers: dict[str, StoredTensor] = {}
    for path in dict.fromkeys(weight_map.values()):
        header = read_header(path)
        keys = {key for key, p in weight_map.items() if p == path}
        absent, extra = sorted(keys - header.keys()), sorted(header.keys() - keys)
        if absent or extra:
            parts = []
            if absent:
                parts.append(
                    f"the index places {', '.join(absent[:5])} in it but the file lacks them"
                )
            if extra:
                parts.append(f"it holds {', '.join(extra[:5])}, which the index does not list")
            raise FindingError(
                Finding(
                    f"{INDEX_NAME} and shard {path.name} disagree: {'; '.join(parts)}",
                    "use the index written together with these shards",
                )
            )
        headers.update(header)
    return {key: headers[key] for key in weight_map}


@dataclass(frozen=True)
class Checkpoint:
    """A drafter directory as read: its config, its raw config.json and its shards' headers."""

    config: K3DSparkConfig | DrafterFields
    config_json: dict[str, Any]
    stored: dict[str, StoredTensor]
    quantization_config: dict[str, Any] | None = None  # :func:`read_quantization_config`'s

    def plan(self) -> QuantPlan:
        """:func:`resolve` over its quantization config and stored dtypes (raises QuantPlanError)."""
        return resolve(
            self.config,
            self.quantization_config,
            {key: t.dtype for key, t in self.stored.items()},
        )


def read_checkpoint(model_dir: str | Path, *, fields_only: bool = False) -> Checkpoint:
    """Read a drafter directory's config.json and shard headers (no tensor data); ``fields_only``
    checks the config without building a ``K3DSparkConfig`` (no transformers import)."""
    model_dir = Path(model_dir)
    raw = read_config_json(model_dir)
    config = _parse_config(raw, model_dir / CONFIG_NAME, fields_only=fields_only)
    return Checkpoint(
        config, raw, stored_tensors(model_dir), read_quantization_config(model_dir, raw)
    )


def resolve_checkpoint(model_dir: str | Path) -> QuantPlan:
    """:func:`resolve` for a drafter directory: its config.json and its shard headers."""
    return read_checkpoint(model_dir).plan()


def load_drafter_state_dict(
    model_dir: str | Path, *, dtype: torch.dtype | str | None = "bfloat16"
) -> tuple[K3DSparkConfig, dict[str, torch.Tensor]]:
    """Load and validate a drafter directory; returns ``(config, {HF key: tensor})``.

    The result always has the unquantized key set of ``layout.tensor_shapes(config)``: quantized
    modules (FP8 / MXFP4 / NVFP4 compressed-tensors) are dequantized here, once. Every tensor is cast
    to ``dtype`` (a torch dtype or its name: the module imports no torch); with ``dtype=None``
    unquantized tensors keep their stored dtype and dequantized ones are fp32 (the exact dequantized
    values, for an FP32 reference).

    Tensors that need no conversion are memory-mapped (copy-on-write) from the shards: loading is
    instant, and processes reading the same checkpoint share its pages. :func:`~vllm_dspark.checkpoint.save.save_drafter` replaces
    files atomically, so rewriting a checkpoint never changes a mapped one under a running reader.
    """
    import torch

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model_dir = Path(model_dir)
    checkpoint = read_checkpoint(model_dir)
    config, stored = checkpoint.config, checkpoint.stored
    try:
        plan = checkpoint.plan()
    except QuantPlanError as e:
        raise FindingError(*within(str(model_dir), e.findings)) from None
    for warning in plan.warnings():
        _LOG.warning("%s: %s", model_dir, warning)
    stored = {k: t for k, t in stored.items() if not is_stray(k, config)}
    quantized = plan.modules
    validate_tensor_shapes(
        {k: t.shape for k, t in stored.items()},
        expected_tensors(config, quantized, plan.encoding),
        source=f"checkpoint {model_dir}",
        config=config,
    )

    state_dict: dict[str, torch.Tensor] = {}
    with TensorReader() as reader:

        def read(key: str) -> torch.Tensor:
            return reader.read(stored[key].path, key)

        for spec in stored_modules(config, stored):
            fmt = quantized.get(spec.name)
            if fmt is None:
                weight = read(f"{spec.name}.weight")
                state_dict[f"{spec.name}.weight"] = weight if dtype is None else weight.to(dtype)
            else:
                weight = _dequantize(spec.name, fmt, spec.shape, read, plan.encoding)
                state_dict[f"{spec.name}.weight"] = weight.to(dtype or torch.float32)
            if spec.bias:
                bias = read(f"{spec.name}.bias")
                state_dict[f"{spec.name}.bias"] = bias if dtype is None else bias.to(dtype)
    return config, state_dict


def stored_k_scales(model_dir: str | Path) -> torch.Tensor | None:
    """The draft layers' FP8 KV-cache ``k_scale`` ``[L]`` a drafter directory stores, or None if none."""
    checkpoint = read_checkpoint(model_dir, fields_only=True)
    keys = [key for key in checkpoint.stored if kv_scales.is_kv_scale(key)]
    with TensorReader() as reader:
        tensors = {key: reader.read(checkpoint.stored[key].path, key) for key in keys}
    try:
        return kv_scales.k_scales(tensors, checkpoint.config.num_hidden_layers)
    except FindingError as e:
        raise FindingError(*within(str(model_dir), e.findings)) from None


def input_quantizers(model_dir: str | Path) -> dict[str, tuple[ActScheme, torch.Tensor | None]]:
    """``{module: (activation scheme, stored input scale or None)}`` of a build's W8A8 / W4A4 modules
    (absorbed ones excepted: vLLM never quantizes their input)."""
    checkpoint = read_checkpoint(model_dir)
    plan = checkpoint.plan()
    out = {}
    with TensorReader() as reader:
        for module, fmt in plan.modules.items():

            def read(suffix: str, module: str = module) -> torch.Tensor:
                key = f"{module}.{suffix}"
                return reader.read(checkpoint.stored[key].path, key)

            scheme = formats.get(fmt).activation
            if scheme is None or module_kind(module) in ABSORBED_KINDS:
                continue
            if plan.encoding == modelopt.ENCODING:
                stored = {
                    s: read(s) for s in ("input_scale",) if f"{module}.{s}" in checkpoint.stored
                }
                out[module] = (scheme, modelopt.input_scale(fmt, stored))
            else:
                out[module] = formats.get(fmt).input_quantizer(read)
    return out


def _dequantize(
    module: str,
    fmt: str,
    shape: tuple[int, ...],
    read: Callable[[str], torch.Tensor],
    encoding: str = "compressed-tensors",
) -> torch.Tensor:
    """``module``'s weight, dequantized from the ``fmt`` tensors (in ``encoding``) that ``read(key)`` returns."""
    parts = {  # each as vLLM's parameter holds it: a [] scale as [1], a BF16 scale in float32, ...
        suffix: spec.conform(read(f"{module}.{suffix}"))
        for suffix, spec in stored_tensor_specs(fmt, shape, encoding).items()
        if not spec.optional  # nothing computes with it
    }
    for suffix, tensor in parts.items():
        bad = invalid_scale_count(tensor) if formats.is_scale(suffix) else 0
        if bad:
            raise FindingError(
                Finding(
                    f"{module}.{suffix}: {bad} of {tensor.numel()} scale values are NaN, infinite, zero or "
                    "negative, so the weight cannot be dequantized",
                    "re-quantize the BF16 checkpoint with `vllm-dspark quantize`",
                )
            )
    try:
        if encoding == modelopt.ENCODING:
            weight = modelopt.dequantize(parts, fmt, tuple(shape))
        else:
            weight = formats.get(fmt).served_weight(parts, tuple(shape))
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"{module}: cannot dequantize its {fmt} weight: {e}") from None
    if tuple(weight.shape) != tuple(shape):
        raise ValueError(
            f"{module}: its {fmt} tensors dequantize to shape {tuple(weight.shape)}, expected {shape}."
        )
    return weight


def load_target_heads(
    target_dir: str | Path, *, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embed_tokens [V, H], lm_head [V, H])`` of the target the drafter shares them with.

    ``target_dir`` is the target's checkpoint directory (sharded or not; only these two tensors are
    read) or a single ``.safetensors`` file holding ``model.embed_tokens.weight`` and ``lm_head.weight``.
    """
    target_dir = Path(target_dir)
    if target_dir.is_file():
        weight_map = dict.fromkeys(read_header(target_dir), target_dir)
    elif target_dir.is_dir():
        weight_map = _weight_map(target_dir)
    else:
        raise FindingError(
            Finding(
                f"target {target_dir} does not exist",
                f"pass the target model's directory (or a safetensors file with {TARGET_EMBED_KEY} "
                f"and {TARGET_LM_HEAD_KEY})",
            )
        )
    keys = next(
        (pair for pair in TARGET_HEAD_KEYS if all(k in weight_map for k in pair)),
        None,
    )
    if keys is None:
        missing = [k for k in (TARGET_EMBED_KEY, TARGET_LM_HEAD_KEY) if k not in weight_map]
        raise FindingError(
            Finding(
                f"target {target_dir} lacks {' and '.join(missing)} (nor has it Kimi-K3's "
                f"{' and '.join(TARGET_HEAD_KEYS[1])})",
                "pass the target model the drafter was trained for; the drafter shares its "
                "embedding and lm_head",
            )
        )
    embed_key, lm_head_key = keys
    embed, lm_head = (read_tensor(weight_map[key], key) for key in keys)
    if dtype is not None:
        embed, lm_head = embed.to(dtype), lm_head.to(dtype)
    if embed.dim() != 2 or embed.shape != lm_head.shape:
        raise ValueError(
            f"target {target_dir}: {embed_key} {tuple(embed.shape)} and {lm_head_key} "
            f"{tuple(lm_head.shape)} must both be [vocab_size, hidden_size]."
        )
    return embed, lm_head


def target_text_config(target_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's part of a target config.json: Kimi-K3's nested ``text_config`` (a Kimi-Linear
    config), else the config itself (DeepSeek-V3-style targets)."""
    text = target_config.get("text_config")
    return text if isinstance(text, Mapping) else target_config
