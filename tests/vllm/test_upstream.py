# SPDX-License-Identifier: Apache-2.0
"""The plugin's drafter against vLLM's in-tree ``K3DSparkForCausalLM`` on the same weights.

Both are built by vLLM's own ``load_dspark_model`` from one BF16 checkpoint, in FP32. Where the
in-tree class needs a CUDA kernel it gets a CPU stand-in: the plugin's torch MLA layer for vLLM's
Kimi-K3 MLA layer, and for the three kernels of its context-KV path, vLLM's own native ops
(``ir.ops.rms_norm``, ``RotaryEmbedding.forward_static``) and a plain slot write. Everything else
(the projections, heads, weight mapping and the context-KV orchestration) is upstream's code as is.

The in-tree class's FP8 failures are kept as tests too: they are why the plugin overrides it.
"""

from __future__ import annotations

import contextlib
import types
from pathlib import Path

import pytest
import torch

from tests.support.encodings import SERVED, encoded
from tests.support.vllm_drafter import Served, load_drafter, make_batch
from vllm_dspark.checkpoint.layout import FP8_RECIPE

pytestmark = [pytest.mark.vllm_api, pytest.mark.usefixtures("one_torch_thread")]

IN_TREE = "vllm.models.kimi_k3.nvidia.dspark_mla:K3DSparkForCausalLM"
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _torch_mla(*, config, cache_config, quant_config, prefix, **_):
    """The plugin's torch MLA in place of vLLM's CUDA-only one, with what the in-tree context path reads."""
    from vllm_dspark.runtime.attention import TorchLatentAttention

    attn = TorchLatentAttention(
        config=config, cache_config=cache_config, quant_config=quant_config, prefix=prefix
    )
    attn.kv_cache_dtype = cache_config.cache_dtype
    attn._k_scale = torch.ones(())
    return attn


class _CpuContextOps:
    """The kernels of the in-tree context-KV path, on CPU, with the CUDA ops' in-place signatures."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        self.caches = {cache.data_ptr(): cache for cache in caches}

    @staticmethod
    def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        from vllm import ir

        for layer in range(x.shape[0]):  # layer-major input, one weight row per layer
            out[layer] = ir.ops.rms_norm(x[layer], weight[layer], eps)

    @staticmethod
    def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox_style) -> None:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

        rotated, _ = RotaryEmbedding.forward_static(
            positions, query, key, head_size, head_size, cos_sin_cache, is_neox_style
        )
        query.copy_(rotated.view_as(query))

    def concat_and_cache_mla_grouped(
        self,
        kv_c,
        k_pe,
        cache_ptrs,
        slot_mapping,
        block_size,
        stride0,
        stride1,
        scales,
        cache_dtype,
    ) -> None:
        assert scales is None and cache_dtype == "auto"
        for layer, ptr in enumerate(cache_ptrs.tolist()):
            cache = self.caches[ptr].view(-1, kv_c.shape[-1] + k_pe.shape[-1])
            valid = slot_mapping[layer] >= 0
            cache[slot_mapping[layer][valid]] = torch.cat([kv_c[layer], k_pe[layer]], dim=-1)[
                valid
            ].to(cache.dtype)


@contextlib.contextmanager
def _in_tree_class(monkeypatch: pytest.MonkeyPatch):
    """vLLM's registry maps K3DSparkModel to the in-tree class (with the torch MLA) inside the block."""
    from vllm import ModelRegistry
    from vllm.model_executor.model_loader import utils
    from vllm.models.kimi_k3.nvidia import dspark_mla

    import vllm_dspark

    vllm_dspark.register()  # so that the plugin's own registration cannot run again inside the block
    monkeypatch.setattr(dspark_mla, "MultiHeadLatentAttention", _torch_mla)
    monkeypatch.setattr(utils, "_MODEL_ARCH_BY_HASH", {})  # vLLM caches the class per model path
    ModelRegistry.register_model(vllm_dspark.ARCHITECTURE, IN_TREE)
    try:
        yield
    finally:
        ModelRegistry.register_model(vllm_dspark.ARCHITECTURE, vllm_dspark.MODEL_CLASS_PATH)


