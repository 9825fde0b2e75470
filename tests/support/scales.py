# SPDX-License-Identifier: Apache-2.0
"""Copies of a quantized checkpoint whose scales are stored another way, as other producers write them.

AutoFP8 and some ModelOpt versions store a per-tensor scale as a 0-dim tensor (shape ``[]``) where
compressed-tensors and ModelOpt 0.47's FP8 write ``[1]`` (0.47's NVFP4 writes ``[]``); some exports
keep scales in BF16 or F16; older ModelOpt W4A16 NVFP4 exports keep an ``input_scale``. The copies are
written through the project's safetensors layer (:mod:`vllm_dspark.checkpoint.st_io`): each shard under
its own name and in its own key order, every tensor not edited copied byte for byte, the other files
(config.json, hf_quant_config.json, the target heads) beside them and the index, if any, re-listed.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from vllm_dspark.checkpoint import modelopt
from vllm_dspark.checkpoint.formats import ONE_VALUE_SHAPES, is_scale
from vllm_dspark.checkpoint.layout import MODULE_SETS
from vllm_dspark.checkpoint.st_io import (
    Entry,
    SafetensorsWriter,
    StoredTensor,
    read_header,
    read_tensor,
)
from vllm_dspark.checkpoint.store import INDEX_NAME

# What to store in a stored tensor's place: {key: new tensor, or None for the stored one as it is}.
Edit = Callable[[str, StoredTensor], dict[str, torch.Tensor | None]]


def copy_checkpoint(source: Path, dest: Path, edit: Edit) -> list[str]:
    """Copy checkpoint ``source`` to ``dest``, each stored tensor replaced by what ``edit`` returns for
    it; the keys written anew or left out (never none: a copy that changes nothing tests nothing)."""
    dest.mkdir(parents=True)
    for path in source.iterdir():
        if path.is_dir():
            (dest / path.name).symlink_to(path.resolve(), target_is_directory=True)
        elif path.suffix != ".safetensors" and path.name != INDEX_NAME:
            shutil.copyfile(path, dest / path.name)
    written, weight_map = [], {}
    for shard in sorted(source.glob("*.safetensors")):
        header = read_header(shard)
        out = {}
        for key, stored in header.items():
            edited = edit(key, stored)
            if key not in edited:
                written.append(key)  # left out
            for new_key, tensor in edited.items():
                out[new_key] = stored if tensor is None else tensor.contiguous()
        entries = [
            t.entry(k) if isinstance(t, StoredTensor) else Entry.of(k, t) for k, t in out.items()
        ]
        with SafetensorsWriter(dest / shard.name, entries) as writer:
            for key, tensor in out.items():
                if isinstance(tensor, StoredTensor):
                    writer.copy(key, tensor)
                else:
                    writer.write(key, tensor)
                    written.append(key)
        weight_map.update(dict.fromkeys(out, shard.name))
    if (source / INDEX_NAME).is_file():
        index = json.loads((source / INDEX_NAME).read_text())
        (dest / INDEX_NAME).write_text(json.dumps({**index, "weight_map": weight_map}, indent=2))
    assert written, f"nothing of {source} was rewritten"
    return written


def one_value_scale(key: str, stored: StoredTensor) -> bool:
    """Whether ``key`` is a per-tensor scale: a scale holding one value."""
    return is_scale(key.rpartition(".")[2]) and stored.shape in ONE_VALUE_SHAPES


def rewrite_scales(
    source: Path,
    dest: Path,
    change: Callable[[torch.Tensor], torch.Tensor],
    *,
    which: Callable[[str, StoredTensor], bool] = one_value_scale,
) -> list[str]:
    """Copy checkpoint ``source`` to ``dest`` with ``change(tensor)`` stored for every key ``which``
    picks (by default every per-tensor scale); the keys changed, in order."""

    def edit(key: str, stored: StoredTensor) -> dict[str, torch.Tensor | None]:
        return {key: change(read_tensor(stored.path, key)) if which(key, stored) else None}

    return copy_checkpoint(source, dest, edit)


def build(source: Path, root: Path, export: str, fmt: str) -> Path:
    """``source`` quantized to ``fmt`` on every linear (ModelOpt's module set), in ``export``'s encoding."""
    from vllm_dspark.checkpoint_tools.quantize import quantize_checkpoint

    out = root / f"{export}-{fmt}"
    if not out.exists():
        quantize_checkpoint(
            source, out, fmt, MODULE_SETS["modelopt"], progress=False, export=export
        )
    return out


def with_legacy_input_scales(written: Path, dest: Path) -> list[str]:
    """A copy of ModelOpt W4A16 NVFP4 build ``written`` with an ``input_scale`` beside every
    ``weight_scale_2``, as older ModelOpt exports store it (W4A4's calibration-free value, [])."""
    value = modelopt.quantize(torch.ones(1, 16), "nvfp4-w4a4")["input_scale"]

    def edit(key: str, _) -> dict[str, torch.Tensor | None]:
        if not key.endswith(".weight_scale_2"):
            return {key: None}
        return {key: None, key.removesuffix("weight_scale_2") + "input_scale": value}

    return copy_checkpoint(written, dest, edit)


def other_shape(model_dir: Path) -> tuple[int, ...]:
    """The one-value shape ``model_dir`` does not write its per-tensor scales in ([] for [1], [1] for [])."""
    (written,) = {
        t.shape
        for shard in model_dir.glob("*.safetensors")
        for key, t in read_header(shard).items()
        if key.endswith(("scale", "scale_2")) and t.shape in ONE_VALUE_SHAPES
    }
    return () if written == (1,) else (1,)
