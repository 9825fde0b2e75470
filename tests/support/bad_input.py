# SPDX-License-Identifier: Apache-2.0
"""Building bad inputs for ``tests/bad_input/``: copies, edits, argv builders, and running a command."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.support.checkpoints import DROP, edit_config
from vllm_dspark.tools import cli

ROOT = Path(__file__).resolve().parents[2]


def tree(*roots: Path) -> dict[str, str]:
    """``{path: sha256}`` of every file (and ``{dir: "dir"}`` of every folder) under ``roots``."""
    found = {}
    for root in roots:
        for path in [root, *root.rglob("*")] if root.exists() else []:
            found[str(path)] = (
                "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
            )
    return found


@dataclass
class Result:
    code: int
    out: str
    err: str


def run_cli(argv: list[str]) -> Result:
    """``vllm-dspark ARGV`` in this process: exit code (argparse's SystemExit included) and output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
    return Result(code, out.getvalue(), err.getvalue())


# ----- building bad inputs -----


def copy_input(src: Path, tmp: Path, name: str | None = None) -> Path:
    dst = tmp / "in" / (name or src.name)
    shutil.copytree(src, dst)
    return dst


def edit_tensor(model: Path, key: str, edit: Callable[[torch.Tensor], None]) -> Path:
    index = json.loads((model / "model.safetensors.index.json").read_text())
    shard = model / index["weight_map"][key]
    tensors = load_file(str(shard))
    edit(tensors[key])
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return model


def set_first(value: float) -> Callable[[torch.Tensor], None]:
    def edit(t: torch.Tensor) -> None:
        t.view(-1)[0] = torch.tensor(value).to(t.dtype)

    return edit


SCALE = "layers.0.mlp.down_proj"  # quantized in every format's default recipe, fused with nothing
WEIGHT = "layers.0.mlp.down_proj.weight"


def draft_inputs(tmp: Path, ckpts: dict[str, Path], **changes) -> Path:
    tensors = load_file(str(ckpts["inputs"]))
    for key, value in changes.items():
        if value is DROP:
            tensors.pop(key)
        elif callable(value):
            tensors[key] = value(tensors[key])
        else:
            tensors[key] = value
    path = tmp / "in" / "inputs.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def draft_argv(
    model: Path, inputs: Path, tmp: Path, *extra: str, out: Path | None = None
) -> list[str]:
    return [
        "draft",
        "--model",
        str(model),
        "--inputs",
        str(inputs),
        "--out",
        str(out or tmp / "out.safetensors"),
        *extra,
    ]


def eval_argv(
    model: Path, tmp: Path, *variants: str, extra: tuple[str, ...] = (), out: Path | None = None
) -> list[str]:
    return [
        "eval",
        "--model",
        str(model),
        "--variants",
        *(variants or ("bf16",)),
        "--blocks",
        "2",
        "--regimes",
        "gauss",
        "--context-len",
        "4",
        "--batch-size",
        "2",
        "--resamples",
        "4",
        "--no-progress",
        "--out",
        str(out or tmp / "out"),
        *extra,
    ]


def quantize_argv(model: Path, tmp: Path, *extra: str, fmt: str = "fp8") -> list[str]:
    return [
        "quantize",
        "--model-dir",
        str(model),
        "--output-dir",
        str(tmp / "out"),
        "--quant-format",
        fmt,
        *extra,
    ]


def check_argv(model: Path, tmp: Path) -> list[str]:
    return ["check", str(model)]


def doctor_argv(model: Path, tmp: Path, *extra: str) -> list[str]:
    return [
        "doctor",
        "-sc",
        json.dumps({"method": "dspark", "model": str(model), "num_speculative_tokens": 7}),
        *extra,
    ]


def ids_file(tmp: Path, ids, suffix: str) -> Path:
    path = tmp / "in" / f"ids{suffix}"
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".npy":
        np.save(path, np.asarray(ids))
    elif suffix == ".json":
        path.write_text(json.dumps(ids))
    else:
        path.write_text(ids)
    return path


def nan_heads(model: Path, tmp: Path) -> Path:
    heads = load_file(str(model / "target" / "model.safetensors"))
    heads["lm_head.weight"][3, 5] = float("nan")
    path = tmp / "in" / "heads.safetensors"
    save_file(heads, str(path))
    return path


def edit_index(model: Path, edit) -> None:
    path = model / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    edit(index)
    path.write_text(json.dumps(index))


def replace_shard(model: Path, make) -> None:
    shard = next(model.glob("model-*.safetensors"))
    shard.unlink()
    make(shard)


def user_file(path: Path, text: str = "keep me") -> Path:
    """A user's file that must survive: ``path`` with ``text``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def raw_file(tmp: Path, name: str, content: bytes) -> Path:
    path = tmp / "in" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


# ----- the cases: (id, argv builder, exit code, text the one message line contains) -----

Build = Callable[[Path, dict[str, Path]], list[str]]


@dataclass(frozen=True)
class Case:
    id: str
    build: Build
    code: int
    message: str


MALFORMED = {
    "config-is-directory": lambda m: ((m / "config.json").unlink(), (m / "config.json").mkdir()),
    "config-not-utf8": lambda m: (m / "config.json").write_bytes(b'{"a": "\xff\xfe"}'),
    "config-is-list": lambda m: (m / "config.json").write_text("[1, 2]"),
    "config-truncated": lambda m: (m / "config.json").write_text(
        (m / "config.json").read_text()[:50]
    ),
    "index-non-str-entry": lambda m: edit_index(
        m, lambda i: i["weight_map"].__setitem__("final_norm.weight", 5)
    ),
    "index-is-list": lambda m: (m / "model.safetensors.index.json").write_text("[]"),
    "index-not-utf8": lambda m: (m / "model.safetensors.index.json").write_bytes(b"\xff\xfe{}"),
    "shard-is-directory": lambda m: replace_shard(m, lambda s: s.mkdir()),
    "shard-truncated": lambda m: replace_shard(m, lambda s, b=None: s.write_bytes(b"")),
    "shard-garbage": lambda m: replace_shard(m, lambda s: s.write_bytes(b"\x00" * 64)),
    "shard-missing": lambda m: replace_shard(m, lambda s: None),
    "quantization-config-string": lambda m: edit_config(m, quantization_config="fp8"),
    "quantization-config-list": lambda m: edit_config(m, quantization_config=["fp8"]),
    "target-layer-ids-string": lambda m: edit_config(m, target_layer_ids="2,23"),
}


def malformed(src: str, name: str) -> Callable[[Path, dict[str, Path]], Path]:
    def build(t: Path, c: dict[str, Path]) -> Path:
        m = copy_input(c[src], t)
        MALFORMED[name](m)
        return m

    return build
