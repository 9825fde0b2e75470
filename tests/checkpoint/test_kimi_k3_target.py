# SPDX-License-Identifier: Apache-2.0
"""``make-random --target kimi-k3`` against vLLM's own Kimi-K3: the config through vLLM's config path, the
weights through vLLM's model loader into ``KimiK3ForConditionalGeneration`` built on CPU; and
``make-random --like`` on that target."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from vllm_dspark.checkpoint.st_io import read_tensors
from vllm_dspark.checkpoint_tools.kimi_k3_target import (
    EMBED_KEY,
    LM_HEAD_KEY,
    kimi_k3_config_json,
    kimi_k3_tensor_specs,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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


@pytest.fixture(scope="module")
def vllm_k3(k3_target: Path):
    """``KimiK3ForConditionalGeneration`` (vision tower included) built by vLLM on CPU and loaded by its
    default model loader (which refuses a checkpoint that leaves a parameter unloaded)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
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
            # DefaultModelLoader.load_model's steps, with a look at the parameters in between.
            loader = get_model_loader(vllm_config.load_config)
            with torch.device("cpu"):
                model = loader.create_model(vllm_config=vllm_config, model_config=model_config)
            params = {name: tuple(p.shape) for name, p in model.named_parameters()}
            # Every name written is one load_weights consumes (an unknown one raises).
            loaded = model.load_weights(iter(_stored(k3_target).items()))
            loader.load_weights(model, model_config)  # raises if a parameter is left unloaded
            # As loaded, before the CPU backends repack them (the MoE experts, oneDNN linears).
            as_loaded = {name: p.detach().clone() for name, p in model.named_parameters()}
            process_weights_after_loading(model, model_config, torch.device("cpu"))
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
    text = "language_model.model.layers"
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
