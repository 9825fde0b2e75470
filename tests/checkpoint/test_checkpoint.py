# SPDX-License-Identifier: Apache-2.0
"""Drafter directories: the make-random layout, save/load round trips, quantized loading, and a clear
error for every way a checkpoint can be broken."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vllm_dspark.checkpoint import formats, quant_config
from vllm_dspark.checkpoint.layout import tensor_shapes
from vllm_dspark.checkpoint.presets import preset_config, preset_config_json
from vllm_dspark.checkpoint.save import save_drafter
from vllm_dspark.checkpoint.st_io import Entry, SafetensorsWriter, save_tensors
from vllm_dspark.checkpoint.store import (
    load_config,
    load_drafter_state_dict,
    load_target_heads,
    read_config_json,
)
from vllm_dspark.checkpoint_tools.make_random import make_random, random_drafter_tensors
from vllm_dspark.reference.drafter import ReferenceDrafter


def tensors_of(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_drafter_state_dict(model_dir, dtype=None)[1]


def rewrite(src: Path, dst: Path, *, edit_tensors=None, edit_config=None) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` with its tensors and/or config.json edited (index kept consistent)."""
    config_json = read_config_json(src)
    tensors = tensors_of(src)
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config_json)
    save_drafter(dst, config_json, tensors.items(), max_shard_bytes=100_000)
    shutil.copytree(src / "target", dst / "target")
    return dst


