# SPDX-License-Identifier: Apache-2.0
"""The table of bad inputs: each a real ``vllm-dspark`` command on real files (tiny preset), asserting
its exit code, no traceback, one line naming the problem, every input's sha256 unchanged and nothing
left behind. They run in-process through ``cli.main``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.bad_input import (
    MALFORMED,
    SCALE,
    WEIGHT,
    Build,
    Case,
    check_argv,
    copy_input,
    doctor_argv,
    draft_argv,
    draft_inputs,
    edit_tensor,
    eval_argv,
    ids_file,
    malformed,
    nan_heads,
    quantize_argv,
    raw_file,
    run_cli,
    set_first,
    tree,
    user_file,
)
from tests.support.checkpoints import DROP, edit_config
from vllm_dspark.fields import REQUIRED_FIELDS

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
            str(copy_input(c["bf16"], t, "m")),
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
            str(copy_input(c["bf16"], t, "m")),
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
            str(copy_input(c["bf16"], t, "m")),
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
            str(copy_input(c["bf16"], t, "m")),
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
            str(copy_input(c["bf16"], t, "m")),
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
    lambda t, c: quantize_argv(c["bf16"], t) if shutil.copytree(c["fp8"], t / "out") else [],
)
add(
    "quantize-out-is-file",
    2,
    "exists and is not a directory",
    lambda t, c: quantize_argv(c["bf16"], t) if user_file(t / "out") else [],
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
        str(draft_inputs(t, c)),
        "--out",
        str(t / "in" / "inputs.safetensors"),
    ],
)
add(
    "draft-out-is-model-config",
    2,
    "lies inside the input",
    lambda t, c: draft_argv(
        m := copy_input(c["bf16"], t), draft_inputs(t, c), t, out=m / "config.json"
    ),
)
add(
    "draft-out-is-model-shard",
    2,
    "lies inside the input",
    lambda t, c: draft_argv(
        m := copy_input(c["bf16"], t),
        draft_inputs(t, c),
        t,
        out=next(m.glob("model-*.safetensors")),
    ),
)
add(
    "draft-out-inside-model",
    2,
    "lies inside the input",
    lambda t, c: draft_argv(
        m := copy_input(c["bf16"], t), draft_inputs(t, c), t, out=m / "out.safetensors"
    ),
)
add(
    "draft-out-is-target-heads",
    2,
    "lies inside the input",
    lambda t, c: draft_argv(
        m := copy_input(c["bf16"], t), draft_inputs(t, c), t, out=m / "target" / "model.safetensors"
    ),
)
add(
    "draft-out-is-explicit-target-file",
    2,
    "is the input",
    lambda t, c: draft_argv(
        m := copy_input(c["bf16"], t),
        draft_inputs(t, c),
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
    lambda t, c: draft_argv(c["bf16"], draft_inputs(t, c), t, out=t / "in"),
)
add(
    "draft-example-inputs-over-config",
    2,
    "lies inside the input",
    lambda t, c: [
        "draft",
        "--model",
        str(m := copy_input(c["bf16"], t)),
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
        str(m := copy_input(c["bf16"], t)),
        "--example-inputs",
        str(m / "x.safetensors"),
    ],
)
add(
    "draft-example-inputs-is-model",
    2,
    "is the input",
    lambda t, c: [
        "draft",
        "--model",
        str(m := copy_input(c["bf16"], t)),
        "--example-inputs",
        str(m),
    ],
)
add(
    "eval-out-is-model",
    2,
    "is the input",
    lambda t, c: eval_argv(m := copy_input(c["bf16"], t), t, out=m),
)
add(
    "eval-out-inside-model",
    2,
    "lies inside the input",
    lambda t, c: eval_argv(m := copy_input(c["bf16"], t), t, out=m / "drift"),
)
add(
    "eval-out-contains-model",
    2,
    "contains the input",
    lambda t, c: eval_argv(copy_input(c["bf16"], t), t, out=t / "in"),
)
add(
    "eval-out-is-variant",
    2,
    "is the input",
    lambda t, c: eval_argv(c["bf16"], t, str(v := copy_input(c["fp8"], t)), out=v),
)
add(
    "eval-out-is-corpus",
    2,
    "is the input",
    lambda t, c: eval_argv(
        c["bf16"], t, extra=("--corpus", str(p := ids_file(t, [1, 2, 3] * 9, ".json"))), out=p
    ),
)
add(
    "eval-out-is-file",
    2,
    "exists and is not a directory",
    lambda t, c: eval_argv(c["bf16"], t) if user_file(t / "out") else [],
)
add(
    "make-random-nonempty",
    2,
    "exists and is not empty. Fix: pass --overwrite",
    lambda t, c: [
        "make-random",
        "--preset",
        "tiny",
        "--quiet",
        "--out",
        str(copy_input(c["bf16"], t)),
    ],
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
        str(user_file(t / "in" / "notes.txt").parent),
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
        str(user_file(t / "in" / "f")),
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
        str(user_file(t / "in" / "f") / "x"),
    ],
)


# 3. Finite or refused: source weights, scales in every loader, draft inputs, eval logits and variants.
for key in (
    WEIGHT,
    "layers.0.input_layernorm.weight",
    "embed_tokens.weight",
    "confidence_head.proj.bias",
):
    for value in (float("nan"), float("inf"), float("-inf")):
        add(
            f"quantize-source-{value}-{key}",
            2,
            f"source tensor {key}",
            lambda t, c, k=key, v=value: quantize_argv(
                edit_tensor(copy_input(c["bf16"], t), k, set_first(v)), t
            ),
        )
for fmt in ("mxfp4", "nvfp4"):
    for key in (WEIGHT, "layers.1.mlp.up_proj.weight"):
        add(
            f"quantize-{fmt}-source-nan-{key}",
            2,
            f"source tensor {key}",
            lambda t, c, k=key, f=fmt: quantize_argv(
                edit_tensor(copy_input(c["bf16"], t), k, set_first(float("nan"))), t, fmt=f
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
    key = f"{SCALE}.{suffix}"
    bad = lambda t, c, f=fmt, k=key, v=value: edit_tensor(copy_input(c[f], t), k, set_first(v))  # noqa: E731
    add(
        f"draft-scale-{fmt}-{suffix}-{value}",
        2,
        f"{key}: 1 of",
        lambda t, c, b=bad: draft_argv(b(t, c), draft_inputs(t, c), t),
    )
    add(
        f"eval-scale-{fmt}-{suffix}-{value}",
        2,
        f"{key}: 1 of",
        lambda t, c, b=bad: eval_argv(c["bf16"], t, str(b(t, c))),
    )
    add(
        f"check-scale-{fmt}-{suffix}-{value}",
        1,
        f"{key}: 1 of",
        lambda t, c, b=bad: check_argv(b(t, c), t),
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
        lambda t, c, f=_aux: draft_argv(c["bf16"], draft_inputs(t, c, aux_hidden_states=f), t),
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
        lambda t, c, f=_positions: draft_argv(
            c["bf16"], draft_inputs(t, c, context_positions=f), t
        ),
    )
add(
    "draft-positions-negative",
    2,
    "context_positions must lie in",
    lambda t, c: draft_argv(
        c["bf16"], draft_inputs(t, c, context_positions=lambda p: p - p.max() - 1), t
    ),
)
add(
    "draft-positions-int64-min",
    2,
    "context_positions must lie in",
    lambda t, c: draft_argv(
        c["bf16"],
        draft_inputs(
            t, c, context_positions=lambda p: torch.full_like(p, torch.iinfo(torch.int64).min)
        ),
        t,
    ),
)
add(
    "draft-positions-float",
    2,
    "context_positions must be integer",
    lambda t, c: draft_argv(
        c["bf16"], draft_inputs(t, c, context_positions=lambda p: p.double() + 0.5), t
    ),
)
add(
    "draft-seeds-float",
    2,
    "seeds must be integers",
    lambda t, c: draft_argv(
        c["bf16"],
        draft_inputs(t, c, seeds=lambda s: s.double() + 0.5, temperature=lambda x: x + 1.0),
        t,
    ),
)
add(
    "draft-seeds-bool",
    2,
    "seeds must be integers",
    lambda t, c: draft_argv(
        c["bf16"], draft_inputs(t, c, seeds=lambda s: s > 0, temperature=lambda x: x + 1.0), t
    ),
)
for value in (float("nan"), float("inf"), -1.0):
    add(
        f"draft-temperature-{value}",
        2,
        "temperature must be a finite float >= 0",
        lambda t, c, v=value: draft_argv(
            c["bf16"], draft_inputs(t, c, temperature=lambda x: torch.full_like(x, v)), t
        ),
    )
add(
    "draft-context-length-0",
    2,
    "at least one context token",
    lambda t, c: draft_argv(
        c["bf16"],
        draft_inputs(
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
    lambda t, c: draft_argv(
        c["bf16"],
        draft_inputs(
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
    lambda t, c: draft_argv(c["bf16"], draft_inputs(t, c, anchor_ids=lambda a: a + 100000), t),
)
add(
    "draft-anchor-float",
    2,
    "anchor_ids must be integer",
    lambda t, c: draft_argv(c["bf16"], draft_inputs(t, c, anchor_ids=lambda a: a.float()), t),
)
add(
    "draft-mask-empty",
    2,
    "without any context token",
    lambda t, c: draft_argv(
        c["bf16"], draft_inputs(t, c, context_mask=lambda m: torch.zeros_like(m)), t
    ),
)
add(
    "draft-missing-aux",
    2,
    "lacks required tensor(s) aux_hidden_states",
    lambda t, c: draft_argv(c["bf16"], draft_inputs(t, c, aux_hidden_states=DROP), t),
)
add(
    "draft-unknown-tensor",
    2,
    "unknown tensor(s) extra",
    lambda t, c: draft_argv(c["bf16"], draft_inputs(t, c, extra=torch.zeros(1)), t),
)
add(
    "draft-nan-weights",
    2,
    "the drafted logits: ",
    lambda t, c: draft_argv(
        edit_tensor(copy_input(c["bf16"], t), "final_norm.weight", set_first(float("nan"))),
        draft_inputs(t, c),
        t,
    ),
)
add(
    "draft-nan-lm-head",
    2,
    "the drafted logits: ",
    lambda t, c: draft_argv(
        m := copy_input(c["bf16"], t), draft_inputs(t, c), t, "--target", str(nan_heads(m, t))
    ),
)


add(
    "eval-reference-nan",
    2,
    "the reference's logits: ",
    lambda t, c: eval_argv(
        edit_tensor(copy_input(c["bf16"], t), "final_norm.weight", set_first(float("nan"))), t
    ),
)
add(
    "eval-reference-nan-lm-head",
    2,
    "the reference's logits: ",
    lambda t, c: eval_argv(
        m := copy_input(c["bf16"], t), t, extra=("--target", str(nan_heads(m, t)))
    ),
)
add(
    "eval-variant-nan-fp8-codes",
    2,
    "'s logits: ",
    lambda t, c: eval_argv(
        c["bf16"],
        t,
        str(
            edit_tensor(
                copy_input(c["fp8"], t),
                f"{SCALE}.weight",
                lambda w: w.view(torch.uint8).view(-1).__setitem__(slice(0, 64), 0x7F),
            )
        ),
    ),
)
add(
    "eval-variant-other-model",
    2,
    "is not a build of the reference",
    lambda t, c: eval_argv(c["bf16"], t, str(c["other"])),
)
add(
    "eval-variant-other-model-fp8",
    2,
    "is not a build of the reference",
    lambda t, c: eval_argv(c["bf16"], t, str(c["other-fp8"])),
)
add(
    "eval-variant-one-norm-changed",
    2,
    "is not a build of the reference",
    lambda t, c: eval_argv(
        c["bf16"], t, str(edit_tensor(copy_input(c["fp8"], t), "final_norm.weight", set_first(1.5)))
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
    bad = lambda t, c, f=field, v=value: edit_config(copy_input(c["bf16"], t), **{f: v})  # noqa: E731
    add(
        f"check-{tag}",
        1,
        "are not a K3 DSpark drafter's",
        lambda t, c, b=bad: check_argv(b(t, c), t),
    )
    add(
        f"draft-{tag}",
        2,
        "are not a K3 DSpark drafter's",
        lambda t, c, b=bad: draft_argv(b(t, c), draft_inputs(t, c), t),
    )
    add(
        f"quantize-{tag}",
        2,
        "are not a K3 DSpark drafter's",
        lambda t, c, b=bad: quantize_argv(b(t, c), t),
    )
    add(
        f"eval-{tag}", 2, "are not a K3 DSpark drafter's", lambda t, c, b=bad: eval_argv(b(t, c), t)
    )
for field in REQUIRED_FIELDS:
    add(
        f"check-missing-{field}",
        1,
        f"required field(s) {field} missing",
        lambda t, c, f=field: check_argv(edit_config(copy_input(c["bf16"], t), **{f: DROP}), t),
    )
# Variant fields that change the math: a wrong value is refused by name, a variant without its tensors too.
for tag, code, message, changes in (
    (
        "fc_norm-without-its-tensors",
        1,
        "missing; the unquantized module fc_norm.0",
        {"fc_norm": True},
    ),
    ("unknown-aux-stream", 1, "aux_hidden_stream", {"aux_hidden_stream": "mtp"}),
    ("sliding-window", 1, "dflash_config.use_swa", {"dflash_config": {"use_swa": True}}),
    ("is_causal-not-a-bool", 1, "is_causal: must be true or false", {"is_causal": "yes"}),
):
    add(
        f"check-{tag}",
        code,
        message,
        lambda t, c, ch=changes: check_argv(edit_config(copy_input(c["bf16"], t), **ch), t),
    )
for field in ("hidden_size", "vocab_size", "markov_rank"):
    add(
        f"draft-missing-{field}",
        2,
        f"required field(s) {field} missing",
        lambda t, c, f=field: draft_argv(
            edit_config(copy_input(c["bf16"], t), **{f: DROP}), draft_inputs(t, c), t
        ),
    )
    add(
        f"quantize-missing-{field}",
        2,
        f"required field(s) {field} missing",
        lambda t, c, f=field: quantize_argv(edit_config(copy_input(c["bf16"], t), **{f: DROP}), t),
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
        lambda t, c, s=seed: eval_argv(c["bf16"], t, extra=("--seed", s)),
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
        lambda t, c, i=ids, s=suffix: eval_argv(
            c["bf16"], t, extra=("--corpus", str(ids_file(t, i, s)))
        ),
    )
add(
    "eval-corpus-missing",
    2,
    "does not exist",
    lambda t, c: eval_argv(c["bf16"], t, extra=("--corpus", str(t / "nowhere.npy"))),
)
add(
    "eval-corpus-directory",
    2,
    "is a directory",
    lambda t, c: eval_argv(c["bf16"], t, extra=("--corpus", str(copy_input(c["bf16"], t)))),
)
add(
    "eval-corpus-garbage-npy",
    2,
    "is not a .npy array file",
    lambda t, c: eval_argv(
        c["bf16"],
        t,
        extra=("--corpus", str(ids_file(t, "not numpy", ".txt").rename(t / "in" / "ids.npy"))),
    ),
)

# 5. What used to end in a traceback: unreadable or malformed files, odd arguments.
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


for name in MALFORMED:
    bad = malformed("bf16", name)
    add(f"check-{name}", 1, MALFORMED_MESSAGES[name], lambda t, c, b=bad: check_argv(b(t, c), t))
    add(
        f"draft-{name}",
        2,
        MALFORMED_MESSAGES[name],
        lambda t, c, b=bad: draft_argv(b(t, c), draft_inputs(t, c), t),
    )
    add(
        f"quantize-{name}",
        2,
        MALFORMED_MESSAGES[name],
        lambda t, c, b=bad: quantize_argv(b(t, c), t),
    )
add(
    "eval-shard-truncated",
    2,
    "is not a readable safetensors file",
    lambda t, c: eval_argv(malformed("bf16", "shard-truncated")(t, c), t),
)
add(
    "eval-variant-shard-truncated",
    2,
    "is not a readable safetensors file",
    lambda t, c: eval_argv(c["bf16"], t, str(malformed("fp8", "shard-truncated")(t, c))),
)
add(
    "draft-out-is-directory",
    2,
    "is a directory",
    lambda t, c: draft_argv(
        c["bf16"], draft_inputs(t, c), t, out=user_file(t / "out.safetensors" / "x").parent
    ),
)
add(
    "draft-out-parent-is-file",
    2,
    "is a file, not a directory",
    lambda t, c: draft_argv(c["bf16"], draft_inputs(t, c), t, out=user_file(t / "f") / "o"),
)
add(
    "draft-inputs-missing",
    2,
    "does not exist",
    lambda t, c: draft_argv(c["bf16"], t / "none.safetensors", t),
)
add(
    "draft-inputs-directory",
    2,
    "is a directory",
    lambda t, c: draft_argv(c["bf16"], copy_input(c["bf16"], t), t),
)
add(
    "draft-inputs-garbage",
    2,
    "is not a readable safetensors file",
    lambda t, c: draft_argv(c["bf16"], ids_file(t, "garbage", ".txt"), t),
)
add(
    "draft-model-missing",
    2,
    "is not a directory",
    lambda t, c: draft_argv(t / "nowhere", draft_inputs(t, c), t),
)
add(
    "draft-model-is-file",
    2,
    "is not a directory",
    lambda t, c: draft_argv(draft_inputs(t, c), draft_inputs(t, c), t),
)
add(
    "draft-target-missing",
    2,
    "does not exist",
    lambda t, c: draft_argv(c["bf16"], draft_inputs(t, c), t, "--target", str(t / "nowhere")),
)
add(
    "draft-target-lacks-heads",
    2,
    "lacks model.embed_tokens.weight and lm_head.weight",
    lambda t, c: draft_argv(c["bf16"], draft_inputs(t, c), t, "--target", str(draft_inputs(t, c))),
)
add("quantize-model-missing", 2, "is not a directory", lambda t, c: quantize_argv(t / "nowhere", t))
add(
    "quantize-already-quantized", 2, "is already quantized", lambda t, c: quantize_argv(c["fp8"], t)
)
add(
    "quantize-workers-0",
    2,
    "--workers must be at least 1",
    lambda t, c: quantize_argv(c["bf16"], t, "--workers", "0"),
)
add(
    "quantize-unknown-format",
    2,
    "unknown quant format 'int3'; choose one of fp8, fp8-dynamic, fp8-static, fp8-block, mxfp4, nvfp4, nvfp4-w4a4",
    lambda t, c: quantize_argv(c["bf16"], t, fmt="int3"),
)
add("check-missing-dir", 1, "is not a directory", lambda t, c: check_argv(t / "nowhere", t))
add(
    "eval-context-len-0",
    2,
    "--resamples >= 1; got 2, 2, 0 and 4",
    lambda t, c: eval_argv(c["bf16"], t, extra=("--context-len", "0")),
)
add(
    "eval-blocks-1",
    2,
    "--blocks must be >= 2",
    lambda t, c: eval_argv(c["bf16"], t, extra=("--blocks", "1")),
)
add("eval-unknown-variant", 2, "unknown variant", lambda t, c: eval_argv(c["bf16"], t, "int3"))
add(
    "eval-quantized-reference",
    2,
    "is quantized; --model must be the unquantized",
    lambda t, c: eval_argv(c["fp8"], t),
)
add(
    "eval-position-out-of-range",
    2,
    "out of range",
    lambda t, c: eval_argv(c["bf16"], t, extra=("--positions", "2M")),
)
add("eval-model-missing", 2, "is not a directory", lambda t, c: eval_argv(t / "nowhere", t))
add(
    "eval-cuda-without-gpu",
    2,
    "torch sees no CUDA device",
    lambda t, c: (
        eval_argv(c["bf16"], t, extra=("--device", "cuda"))
        if not torch.cuda.is_available()
        else eval_argv(c["bf16"], t, extra=("--device", "tpu"))
    ),
)
for cc in ("abc", "9.x", "nine", "-1"):
    add(
        f"doctor-compute-capability-{cc}",
        2,
        "is not a compute capability",
        lambda t, c, v=cc: doctor_argv(c["bf16"], t, "--compute-capability", v),
    )
for name in ("config-is-list", "config-not-utf8", "target-layer-ids-string", "config-truncated"):
    add(
        f"doctor-{name}",
        1,
        {"target-layer-ids-string": "target_layer_ids"}.get(name, "is not a valid config"),
        lambda t, c, b=malformed("bf16", name): doctor_argv(b(t, c), t),
    )
for name, content in (("list", b"[1]"), ("not-utf8", b'{"a": "\xff"}')):
    add(
        f"doctor-target-config-{name}",
        1,
        "is not a valid config",
        lambda t, c, b=content: doctor_argv(
            c["bf16"], t, "--target", str(raw_file(t, "config.json", b))
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
    lambda t, c: doctor_argv(t / "nothere", t),
)
add(
    "doctor-model-is-a-file",
    1,
    "is a file, not a directory (taken as a local path)",
    lambda t, c: doctor_argv(c["bf16"] / "config.json", t),
)
add(
    "eval-binary-corpus",
    2,
    "corpus.txt is not UTF-8 text (byte 0: invalid continuation byte); a .txt corpus is token ids as text",
    lambda t, c: eval_argv(
        c["bf16"], t, extra=("--corpus", str(raw_file(t, "corpus.txt", b"\xd7\x00\xff" * 64)))
    ),
)
add(
    "eval-corpus-bad-json",
    2,
    "is not valid JSON",
    lambda t, c: eval_argv(
        c["bf16"], t, extra=("--corpus", str(raw_file(t, "ids.json", b"[1, 2,")))
    ),
)
add(
    "eval-resamples-0",
    2,
    "--resamples >= 1; got 2, 2, 4 and 0",
    lambda t, c: eval_argv(c["bf16"], t, extra=("--resamples", "0")),
)


@pytest.mark.parametrize("bad", CASES, ids=[c.id for c in CASES])
def test_bad_input(
    bad: Case, ckpts: dict[str, Path], tmp_path: Path, isolated_tmpdir: Path, one_torch_thread
) -> None:
    argv = bad.build(tmp_path, ckpts)
    shared = list(ckpts.values())
    before = tree(tmp_path, *shared)
    result = run_cli(argv)
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
        tree(tmp_path, *shared) == before
    )  # inputs unchanged, nothing written, nothing left behind
