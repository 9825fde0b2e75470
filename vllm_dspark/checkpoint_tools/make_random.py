# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark make-random``: a random drafter in exactly the published on-disk layout, with realistic
weight statistics (docs/tools/make-random.md).

``--preset`` writes what Inferact/Kimi-K3-DSpark publishes: config.json (``k3``: the published file byte
for byte), one ``model.safetensors`` (no index) as the safetensors library's ``save_file`` writes it
(tensors sorted by name, metadata ``{"torchspec_version": "0.1.0"}``; ``k3``: 7,124,633,450 bytes,
a 7,520-byte header), plus the target's heads in ``target/``. ``--like`` keeps the sharded layout."""

from __future__ import annotations

import math
import shutil
import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from vllm_dspark.checkpoint.layout import (
    TARGET_DIR,
    TARGET_HEADS,
    checkpoint_modules,
    tensor_shapes,
)
from vllm_dspark.checkpoint.presets import (
    PUBLISHED_METADATA,
    WITHOUT_EMBED_TOKENS,
    preset_config_json,
)
from vllm_dspark.checkpoint.save import save_drafter, write_target_config
from vllm_dspark.checkpoint.st_io import (
    Entry,
    FilePlan,
    SafetensorsWriter,
    library_order,
    plan_file,
    save_tensors,
)
from vllm_dspark.checkpoint.store import (
    TARGET_EMBED_KEY,
    TARGET_LM_HEAD_KEY,
    load_target_heads,
    target_text_config,
)
from vllm_dspark.config import K3DSparkConfig
from vllm_dspark.fields import GEOMETRY_FIELDS, MLA_FIELDS
from vllm_dspark.findings import Finding, FindingError
from vllm_dspark.safety import check_output, refuse_nonempty, staged

# Rows are generated in fixed-size slabs, so the values do not depend on memory settings.
_SLAB_ELEMENTS = 1 << 24

# Gain over the default init: a small embedding as in trained LMs, a sharp lm_head for peaked drafts.
_GAIN = {"embed_tokens": 0.02, "lm_head": 4.0}
_CONFIDENCE_BIAS = 1.5  # sigmoid(1.5) ~ 0.82: a plausible prior acceptance rate


def _seed(seed: int, name: str) -> int:
    return (seed * 0x100000001B3 + zlib.crc32(name.encode())) % (1 << 63)


def exp_rounded_once(x: torch.Tensor) -> torch.Tensor:
    """``exp`` of a float32 tensor computed in float64 and rounded once to float32.

    torch's float32 ``exp`` runs MKL's VML, whose kernels MKL picks by the CPU: between two of its code
    paths 1 to 5 values in 100 round to the other neighbour, which moves a BF16 weight now and then.
    float64's are within about an ulp of the true value on every path, so one rounding gives the same
    float32 everywhere unless the true value lies within ~1e-16 (relative) of a float32 midpoint."""
    return x.double().exp().float()


