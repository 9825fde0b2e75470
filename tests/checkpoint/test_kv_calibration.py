# SPDX-License-Identifier: Apache-2.0
"""``quantize --kv-cache-scheme fp8``'s calibration input (issue 43): a user's aux-state file is
validated, NaN/Inf in it refused by name, and a request it cannot serve is one line, before anything
is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vllm_dspark.checkpoint.store import load_config
from vllm_dspark.checkpoint_tools.kv_calibration import read_aux_file
from vllm_dspark.tools.cli import main

PAIR = Path(__file__).resolve().parents[1] / "data" / "pair"


@pytest.fixture(scope="module")
def config():
    return load_config(PAIR / "drafter")


def _write(path: Path, **tensors: torch.Tensor) -> Path:
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return path


def test_an_aux_file_reads_as_sequences_with_positions(config, tmp_path) -> None:
    width = config.num_target_layers * config.target_hidden_size
    aux = torch.randn(3, 5, width)
    sequences = read_aux_file(_write(tmp_path / "a.safetensors", aux_hidden_states=aux), config)
    assert len(sequences) == 3
    assert torch.equal(sequences[1][0], aux[1:2]) and sequences[1][1].tolist() == [[0, 1, 2, 3, 4]]
    positions = torch.arange(10, 15)
    one = _write(tmp_path / "b.safetensors", aux_hidden_states=aux[0], positions=positions)
    ((got, pos),) = read_aux_file(one, config)
    assert got.shape == (1, 5, width) and pos.tolist() == [positions.tolist()]


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"hidden": torch.zeros(2, 640)}, "aux_hidden_states is no such tensor"),
        ({"aux_hidden_states": torch.zeros(2, 64)}, "takes 640 wide aux states"),
        ({"aux_hidden_states": torch.zeros(2, 640, dtype=torch.int32)}, "torch.int32"),
        (
            {"aux_hidden_states": torch.zeros(2, 640), "positions": torch.zeros(3)},
            "positions is torch.float32 (3,)",
        ),
        (
            {"aux_hidden_states": torch.zeros(2, 640), "positions": torch.tensor([0, -1])},
            "positions must lie in",
        ),
    ],
)
def test_a_malformed_aux_file_is_one_line(config, tmp_path, tensors, message) -> None:
    with pytest.raises(ValueError, match=None) as e:
        read_aux_file(_write(tmp_path / "bad.safetensors", **tensors), config)
    assert message in str(e.value) and "\n" not in str(e.value) and "Fix:" in str(e.value)


def test_nan_aux_states_are_refused_by_name_before_anything_is_written(tmp_path, capsys) -> None:
    aux = torch.zeros(4, 640)
    aux[2, 7] = float("nan")
    path = _write(tmp_path / "nan.safetensors", aux_hidden_states=aux)
    out = tmp_path / "out"
    argv = ["quantize", "--model", str(PAIR / "drafter"), "--out", str(out), "--quant-format"]
    argv += ["fp8", "--kv-cache-scheme", "fp8", "--kv-calibration", str(path), "--no-progress"]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert f"aux_hidden_states in {path}" in err and "NaN or infinite" in err
    assert not out.exists() and list(tmp_path.iterdir()) == [path]


def test_no_calibration_source_is_refused(tiny_checkpoint, tmp_path, capsys) -> None:
    argv = ["quantize", "--model", str(tiny_checkpoint), "--out", str(tmp_path / "o")]
    argv += ["--quant-format", "fp8", "--kv-cache-scheme", "fp8", "--no-progress"]
    assert main(argv) != 0
    assert "pass --kv-calibration" in capsys.readouterr().err
    argv = ["quantize", "--model", str(tiny_checkpoint), "--out", str(tmp_path / "o")]
    argv += ["--quant-format", "fp8", "--kv-calibration", str(tmp_path), "--no-progress"]
    assert main(argv) != 0
    assert "add --kv-cache-scheme fp8" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
