# SPDX-License-Identifier: Apache-2.0
"""Draft KV-cache scales end to end (issue 43): ``quantize --kv-cache-scheme fp8`` calibrates a static
k_scale per draft layer from the trained pair's target and writes compressed-tensors' layout; built
through vLLM's dspark loader, each draft layer's ``_k_scale`` is the checkpoint's (an fp8 cache) or
1.0 (a model-dtype cache, as vLLM enforces), and the fp8 pages hold latent / k_scale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.vllm_drafter import bind_caches, load_drafter, make_batch
from vllm_dspark.checkpoint import kv_scales
from vllm_dspark.checkpoint.check import check_checkpoint
from vllm_dspark.checkpoint.st_io import read_tensors

PAIR = Path(__file__).resolve().parents[1] / "data" / "pair"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The pair's drafter in FP8 with calibrated KV-cache scales, and the quantizer's report."""
    from vllm_dspark.checkpoint_tools.quantize import quantize_checkpoint

    out = tmp_path_factory.mktemp("kv") / "fp8-kv"
    report = quantize_checkpoint(
        PAIR / "drafter", out, "fp8", kv_cache_scheme="fp8", progress=False
    )
    return out, report


def test_the_quantizer_writes_compressed_tensors_kv_scales(calibrated) -> None:
    out, report = calibrated
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["kv_cache_scheme"] == kv_scales.KV_CACHE_SCHEME
    stored = read_tensors(out / kv_scales.SHARD_NAME)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    layers = config["num_hidden_layers"]
    assert set(stored) == {k for i in range(layers) for k in kv_scales.scale_keys(i)}
    assert all(index[k] == kv_scales.SHARD_NAME for k in stored)
    amax = torch.tensor(report["kv_cache"]["amax"])
    expected = amax / 448.0
    got = kv_scales.k_scales(stored, layers)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for i in range(layers):  # MLA reads k_scale only; v_scale is written equal to it
        k, v = kv_scales.scale_keys(i)
        assert stored[k].dtype == torch.float32 and torch.equal(stored[k], stored[v])
    assert (amax > 1.0).all(), "the pair's latents span more than E4M3's unit range"


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "auto"])
def test_the_model_class_loads_the_draft_layers_k_scale(calibrated, kv_cache_dtype: str) -> None:
    out, report = calibrated
    option = {} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}
    served = load_drafter(None, out, dtype="bfloat16", **option)
    attentions = [layer.self_attn for layer in served.model.model.layers]
    want = report["kv_cache"]["k_scales"] if kv_cache_dtype == "fp8" else [1.0] * len(attentions)
    assert [float(a._k_scale) for a in attentions] == pytest.approx(want, rel=0, abs=0)
    if kv_cache_dtype == "auto":
        return
    # The fp8 pages the context path writes hold the latents divided by each layer's own scale.
    model, dtype = served.model, served.vllm_config.model_config.dtype
    batch = make_batch(model.config)
    caches = bind_caches(model, batch, torch.uint8)  # vLLM allocates fp8 pages as bytes
    context = model.combine_hidden_states(batch.aux.to(dtype))
    model.precompute_and_store_context_kv(context, batch.context_positions, batch.context_slots)
    slots = batch.context_slots
    for attn, cache, scale in zip(attentions, caches, want):
        raw = cache.view(-1, cache.shape[-1])[slots].view(torch.float8_e4m3fn).float()
        assert raw.abs().max() > 1, "latent / k_scale, not the latent (its amax is k_scale * 448)"
        torch.testing.assert_close(attn.load_latent(slots, torch.float32), raw * scale)


def test_a_bad_kv_scale_is_refused_by_name(calibrated, tmp_path: Path) -> None:
    import shutil

    from vllm_dspark.checkpoint.st_io import Entry, SafetensorsWriter

    out, _ = calibrated
    copy = tmp_path / "nan-kv"
    shutil.copytree(out, copy)
    stored = read_tensors(copy / kv_scales.SHARD_NAME)
    key = kv_scales.scale_keys(1)[0]
    stored[key] = torch.tensor(float("nan"))
    entries = [Entry.of(k, t) for k, t in stored.items()]
    (copy / kv_scales.SHARD_NAME).unlink()
    with SafetensorsWriter(copy / kv_scales.SHARD_NAME, entries) as shard:
        for e in entries:
            shard.write(e.key, stored[e.key])
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_drafter(None, copy, dtype="bfloat16", kv_cache_dtype="fp8")
    report = check_checkpoint(copy)
    assert not report.ok and [p.where for p in report.problems] == [key]


def test_check_lists_the_kv_scales(calibrated) -> None:
    out, report = calibrated
    checked = check_checkpoint(out)
    assert checked.ok
    scales = ", ".join(f"{s:.4g}" for s in report["kv_cache"]["k_scales"])
    assert f"fp8 KV-cache k_scale per draft layer: {scales}" in checked.summary