def _matrix(
    shape: tuple[int, int], generator: torch.Generator, *, std: float, channel_structure: bool
) -> torch.Tensor:
    out_features, in_features = shape
    row_scale = torch.ones(out_features)
    col_scale = torch.ones(in_features)
    if channel_structure:
        row_scale = exp_rounded_once(0.3 * torch.randn(out_features, generator=generator))
        col_scale = exp_rounded_once(0.4 * torch.randn(in_features, generator=generator))
        outliers = torch.randperm(in_features, generator=generator)[: max(1, in_features // 512)]
        col_scale[outliers] *= 8.0
    weight = torch.empty(shape, dtype=torch.bfloat16)
    rows = max(1, _SLAB_ELEMENTS // in_features)
    for start in range(0, out_features, rows):
        stop = min(start + rows, out_features)
        slab = torch.randn(stop - start, in_features, generator=generator)
        weight[start:stop] = slab * (std * col_scale) * row_scale[start:stop, None]
    return weight


def tensor_generator(seed: int, name: str) -> torch.Generator:
    """The generator of tensor ``name``'s values for ``seed`` (independent of every other tensor)."""
    return torch.Generator().manual_seed(_seed(seed, name))


def random_tensor(
    name: str, shape: tuple[int, ...], role: str, *, seed: int, gain: float | None = None
) -> torch.Tensor:
    """The BF16 value of tensor ``name`` (role ``linear``/``norm``/``embedding``) for ``seed``;
    ``gain`` overrides the drafter's per-kind gain (``embed_tokens`` 0.02, ``lm_head`` 4, else 1)."""
    generator = tensor_generator(seed, name)
    kind = name.rsplit(".", 1)[0]
    if gain is None:
        gain = _GAIN.get(kind, 1.0)
    if name.endswith(".bias"):
        return torch.full(shape, _CONFIDENCE_BIAS, dtype=torch.bfloat16)
    if role == "norm":
        return (1.0 + 0.05 * torch.randn(shape, generator=generator)).to(torch.bfloat16)
    if role == "embedding":
        return _matrix(shape, generator, std=gain, channel_structure=False)
    return _matrix(shape, generator, std=gain / math.sqrt(shape[1]), channel_structure=True)


def random_drafter_tensors(
    config: K3DSparkConfig, *, seed: int, keys: Iterable[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every drafter tensor in checkpoint order (or those of ``keys``, in that order), generated
    lazily. A tensor's value depends only on its name and ``seed``, never on the order."""
    planned: dict[str, tuple[tuple[int, ...], str]] = {}
    for spec in checkpoint_modules(config):
        planned[f"{spec.name}.weight"] = (spec.shape, spec.role)
        if spec.bias:
            planned[f"{spec.name}.bias"] = ((spec.shape[0],), spec.role)
    for key in planned if keys is None else keys:
        yield key, random_tensor(key, *planned[key], seed=seed)


def random_lm_head(config: K3DSparkConfig, *, seed: int) -> torch.Tensor:
    """The random target's lm_head ``[vocab_size, hidden_size]``."""
    return random_tensor(
        "lm_head.weight", (config.vocab_size, config.hidden_size), "linear", seed=seed
    )


def make_random(
    out_dir: str | Path,
    preset: str,
    *,
    seed: int = 0,
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """Write a random drafter for ``preset`` (and its target heads under ``out_dir/target``).

    A non-empty ``out_dir`` is replaced only with ``overwrite``; the checkpoint is built beside it
    and renamed into place when complete.
    """
    out_dir = Path(out_dir)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise FindingError(Finding(f"seed must be an integer, got {seed!r}", "pass a whole number"))
    refuse_nonempty(out_dir, overwrite=overwrite, flag="--out")
    with staged(out_dir, directory=True) as staging:
        _write_random(staging, preset, seed=seed, progress=progress)
    return out_dir


def drafter_entries(preset: str) -> list[Entry]:
    """The tensors of ``preset``'s ``model.safetensors``, in the order they lie in the file (the
    safetensors library's): BF16, ``embed_tokens.weight`` left out where the published counterpart
    ships none (``presets.WITHOUT_EMBED_TOKENS``)."""
    config = K3DSparkConfig(**preset_config_json(preset))
    entries = _bf16_entries(config)
    if preset in WITHOUT_EMBED_TOKENS:
        entries = [e for e in entries if e.key != "embed_tokens.weight"]
    return library_order(entries)


def drafter_file_plan(preset: str) -> FilePlan:
    """The header and size of ``preset``'s ``model.safetensors``, as :func:`make_random` writes it,
    computed without any data (``k3``: a 7,520-byte header, 7,124,633,450 bytes)."""
    return plan_file(drafter_entries(preset), PUBLISHED_METADATA)


def _write_random(out_dir: Path, preset: str, *, seed: int, progress: bool) -> None:
    config_json = preset_config_json(preset)
    config = K3DSparkConfig(**config_json)
    entries = drafter_entries(preset)
    embed_shape = (config.vocab_size, config.hidden_size)
    total = sum(e.nbytes for e in entries) + 2 * math.prod(embed_shape) * 2  # + the target's heads
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=f"make-random {preset}",
        disable=not progress,
    )

    target_dir = out_dir / TARGET_DIR
    heads = [
        Entry.planned(key, torch.bfloat16, embed_shape)
        for key in (TARGET_EMBED_KEY, TARGET_LM_HEAD_KEY)
    ]
    with SafetensorsWriter(target_dir / "model.safetensors", heads) as target:

        def write_embed(tensor: torch.Tensor) -> None:
            target.write(TARGET_EMBED_KEY, tensor)
            bar.update(tensor.numel() * tensor.element_size())

        if preset in WITHOUT_EMBED_TOKENS:  # the drafter uses the target's embedding
            write_embed(
                next(random_drafter_tensors(config, seed=seed, keys=["embed_tokens.weight"]))[1]
            )

        def drafter_tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in random_drafter_tensors(
                config, seed=seed, keys=[e.key for e in entries]
            ):
                if name == "embed_tokens.weight":
                    # The drafter ships the target's embedding; both files hold the same tensor.
                    write_embed(tensor)
                bar.update(tensor.numel() * tensor.element_size())
                yield name, tensor

        save_drafter(
            out_dir,
            config_json,
            drafter_tensors(),
            entries=entries,
            single_file=True,
            metadata=PUBLISHED_METADATA,
        )
        lm_head = random_lm_head(config, seed=seed)
        target.write(TARGET_LM_HEAD_KEY, lm_head)
        bar.update(lm_head.numel() * lm_head.element_size())
    bar.close()
    # OUT/target stands in for the target wherever only its config is read (vLLM, the doctor's --target).
    write_target_config(config, target_dir)


def _bf16_entries(config: K3DSparkConfig) -> list[Entry]:
    """The entries of every drafter tensor, in the order :func:`random_drafter_tensors` yields them."""
    return [
        Entry.planned(key, torch.bfloat16, shape) for key, shape in tensor_shapes(config).items()
    ]


def aux_layer_ids(num_target_layers: int, count: int = 5) -> list[int]:
    """``count`` target layers spread from layer 1 to the third-last (``[1, 2, 4, 5, 6]`` for 8 layers)."""
    count = min(count, num_target_layers - 2)
    if count < 1:
        raise FindingError(
            Finding(
                f"a {num_target_layers}-layer target has no layers to tap for aux hidden states",
                "use a target with at least 3 layers",
            )
        )
    if count == 1:
        return [1]
    return sorted({round(1 + i * (num_target_layers - 3) / (count - 1)) for i in range(count)})


# The target config fields a drafter must match: the draft layers' latent lives in its MLA cache.
_TARGET_FIELDS = tuple(f for f in GEOMETRY_FIELDS if f != "intermediate_size")  # that one defaults


def like_config_json(target_config: dict, *, num_layers: int = 5) -> dict:
    """A drafter config.json (the ``small`` preset's structure) with ``target_config``'s geometry
    (for Kimi-K3, that of its nested ``text_config``)."""
    t = target_text_config(target_config)
    missing = [f for f in _TARGET_FIELDS if t.get(f) is None]
    if missing:
        where = "the target's text_config" if t is not target_config else "the target config"
        raise ValueError(
            f"{where} lacks {', '.join(missing)}: the drafter's KV pages live in the "
            "target's MLA cache, so the target must be an MLA model (DeepSeek-V3 / Kimi-K3 style)."
        )
    config = preset_config_json("small")
    layer_ids = aux_layer_ids(t["num_hidden_layers"])
    config.update(
        hidden_size=t["hidden_size"],
        intermediate_size=t.get("intermediate_size", 2 * t["hidden_size"]),
        num_hidden_layers=num_layers,
        **{f: t[f] for f in MLA_FIELDS},
        num_key_value_heads=t["num_attention_heads"],
        vocab_size=t["vocab_size"],
        draft_vocab_size=t["vocab_size"],
        target_hidden_size=t["hidden_size"],
        target_num_hidden_layers=t["num_hidden_layers"],
        target_layer_ids=layer_ids,
        num_target_layers=len(layer_ids),
        target_kv_latent_dim=t["kv_lora_rank"] + t["qk_rope_head_dim"],
        mask_token_id=t["vocab_size"] - 3,
        rms_norm_eps=t.get("rms_norm_eps", config["rms_norm_eps"]),
    )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the target's tokenizer's
        if t.get(key) is None:
            config.pop(key, None)
        else:
            config[key] = t[key]
    return config


def make_random_like(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    num_layers: int = 5,
    seed: int = 0,
    progress: bool = True,
    overwrite: bool = False,
    variant: Mapping[str, Any] | None = None,
) -> Path:
    """Write a random drafter with ``target_dir``'s geometry; its ``target/`` heads are the target's own.

    ``variant``: config.json fields set over the ``small`` structure's (a published variant's, e.g.
    ``{"fc_norm": True, "aux_hidden_stream": "attn_res"}``); the tensors follow the config.
    """
    import json

    out_dir, target_dir = Path(out_dir), Path(target_dir)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise FindingError(Finding(f"seed must be an integer, got {seed!r}", "pass a whole number"))
    target_config = json.loads((target_dir / "config.json").read_text())
    config_json = {**like_config_json(target_config, num_layers=num_layers), **(variant or {})}
    config = K3DSparkConfig(**config_json)
    embed_tokens, lm_head = load_target_heads(target_dir)
    if tuple(embed_tokens.shape) != (config.vocab_size, config.hidden_size):
        raise ValueError(
            f"target {target_dir}: embedding {tuple(embed_tokens.shape)} does not match its config "
            f"(vocab_size {config.vocab_size}, hidden_size {config.hidden_size})."
        )
    check_output(out_dir, [target_dir], flag="--out")
    refuse_nonempty(out_dir, overwrite=overwrite, flag="--out")
    tensors = (
        (name, embed_tokens.to(torch.bfloat16) if name == "embed_tokens.weight" else tensor)
        for name, tensor in tqdm(
            random_drafter_tensors(config, seed=seed),
            desc="make-random --like",
            disable=not progress,
        )
    )
    with staged(out_dir, directory=True) as staging:
        save_drafter_with_heads(
            staging,
            config_json,
            tensors,
            embed_tokens=embed_tokens,
            lm_head=lm_head,
            target_config=target_dir / "config.json",
            entries=_bf16_entries(config),
        )
    return out_dir


def save_drafter_with_heads(
    out_dir: Path,
    config_json: dict,
    tensors: Iterator[tuple[str, torch.Tensor]],
    *,
    embed_tokens: torch.Tensor,
    lm_head: torch.Tensor,
    target_config: Path,
    entries: list[Entry] | None = None,
) -> None:
    """Write a drafter directory plus ``target/``: the target's shared heads and its config.json."""
    save_drafter(out_dir, config_json, tensors, entries=entries)
    heads = {TARGET_EMBED_KEY: embed_tokens, TARGET_LM_HEAD_KEY: lm_head}
    save_tensors(out_dir / TARGET_HEADS, heads)
    shutil.copyfile(target_config, out_dir / TARGET_DIR / "config.json")
