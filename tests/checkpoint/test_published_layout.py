# SPDX-License-Identifier: Apache-2.0
"""``make-random --preset`` writes the published on-disk layout (issue 39): config.json byte for byte,
one ``model.safetensors`` exactly as the safetensors library writes it, and the published k3 file's
header length and size (planned by the code that writes it, without its 7 GB of data)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vllm_dspark.checkpoint.check import check_checkpoint
from vllm_dspark.checkpoint.presets import PUBLISHED_METADATA, preset_config_json
from vllm_dspark.checkpoint.save import save_drafter, write_config_json
from vllm_dspark.checkpoint.st_io import Entry, library_order, read_tensors, save_tensors
from vllm_dspark.checkpoint_tools.make_random import (
    drafter_entries,
    drafter_file_plan,
    make_random,
)

PUBLISHED_CONFIG_SHA256 = "5a3c2f4f91c965ed93b14de5f12a4e9c17fd98d8c99916ed2deb26ce8702f970"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _header(path: Path) -> bytes:
    raw = path.read_bytes()
    return raw[8 : 8 + int.from_bytes(raw[:8], "little")]


def test_k3_plan_is_the_published_files_header_and_size() -> None:
    plan = drafter_file_plan("k3")
    assert len(plan.header) == 7520 and plan.size == 7_124_633_450
    header = json.loads(plan.header)
    assert header.pop("__metadata__") == PUBLISHED_METADATA == {"torchspec_version": "0.1.0"}
    assert len(header) == 68 and list(header) == sorted(header)
    assert {e["dtype"] for e in header.values()} == {"BF16"}
    assert "embed_tokens.weight" in header
    assert sum(torch.Size(e["shape"]).numel() for e in header.values()) == 3_562_312_961
    ends = [e["data_offsets"] for e in header.values()]
    assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ends, ends[1:]))
    assert (
        plan.header.rstrip(b" ")
        == json.dumps(
            {"__metadata__": PUBLISHED_METADATA, **header}, separators=(",", ":")
        ).encode()
    )


def test_k3_config_json_is_the_published_file(tmp_path: Path) -> None:
    path = write_config_json(tmp_path, preset_config_json("k3"))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == PUBLISHED_CONFIG_SHA256


def test_small_is_the_safetensors_librarys_own_file(tmp_path: Path) -> None:
    out = make_random(tmp_path / "small", "small", seed=3, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "target"]
    drafter = out / "model.safetensors"
    tensors = read_tensors(drafter)
    assert list(tensors) == [e.key for e in drafter_entries("small")]
    assert drafter.read_bytes()[8:].startswith(drafter_file_plan("small").header)
    reference = tmp_path / "reference.safetensors"
    save_file(tensors, str(reference), metadata={"torchspec_version": "0.1.0"})
    assert drafter.read_bytes() == reference.read_bytes()
    assert (out / "config.json").read_text() == json.dumps(
        preset_config_json("small"), indent=2
    ) + "\n"
    # The target's heads stay as they were: embedding then lm_head, transformers' metadata.
    heads = read_tensors(out / "target" / "model.safetensors")
    assert list(heads) == ["model.embed_tokens.weight", "lm_head.weight"]
    assert torch.equal(heads["model.embed_tokens.weight"], tensors["embed_tokens.weight"])
    assert json.loads(_header(out / "target" / "model.safetensors"))["__metadata__"] == {
        "format": "pt"
    }


def test_k31_small_ships_no_embedding_but_its_target_does(tmp_path: Path) -> None:
    out = make_random(tmp_path / "k31", "k31-small", seed=0, progress=False)
    header = json.loads(_header(out / "model.safetensors"))
    assert "embed_tokens.weight" not in header and "layers.0.mlp.down_proj.weight" in header
    assert [e.key for e in drafter_entries("k31-small")] == [k for k in header if k[0] != "_"]
    heads = read_tensors(out / "target" / "model.safetensors")
    assert heads["model.embed_tokens.weight"].shape == (4096, 256)
    assert check_checkpoint(out).ok  # the embedding is the target's


def test_library_order_matches_save_file_across_dtypes(tmp_path: Path) -> None:
    """Mixed dtypes: the library puts the widest first, then sorts by name (bytes, non-ASCII too)."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "b": torch.randn(3, generator=g).to(torch.bfloat16),
        "a": torch.randint(0, 255, (5,), generator=g, dtype=torch.uint8),
        "c.scale": torch.randn(1, generator=g),
        "é": torch.randn(2, generator=g).to(torch.bfloat16),
        "Z": torch.randn(2, generator=g).to(torch.float8_e4m3fn),
        "x64": torch.arange(2),
    }
    for metadata in (None, {"torchspec_version": "0.1.0"}):
        ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
        save_tensors(ours, tensors, metadata=metadata, in_library_order=True)
        save_file(tensors, str(theirs), metadata=metadata)
        assert ours.read_bytes() == theirs.read_bytes()
    planned = [e.key for e in library_order(Entry.of(k, t) for k, t in tensors.items())]
    assert planned == ["x64", "c.scale", "b", "é", "Z", "a"]


def test_single_file_save_drafter_refuses_a_stream_out_of_library_order(tmp_path: Path) -> None:
    tensors = {"b.weight": torch.zeros(2, dtype=torch.bfloat16), "a.weight": torch.ones(2)}
    entries = [Entry.of(k, t) for k, t in tensors.items()]
    with pytest.raises(ValueError, match="library_order"):
        save_drafter(tmp_path, {}, iter(tensors.items()), entries=entries, single_file=True)
    # Given in memory, it orders them itself.
    save_drafter(tmp_path, {"x": 1}, tensors.items(), single_file=True, metadata=None)
    assert list(read_tensors(tmp_path / "model.safetensors")) == ["a.weight", "b.weight"]
    assert not (tmp_path / "model.safetensors.index.json").exists()