@pytest.fixture(scope="module")
def pair(tiny_checkpoint: Path, tiny_mla_target: Path) -> tuple[Served, Served]:
    plugin = load_drafter(tiny_mla_target, tiny_checkpoint)
    with pytest.MonkeyPatch.context() as mp, _in_tree_class(mp):
        upstream = load_drafter(tiny_mla_target, tiny_checkpoint)
    assert type(upstream.model).__module__ == "vllm.models.kimi_k3.nvidia.dspark_mla"
    return plugin, upstream


def test_hooks_equal_upstream_on_the_same_weights(pair: tuple[Served, Served]) -> None:
    plugin, upstream = pair
    config = plugin.model.config
    batch = make_batch(config)
    torch.testing.assert_close(
        plugin.model.combine_hidden_states(batch.aux),
        upstream.model.combine_hidden_states(batch.aux),
        **TOL,
    )
    hidden = torch.randn(6, config.hidden_size, generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, config.vocab_size, (6,), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(
        plugin.model.compute_draft_logits(hidden),
        upstream.model.compute_draft_logits(hidden),
        **TOL,
    )
    m_plugin, m_upstream = plugin.model.markov_embed(tokens), upstream.model.markov_embed(tokens)
    torch.testing.assert_close(m_plugin, m_upstream, **TOL)
    torch.testing.assert_close(
        plugin.model.markov_bias(m_plugin), upstream.model.markov_bias(m_upstream), **TOL
    )
    torch.testing.assert_close(
        plugin.model.compute_confidence(hidden, m_plugin),
        upstream.model.compute_confidence(hidden, m_upstream),
        **TOL,
    )


def test_context_latents_written_to_the_cache_equal_upstreams(
    pair: tuple[Served, Served], monkeypatch
) -> None:
    from vllm.models.kimi_k3.nvidia import dspark_mla
    from vllm.v1.worker import workspace

    plugin, upstream = pair
    batch = make_batch(plugin.model.config)
    written = []
    for served in pair:
        caches = []
        for layer in served.model.model.layers:
            cache = torch.full(
                (int(batch.block_table.max()) + 1, batch.block_size, layer.self_attn.head_size),
                -7.0,
            )
            layer.self_attn.bind_kv_cache(cache)
            caches.append(cache)
        written.append(caches)
    monkeypatch.setattr(dspark_mla, "ops", _CpuContextOps(written[1]))
    monkeypatch.setattr(
        torch.cuda, "is_current_stream_capturing", lambda: False
    )  # a CPU build cannot ask
    if workspace._manager is None:
        workspace.init_workspace_manager(torch.device("cpu"))
    for served in pair:
        context = served.model.combine_hidden_states(batch.aux)
        served.model.precompute_and_store_context_kv(
            context, batch.context_positions, batch.context_slots
        )
    for mine, theirs in zip(*written):
        assert int((mine != -7.0).all(dim=-1).sum()) == sum(
            batch.context_lens
        )  # every context slot, nothing else
        torch.testing.assert_close(mine, theirs, **TOL)


def test_the_cuda_context_path_is_upstreams_code() -> None:
    """On CUDA the plugin binds the in-tree class's context-KV methods (their kernels need a GPU to run)."""
    from vllm.models.kimi_k3.nvidia.dspark_mla import K3DSparkModel as Upstream

    from vllm_dspark import compat

    fake = types.SimpleNamespace()
    compat.bind_upstream_context_kv(fake, 8192)
    for name in compat.UPSTREAM_CONTEXT_KV.members:
        assert getattr(fake, name).__func__ is getattr(Upstream, name)
    assert fake._max_num_context_tokens == 8192


# ----- why the override exists -----


@pytest.fixture(scope="module")
def fp8_builds(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> dict[str, Path]:
    from vllm_dspark.checkpoint_tools.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("fp8")
    quantize_checkpoint(tiny_checkpoint, root / "fp8", "fp8", progress=False)
    return {
        "regex": root / "fp8",
        "linear-class": encoded(
            root / "fp8", root / "linear", SERVED["linear-class"], list(FP8_RECIPE)
        ),
    }


def test_in_tree_class_fails_to_load_the_projects_fp8_encoding(
    fp8_builds, tiny_mla_target: Path
) -> None:
    """Each in-tree layer builds its own quant config, without packed_modules_mapping, so the fused
    gate_up_proj matches no target and is built unquantized; its FP8 shards then have nowhere to go."""
    from vllm.model_executor.models.utils import get_draft_quant_config

    from vllm_dspark.runtime.cpu_fp8 import install
    from vllm_dspark.tools.vllm_load import engine_config

    quant_config = get_draft_quant_config(engine_config(tiny_mla_target, fp8_builds["regex"]))
    layer = torch.nn.Linear(1, 1)
    assert not quant_config.packed_modules_mapping
    assert (
        quant_config.get_scheme_dict(layer, layer_name="model.layers.8.mlp.gate_proj") is not None
    )
    assert quant_config.get_scheme_dict(layer, layer_name="model.layers.8.mlp.gate_up_proj") is None
    install()  # vLLM has no CPU FP8 W8A16 kernel; the plugin's stands in for the GPU's
    with (
        pytest.MonkeyPatch.context() as mp,
        _in_tree_class(mp),
        pytest.raises(
            AttributeError, match="'MergedColumnParallelLinear' object has no attribute 'data'"
        ),
    ):
        load_drafter(tiny_mla_target, fp8_builds["regex"])
    # The plugin serves the same build.
    served = load_drafter(tiny_mla_target, fp8_builds["regex"])
    assert served.model.model.layers[0].mlp.gate_up_proj.scheme is not None


def test_in_tree_class_silently_quantizes_the_bf16_kv_b_proj(
    fp8_builds, tiny_mla_target: Path
) -> None:
    """``Linear`` + checkpoint-name ignores: its ignores miss the runtime names, so the BF16 kv_b_proj is
    built FP8 and loaded from BF16 weights without a scale; the plugin keeps it BF16."""
    from vllm_dspark.runtime.cpu_fp8 import install

    install()
    with pytest.MonkeyPatch.context() as mp, _in_tree_class(mp):
        upstream = load_drafter(tiny_mla_target, fp8_builds["linear-class"])
    assert getattr(upstream.model.model.layers[0].self_attn.kv_b_proj, "scheme", None) is not None
    plugin = load_drafter(tiny_mla_target, fp8_builds["linear-class"])
    assert getattr(plugin.model.model.layers[0].self_attn.kv_b_proj, "scheme", None) is None


@pytest.mark.upstream_bug
def test_specialized_decode_replaces_the_plugins_drafter_with_the_in_tree_one() -> None:
    """Why the serve-time hook refuses quantized drafters under ``latency_specialized``: vLLM 0.34's
    Kimi-K3 target re-registers ``K3DSparkModel`` as a subclass of the in-tree drafter (whose FP8
    loading the tests above show broken), replacing this package's class in that process."""
    import subprocess
    import sys

    from vllm_dspark import compat

    if not compat.SPECIALIZED_DRAFTER.applies():
        pytest.skip("this vLLM has no specialized K3 drafter")
    code = f"""
from vllm.plugins import load_general_plugins
from vllm import ModelRegistry
load_general_plugins()
print(ModelRegistry._try_load_model_cls("K3DSparkModel").__module__)
from {compat.SPECIALIZED_DRAFTER.target.replace(":", " import ")}
register()
cls = ModelRegistry._try_load_model_cls("K3DSparkModel")
print(cls.__module__, [c.__module__ for c in cls.__mro__[1:3]])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    before, after = out.stdout.strip().splitlines()[-2:]
    assert before == "vllm_dspark.runtime.model"
    assert "specialized_decode.drafter.model" in after
    assert "'vllm.models.kimi_k3.nvidia.dspark_mla'" in after
