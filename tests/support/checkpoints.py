# SPDX-License-Identifier: Apache-2.0
"""Editing a test checkpoint's config.json, in place or in a copy whose weights are linked; tensor digests."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DROP = object()  # a change that removes the key


def edit_config(
    model_dir: Path, edit: Callable[[dict[str, Any]], None] | None = None, **changes: Any
) -> Path:
    """Rewrite ``model_dir/config.json``: ``edit(config)``, then ``changes`` (``DROP`` removes a key)."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    if edit is not None:
        edit(config)
    for key, value in changes.items():
        if value is DROP:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config, indent=2))
    return model_dir


def variant(
    source: Path, dest: Path, edit: Callable[[dict[str, Any]], None] | None = None, **changes: Any
) -> Path:
    """A copy of checkpoint ``source`` (weights linked, not copied) with its config.json edited."""
    dest.mkdir(parents=True)
    for path in source.iterdir():
        if path.name != "config.json":
            (dest / path.name).symlink_to(path.resolve(), target_is_directory=path.is_dir())
    (dest / "config.json").write_text((source / "config.json").read_text())
    return edit_config(dest, edit, **changes)


def tensor_digest(t: torch.Tensor) -> str:
    """A tensor's dtype, shape and the sha256 of its bytes, in one string."""
    raw = t.contiguous().reshape(-1).view(dtype=torch.uint8).numpy().tobytes()
    return f"{t.dtype} {list(t.shape)} {hashlib.sha256(raw).hexdigest()}"


# The published variants at the ``tiny`` preset's sizes: Block5 / K3.1-Pro (causal; K3.1 ships no
# embed_tokens.weight) and lightseekorg's (per-tap fc_norm).
TINY_VARIANTS: dict[str, dict[str, Any]] = {
    "causal": {"is_causal": True, "block_size": 5},
    "no-embed": {"is_causal": True, "block_size": 7},
    "fc-norm": {"fc_norm": True, "aux_hidden_stream": "attn_res"},
}


def random_variant(out: Path, name: str, *, seed: int = 0) -> Path:
    """A random ``tiny`` drafter of variant ``name`` (:data:`TINY_VARIANTS`) with its target heads,
    written through the project's own writers in the published layout."""
    from vllm_dspark.checkpoint.layout import TARGET_HEADS
    from vllm_dspark.checkpoint.presets import PUBLISHED_METADATA, preset_config_json
    from vllm_dspark.checkpoint.save import save_drafter
    from vllm_dspark.checkpoint.st_io import save_tensors
    from vllm_dspark.checkpoint.store import TARGET_EMBED_KEY, TARGET_LM_HEAD_KEY
    from vllm_dspark.checkpoint_tools.make_random import random_drafter_tensors, random_lm_head
    from vllm_dspark.config import K3DSparkConfig

    config_json = {**preset_config_json("tiny"), **TINY_VARIANTS[name]}
    config = K3DSparkConfig(**config_json)
    tensors = dict(random_drafter_tensors(config, seed=seed))
    embed = tensors["embed_tokens.weight"]
    if name == "no-embed":
        del tensors["embed_tokens.weight"]
    save_drafter(
        out, config_json, list(tensors.items()), single_file=True, metadata=PUBLISHED_METADATA
    )
    lm_head = random_lm_head(config, seed=seed)
    save_tensors(out / TARGET_HEADS, {TARGET_EMBED_KEY: embed, TARGET_LM_HEAD_KEY: lm_head})
    return out
