# SPDX-License-Identifier: Apache-2.0
"""Reading and writing K3 DSpark drafter directories.

A drafter directory holds ``config.json`` (a ``K3DSparkConfig``, plus a compressed-tensors
``quantization_config`` when quantized) and its weights under the HF key names of
:mod:`vllm_dspark.layout`, either as ``model.safetensors`` or as shards
``model-0000i-of-0000n.safetensors`` listed in ``model.safetensors.index.json``.

The target's embedding and lm_head, which the drafter shares, live elsewhere: in the target's own
directory (keys ``model.embed_tokens.weight`` and ``lm_head.weight``), or in the ``target/``
directory that ``vllm-dspark make-random`` writes next to the drafter.

Every way a checkpoint can disagree with its config is reported as one ``ValueError`` that names
each offending tensor and the shape the config implies, before any weight is read into memory.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import struct
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from vllm_dspark.config import K3DSparkConfig, check_identity
from vllm_dspark.layout import checkpoint_modules
from vllm_dspark.safety import invalid_scale_count

__all__ = [
    "CONFIG_NAME",
    "INDEX_NAME",
    "SINGLE_FILE_NAME",
    "TARGET_EMBED_KEY",
    "TARGET_LM_HEAD_KEY",
    "SafetensorsWriter",
    "expected_tensor_shapes",
    "load_config",
    "load_drafter_state_dict",
    "load_target_heads",
    "read_config_json",
    "save_drafter",
    "stored_dtypes",
    "validate_tensor_shapes",
]

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
TARGET_EMBED_KEY = "model.embed_tokens.weight"
TARGET_LM_HEAD_KEY = "lm_head.weight"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # the HF default, "5GB"

_LOG = logging.getLogger(__name__)
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_MAX_LISTED_PROBLEMS = 12

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


# ----- config.json -----


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    """The raw ``config.json`` of ``model_dir`` as a dict, with a clear error if absent or malformed."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"{model_dir} is not a directory. Fix: pass the drafter checkpoint directory "
                         f"(the one holding {CONFIG_NAME} and the safetensors shards).")
    path = model_dir / CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"{model_dir} has no {CONFIG_NAME}. Fix: copy the drafter's {CONFIG_NAME} next to its "
                         "shards, or write a fresh checkpoint with `vllm-dspark make-random`.")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}. "
                         "Fix: repair the file (a trailing comma or a truncated copy is the usual cause).") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}). Fix: use the checkpoint's "
                         "own config.json.") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, found a {type(raw).__name__}.")
    qc = raw.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ValueError(f"{path}: quantization_config must be a JSON object (a compressed-tensors config), found a "
                         f"{type(qc).__name__}. Fix: use the config.json `vllm-dspark quantize` wrote.")
    return raw


def load_config(model_dir: str | Path) -> K3DSparkConfig:
    """The ``K3DSparkConfig`` of ``model_dir``; every problem is a ``ValueError`` naming the file."""
    raw = read_config_json(model_dir)
    path = Path(model_dir) / CONFIG_NAME
    try:
        check_identity(raw)
        return K3DSparkConfig(**raw)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{path}: {e}") from None


def _describe(config: K3DSparkConfig) -> str:
    return (f"hidden_size={config.hidden_size}, num_hidden_layers={config.num_hidden_layers}, "
            f"intermediate_size={config.intermediate_size}, num_attention_heads={config.num_attention_heads}, "
            f"vocab_size={config.vocab_size}")


# ----- expected tensors -----


def expected_tensor_shapes(
    config: K3DSparkConfig, quantized: Mapping[str, str] | None = None
) -> dict[str, tuple[int, ...]]:
    """``{key: shape}`` a checkpoint for ``config`` must hold; ``quantized`` maps module -> format.

    A quantized module holds its format's tensors (:meth:`formats.QuantFormat.tensor_specs`: packed
    codes and scales) instead of ``weight``.
    """
    from vllm_dspark import formats

    quantized = quantized or {}
    shapes: dict[str, tuple[int, ...]] = {}
    for spec in checkpoint_modules(config):
        fmt = quantized.get(spec.name)
        if fmt is None:
            shapes[f"{spec.name}.weight"] = spec.shape
        else:
            for suffix, tensor in formats.get(fmt).tensor_specs(spec.shape).items():
                shapes[f"{spec.name}.{suffix}"] = tensor.shape
        if spec.bias:
            shapes[f"{spec.name}.bias"] = (spec.shape[0],)
    return shapes


