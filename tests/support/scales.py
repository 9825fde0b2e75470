# SPDX-License-Identifier: Apache-2.0
"""Copies of a quantized checkpoint whose scales are stored another way, as other producers write them.

AutoFP8 and some ModelOpt versions store a per-tensor scale as a 0-dim tensor (shape ``[]``) where
compressed-tensors and ModelOpt 0.47's FP8 write ``[1]`` (0.47's NVFP4 writes ``[]``); some exports
keep scales in BF16 or F16. :func:`rewrite_scales` writes such a copy through the project's
safetensors layer (:mod:`vllm_dspark.checkpoint.st_io`): each shard under its own name and in its own
key order, every other tensor's bytes copied as they are, the other files (config.json, the index,
hf_quant_config.json, the target heads) beside them.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from vllm_dspark.checkpoint.formats import ONE_VALUE_SHAPES, is_scale
from vllm_dspark.checkpoint.st_io import (
    Entry,
    SafetensorsWriter,
    StoredTensor,
    read_header,
    read_tensor,
)


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
    """Copy checkpoint ``source`` to ``dest`` with ``change(tensor)`` stored for every key ``which`` picks;
    the keys changed, in order (never none: a copy that changes nothing tests nothing)."""
    dest.mkdir(parents=True)
    for path in source.iterdir():
        if path.is_dir():
            (dest / path.name).symlink_to(path.resolve(), target_is_directory=True)
        elif path.suffix != ".safetensors":
            shutil.copyfile(path, dest / path.name)
    changed = []
    for shard in sorted(source.glob("*.safetensors")):
        header = read_header(shard)
        new = {key: change(read_tensor(shard, key)) for key, t in header.items() if which(key, t)}
        entries = [Entry.of(k, new[k]) if k in new else t.entry(k) for k, t in header.items()]
        with SafetensorsWriter(dest / shard.name, entries) as writer:
            for key, stored in header.items():
                if key in new:
                    writer.write(key, new[key])
                else:
                    writer.copy(key, stored)
        changed += new
    assert changed, f"{source} has no scale to rewrite"
    return changed
