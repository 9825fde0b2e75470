# SPDX-License-Identifier: Apache-2.0
"""The plugin reads no vLLM source when it serves: touchpoints resolve by attributes, and what their
source must still say is checked here, on each supported vLLM (marker ``vllm_api``).

An image may ship vLLM without its ``.py`` sources, and an upstream rewording of a function must not
turn into an engine that cannot import the model class.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_dspark import compat

pytestmark = pytest.mark.vllm_api

ROOT = Path(__file__).resolve().parents[2]

# Python's source readers, raising when called from the plugin (through inspect's own helpers or
# not); every other caller (vLLM, torch, warnings) gets them unchanged.
SCRIPT = textwrap.dedent(
    """
    import inspect, linecache, sys

    READERS = {
        inspect: ("getsource", "getsourcelines", "findsource", "getsourcefile", "getfile", "getcomments"),
        linecache: ("getline", "getlines", "updatecache", "checkcache", "lazycache"),
    }

    def refused(module, name):
        reader = getattr(module, name)

        def read(*args, **kwargs):
            frame = sys._getframe(1)
            while frame.f_globals.get("__name__") in ("inspect", "linecache"):
                frame = frame.f_back
            caller = frame.f_globals.get("__name__", "")
            if caller.partition(".")[0] == "vllm_dspark":
                raise OSError(f"{caller} read source with {module.__name__}.{name}")
            return reader(*args, **kwargs)

        return read

    for module, names in READERS.items():
        for name in names:
            setattr(module, name, refused(module, name))

    import vllm_dspark
    from vllm.config import ParallelConfig, SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.platforms import current_platform

    target_dir, drafter_dir, checkpoint = sys.argv[1:]
    vllm_dspark.register()
    target = EngineArgs(
        model=target_dir, skip_tokenizer_init=True, max_model_len=256, enforce_eager=True
    ).create_model_config()
    draft = SpeculativeConfig(
        method="dspark",
        model=drafter_dir,
        num_speculative_tokens=7,
        target_model_config=target,
        target_parallel_config=ParallelConfig(),
    ).draft_model_config
    cls, _ = ModelRegistry.resolve_model_cls(draft.architectures, draft)
    print("CLASS", cls.__module__, cls.__name__)
    if current_platform.is_cpu():
        from vllm_dspark.tools.vllm_load import load_with_vllm

        load_with_vllm(checkpoint, target_dir=target_dir)
        print("BUILT")
    """
)


@pytest.mark.parametrize(
    "touchpoint", [t for t in compat.TOUCHPOINTS if t.reads], ids=lambda t: t.name
)
def test_each_touchpoint_source_still_reads_what_the_plugin_relies_on(
    touchpoint: compat.Touchpoint,
) -> None:
    """The source check ``Touchpoint.resolve`` made in every worker, where it belongs: in the tests."""
    if not touchpoint.applies():
        pytest.skip(f"{touchpoint.name} is for vLLM {touchpoint.versions}")
    assert touchpoint.reads in inspect.getsource(touchpoint.resolve()), (
        f"{touchpoint.target} no longer reads {touchpoint.reads}"
    )


def test_the_plugin_registers_and_builds_the_model_class_without_reading_source(
    tmp_path: Path, tiny_mla_target: Path, tiny_checkpoint: Path
) -> None:
    """In a fresh process with inspect's and linecache's source readers refusing the plugin: vLLM
    resolves the class (its body reads vLLM's speculator config on 0.34), and on CPU builds and loads it."""
    from vllm_dspark.checkpoint.presets import preset_config_json

    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps(preset_config_json("tiny")))
    script = tmp_path / "no_source.py"
    script.write_text(SCRIPT)
    env = {
        **os.environ,
        "VLLM_DSPARK_DOCTOR": "0",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, str(script), str(tiny_mla_target), str(drafter), str(tiny_checkpoint)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "CLASS vllm_dspark.runtime.model K3DSparkForCausalLM" in out.stdout
    from vllm.platforms import current_platform

    assert ("BUILT" in out.stdout) == current_platform.is_cpu()
