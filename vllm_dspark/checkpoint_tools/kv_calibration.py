# SPDX-License-Identifier: Apache-2.0
"""Static FP8 KV-cache scales for the draft layers, calibrated from the target's aux hidden states.

Per draft layer, ``k_scale = amax / 448`` over the context latents ``[kv_c_normed ; k_pe]`` the
drafter computes from the aux states (:mod:`vllm_dspark.ops.kv_fp8`), in BF16 as served. The aux
states come from a target model run over text windows (default: the package's corpus, which the
accept prompts do not come from), or from a file the user supplies (:func:`read_aux_file`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_dspark.config import K3DSparkConfig
from vllm_dspark.finite import require_finite

AUX_KEY = "aux_hidden_states"  # [N, T, W] or [T, W], W = num_target_layers * target_hidden_size
POSITIONS_KEY = "positions"  # optional, int [N, T] or [T]; default 0 .. T - 1
NUM_WINDOWS = 16
WINDOW = 128


@dataclass(frozen=True)
class Calibration:
    """Per-layer ``k_scales [L]``, the ``amax [L]`` they came from and a line saying from what."""

    k_scales: torch.Tensor
    amax: torch.Tensor
    source: str


def read_aux_file(path: Path, config: K3DSparkConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(aux [1, T, W], positions [1, T])`` per sequence of a user's safetensors file, validated.

    The file holds ``aux_hidden_states`` (float ``[N, T, W]`` or ``[T, W]``: the target's residual
    stream entering layers ``target_layer_ids + 1``, concatenated) and optionally ``positions``.
    """
    from vllm_dspark.checkpoint.st_io import read_tensors

    width = config.num_target_layers * config.target_hidden_size
    fix = (
        f"store {AUX_KEY} as float [N, T, {width}] (the target's aux states at layers "
        f"{list(config.target_layer_ids)}, concatenated), optionally {POSITIONS_KEY} int [N, T]"
    )
    if path.suffix != ".safetensors" or not path.is_file():
        raise ValueError(
            f"--kv-calibration {path} is neither a target model directory nor a .safetensors file. "
            f"Fix: pass the target model, or a .safetensors file holding {AUX_KEY}"
        )
    tensors = read_tensors(path)
    aux = tensors.get(AUX_KEY)
    if aux is None or not aux.is_floating_point() or aux.dim() not in (2, 3):
        got = "no such tensor" if aux is None else f"{aux.dtype} {tuple(aux.shape)}"
        raise ValueError(f"--kv-calibration {path}: {AUX_KEY} is {got}. Fix: {fix}")
    aux = aux if aux.dim() == 3 else aux[None]
    if aux.shape[-1] != width or aux.shape[1] < 1:
        raise ValueError(
            f"--kv-calibration {path}: {AUX_KEY} has shape {tuple(aux.shape)}, but this drafter "
            f"takes {width} wide aux states. Fix: {fix}"
        )
    require_finite(
        aux, f"{AUX_KEY} in {path}", "calibrate from the target's real, finite aux states"
    )
    positions = tensors.get(POSITIONS_KEY)
    if positions is None:
        positions = torch.arange(aux.shape[1]).expand(aux.shape[:2])
    given = f"{positions.dtype} {tuple(positions.shape)}"
    positions = positions if positions.dim() == 2 else positions[None]
    if positions.is_floating_point() or tuple(positions.shape) != tuple(aux.shape[:2]):
        raise ValueError(
            f"--kv-calibration {path}: {POSITIONS_KEY} is {given}, not integer "
            f"{tuple(aux.shape[:2])}. Fix: {fix}"
        )
    top = config.max_position_embeddings
    if bool(((positions < 0) | (positions >= top)).any()):
        raise ValueError(
            f"--kv-calibration {path}: {POSITIONS_KEY} must lie in [0, {top}). Fix: {fix}"
        )
    return [(aux[i : i + 1], positions[i : i + 1].long()) for i in range(aux.shape[0])]


def target_aux(
    target: Path, config: K3DSparkConfig, *, num_windows: int, window: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(aux [1, T, W], positions [1, T])`` of ``target`` over windows of the package's corpus."""
    from vllm_dspark.drift.acceptance import load_prompts
    from vllm_dspark.reference.target import load_target, target_states

    layer_ids = list(config.target_layer_ids)
    model = load_target(target, layer_ids, config.target_hidden_size, config.vocab_size)
    prompts, _ = load_prompts(
        None, target, config.vocab_size, count=num_windows, length=window, seed=seed
    )
    out = []
    for ids in prompts:
        _, aux = target_states(model, torch.tensor([ids]), layer_ids)
        out.append((aux, torch.arange(len(ids))[None]))
    return out


def calibrate(
    model_dir: Path,
    source: Path,
    *,
    num_windows: int = NUM_WINDOWS,
    window: int = WINDOW,
    seed: int = 0,
    progress: bool = True,
) -> Calibration:
    """Per-layer k_scales of the BF16 drafter in ``model_dir`` from ``source`` (a target or aux file)."""
    from vllm_dspark.ops.kv_fp8 import calibrated_scale, latent_amax
    from vllm_dspark.reference.drafter import ReferenceDrafter

    drafter = ReferenceDrafter.from_pretrained(model_dir, compute_dtype=torch.bfloat16)
    config = drafter.config
    if source.is_dir():
        sequences = target_aux(source, config, num_windows=num_windows, window=window, seed=seed)
        what = f"target {source} over {num_windows} windows of {window} tokens of the corpus"
    else:
        sequences = read_aux_file(source, config)
        what = f"{len(sequences)} sequence(s) of aux states in {source}"
    amax = torch.zeros(config.num_hidden_layers)
    with torch.no_grad():
        for aux, positions in tqdm(
            sequences, desc="calibrate KV scales", unit="seq", disable=None if progress else True
        ):
            latents = drafter.context_kv(drafter.combine_hidden_states(aux), positions)
            amax = torch.maximum(amax, latent_amax(latents))
    tokens = sum(aux.shape[1] for aux, _ in sequences)
    return Calibration(
        calibrated_scale(amax),
        amax,
        f"amax / 448 of the context latents of {tokens} tokens: {what}",
    )