def test_make_random_writes_the_real_layout(tiny_checkpoint: Path) -> None:
    config = load_config(tiny_checkpoint)
    assert json.loads((tiny_checkpoint / "config.json").read_text()) == preset_config_json("tiny")
    # The published layout: one model.safetensors, no index (tests/checkpoint/test_published_layout.py).
    assert not (tiny_checkpoint / "model.safetensors.index.json").exists()
    with safe_open(str(tiny_checkpoint / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(tensor_shapes(config))
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    _, state_dict = load_drafter_state_dict(tiny_checkpoint)
    embed, lm_head = load_target_heads(tiny_checkpoint / "target")
    assert torch.equal(
        embed, state_dict["embed_tokens.weight"]
    )  # the drafter ships the target's embedding
    assert lm_head.shape == (config.vocab_size, config.hidden_size) and not torch.equal(
        lm_head, embed
    )
    target_config = json.loads((tiny_checkpoint / "target" / "config.json").read_text())
    assert (target_config["vocab_size"], target_config["hidden_size"]) == (512, 64)
    assert sum(v.numel() for v in state_dict.values()) == sum(
        torch.Size(s).numel() for s in tensor_shapes(config).values()
    )


def test_make_random_is_deterministic(tiny_checkpoint: Path, tmp_path: Path) -> None:
    def digest(d: Path) -> dict[str, str]:
        return {
            str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*"))
            if p.is_file()
        }

    again = make_random(tmp_path / "again", "tiny", seed=0, progress=False)
    assert digest(again) == digest(tiny_checkpoint)
    other = make_random(tmp_path / "other", "tiny", seed=1, progress=False)
    assert digest(other)["config.json"] == digest(tiny_checkpoint)["config.json"]
    shard = "model.safetensors"
    assert digest(other)[shard] != digest(tiny_checkpoint)[shard]


def test_sharded_round_trip_and_stale_shards(tmp_path: Path) -> None:
    config = preset_config("tiny")
    tensors = dict(random_drafter_tensors(config, seed=0))
    save_drafter(tmp_path, preset_config_json("tiny"), tensors.items(), max_shard_bytes=50_000)
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    loaded_config, loaded = load_drafter_state_dict(tmp_path, dtype=None)
    assert loaded_config.to_dict() == config.to_dict()
    assert loaded.keys() == tensors.keys() and all(
        torch.equal(loaded[k], tensors[k]) for k in tensors
    )
    assert all(
        v.dtype == torch.float32
        for v in load_drafter_state_dict(tmp_path, dtype=torch.float32)[1].values()
    )
    # Rewriting with fewer shards leaves no stale shard behind.
    save_drafter(tmp_path, preset_config_json("tiny"), tensors.items())
    assert sorted(p.name for p in tmp_path.glob("model-*.safetensors")) == [
        "model-00001-of-00001.safetensors"
    ]
    assert not list(tmp_path.glob(".*"))  # no temporary files either


def test_single_file_checkpoint_loads(tiny_checkpoint: Path, tmp_path: Path) -> None:
    tensors = tensors_of(tiny_checkpoint)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(tiny_checkpoint / "config.json", tmp_path / "config.json")
    _, loaded = load_drafter_state_dict(tmp_path, dtype=None)
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)


def test_safetensors_writer_round_trips_every_dtype(tmp_path: Path) -> None:
    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "fp8": torch.randn(4, 4).to(torch.float8_e4m3fn),
        "f32": torch.randn(7),
        "i64": torch.arange(6).view(2, 3),
        "mask": torch.tensor([True, False, True]),
        "u8": torch.randint(0, 255, (9,), dtype=torch.uint8),
        "empty": torch.zeros(0, 4),
    }
    save_tensors(tmp_path / "t.safetensors", tensors)
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as f:
        for name, tensor in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == tensor.dtype and torch.equal(
                got.view(torch.uint8), tensor.view(torch.uint8)
            )
    with (
        pytest.raises(ValueError, match="written twice"),
        SafetensorsWriter(tmp_path / "u.safetensors", [Entry.of("x", torch.ones(1))]) as writer,
    ):
        writer.write("x", torch.ones(1))
        writer.write("x", torch.ones(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.safetensors"]


def test_fp8_checkpoint_is_dequantized_once_at_load(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from vllm_dspark.checkpoint.quant_plan import declared

    config = load_config(tiny_checkpoint)
    tensors = tensors_of(tiny_checkpoint)
    kinds = (
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "self_attn.o_proj",
        "self_attn.q_b_proj",
        "context_proj",
    )
    config_json = read_config_json(tiny_checkpoint)
    config_json["quantization_config"] = quant_config.quantization_config("fp8", kinds, config)
    quantized_names = declared(config, config_json["quantization_config"])
    assert len(quantized_names) == 5 * config.num_hidden_layers + 1  # 5 per layer + context_proj

    def stored():
        for key, tensor in tensors.items():
            module = key[: -len(".weight")]
            if module in quantized_names:
                for suffix, part in formats.quantize_weight(tensor, "fp8").items():
                    yield f"{module}.{suffix}", part
            else:
                yield key, tensor

    save_drafter(tmp_path / "fp8", config_json, stored())
    shutil.copytree(tiny_checkpoint / "target", tmp_path / "fp8" / "target")
    _, loaded = load_drafter_state_dict(tmp_path / "fp8", dtype=None)
    assert loaded.keys() == tensors.keys()
    for key, tensor in tensors.items():
        if key[: -len(".weight")] in quantized_names:
            assert loaded[key].dtype == torch.float32
            error = (loaded[key] - tensor.float()).norm() / tensor.float().norm()
            assert 1e-4 < error < 0.05, (key, error)
        else:
            assert torch.equal(loaded[key], tensor)
    out = ReferenceDrafter.from_pretrained(tmp_path / "fp8").draft(
        torch.randn(1, 4, 320), torch.arange(4)[None], torch.tensor([5])
    )
    assert out.tokens.shape == (1, config.draft_block_size)

    # FP8 shards under a config without quantization_config, and the converse.
    unlabelled = tmp_path / "fp8_without_quantization_config"
    shutil.copytree(tmp_path / "fp8", unlabelled)
    shutil.copy(tiny_checkpoint / "config.json", unlabelled / "config.json")
    with pytest.raises(
        ValueError,
        match=r"context_proj is stored as fp8 \(11 quantized modules\), but config.json "
        r"has no quantization_config. Fix: use the config.json written with these "
        r"shards",
    ):
        load_drafter_state_dict(unlabelled)
    bf16_dir = tmp_path / "bf16_with_fp8_config"
    shutil.copytree(tiny_checkpoint, bf16_dir)
    shutil.copy(tmp_path / "fp8" / "config.json", bf16_dir / "config.json")
    with pytest.raises(
        ValueError,
        match=r"quantization_config and the stored tensors disagree: context_proj is stored "
        r"BF16, but quantization_config quantizes it as fp8 .* \(and 10 more "
        r"module\(s\)\)",
    ):
        load_drafter_state_dict(bf16_dir)

    # A per-tensor scale where the recipe stores one per output channel: named, with both shapes.
    per_tensor = tmp_path / "fp8_per_tensor_scale"
    stored_tensors = dict(stored())
    stored_tensors["context_proj.weight_scale"] = (
        stored_tensors["context_proj.weight_scale"].amax().reshape(1)
    )
    save_drafter(per_tensor, config_json, stored_tensors.items())
    rows = config.hidden_size
    with pytest.raises(
        ValueError,
        match=rf"tensor 'context_proj.weight_scale' has shape \(1,\), expected shape "
        rf"\({rows}, 1\)",
    ):
        load_drafter_state_dict(per_tensor)


# ----- every broken checkpoint, with its message -----


def test_missing_tensor(tiny_checkpoint: Path, tmp_path: Path) -> None:
    broken = rewrite(
        tiny_checkpoint, tmp_path / "c", edit_tensors=lambda t: t.pop("layers.1.mlp.up_proj.weight")
    )
    with pytest.raises(ValueError) as e:
        load_drafter_state_dict(broken)
    assert "missing tensor 'layers.1.mlp.up_proj.weight' (expected shape (128, 64))" in str(e.value)
    assert "checkpoint is incomplete" in str(e.value)


def test_mis_shaped_tensor(tiny_checkpoint: Path, tmp_path: Path) -> None:
    def shrink(t):
        t["context_proj.weight"] = t["context_proj.weight"][:, :300]

    with pytest.raises(ValueError) as e:
        load_drafter_state_dict(rewrite(tiny_checkpoint, tmp_path / "c", edit_tensors=shrink))
    assert "tensor 'context_proj.weight' has shape (64, 300), expected shape (64, 320)" in str(
        e.value
    )


def test_unexpected_tensor(tiny_checkpoint: Path, tmp_path: Path) -> None:
    def add(t):
        t["layers.0.self_attn.q_proj.weight"] = torch.zeros(64, 64, dtype=torch.bfloat16)

    with pytest.raises(ValueError) as e:
        load_drafter_state_dict(rewrite(tiny_checkpoint, tmp_path / "c", edit_tensors=add))
    assert "unexpected tensor 'layers.0.self_attn.q_proj.weight' with shape (64, 64)" in str(
        e.value
    )


def test_config_and_shards_disagree(tiny_checkpoint: Path, tmp_path: Path) -> None:
    fewer = rewrite(
        tiny_checkpoint, tmp_path / "fewer", edit_config=lambda c: c.update(num_hidden_layers=1)
    )
    with pytest.raises(ValueError) as e:
        load_drafter_state_dict(fewer)
    message = str(e.value)
    assert "does not match its config.json (hidden_size=64, num_hidden_layers=1" in message
    assert "unexpected tensor 'layers.1.input_layernorm.weight'" in message
    assert "config.json and the shards disagree" in message

    more = rewrite(
        tiny_checkpoint, tmp_path / "more", edit_config=lambda c: c.update(num_hidden_layers=3)
    )
    with pytest.raises(
        ValueError,
        match=r"missing tensor 'layers.2.input_layernorm.weight' \(expected shape \(64,\)\)",
    ):
        load_drafter_state_dict(more)

    wider = rewrite(
        tiny_checkpoint, tmp_path / "wider", edit_config=lambda c: c.update(intermediate_size=96)
    )
    with pytest.raises(ValueError) as e:
        load_drafter_state_dict(wider)
    assert (
        "tensor 'layers.0.mlp.gate_proj.weight' has shape (128, 64), expected shape (96, 64)"
        in str(e.value)
    )


def test_index_and_shards_disagree(tiny_checkpoint: Path, tmp_path: Path) -> None:
    broken = rewrite(tiny_checkpoint, tmp_path / "c")
    index_path = broken / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first, second = sorted(set(index["weight_map"].values()))[:2]
    key = next(k for k, v in index["weight_map"].items() if v == first)
    index["weight_map"][key] = second
    index_path.write_text(json.dumps(index))
    with pytest.raises(
        ValueError,
        match=rf"model.safetensors.index.json and shard model-0000[12]-of-00004.safetensors "
        rf"disagree: .*{key}",
    ):
        load_drafter_state_dict(broken)

    index["weight_map"][key] = "model-00099-of-00099.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(
        ValueError, match="lists shard.*model-00099-of-00099.safetensors, which do not exist"
    ):
        load_drafter_state_dict(broken)

    # Without the index every *.safetensors file counts, as vLLM loads them; a key in two is refused.
    index_path.unlink()
    _, state = load_drafter_state_dict(broken)
    assert key in state
    first = sorted(broken.glob("model-*.safetensors"))[0]
    (broken / "extra.safetensors").symlink_to(first.resolve())
    with pytest.raises(
        ValueError,
        match=r"is in both extra.safetensors and model-00001.*no model.safetensors.index.json",
    ):
        load_drafter_state_dict(broken)


def _corruptions(good: bytes) -> dict[str, bytes]:
    """``good`` (a safetensors file) broken every way the library's reader checks, and a few it takes."""
    length = int.from_bytes(good[:8], "little")
    header, data = json.loads(good[8 : 8 + length]), good[8 + length :]
    key = next(k for k in header if k != "__metadata__")

    def with_header(edit=None, raw=None) -> bytes:
        h = json.loads(json.dumps(header))
        if edit:
            edit(h)
        raw = json.dumps(h).encode() if raw is None else raw
        return len(raw).to_bytes(8, "little") + raw + data

    def entry(**fields):
        return lambda h: h[key].update(fields)

    return {
        "good": good,
        "empty": b"",
        "short": b"abc",
        "truncated": good[:-1],
        "one byte more": good + b"0",
        "length zero": b"\0" * 8 + good[8:],
        "length beyond the file": (len(good) * 2).to_bytes(8, "little") + good[8:],
        "huge length": (10**9).to_bytes(8, "little") + good[8:],
        "not JSON": with_header(raw=b"{not json"),
        "not UTF-8": with_header(raw=b'{"\xff": 1}'),
        "a list": with_header(raw=b"[]"),
        "NUL padding": with_header(raw=json.dumps(header).encode() + b"\0"),
        "space padding": with_header(raw=json.dumps(header).encode() + b"   "),
        "metadata not strings": with_header(lambda h: h.update(__metadata__={"a": 1})),
        "unknown dtype": with_header(entry(dtype="F7")),
        "negative shape": with_header(entry(shape=[-1])),
        "shape of bools": with_header(entry(shape=[True])),
        "no shape": with_header(lambda h: h[key].pop("shape")),
        "shape not its bytes": with_header(entry(shape=[1, 2, 4])),
        "an offset gap": with_header(entry(data_offsets=[1, 2])),
        "three offsets": with_header(entry(data_offsets=[0, 1, 2])),
        "an extra field": with_header(entry(extra=1)),
    }


def test_the_header_reader_refuses_what_the_library_refuses(tmp_path: Path) -> None:
    """``read_header`` validates with the standard library alone (``check`` imports no torch): it
    refuses exactly the files the safetensors library refuses, each as not readable."""
    from vllm_dspark.checkpoint.st_io import read_header
    from vllm_dspark.findings import FindingError

    path = tmp_path / "t.safetensors"
    save_tensors(path, {"a": torch.ones(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)})
    for name, content in _corruptions(path.read_bytes()).items():
        path.write_bytes(content)
        try:
            with safe_open(str(path), "numpy"):
                pass
            library_reads = True
        except Exception:
            library_reads = False
        try:
            ours = read_header(path)
        except FindingError as e:
            assert not library_reads, (name, str(e))
            assert "is not a readable safetensors file" in str(e), (name, str(e))
        else:
            assert library_reads, name
            assert {k: (t.dtype, t.shape) for k, t in ours.items()} == {
                "a": ("F32", (2, 3)),
                "b": ("BF16", (4,)),
            }, name


def test_unreadable_shard(tiny_checkpoint: Path, tmp_path: Path) -> None:
    broken = tmp_path / "c"
    shutil.copytree(tiny_checkpoint, broken)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        load_drafter_state_dict(broken)


@pytest.mark.parametrize(
    "content, message",
    [
        (
            '{"model_type": "k3_dspark", "hidden_size": 64,',
            r"config.json is not valid JSON: .* at line 1, column \d+",
        ),
        ("[1, 2]", "must hold a JSON object, found a list"),
        (None, "has no config.json"),
    ],
)
def test_malformed_config(
    tiny_checkpoint: Path, tmp_path: Path, content: str | None, message: str
) -> None:
    broken = tmp_path / "c"
    shutil.copytree(tiny_checkpoint, broken)
    if content is None:
        (broken / "config.json").unlink()
    else:
        (broken / "config.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        load_drafter_state_dict(broken)


def test_invalid_config_field_names_file_and_field(tiny_checkpoint: Path, tmp_path: Path) -> None:
    broken = tmp_path / "c"
    shutil.copytree(tiny_checkpoint, broken)
    config_json = read_config_json(broken)
    config_json["block_size"] = 0
    (broken / "config.json").write_text(json.dumps(config_json))
    with pytest.raises(
        ValueError, match=r"c/config.json: K3DSparkConfig.block_size: must be an integer >= 1"
    ):
        load_config(broken)
    config_json.update(block_size=7, model_type="deepseek_v3")
    (broken / "config.json").write_text(json.dumps(config_json))
    with pytest.raises(ValueError, match="model_type 'deepseek_v3' are not a K3 DSpark drafter's"):
        load_config(broken)


def test_missing_directory_and_weights(tiny_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a directory"):
        load_config(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(tiny_checkpoint / "config.json", empty / "config.json")
    with pytest.raises(ValueError, match="holds no weights"):
        load_drafter_state_dict(empty)


def test_target_heads_errors(tiny_checkpoint: Path, tmp_path: Path) -> None:
    embed, lm_head = load_target_heads(
        tiny_checkpoint / "target" / "model.safetensors"
    )  # a file works too
    save_file({"model.embed_tokens.weight": embed}, str(tmp_path / "heads.safetensors"))
    with pytest.raises(ValueError, match="lacks lm_head.weight"):
        load_target_heads(tmp_path / "heads.safetensors")
    with pytest.raises(ValueError, match="does not exist"):
        load_target_heads(tmp_path / "missing")
    # The drafter refuses a target of another vocabulary.
    save_file(
        {"model.embed_tokens.weight": embed[:100], "lm_head.weight": lm_head[:100]},
        str(tmp_path / "small.safetensors"),
    )
    with pytest.raises(ValueError, match=r"target embed_tokens has shape \(100, 64\).*\(512, 64\)"):
        ReferenceDrafter.from_pretrained(tiny_checkpoint, target_dir=tmp_path / "small.safetensors")
    lonely = tmp_path / "lonely"
    shutil.copytree(tiny_checkpoint, lonely, ignore=shutil.ignore_patterns("target"))
    with pytest.raises(ValueError, match="no target given"):
        ReferenceDrafter.from_pretrained(lonely)


def test_make_random_like_takes_the_targets_geometry_and_heads(
    tiny_llama_target, tmp_path, capsys
) -> None:
    """``make-random --like``: an MLA target's sizes and its own heads; a non-MLA target is one line."""
    import json

    from transformers import DeepseekV3ForCausalLM

    from vllm_dspark.checkpoint.save import mla_target_config
    from vllm_dspark.checkpoint.store import load_config, load_target_heads
    from vllm_dspark.checkpoint_tools.make_random import aux_layer_ids
    from vllm_dspark.tools.cli import main as cli_main

    def main(argv: list[str]) -> int:
        return cli_main(["make-random", *argv])

    torch.manual_seed(0)
    geometry = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
                "num_attention_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
                "qk_nope_head_dim": 16, "v_head_dim": 32}  # fmt: skip
    config = mla_target_config(geometry, moe_intermediate_size=32)
    DeepseekV3ForCausalLM(config).save_pretrained(tmp_path / "target")
    assert (
        main(
            [
                "--like",
                str(tmp_path / "target"),
                "--out",
                str(tmp_path / "drafter"),
                "--num-layers",
                "2",
                "--quiet",
            ]
        )
        == 0
    )
    drafter = load_config(tmp_path / "drafter")
    assert (
        drafter.hidden_size,
        drafter.target_hidden_size,
        drafter.target_num_hidden_layers,
        drafter.vocab_size,
        drafter.num_hidden_layers,
        drafter.target_kv_latent_dim,
    ) == (64, 64, 8, 512, 2, 48)
    assert drafter.target_layer_ids == aux_layer_ids(8) == [1, 2, 4, 5, 6]
    embed, lm_head = load_target_heads(tmp_path / "drafter" / "target")
    want_embed, want_lm_head = load_target_heads(tmp_path / "target")
    assert torch.equal(embed, want_embed) and torch.equal(lm_head, want_lm_head)
    assert (
        json.loads((tmp_path / "drafter" / "target" / "config.json").read_text())[
            "num_hidden_layers"
        ]
        == 8
    )

    capsys.readouterr()
    assert main(["--like", str(tiny_llama_target), "--out", str(tmp_path / "bad"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "kv_lora_rank" in err and "MLA" in err
    # The target is an input: the drafter is never written into it.
    assert (
        main(
            ["--like", str(tmp_path / "target"), "--out", str(tmp_path / "target" / "d"), "--quiet"]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert "lies inside the input" in err and not (tmp_path / "target" / "d").exists()
