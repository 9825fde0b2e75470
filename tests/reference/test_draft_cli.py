# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark make-random`` -> ``vllm-dspark draft``, end to end, and the CLI's error contract:
bad inputs exit with code 2 and a one-line message, never a traceback."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_dspark.checkpoint.presets import preset_config
from vllm_dspark.reference import INPUT_TENSORS, OUTPUT_TENSORS
from vllm_dspark.reference.drafter import ReferenceDrafter
from vllm_dspark.reference.io import example_inputs
from vllm_dspark.tools import cli


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "tiny"
    assert (
        cli.main(["make-random", "--preset", "tiny", "--out", str(out), "--seed", "3", "--quiet"])
        == 0
    )
    return out


@pytest.fixture(scope="module")
def inputs_file(checkpoint: Path) -> Path:
    path = checkpoint.parent / "inputs.safetensors"
    assert cli.main(["draft", "--model", str(checkpoint), "--example-inputs", str(path)]) == 0
    return path


def draft(*args: str) -> int:
    return cli.main(["draft", *args])


def test_round_trip_matches_the_reference(
    checkpoint: Path, inputs_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out.safetensors"
    assert draft("--model", str(checkpoint), "--inputs", str(inputs_file), "--out", str(out)) == 0
    result = load_file(str(out))
    config = preset_config("tiny")
    inputs = load_file(str(inputs_file))
    batch = inputs["anchor_ids"].shape[0]
    assert set(result) == set(OUTPUT_TENSORS)
    assert (
        result["draft_tokens"].shape == (batch, config.draft_block_size)
        and result["draft_tokens"].dtype == torch.int64
    )
    assert result["logits"].shape == (batch, config.draft_block_size, config.vocab_size)
    assert ((result["confidences"] > 0) & (result["confidences"] < 1)).all()

    expected = ReferenceDrafter.from_pretrained(checkpoint).draft(
        inputs["aux_hidden_states"],
        inputs["context_positions"],
        inputs["anchor_ids"],
        context_mask=inputs["context_mask"],
        temperature=inputs["temperature"],
        seeds=inputs["seeds"],
    )
    assert torch.equal(result["draft_tokens"], expected.tokens)
    torch.testing.assert_close(result["logits"], expected.logits)
    # The example inputs pad the last request: its block starts after its last valid position.
    last_valid = inputs["context_positions"][-1][inputs["context_mask"][-1]].max()
    assert result["block_positions"][-1, 0] == last_valid + 1

    absorbed = tmp_path / "absorbed.safetensors"
    assert (
        draft(
            "--model",
            str(checkpoint),
            "--target",
            str(checkpoint / "target"),
            "--inputs",
            str(inputs_file),
            "--out",
            str(absorbed),
            "--absorbed",
        )
        == 0
    )
    assert torch.equal(load_file(str(absorbed))["draft_tokens"], result["draft_tokens"])


def test_bf16_and_seeded_sampling(checkpoint: Path, tmp_path: Path) -> None:
    inputs = example_inputs(preset_config("tiny"), batch=3, seed=5, temperature=1.0)
    save_file(inputs, str(tmp_path / "in.safetensors"))
    runs = []
    for name in ("a", "b"):
        assert (
            draft(
                "--model",
                str(checkpoint),
                "--inputs",
                str(tmp_path / "in.safetensors"),
                "--out",
                str(tmp_path / f"{name}.safetensors"),
                "--dtype",
                "bf16",
            )
            == 0
        )
        runs.append(load_file(str(tmp_path / f"{name}.safetensors")))
    assert torch.equal(runs[0]["draft_tokens"], runs[1]["draft_tokens"])
    assert runs[0]["logits"].dtype == torch.float32


def test_help_documents_the_tensors(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        draft("--help")
    assert e.value.code == 0
    text = capsys.readouterr().out
    for name in [*INPUT_TENSORS, *OUTPUT_TENSORS]:
        assert name in text


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t.pop("anchor_ids"),
            r"lacks required tensor\(s\) anchor_ids: anchor_ids \[B\] int64",
        ),
        (
            lambda t: t.update(aux_hidden_states=t["aux_hidden_states"][..., :100]),
            r"aux_hidden_states must be \[B, T, 320\] \(num_target_layers 5 x target_hidden_size 64\), "
            r"got shape \(2, 16, 100\)",
        ),
        (
            lambda t: t.update(context_positions=t["context_positions"][:, :3]),
            r"context_positions must be integer \[B, T\] = \[2, 16\]",
        ),
        (
            lambda t: t.update(context_mask=t["context_mask"].long()),
            r"context_mask must be bool \[B, T\]",
        ),
        (
            lambda t: t.update(seeds=t["seeds"][:1], temperature=torch.ones(2)),
            r"seeds must be \[B\] = \[2\]",
        ),
        (lambda t: t.update(extra=torch.ones(1)), r"unknown tensor\(s\) extra"),
    ],
)
def test_bad_inputs_exit_2_without_traceback(
    checkpoint, inputs_file, tmp_path, capsys, edit, message
) -> None:
    tensors = load_file(str(inputs_file))
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "bad.safetensors"))
    code = draft(
        "--model",
        str(checkpoint),
        "--inputs",
        str(tmp_path / "bad.safetensors"),
        "--out",
        str(tmp_path / "o"),
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("vllm-dspark draft: error: ") and "Traceback" not in err
    assert re.search(message, err), err
    assert not (tmp_path / "o").exists()


def test_bad_checkpoint_exits_2(checkpoint, inputs_file, tmp_path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    code = draft(
        "--model",
        str(tmp_path / "empty"),
        "--inputs",
        str(inputs_file),
        "--out",
        str(tmp_path / "o"),
    )
    assert code == 2 and "has no config.json" in capsys.readouterr().err
    code = draft(
        "--model",
        str(checkpoint),
        "--inputs",
        str(tmp_path / "none.safetensors"),
        "--out",
        str(tmp_path / "o"),
    )
    assert code == 2 and "none.safetensors does not exist" in capsys.readouterr().err


def test_console_entry_point_reports_errors_cleanly(checkpoint: Path, tmp_path: Path) -> None:
    """The real process: exit status 2 and a message, no traceback."""
    bad = tmp_path / "bad.safetensors"
    save_file({"anchor_ids": torch.zeros(1, dtype=torch.long)}, str(bad))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_dspark.tools.cli",
            "draft",
            "--model",
            str(checkpoint),
            "--inputs",
            str(bad),
            "--out",
            str(tmp_path / "o.safetensors"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "lacks required tensor(s) aux_hidden_states, context_positions" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_empty_batch_is_refused_by_the_api_and_the_cli_alike(
    checkpoint: Path, inputs_file: Path, tmp_path: Path, capsys
) -> None:
    """B = 0 is a mistake, not a request for nothing: both ways in refuse it with the same words."""
    empty = {k: v[:0].contiguous() for k, v in load_file(str(inputs_file)).items()}
    with pytest.raises(ValueError, match="there must be at least one request") as api:
        ReferenceDrafter.from_pretrained(checkpoint).draft(
            empty["aux_hidden_states"], empty["context_positions"], empty["anchor_ids"]
        )
    path = tmp_path / "empty.safetensors"
    save_file(empty, str(path))
    out = tmp_path / "out.safetensors"
    assert draft("--model", str(checkpoint), "--inputs", str(path), "--out", str(out)) == 2
    assert str(api.value).rstrip(".") in capsys.readouterr().err and not out.exists()