def validate_tensor_shapes(
    found: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, tuple[int, ...]],
    *,
    source: str,
    config: K3DSparkConfig,
) -> None:
    """Raise one ``ValueError`` listing every missing, unexpected and mis-shaped tensor."""
    problems: list[str] = []
    kinds: set[str] = set()
    for key, shape in expected.items():
        if key not in found:
            kinds.add("missing")
            problems.append(f"missing tensor {key!r} (expected shape {shape})")
        elif tuple(found[key]) != tuple(shape):
            kinds.add("shape")
            problems.append(f"tensor {key!r} has shape {tuple(found[key])}, expected shape {shape}")
    for key in found:
        if key not in expected:
            kinds.add("unexpected")
            problems.append(f"unexpected tensor {key!r} with shape {tuple(found[key])} "
                            "(no such tensor in a drafter with this config)")
    if not problems:
        return
    listed = problems[:_MAX_LISTED_PROBLEMS]
    if len(problems) > len(listed):
        listed.append(f"... and {len(problems) - len(listed)} more")
    # compressed-tensors names a quantized weight's tensors weight_packed, weight_scale, weight_global_scale, ...
    quantized_extra = [k for k in found if k not in expected and k.rsplit(".", 1)[-1].startswith("weight_")]
    if quantized_extra:
        fix = (f"the shards hold quantized tensors ({quantized_extra[0]}, ...) that config.json's "
               "quantization_config does not describe: use the config.json written with these shards")
    elif kinds == {"missing"}:
        fix = ("the checkpoint is incomplete: check that every shard listed in the index was copied, "
               "or re-export it")
    else:
        fix = ("config.json and the shards disagree: use the config.json these shards were written with "
               "(the shapes follow hidden_size, num_hidden_layers, intermediate_size, the MLA ranks, vocab_size "
               "and markov_rank), or re-export the checkpoint")
    raise ValueError(f"{source} does not match its config.json ({_describe(config)}):\n  - "
                     + "\n  - ".join(listed) + f"\nFix: {fix}.")


# ----- reading safetensors -----


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error types for truncated / corrupt headers
        raise ValueError(f"{path} is not a readable safetensors file ({e}). Fix: re-copy or re-export it.") from None


def _file_keys(path: Path) -> list[str]:
    with _open(path) as f:
        return list(f.keys())


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
                raise TypeError(f"weight_map entries must name shard files, got {', '.join(odd[:3])}")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index_path} is malformed ({e}). Fix: it must be a JSON object with a "
                             '"weight_map" of {"tensor name": "shard file name"}.') from None
        missing_files = sorted({f for f in weight_map.values() if not (model_dir / f).is_file()})
        if missing_files:
            raise ValueError(f"{index_path} lists shard(s) {', '.join(missing_files)}, which do not exist in "
                             f"{model_dir}. Fix: copy every shard of the checkpoint.")
        return {key: model_dir / name for key, name in weight_map.items()}
    single = model_dir / SINGLE_FILE_NAME
    if single.is_file():
        return {key: single for key in _file_keys(single)}
    shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if shards:
        raise ValueError(f"{model_dir} has shards ({', '.join(shards[:3])}{', ...' if len(shards) > 3 else ''}) "
                         f"but no {INDEX_NAME}. Fix: copy the index file that came with them.")
    raise ValueError(f"{model_dir} holds no weights ({SINGLE_FILE_NAME} or {INDEX_NAME}). "
                     "Fix: pass the directory the checkpoint was downloaded or exported to.")


def checked_weight_map(model_dir: Path) -> dict[str, Path]:
    """The weight map, after checking that each shard holds exactly the tensors the index says."""
    weight_map = _weight_map(model_dir)
    by_file: dict[Path, set[str]] = {}
    for key, path in weight_map.items():
        by_file.setdefault(path, set()).add(key)
    for path, keys in by_file.items():
        actual = set(_file_keys(path))
        absent = sorted(keys - actual)
        extra = sorted(actual - keys)
        if absent or extra:
            parts = []
            if absent:
                parts.append(f"the index places {', '.join(absent[:5])} in it but the file lacks them")
            if extra:
                parts.append(f"it holds {', '.join(extra[:5])}, which the index does not list")
            raise ValueError(f"{INDEX_NAME} and shard {path.name} disagree: {'; '.join(parts)}. "
                             "Fix: use the index written together with these shards.")
    return weight_map


def stored_dtypes(weight_map: Mapping[str, Path]) -> dict[str, str]:
    """``{key: safetensors dtype}`` from the file headers, without reading any tensor data."""
    return {key: dtype for key, (_, dtype) in _header(weight_map).items()}


