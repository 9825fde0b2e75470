# SPDX-License-Identifier: Apache-2.0
"""Writing drafter directories, and the MLA target config a drafter's geometry implies."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vllm_dspark.checkpoint.st_io import DEFAULT_METADATA, Entry, SafetensorsWriter, library_order
from vllm_dspark.checkpoint.store import CONFIG_NAME, INDEX_NAME, SINGLE_FILE_NAME
from vllm_dspark.fields import GEOMETRY_FIELDS, MLA_FIELDS

if TYPE_CHECKING:
    from transformers import DeepseekV3Config

    from vllm_dspark.config import K3DSparkConfig

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # the HF default, "5GB"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def mla_target_config(geometry: Mapping[str, int], **overrides: Any) -> DeepseekV3Config:
    """A DeepSeek-V3 (MLA) target config of ``geometry`` (every ``GEOMETRY_FIELDS`` entry): dense,
    untied heads, unless ``overrides`` say otherwise."""
    from transformers import DeepseekV3Config

    fields = {
        "moe_intermediate_size": geometry["intermediate_size"],
        "first_k_dense_replace": geometry["num_hidden_layers"],
        "num_key_value_heads": geometry["num_attention_heads"],
        "n_group": 1,
        "topk_group": 1,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    config = DeepseekV3Config(
        **{**fields, **{f: geometry[f] for f in GEOMETRY_FIELDS}, **overrides}
    )
    config.architectures = ["DeepseekV3ForCausalLM"]
    return config


def write_target_config(drafter: K3DSparkConfig, out_dir: str | Path) -> Path:
    """A DeepSeek-V3 (MLA) target config.json with the geometry ``drafter`` expects of its target.

    Hidden size, depth and vocabulary come from the drafter's ``target_*`` fields; the MLA shape is
    the drafter's own, so the target's latent cache and the draft's agree (576 for Kimi-K3).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hidden = drafter.target_hidden_size
    geometry = {
        "vocab_size": drafter.vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": drafter.target_num_hidden_layers,
        **{f: getattr(drafter, f) for f in MLA_FIELDS},
    }
    # A MoE target after its first layer, as Kimi-K3 is.
    config = mla_target_config(
        geometry,
        moe_intermediate_size=hidden // 2,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
    )
    config.save_pretrained(out_dir)
    return out_dir


def write_config_json(model_dir: str | Path, config_json: Mapping[str, Any]) -> Path:
    """``model_dir/config.json`` as the published checkpoints write it: ``json.dumps(doc, indent=2)``
    and a newline, keys in the document's order (the ``k3`` preset's is the published file byte for
    byte)."""
    path = Path(model_dir) / CONFIG_NAME
    path.write_text(json.dumps(dict(config_json), indent=2) + "\n")
    return path


def save_drafter(
    model_dir: str | Path,
    config_json: Mapping[str, Any],
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    entries: Sequence[Entry] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    single_file: bool = False,
    metadata: Mapping[str, str] | None = DEFAULT_METADATA,
) -> None:
    """Write a drafter directory: shards ``model-0000i-of-0000n.safetensors``, the index, config.json.

    With ``single_file``, one ``model.safetensors`` and no index, as the published drafters ship:
    the tensors in :func:`~vllm_dspark.checkpoint.st_io.library_order`, so the file is the
    safetensors library's own ``save_file(tensors, path, metadata)`` byte for byte.
    ``metadata`` is every file's safetensors ``__metadata__`` (``None``: none).

    With ``entries`` (every tensor's :class:`Entry`, in the order ``tensors`` yields them; with
    ``single_file``, in library order) ``tensors`` may be a generator, consumed one tensor at a
    time. ``config.json`` is written last: a directory that has one is complete.
    """
    model_dir = Path(model_dir)
    if entries is None:
        tensors = list(tensors)
        entries = [Entry.of(key, tensor) for key, tensor in tensors]
        if single_file:
            by_key = dict(tensors)
            entries = library_order(entries)
            tensors = [(e.key, by_key[e.key]) for e in entries]
    elif single_file and list(entries) != library_order(entries):
        raise ValueError("save_drafter(single_file=True): entries must be in library_order.")
    if not entries:
        raise ValueError("save_drafter: no tensors to write.")
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_shard_bytes and not single_file:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes

    model_dir.mkdir(parents=True, exist_ok=True)
    for stale in [
        model_dir / INDEX_NAME,
        model_dir / SINGLE_FILE_NAME,
        model_dir / CONFIG_NAME,
        *(p for p in model_dir.iterdir() if _SHARD_RE.match(p.name)),
    ]:
        stale.unlink(missing_ok=True)
    if single_file:
        names = [SINGLE_FILE_NAME]
    else:
        names = [
            f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
        ]
    stream = iter(tensors)
    for name, planned in zip(names, shards):
        with SafetensorsWriter(model_dir / name, planned, metadata=metadata) as writer:
            for _ in planned:
                writer.write(*next(stream))
    if not single_file:
        weight_map = {entry.key: name for name, planned in zip(names, shards) for entry in planned}
        index = {
            "metadata": {"total_size": sum(e.nbytes for e in entries)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (model_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    write_config_json(model_dir, config_json)
