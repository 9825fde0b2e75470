# SPDX-License-Identifier: Apache-2.0
"""The drafter built by vLLM's ``load_dspark_model`` from what a user passes vLLM (a hub id, a path, a
load format), with nothing read by the harness: what the model reads is all that is read.

``vllm_dspark.tools.vllm_load.load_with_vllm`` checks a local drafter directory before vLLM sees it;
here the drafter is named only to vLLM. The serve-time doctor is off (``VLLM_DSPARK_DOCTOR=0``): it
reads local checkpoints on its own, before the model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vllm_dspark.tools.vllm_load import Served

HUB_REVISION = "0123456789abcdef0123456789abcdef01234567"


def load_named(
    target_dir: Path,
    drafter: str,
    heads_file: Path,
    *,
    load_format: str = "auto",
    num_speculative_tokens: int = 7,
) -> Served:
    """vLLM's ``load_dspark_model`` for ``drafter`` as vLLM takes it, in FP32 next to the target heads."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu.spec_decode.dspark.utils import load_dspark_model

    import vllm_dspark
    from vllm_dspark.compat import configs_without_an_engine
    from vllm_dspark.tools.vllm_load import TargetHeads, ensure_single_process_runtime

    vllm_dspark.register()
    args = EngineArgs(
        model=str(target_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        load_format=load_format,
        speculative_config={
            "method": "dspark",
            "model": drafter,
            "num_speculative_tokens": num_speculative_tokens,
        },
    )
    with pytest.MonkeyPatch.context() as mp, configs_without_an_engine():
        mp.setenv("VLLM_DSPARK_DOCTOR", "0")
        vllm_config = args.create_engine_config()
    with set_current_vllm_config(vllm_config), configs_without_an_engine():
        ensure_single_process_runtime()
        target = TargetHeads(heads_file, vllm_config.model_config.dtype)
        return Served(load_dspark_model(target, vllm_config), vllm_config, target)


def hub_cache(drafter_dir: Path, hf_home: Path, repo_id: str) -> Path:
    """``drafter_dir``'s config and shards as the Hugging Face cache under ``hf_home`` holds ``repo_id``
    after a download (one snapshot, ``refs/main``); returns the snapshot directory."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / HUB_REVISION
    snapshot.mkdir(parents=True)
    for path in drafter_dir.iterdir():
        if path.is_file():
            shutil.copy(path, snapshot / path.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_REVISION)
    return snapshot
