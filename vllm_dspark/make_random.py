# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark make-random``: a random K3 DSpark drafter in exactly the real on-disk layout.

Writes ``OUT/config.json`` (the preset's config), ``OUT/model-0000i-of-0000n.safetensors`` and
``OUT/model.safetensors.index.json`` (HF key names, BF16, ``embed_tokens.weight`` included, as in the
published checkpoint), and the target's shared heads in ``OUT/target/model.safetensors``
(``model.embed_tokens.weight``, equal to the drafter's, and ``lm_head.weight``) with
``OUT/target/config.json``: a DeepSeek-V3 MLA config of the target geometry the drafter expects.

Weights are random with realistic structure, so that quantization error means something: linears
are ``N(0, 1/fan_in)`` with lognormal per-output-channel and per-input-channel scales and a few
outlier input channels; norms are ``1 +- 0.05``. Every tensor has its own generator seeded from
``(--seed, tensor name)``: the output is deterministic, and tensors are generated and written one at
a time, so peak memory stays near the largest tensor (the 163840 x 7168 embedding for ``k3``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_dspark.checkpoint import (
    TARGET_EMBED_KEY,
    TARGET_LM_HEAD_KEY,
    SafetensorsWriter,
    save_drafter,
)
from vllm_dspark.config import K3DSparkConfig
from vllm_dspark.layout import checkpoint_modules
from vllm_dspark.presets import PRESETS, preset_config_json
from vllm_dspark.safety import refuse_nonempty, staged
from vllm_dspark.vllm_load import write_target_config

__all__ = ["main", "make_random", "random_drafter_tensors", "random_lm_head", "random_tensor"]

# Rows are generated in slabs of about this many elements; the slab size is fixed so the values do
# not depend on memory settings.
_SLAB_ELEMENTS = 1 << 24

# Output scale per module kind, relative to the default (1/sqrt(fan_in) for linears, N(0, 1) for
# embeddings). The token embedding is small, as in trained LMs; the lm_head is sharper than a
# unit-variance projection so that draft distributions are peaked, as real ones are.
_GAIN = {"embed_tokens": 0.02, "lm_head": 4.0}
_CONFIDENCE_BIAS = 1.5  # sigmoid(1.5) ~ 0.82: a plausible prior acceptance rate


def _seed(seed: int, name: str) -> int:
    return (seed * 0x100000001B3 + zlib.crc32(name.encode())) % (1 << 63)


def _matrix(shape: tuple[int, int], generator: torch.Generator, *, std: float, channel_structure: bool) -> torch.Tensor:
    out_features, in_features = shape
    row_scale = torch.ones(out_features)
    col_scale = torch.ones(in_features)
    if channel_structure:
        row_scale = torch.exp(0.3 * torch.randn(out_features, generator=generator))
        col_scale = torch.exp(0.4 * torch.randn(in_features, generator=generator))
        outliers = torch.randperm(in_features, generator=generator)[: max(1, in_features // 512)]
        col_scale[outliers] *= 8.0
    weight = torch.empty(shape, dtype=torch.bfloat16)
    rows = max(1, _SLAB_ELEMENTS // in_features)
    for start in range(0, out_features, rows):
        stop = min(start + rows, out_features)
        slab = torch.randn(stop - start, in_features, generator=generator)
        weight[start:stop] = slab * (std * col_scale) * row_scale[start:stop, None]
    return weight


def random_tensor(name: str, shape: tuple[int, ...], role: str, *, seed: int) -> torch.Tensor:
    """The BF16 value of tensor ``name`` (role ``linear``/``norm``/``embedding``) for ``seed``."""
    generator = torch.Generator().manual_seed(_seed(seed, name))
    kind = name.rsplit(".", 1)[0]
    gain = _GAIN.get(kind, 1.0)
    if name.endswith(".bias"):
        return torch.full(shape, _CONFIDENCE_BIAS, dtype=torch.bfloat16)
    if role == "norm":
        return (1.0 + 0.05 * torch.randn(shape, generator=generator)).to(torch.bfloat16)
    if role == "embedding":
        return _matrix(shape, generator, std=gain, channel_structure=False)
    return _matrix(shape, generator, std=gain / math.sqrt(shape[1]), channel_structure=True)


def random_drafter_tensors(config: K3DSparkConfig, *, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Every drafter tensor, in checkpoint order, generated lazily."""
    for spec in checkpoint_modules(config):
        yield f"{spec.name}.weight", random_tensor(f"{spec.name}.weight", spec.shape, spec.role, seed=seed)
        if spec.bias:
            yield f"{spec.name}.bias", random_tensor(f"{spec.name}.bias", (spec.shape[0],), spec.role, seed=seed)


def random_lm_head(config: K3DSparkConfig, *, seed: int) -> torch.Tensor:
    """The random target's lm_head ``[vocab_size, hidden_size]``."""
    return random_tensor("lm_head.weight", (config.vocab_size, config.hidden_size), "linear", seed=seed)


def make_random(
    out_dir: str | Path, preset: str, *, seed: int = 0, progress: bool = True, overwrite: bool = False
) -> Path:
    """Write a random drafter for ``preset`` (and its target heads under ``out_dir/target``).

    A non-empty ``out_dir`` is replaced only with ``overwrite``; the checkpoint is built beside it
    and renamed into place when complete.
    """
    out_dir = Path(out_dir)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an integer, got {seed!r}. Fix: pass a whole number.")
    refuse_nonempty(out_dir, overwrite=overwrite, flag="--out")
    with staged(out_dir, directory=True) as staging:
        _write_random(staging, preset, seed=seed, progress=progress)
    return out_dir


def _write_random(out_dir: Path, preset: str, *, seed: int, progress: bool) -> None:
    config_json = preset_config_json(preset)
    config = K3DSparkConfig(**config_json)
    specs = checkpoint_modules(config)
    total = sum(math.prod(s.shape) + (s.shape[0] if s.bias else 0) for s in specs)
    total += math.prod((config.vocab_size, config.hidden_size)) * 2  # the target's embedding and lm_head
    bar = tqdm(total=total * 2, unit="B", unit_scale=True, desc=f"make-random {preset}", disable=not progress)

    target_dir = out_dir / "target"
    with SafetensorsWriter(target_dir / "model.safetensors") as target:

        def drafter_tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in random_drafter_tensors(config, seed=seed):
                if name == "embed_tokens.weight":
                    # The drafter ships the target's embedding; both files hold the same tensor.
                    target.add(TARGET_EMBED_KEY, tensor)
                    bar.update(tensor.numel() * tensor.element_size())
                bar.update(tensor.numel() * tensor.element_size())
                yield name, tensor

        save_drafter(out_dir, config_json, drafter_tensors())
        lm_head = random_lm_head(config, seed=seed)
        target.add(TARGET_LM_HEAD_KEY, lm_head)
        bar.update(lm_head.numel() * lm_head.element_size())
    bar.close()
    # A target config of the geometry the drafter expects, so that OUT/target stands in for the
    # target wherever only its config is read (vLLM's config building, the doctor's --target).
    write_target_config(config, target_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-dspark make-random",
        description="Write a random K3 DSpark drafter checkpoint in the real on-disk layout: config.json, "
                    "BF16 safetensors shards with HF key names and their index, plus the target's shared "
                    "embedding and lm_head in OUT/target/. Deterministic for a given --seed.",
    )
    parser.add_argument("--preset", required=True, choices=list(PRESETS),
                        help="tiny / small: CPU-test sizes; "
                             "k3: the published shapes (6.6 GiB drafter + 2.3 GiB lm_head)")
    parser.add_argument("--out", required=True, type=Path,
                        help="output directory (created; built beside it and renamed into place)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    parser.add_argument("--seed", type=int, default=0, help="random seed, an integer (default 0)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    make_random(args.out, args.preset, seed=args.seed, progress=not args.quiet, overwrite=args.overwrite)
    size = sum(p.stat().st_size for p in args.out.rglob("*.safetensors"))
    print(f"wrote {args.out} ({args.preset}, seed {args.seed}): {size / 2**30:.2f} GiB "
          f"in {time.perf_counter() - start:.1f} s; target heads in {args.out / 'target'}")
    return 0


if __name__ == "__main__":
    from vllm_dspark.cli import main as cli_main

    sys.exit(cli_main(["make-random", *sys.argv[1:]]))