def _header(weight_map: Mapping[str, Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{key: (shape, safetensors dtype)}`` from the file headers, without reading any tensor data."""
    info: dict[str, tuple[tuple[int, ...], str]] = {}
    by_file: dict[Path, list[str]] = {}
    for key, path in weight_map.items():
        by_file.setdefault(path, []).append(key)
    for path, keys in by_file.items():
        with _open(path) as f:
            for key in keys:
                piece = f.get_slice(key)
                info[key] = (tuple(piece.get_shape()), piece.get_dtype())
    return info


def load_drafter_state_dict(
    model_dir: str | Path, *, dtype: torch.dtype | None = torch.bfloat16
) -> tuple[K3DSparkConfig, dict[str, torch.Tensor]]:
    """Load and validate a drafter directory; returns ``(config, {HF key: tensor})``.

    The result always has the unquantized key set of ``layout.tensor_shapes(config)``: quantized
    modules (FP8 / MXFP4 / NVFP4 compressed-tensors) are dequantized here, once. Every tensor is cast
    to ``dtype``; with ``dtype=None`` unquantized tensors keep their stored dtype and dequantized
    ones are fp32 (the exact dequantized values, for an FP32 reference).

    Tensors that need no conversion are memory-mapped (copy-on-write) from the shards: loading is
    instant, and processes reading the same checkpoint share its pages. :func:`save_drafter` replaces
    files atomically, so rewriting a checkpoint never changes a mapped one under a running reader.
    """
    from vllm_dspark.quant_plan import QuantPlanError, is_stray, resolve

    model_dir = Path(model_dir)
    config = load_config(model_dir)
    raw = read_config_json(model_dir)
    weight_map = checked_weight_map(model_dir)
    header = _header(weight_map)
    try:
        plan = resolve(config, raw.get("quantization_config"), {k: d for k, (_, d) in header.items()})
    except QuantPlanError as e:
        raise ValueError(f"{model_dir}: {e}") from None
    for warning in (plan.warning, plan.stray_warning()):
        if warning:
            _LOG.warning("%s: %s", model_dir, warning)
    header = {k: v for k, v in header.items() if not is_stray(k, config)}
    quantized = plan.modules
    validate_tensor_shapes({k: s for k, (s, _) in header.items()}, expected_tensor_shapes(config, quantized),
                           source=f"checkpoint {model_dir}", config=config)

    state_dict: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        handles = {path: stack.enter_context(_open(path)) for path in set(weight_map.values())}

        def read(key: str) -> torch.Tensor:
            return handles[weight_map[key]].get_tensor(key)

        for spec in checkpoint_modules(config):
            fmt = quantized.get(spec.name)
            if fmt is None:
                weight = read(f"{spec.name}.weight")
                state_dict[f"{spec.name}.weight"] = weight if dtype is None else weight.to(dtype)
            else:
                weight = _dequantize(spec.name, fmt, spec.shape, read)
                state_dict[f"{spec.name}.weight"] = weight.to(dtype or torch.float32)
            if spec.bias:
                bias = read(f"{spec.name}.bias")
                state_dict[f"{spec.name}.bias"] = bias if dtype is None else bias.to(dtype)
    return config, state_dict


def _dequantize(
    module: str, fmt: str, shape: tuple[int, ...], read: Callable[[str], torch.Tensor]
) -> torch.Tensor:
    """``module``'s weight, dequantized from the ``fmt`` tensors that ``read(key)`` returns."""
    from vllm_dspark import formats

    parts = {suffix: read(f"{module}.{suffix}") for suffix in formats.get(fmt).tensor_specs(shape)}
    for suffix, tensor in parts.items():
        bad = invalid_scale_count(tensor) if suffix.endswith("scale") else 0
        if bad:
            raise ValueError(f"{module}.{suffix}: {bad} of {tensor.numel()} scale values are NaN, infinite, zero or "
                             "negative, so the weight cannot be dequantized. Fix: re-quantize the BF16 checkpoint "
                             "with `vllm-dspark quantize`.")
    try:
        weight = formats.get(fmt).dequantize(parts, tuple(shape))
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"{module}: cannot dequantize its {fmt} weight: {e}") from None
    if tuple(weight.shape) != tuple(shape):
        raise ValueError(f"{module}: its {fmt} tensors dequantize to shape {tuple(weight.shape)}, expected {shape}.")
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
        weight_map = {key: target_dir for key in _file_keys(target_dir)}
    elif target_dir.is_dir():
        weight_map = _weight_map(target_dir)
    else:
        raise ValueError(f"target {target_dir} does not exist. Fix: pass the target model's directory (or a "
                         f"safetensors file with {TARGET_EMBED_KEY} and {TARGET_LM_HEAD_KEY}).")
    missing = [k for k in (TARGET_EMBED_KEY, TARGET_LM_HEAD_KEY) if k not in weight_map]
    if missing:
        raise ValueError(f"target {target_dir} lacks {' and '.join(missing)}. Fix: pass the target model the "
                         "drafter was trained for; the drafter shares its embedding and lm_head.")
    heads = []
    for key in (TARGET_EMBED_KEY, TARGET_LM_HEAD_KEY):
        with _open(weight_map[key]) as f:
            tensor = f.get_tensor(key)
        heads.append(tensor if dtype is None else tensor.to(dtype))
    embed, lm_head = heads
    if embed.dim() != 2 or embed.shape != lm_head.shape:
        raise ValueError(f"target {target_dir}: {TARGET_EMBED_KEY} {tuple(embed.shape)} and {TARGET_LM_HEAD_KEY} "
                         f"{tuple(lm_head.shape)} must both be [vocab_size, hidden_size].")
    return embed, lm_head


# ----- writing -----


class SafetensorsWriter:
    """Writes one ``.safetensors`` file tensor by tensor, holding at most one tensor in memory.

    The header (which precedes the data in the format) is only known at the end, so tensor bytes go to
    a side file first and are appended after the header on :meth:`close`.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._data_path = self.path.with_name(f".{self.path.name}.data")
        self._data = open(self._data_path, "wb")  # noqa: SIM115 - closed in close()/abort()
        self._entries: dict[str, dict[str, Any]] = {}
        self.nbytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._entries:
            raise ValueError(f"tensor {name!r} written twice to {self.path}.")
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} cannot be stored in safetensors.")
        t = tensor.detach().to("cpu").contiguous()
        size = t.numel() * t.element_size()
        self._data.write(t.reshape(-1).view(torch.uint8).numpy().data)
        self._entries[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                               "data_offsets": [self.nbytes, self.nbytes + size]}
        self.nbytes += size

    def close(self) -> None:
        self._data.close()
        header = json.dumps({"__metadata__": {"format": "pt"}, **self._entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the format allows space padding; aligned data reads faster
        partial = self.path.with_name(f".{self.path.name}.partial")
        with open(partial, "wb") as out, open(self._data_path, "rb") as data:
            out.write(struct.pack("<Q", len(header)))
            out.write(header)
            shutil.copyfileobj(data, out, 64 << 20)
        self._data_path.unlink()
        partial.replace(self.path)

    def abort(self) -> None:
        self._data.close()
        self._data_path.unlink(missing_ok=True)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def save_drafter(
    model_dir: str | Path,
    config_json: Mapping[str, Any],
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write a drafter directory: shards ``model-0000i-of-0000n.safetensors``, the index, config.json.

    ``tensors`` is consumed lazily, one tensor at a time, so a generator keeps peak memory near the
    largest tensor. ``config.json`` is written last: a directory that has one is complete.
    """
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    for stale in [model_dir / INDEX_NAME, model_dir / SINGLE_FILE_NAME, model_dir / CONFIG_NAME,
                  *(p for p in model_dir.iterdir() if _SHARD_RE.match(p.name))]:
        stale.unlink(missing_ok=True)

    shard_paths: list[Path] = []
    weight_map: dict[str, int] = {}
    writer: SafetensorsWriter | None = None
    total = 0
    try:
        for name, tensor in tensors:
            size = tensor.numel() * tensor.element_size()
            if writer is not None and writer.nbytes and writer.nbytes + size > max_shard_bytes:
                writer.close()
                writer = None
            if writer is None:
                shard_paths.append(model_dir / f".shard-{len(shard_paths) + 1:05d}.safetensors")
                writer = SafetensorsWriter(shard_paths[-1])
            writer.add(name, tensor)
            weight_map[name] = len(shard_paths)
            total += size
        if writer is None:
            raise ValueError("save_drafter: no tensors to write.")
        writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        for path in shard_paths:
            path.unlink(missing_ok=True)
        raise

    count = len(shard_paths)
    names = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    for path, name in zip(shard_paths, names):
        path.replace(model_dir / name)
    index = {"metadata": {"total_size": total},
             "weight_map": {key: names[shard - 1] for key, shard in sorted(weight_map.items())}}
    (model_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    (model_dir / CONFIG_NAME).write_text(json.dumps(dict(config_json), indent=2) + "\n")
