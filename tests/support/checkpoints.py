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
