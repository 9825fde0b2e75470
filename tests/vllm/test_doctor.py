# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark doctor``: each misconfiguration it exists for is flagged, a correct config passes,
and the plugin's hook runs the same checks inside vLLM's real ``EngineArgs`` on a tiny drafter."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from vllm_dspark.checkpoint.presets import preset_config_json
from vllm_dspark.doctor import checks, facts, serve
from vllm_dspark.doctor.checks import diagnose
from vllm_dspark.doctor.facts import EngineFacts, MachineFacts
from vllm_dspark.findings import Finding
from vllm_dspark.tools import doctor as cli

GB300 = MachineFacts("cuda", (10, 3), "NVIDIA GB300")
H200 = MachineFacts("cuda", (9, 0), "NVIDIA H200")
NO_GPU = MachineFacts(None)


@pytest.fixture(scope="module")
def schema() -> facts.VllmSchema:
    return facts.vllm_schema()


@pytest.fixture(scope="module")
def drafter() -> dict[str, Any]:
    # A stated block of 7, confidence head, target: hidden 64, 8 layers, vocab 512.
    return dict(preset_config_json("tiny"), block_size=7)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.checkpoints import edit_config
    from vllm_dspark.checkpoint_tools.make_random import make_random

    out = make_random(tmp_path_factory.mktemp("doctor") / "tiny", "tiny", progress=False)
    return edit_config(out, block_size=7)


def spec(**overrides: Any) -> dict[str, Any]:
    """The GB300 sampling recipe's speculative config, with overrides (None removes a key)."""
    base = {
        "method": "dspark",
        "model": "Inferact/Kimi-K3-DSpark",
        "num_speculative_tokens": 7,
        "attention_backend": "FLASHINFER_MLA",
        "draft_sample_method": "probabilistic",
        "rejection_sample_method": "block",
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def only(findings: list[Finding], where: str) -> list[Finding]:
    return [f for f in findings if f.where == where]


def severities(findings: list[Finding]) -> set[str]:
    return {f.severity for f in findings}


# ----- a correct config -----


@pytest.mark.parametrize("machine, backend", [(GB300, "FLASHINFER_MLA"), (H200, "TRITON_MLA")])
def test_the_recipes_pass_on_their_hardware(schema, drafter, machine, backend) -> None:
    for s in (
        spec(attention_backend=backend),
        spec(attention_backend=backend, draft_sample_method="greedy", rejection_sample_method=None),
        spec(attention_backend=backend, enable_adaptive_verification=True),
    ):
        assert diagnose(s, drafter=drafter, machine=machine, schema=schema, target=None) == []


def test_leaving_num_speculative_tokens_out_is_fine(drafter) -> None:
    assert (
        only(diagnose(spec(num_speculative_tokens=None), drafter=drafter), "num_speculative_tokens")
        == []
    )


def test_no_block_anywhere_is_an_error_that_names_seven() -> None:
    """The published config.json states no block_size: vLLM then has nothing to draft with."""
    published = preset_config_json("k3")
    [f] = only(
        diagnose(spec(num_speculative_tokens=None), drafter=published), "num_speculative_tokens"
    )
    assert f.severity == "error" and "no block_size" in f.problem
    assert '"num_speculative_tokens": 7' in f.fix
    [note] = only(diagnose(spec(), drafter=published), "num_speculative_tokens")
    assert note.severity == "note" and "vLLM drafts 7-token blocks" in note.problem


@pytest.mark.parametrize(("causal", "severity"), [(False, "warning"), (True, "note")])
def test_another_block_without_a_stated_one_is_said(causal: bool, severity: str) -> None:
    drafter = dict(preset_config_json("k3"), is_causal=causal)
    [f] = only(diagnose(spec(num_speculative_tokens=5), drafter=drafter), "num_speculative_tokens")
    assert f.severity == severity and "drafts 5-token blocks" in f.problem


def test_a_causal_drafter_may_draft_fewer_tokens_than_its_block() -> None:
    block5 = preset_config_json("block5-small")
    findings = diagnose(spec(num_speculative_tokens=3), drafter=block5)
    assert only(findings, "num_speculative_tokens") == []


# ----- aux_hidden_stream vs VLLM_KIMI_K3_AUX_ATTN_RES_STREAM -----

ATTN_RES = dict(preset_config_json("fc-norm-small"))  # aux_hidden_stream: attn_res


@pytest.mark.parametrize(
    ("drafter", "env", "pp", "severity", "needle"),
    [
        (ATTN_RES, None, 1, "note", "=1 is set for this engine"),
        (ATTN_RES, "1", 1, None, ""),
        (ATTN_RES, "0", 1, "error", "unset VLLM_KIMI_K3_AUX_ATTN_RES_STREAM"),
        (ATTN_RES, "yes", 1, "error", "not an integer"),
        (ATTN_RES, None, 2, "error", "--pipeline-parallel-size 1"),
        (preset_config_json("tiny"), "1", 1, "error", "residual prefix stream"),
        (preset_config_json("tiny"), "0", 1, None, ""),
    ],
    ids=["set", "already-1", "conflict-0", "not-int", "pp", "prefix-drafter-env-1", "prefix-0"],
)
def test_aux_hidden_stream_against_the_environment(
    schema, drafter, env, pp: int, severity, needle: str
) -> None:
    engine = EngineFacts(aux_stream_env=env, pipeline_parallel_size=pp)
    found = only(
        diagnose(spec(), drafter=drafter, engine=engine, schema=schema), "aux_hidden_stream"
    )
    assert [f.severity for f in found] == ([severity] if severity else [])
    assert all(needle in f.problem + f.fix for f in found)


def test_a_vllm_without_the_attn_res_stream_is_refused(schema) -> None:
    import dataclasses

    old = dataclasses.replace(schema, env_vars=frozenset())
    [f] = only(diagnose(spec(), drafter=ATTN_RES, schema=old), "aux_hidden_stream")
    assert f.severity == "error" and "cannot provide" in f.problem


# ----- num_speculative_tokens vs block_size -----


@pytest.mark.parametrize(
    ("offset", "expected"),
    [(-1, ["error"]), (0, []), (1, ["warning"])],
    ids=["block-1", "block", "block+1"],
)
def test_num_speculative_tokens_at_the_block_boundary(
    drafter, offset: int, expected: list[str]
) -> None:
    n = drafter["block_size"] + offset
    found = only(
        diagnose(spec(num_speculative_tokens=n), drafter=drafter), "num_speculative_tokens"
    )
    assert [f.severity for f in found] == expected


def test_fewer_tokens_than_the_block_is_an_error(drafter) -> None:
    [f] = only(diagnose(spec(num_speculative_tokens=5), drafter=drafter), "num_speculative_tokens")
    assert (
        f.severity == "error" and "garbage" in f.problem and '"num_speculative_tokens": 7' in f.fix
    )


def test_more_tokens_than_the_block_is_a_warning(drafter) -> None:
    [f] = only(diagnose(spec(num_speculative_tokens=9), drafter=drafter), "num_speculative_tokens")
    assert f.severity == "warning" and "never trained" in f.problem


def test_a_non_positive_token_count_is_an_error(drafter) -> None:
    [f] = only(diagnose(spec(num_speculative_tokens=0), drafter=drafter), "num_speculative_tokens")
    assert f.severity == "error"


# ----- attention backend vs GPU -----


def test_flashinfer_mla_on_hopper_is_an_error_that_suggests_triton(drafter, schema) -> None:
    [f] = only(diagnose(spec(), drafter=drafter, machine=H200, schema=schema), "attention_backend")
    assert f.severity == "error" and "10.x" in f.problem and "TRITON_MLA" in f.fix


def test_no_gpu_is_said_plainly(drafter, schema) -> None:
    [f] = only(
        diagnose(spec(), drafter=drafter, machine=NO_GPU, schema=schema), "attention_backend"
    )
    assert (
        f.severity == "warning"
        and "no GPU is visible" in f.problem
        and "--compute-capability" in f.fix
    )
    # TRITON_MLA runs anywhere CUDA does: not knowing the GPU is only a note for it.
    [g] = only(
        diagnose(spec(attention_backend="TRITON_MLA"), drafter=drafter, machine=NO_GPU),
        "attention_backend",
    )
    assert g.severity == "note"


def test_backends_without_non_causal_mla_and_unknown_names_are_errors(drafter, schema) -> None:
    [f] = only(
        diagnose(spec(attention_backend="FLASHMLA"), drafter=drafter, machine=H200, schema=schema),
        "attention_backend",
    )
    assert f.severity == "error" and "non-causal" in f.problem and "TRITON_MLA" in f.fix
    [g] = only(
        diagnose(spec(attention_backend="FLASHINFER_ML"), drafter=drafter, schema=schema),
        "attention_backend",
    )
    assert g.severity == "error" and "FLASHINFER_MLA" in g.fix


def test_an_unset_backend_is_a_warning_with_the_right_suggestion(drafter) -> None:
    [f] = only(
        diagnose(spec(attention_backend="auto"), drafter=drafter, machine=GB300),
        "attention_backend",
    )
    assert f.severity == "warning" and "FLASHINFER_MLA on this GPU" in f.fix
    assert checks.recommended_attention_backend(H200) == "TRITON_MLA"


def test_backend_kv_dtype_support(drafter) -> None:
    findings = diagnose(
        spec(), drafter=drafter, engine=EngineFacts(kv_cache_dtype="fp8_e5m2"), machine=GB300
    )
    [f] = only(findings, "attention_backend")
    assert f.severity == "error" and "fp8_e5m2" in f.problem


# ----- KV-cache dtypes -----


def test_draft_and_target_kv_cache_dtypes_must_match(drafter, schema) -> None:
    findings = diagnose(
        spec(kv_cache_dtype="fp8"),
        drafter=drafter,
        engine=EngineFacts(kv_cache_dtype="auto"),
        schema=schema,
    )
    [f] = [f for f in only(findings, "kv_cache_dtype") if f.severity == "error"]
    assert "one dtype" in f.problem and 'drop "kv_cache_dtype"' in f.fix
    matched = diagnose(
        spec(kv_cache_dtype="fp8"),
        drafter=drafter,
        engine=EngineFacts(kv_cache_dtype="fp8"),
        schema=schema,
    )
    assert [f.severity for f in only(matched, "kv_cache_dtype")] == ["warning"]  # the scales, below


def test_fp8_draft_kv_without_scales_is_a_warning(drafter, schema) -> None:
    fp8 = EngineFacts(kv_cache_dtype="fp8")
    [f] = only(diagnose(spec(), drafter=drafter, engine=fp8, schema=schema), "kv_cache_dtype")
    assert f.severity == "warning" and "scale 1.0" in f.problem
    assert "vllm-dspark quantize --kv-cache-scheme fp8" in f.fix
    # A build with calibrated scales, a BF16 cache and an unknown drafter: nothing to say.
    from vllm_dspark.checkpoint.kv_scales import KV_CACHE_SCHEME

    scaled = dict(drafter, quantization_config={"kv_cache_scheme": dict(KV_CACHE_SCHEME)})
    assert only(diagnose(spec(), drafter=scaled, engine=fp8, schema=schema), "kv_cache_dtype") == []
    assert only(diagnose(spec(), drafter=drafter, schema=schema), "kv_cache_dtype") == []
    assert only(diagnose(spec(), drafter=None, engine=fp8, schema=schema), "kv_cache_dtype") == []


# ----- draft_sample_method x rejection_sample_method -----


def test_block_verification_with_greedy_drafting_is_flagged(drafter, schema) -> None:
    [f] = only(
        diagnose(spec(draft_sample_method="greedy"), drafter=drafter, schema=schema),
        "rejection_sample_method",
    )
    assert f.severity == "warning" and "no-op" in f.problem


def test_synthetic_rules(drafter, schema) -> None:
    findings = diagnose(spec(rejection_sample_method="synthetic"), drafter=drafter, schema=schema)
    assert {f.where for f in errors_of(findings)} == {
        "synthetic_acceptance"
    }  # neither rates nor length
    assert any(
        f.severity == "warning" and "not Kimi-K3's distribution" in f.problem for f in findings
    )
    ok = diagnose(
        spec(rejection_sample_method="synthetic", synthetic_acceptance_length=4.0), drafter=drafter
    )
    assert errors_of(ok) == []
    rising = spec(
        rejection_sample_method="synthetic",
        synthetic_acceptance_rates=[0.5, 0.9, 0.4, 0.3, 0.2, 0.1, 0.0],
    )
    assert "non-increasing" in errors_of(diagnose(rising, drafter=drafter))[0].problem
    stray = diagnose(spec(synthetic_acceptance_length=4.0), drafter=drafter)
    assert any(
        "only valid with rejection_sample_method 'synthetic'" in f.problem for f in errors_of(stray)
    )


def test_values_the_installed_vllm_does_not_accept(drafter, schema) -> None:
    findings = diagnose(spec(rejection_sample_method="fly"), drafter=drafter, schema=schema)
    if "fly" in schema.rejection_sample_methods:  # vLLM 0.33
        assert only(findings, "rejection_sample_method") == []
    else:  # vLLM 0.32
        [f] = errors_of(findings)
        assert "fly" in f.problem and "0.33" in f.fix
    [g] = errors_of(diagnose(spec(draft_sample_method="topk"), drafter=drafter, schema=schema))
    assert g.where == "draft_sample_method"


def test_options_that_break_dspark_sampling(drafter) -> None:
    checks = {
        f.where
        for f in errors_of(
            diagnose(
                spec(
                    use_local_argmax_reduction=True,
                    use_heterogeneous_vocab=True,
                    dspark_draft_topk=8,
                ),
                drafter=drafter,
            )
        )
    }
    assert checks == {"use_local_argmax_reduction", "use_heterogeneous_vocab", "dspark_draft_topk"}


@pytest.mark.parametrize("draft", ["greedy", "probabilistic"])
def test_local_argmax_reduction_is_refused_with_either_drafting(drafter, draft: str) -> None:
    """vLLM's speculator needs the drafter's get_top_tokens() for it, which DSpark has no use for."""
    config = spec(use_local_argmax_reduction=True, draft_sample_method=draft)
    [f] = only(errors_of(diagnose(config, drafter=drafter)), "use_local_argmax_reduction")
    assert "get_top_tokens" in f.problem and "after the target" in f.problem


def test_probabilistic_drafting_memory_note(drafter) -> None:
    [f] = only(
        diagnose(spec(), drafter=drafter, engine=EngineFacts(max_num_seqs=256)),
        "draft_sample_method",
    )
    assert f.severity == "note" and "256 seqs x 7 x 512 x 2 B" in f.problem


# ----- method, model, keys -----


def test_method_must_be_dspark(drafter) -> None:
    [f] = only(diagnose(spec(method="draft_model"), drafter=drafter), "method")
    assert f.severity == "error" and '"method": "dspark"' in f.fix
    [g] = only(diagnose(spec(method=None, model="/models/drafter"), drafter=drafter), "method")
    assert g.severity == "error" and "plain" in g.problem
    [h] = only(
        diagnose(spec(method=None), drafter=drafter), "method"
    )  # "DSpark" in the HF id: vLLM guesses
    assert h.severity == "warning"


def test_missing_model_and_foreign_architecture(drafter) -> None:
    [f] = only(diagnose(spec(model=None), drafter=None), "model")
    assert f.severity == "error" and "inside the target checkpoint" in f.problem
    qwen = dict(drafter, architectures=["Qwen3DSparkModel"])
    [g] = only(diagnose(spec(), drafter=qwen), "model")
    assert g.severity == "error" and "DSparkDraftModel" in g.problem


def test_unknown_keys_get_a_suggestion(drafter, schema) -> None:
    findings = errors_of(
        diagnose(
            spec(num_speculative_token=7, tensor_parallel_size=16), drafter=drafter, schema=schema
        )
    )
    fixes = {f.problem.split()[0]: f.fix for f in findings if f.where == "keys"}
    assert "num_speculative_tokens" in fixes["'num_speculative_token'"]
    assert "draft_tensor_parallel_size" in fixes["'tensor_parallel_size'"]


def test_an_invalid_drafter_config_reuses_the_config_classs_message(drafter) -> None:
    [f] = only(diagnose(spec(), drafter=dict(drafter, markov_head_type="mlp")), "drafter config")
    assert f.severity == "error" and "markov_head_type" in f.problem and "vanilla" in f.fix


# ----- adaptive verification -----


@pytest.mark.parametrize(
    "engine, needle",
    [
        (EngineFacts(enforce_eager=True), "enforce-eager"),
        (EngineFacts(cudagraph_mode="PIECEWISE"), "PIECEWISE has no full graphs"),
        (EngineFacts(enable_lora=True), "LoRA"),
        (EngineFacts(pipeline_parallel_size=2), "pipeline-parallel size 1"),
    ],
)
def test_adaptive_verification_requirements(drafter, engine, needle) -> None:
    [f] = errors_of(
        diagnose(spec(enable_adaptive_verification=True), drafter=drafter, engine=engine)
    )
    assert f.where == "enable_adaptive_verification" and needle in f.problem


def test_adaptive_verification_without_a_confidence_head(drafter) -> None:
    no_head = dict(drafter, enable_confidence_head=False, confidence_head_with_markov=False)
    [f] = only(
        diagnose(spec(enable_adaptive_verification=True), drafter=no_head),
        "enable_adaptive_verification",
    )
    assert f.severity == "warning" and "estimator" in f.problem
    assert (
        diagnose(
            spec(enable_adaptive_verification=True),
            drafter=drafter,
            engine=EngineFacts(cudagraph_mode="FULL_DECODE_ONLY"),
        )
        == []
    )


# ----- target consistency -----


def test_target_geometry_must_match_the_drafter(drafter) -> None:
    target = {
        "hidden_size": 64,
        "num_hidden_layers": 8,
        "vocab_size": 512,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 16,
    }
    assert diagnose(spec(), drafter=drafter, target=target) == []
    assert diagnose(spec(), drafter=drafter, target={"text_config": target}) == []
    bad = {
        "hidden_size": 7168,
        "num_hidden_layers": 4,
        "vocab_size": 163840,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
    }
    problems = " | ".join(
        f.problem for f in only(diagnose(spec(), drafter=drafter, target=bad), "target")
    )
    for needle in (
        "target_hidden_size 64 != target hidden_size 7168",
        "target_num_hidden_layers 8",
        "[1, 2, 4, 5, 6]",
        "vocab_size 512 != target vocab_size 163840",
        "latent is 576",
    ):
        assert needle in problems


# ----- vLLM version -----


def test_vllm_versions_under_the_policy(monkeypatch) -> None:
    from vllm_dspark.version import ALLOW_UNVERIFIED_ENV, VLLM_CPU_BUILD, VLLM_GPU_BUILDS

    monkeypatch.delenv(ALLOW_UNVERIFIED_ENV, raising=False)
    for _, version in (VLLM_CPU_BUILD, *VLLM_GPU_BUILDS):
        assert checks.check_vllm_version(version) == [], version
    [f] = checks.check_vllm_version("0.31.2")
    assert f.severity == "error" and "0.31.2 is unsupported" in f.problem
    assert "vllm==" in f.fix and ALLOW_UNVERIFIED_ENV not in f.fix
    [f] = checks.check_vllm_version("0.34.1.dev12+g1234abc")
    assert f.severity == "error" and "unverified" in f.problem
    assert f"{ALLOW_UNVERIFIED_ENV}=1" in f.fix
    monkeypatch.setenv(ALLOW_UNVERIFIED_ENV, "1")
    [f] = checks.check_vllm_version("0.34.1.dev12+g1234abc")
    assert f.severity == "warning" and "run on purpose" in f.problem


@pytest.mark.vllm_api
def test_hook_refuses_a_k3_drafter_on_a_vllm_the_policy_refuses(
    tiny_mla_target, drafter_dir, monkeypatch
) -> None:
    """register() only logs on such a vLLM (it runs in every process); serving the drafter stops
    at the speculative config, before the target loads, with the way to run it on purpose."""
    import vllm

    from vllm_dspark.version import ALLOW_UNVERIFIED_ENV

    monkeypatch.delenv(ALLOW_UNVERIFIED_ENV, raising=False)
    config = spec(model=str(drafter_dir), attention_backend="TRITON_MLA")
    args = engine_args(tiny_mla_target, config)
    monkeypatch.setattr(vllm, "__version__", "0.99.0rc1")
    with pytest.raises(ValueError, match="vllm_dspark doctor") as e:
        build_spec_config(args)
    assert "vLLM 0.99.0rc1 is unverified" in str(e.value)
    assert f"{ALLOW_UNVERIFIED_ENV}=1" in str(e.value)
    monkeypatch.setenv(ALLOW_UNVERIFIED_ENV, "1")
    assert build_spec_config(engine_args(tiny_mla_target, config)).method == "dspark"


# ----- the CLI on tiny checkpoints -----


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = cli.main(list(argv))
    return rc, capsys.readouterr().out


@pytest.mark.vllm_api
def test_cli_passes_a_correct_checkpoint(capsys, drafter_dir, tiny_mla_target) -> None:
    config = spec(model=str(drafter_dir), attention_backend="TRITON_MLA")
    rc, out = run_cli(
        capsys,
        "--speculative-config",
        json.dumps(config),
        "--target",
        str(tiny_mla_target),
        "--compute-capability",
        "9.0",
    )
    assert rc == 0, out
    # The one warning a correct setup can get is about this machine's `vllm` command (vllm-cpu).
    assert out.strip().endswith(f"OK: 0 error(s), {len(checks.check_vllm_command())} warning(s)")
    assert (
        f"drafter {drafter_dir}" in out and "config.json" in out and "compute capability 9.0" in out
    )


def test_cli_on_a_cpu_machine_checks_a_cpu_run(capsys, drafter_dir) -> None:
    """No GPU beside a CPU build of torch (as vllm-cpu needs) is a CPU run: no GPU advice."""
    config = spec(model=str(drafter_dir), attention_backend=None)
    rc, out = run_cli(capsys, "--speculative-config", json.dumps(config), "--json")
    report = json.loads(out)
    import torch

    if torch.cuda.is_available():
        assert "no GPU visible" not in report["checked"]
    elif torch.version.cuda is None and torch.version.hip is None:
        assert rc == 0 and report["ok"] and "a CPU run (no GPU)" in report["checked"]
        command = [f.as_dict() for f in checks.check_vllm_command()]
        assert [f for f in report["findings"] if f not in command] == []
    else:
        assert rc == 0 and report["ok"] and "no GPU visible" in report["checked"]


def test_cli_device_flag_picks_a_cpu_or_a_gpu_run(capsys, drafter_dir) -> None:
    """--device cpu checks a CPU run anywhere; --device cuda a GPU run even where none is visible."""
    import torch

    config = spec(model=str(drafter_dir), attention_backend=None)
    base = ["--speculative-config", json.dumps(config), "--json"]
    rc, out = run_cli(capsys, *base, "--device", "cpu")
    report = json.loads(out)
    assert rc == 0 and "a CPU run (no GPU)" in report["checked"]
    assert not [f for f in report["findings"] if f["where"] == "attention_backend"]
    if not torch.cuda.is_available():
        rc, out = run_cli(capsys, *base, "--device", "cuda")
        report = json.loads(out)
        assert "no GPU visible" in report["checked"]
        [f] = [f for f in report["findings"] if f["where"] == "attention_backend"]
        assert "TRITON_MLA" in f["fix"]


def test_a_cpu_run_gets_no_gpu_advice(drafter, schema) -> None:
    cpu = MachineFacts("cpu")
    assert cpu.describe() == "a CPU run (no GPU)" and not cpu.gpu
    assert (
        only(
            diagnose(spec(attention_backend=None), drafter=drafter, machine=cpu, schema=schema),
            "attention_backend",
        )
        == []
    )
    # A GPU backend named in a CPU run is a note about GPU serving, not an error.
    [f] = only(
        diagnose(spec(attention_backend="FLASHINFER_MLA"), drafter=drafter, machine=cpu),
        "attention_backend",
    )
    assert f.severity == "note" and "vllm-dspark serve-cpu" in f.fix
    # A Kimi-K3.1 (DSA) target's rules are checked without a GPU to pick a backend for.
    dsa = checks.check_dsa_target(
        spec(attention_backend="FLASHINFER_MLA", kv_cache_dtype="fp8"), cpu
    )
    assert dsa == []
    assert facts.machine_facts("9.0", "cpu") == facts.cpu_run()


def test_a_cpu_run_gets_cpu_advice(drafter) -> None:
    """What a CPU run cannot do is refused with a fix for `vllm-dspark serve-cpu`, not a GPU flag."""
    cpu = MachineFacts("cpu")
    for config, engine, where in [
        (
            spec(attention_backend=None, enable_adaptive_verification=True),
            EngineFacts(),
            "enable_adaptive_verification",
        ),
        (
            spec(attention_backend=None, kv_cache_dtype="fp8"),
            EngineFacts(kv_cache_dtype="fp8"),
            "kv_cache_dtype",
        ),
        (spec(attention_backend=None), EngineFacts(kv_cache_dtype="fp8_e4m3"), "kv_cache_dtype"),
    ]:
        [f] = only(diagnose(config, drafter=drafter, engine=engine, machine=cpu), where)
        assert f.severity == "error" and "vllm-dspark serve-cpu" in f.fix, f
        assert not re.search(r"cudagraph|-cc|FLASHINFER|TRITON", f.fix), f
    assert (
        only(diagnose(spec(attention_backend=None), drafter=drafter, machine=cpu), "kv_cache_dtype")
        == []
    )


def test_float32_on_a_cpu_with_amx_tiles_is_refused_naming_the_reference_mla_backend(
    drafter,
) -> None:
    """vllm-cpu serves MLA with AMX_MLA where torch reports AMX tiles, and AMX_MLA loads only bfloat16
    weights: float32 there fails after the target loads, unless CPU_MLA is asked for."""
    amx = MachineFacts("cpu", amx_tiles=True)
    config = spec(attention_backend=None)
    for dtype in ("float32", "float"):
        [f] = only(
            diagnose(config, drafter=drafter, engine=EngineFacts(dtype=dtype), machine=amx), "dtype"
        )
        assert f.severity == "error" and "AMX_MLA" in f.problem and "\n" not in str(f)
        assert "--attention-backend CPU_MLA" in f.fix
    for engine, machine in [
        (EngineFacts(dtype="float32", attention_backend="CPU_MLA"), amx),
        (EngineFacts(dtype="bfloat16"), amx),
        (EngineFacts(), amx),  # auto never resolves to float32: vLLM downcasts float32 checkpoints
        (EngineFacts(dtype="float32"), MachineFacts("cpu")),  # vllm-cpu picks CPU_MLA itself there
    ]:
        assert (
            only(diagnose(config, drafter=drafter, engine=engine, machine=machine), "dtype") == []
        )


def _fix_texts(path: Path) -> list[tuple[int, str]]:
    """Every ``Finding``'s fix in a module as its source spells it: the string pieces of the fix
    expression, a name in it read from that name's assignments in the module."""
    import ast

    tree = ast.parse(path.read_text())
    assigned: dict[str, list[ast.AST]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assigned.setdefault(target.id, []).append(node.value)

    def pieces(expr: ast.AST, seen: frozenset[str]) -> list[str]:
        out = []
        for node in ast.walk(expr):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(node.value)
            elif isinstance(node, ast.Name) and node.id not in seen:
                for value in assigned.get(node.id, ()):
                    out += pieces(value, seen | {node.id})
        return out

    fixes = []
    for call in ast.walk(tree):
        name = getattr(getattr(call, "func", None), "id", None)
        if not (isinstance(call, ast.Call) and name == "Finding"):
            continue
        fix = call.args[1] if len(call.args) > 1 else None
        fix = next((k.value for k in call.keywords if k.arg == "fix"), fix)
        if fix is not None:
            fixes.append((call.lineno, " ".join(pieces(fix, frozenset()))))
    return fixes


# What a pip user of the wheel lacks: the checkout's examples/, tests/ and Makefile, and vLLM's
# server module in place of the command that starts it (`vllm serve`, `vllm-dspark serve-cpu`).
_CHECKOUT_ONLY = re.compile(
    r"examples/|tests/|benchmarks/|\bmake \w|python -m vllm\.|vllm\.entrypoints"
)


def test_every_fix_names_a_command_a_pip_user_has() -> None:
    """Every fix the doctor can print (its own, and the checkpoint's and config's it relays)."""
    import vllm_dspark

    fixes = [
        (f"{path.name}:{line}", text)
        for path in sorted(Path(vllm_dspark.__file__).parent.rglob("*.py"))
        for line, text in _fix_texts(path)
    ]
    assert len(fixes) > 100 and any("vllm-dspark serve-cpu" in text for _, text in fixes)
    assert [(where, text) for where, text in fixes if _CHECKOUT_ONLY.search(text)] == []


def test_the_broken_vllm_command_of_the_cpu_build_is_named_with_the_working_entry_point() -> None:
    """vllm-cpu installs its metadata as 'vllm-cpu', and the `vllm` command asks for 'vllm'."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
        broken = False
    except PackageNotFoundError:
        broken = True
    findings = checks.check_vllm_command()
    assert bool(findings) == broken
    if broken:
        [f] = findings
        assert f.severity == "warning" and "PackageNotFoundError" in f.problem
        assert "vllm-dspark serve-cpu" in f.fix and "examples/" not in f.fix


def test_cli_flags_a_broken_checkpoint(capsys, drafter_dir, tmp_path) -> None:
    from vllm_dspark.checkpoint.st_io import read_tensor, save_tensors
    from vllm_dspark.checkpoint.store import stored_tensors

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((drafter_dir / "config.json").read_text())
    kept = {
        key: read_tensor(t.path, key)
        for key, t in stored_tensors(drafter_dir).items()
        if "markov_w2" not in key
    }
    save_tensors(broken / "model.safetensors", kept)
    rc, out = run_cli(
        capsys, "-sc", json.dumps(spec(model=str(broken))), "--compute-capability", "10.0"
    )
    assert rc == 1 and "ERROR    checkpoint:" in out and "FAIL: " in out


def test_cli_flags_an_invalid_config_and_a_mismatched_target(
    capsys, drafter_dir, tmp_path, tiny_mla_target
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(
        json.dumps(dict(preset_config_json("tiny"), mask_token_id=None))
    )
    rc, out = run_cli(
        capsys, "-sc", json.dumps(spec(model=str(bad))), "--compute-capability", "10.0"
    )
    assert rc == 1 and "ERROR    drafter config: K3DSparkConfig.mask_token_id: is missing" in out
    small = tmp_path / "small_target.json"
    small.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 8, "vocab_size": 1024}))
    rc, out = run_cli(
        capsys,
        "-sc",
        json.dumps(spec(model=str(drafter_dir))),
        "--target",
        str(small),
        "--compute-capability",
        "10.0",
    )
    assert rc == 1 and "vocab_size 512 != target vocab_size 1024" in out


def test_cli_flags_an_unresolvable_model(capsys, tmp_path) -> None:
    rc, out = run_cli(
        capsys,
        "-sc",
        json.dumps(spec(model="nobody/no-such-drafter")),
        "--target",
        str(tmp_path / "nowhere"),
    )
    assert rc == 1
    assert "hf download nobody/no-such-drafter" in out and "taken as a repo id" in out
    assert f"local path {tmp_path / 'nowhere'} does not exist" in out


@pytest.mark.parametrize(
    "name, local",
    [
        ("/abs/drafter", True),
        ("./drafter", True),
        ("../drafter", True),
        ("~/drafter", True),
        (".", True),
        ("models/k3/drafter", True),  # more than a hub id's one separator
        ("drafters/Kimi K3", True),  # a space: no hub id has one
        ("Inferact/Kimi-K3-DSpark", False),
        ("Kimi-K3-DSpark", False),
        ("org/name.v1_2", False),
    ],
)
def test_local_paths_are_told_from_hub_ids(name: str, local: bool) -> None:
    assert facts.looks_local(name) is local


def test_a_missing_local_path_or_a_file_is_never_sent_to_the_hub(tmp_path) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"x")
    for model, needle in (
        (str(tmp_path / "nothere"), f"local path {tmp_path / 'nothere'} does not exist"),
        (str(file), f"{file} is a file, not a directory (taken as a local path)"),
    ):
        [f] = facts.load_drafter({"model": model})[2]
        assert needle in f.problem and "hf download" not in f.fix, f
    [g] = facts.load_drafter({"model": "nobody/no-such-drafter"})[2]
    assert "taken as a repo id" in g.problem and "hf download nobody/no-such-drafter" in g.fix


def test_cli_rejects_malformed_json(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--speculative-config", "{method: dspark}"])
    assert "not valid JSON" in capsys.readouterr().err


def test_cli_takes_underscore_spellings_without_listing_them() -> None:
    parser = cli.build_parser()
    kebab = parser.parse_args(["--speculative-config", "{}", "--kv-cache-dtype", "fp8", "-pp", "2"])
    underscore = parser.parse_args(
        ["--speculative_config={}", "--kv_cache_dtype", "fp8", "--pipeline_parallel_size", "2"]
    )
    assert vars(underscore) == vars(kebab)
    assert "_" not in "".join(a for a in parser.format_help().split() if a.startswith("--"))


def test_cli_dispatch(capsys, drafter_dir) -> None:
    from vllm_dspark.tools.cli import main

    rc = main(
        [
            "doctor",
            "-sc",
            json.dumps(spec(model=str(drafter_dir), num_speculative_tokens=3)),
            "--compute-capability",
            "10.0",
        ]
    )
    assert rc == 1 and "ERROR    num_speculative_tokens: 3 is below" in capsys.readouterr().out


# ----- the hook inside vLLM's own EngineArgs -----


def engine_args(target: Path, speculative_config: dict[str, Any], **kwargs: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    import vllm_dspark

    # Building EngineArgs loads vLLM's general plugins, whose register() installs the hook, but
    # only once per process: a test that loaded them before arg_utils was imported got no hook.
    vllm_dspark.register()
    return EngineArgs(
        model=str(target),
        skip_tokenizer_init=True,
        max_model_len=256,
        speculative_config=speculative_config,
        **kwargs,
    )


def build_spec_config(args: Any) -> Any:
    from vllm.config import ParallelConfig

    return args.create_speculative_config(args.create_model_config(), ParallelConfig())


@pytest.mark.vllm_api
def test_hook_is_installed_once_by_the_plugin(tiny_mla_target) -> None:
    from vllm.engine.arg_utils import EngineArgs

    import vllm_dspark

    engine_args(tiny_mla_target, {})
    hooked = EngineArgs.create_speculative_config
    assert hooked._vllm_dspark_doctor
    vllm_dspark.register()
    serve.install_speculative_config_hook()
    assert EngineArgs.create_speculative_config is hooked
    assert not getattr(hooked.__wrapped__, "_vllm_dspark_doctor", False)


@pytest.mark.vllm_api
@pytest.mark.parametrize(
    "overrides, kwargs, needle",
    [
        (
            {"num_speculative_tokens": 6},
            {},
            "num_speculative_tokens: 6 is below the drafter's block_size 7",
        ),
        (
            {"kv_cache_dtype": "fp8"},
            {},
            "draft KV-cache dtype 'fp8' != target --kv-cache-dtype 'auto'",
        ),
        ({"enable_adaptive_verification": True}, {"enforce_eager": True}, "needs full CUDA graphs"),
        ({"method": "draft_model"}, {}, "method 'draft_model' cannot run"),
        (
            {"use_local_argmax_reduction": True, "draft_sample_method": "greedy"},
            {},
            "has no get_top_tokens()",
        ),
    ],
)
def test_hook_refuses_before_vllm_builds_the_draft(
    tiny_mla_target, drafter_dir, overrides, kwargs, needle
) -> None:
    args = engine_args(
        tiny_mla_target,
        spec(model=str(drafter_dir), attention_backend="TRITON_MLA", **overrides),
        **kwargs,
    )
    with pytest.raises(ValueError, match="vllm_dspark doctor") as e:
        build_spec_config(args)
    assert needle in str(e.value) and "fix:" in str(e.value)


@pytest.mark.vllm_api
def test_hook_lets_a_correct_config_through(tiny_mla_target, drafter_dir) -> None:
    sc = build_spec_config(
        engine_args(tiny_mla_target, spec(model=str(drafter_dir), attention_backend="TRITON_MLA"))
    )
    assert sc.method == "dspark" and sc.num_speculative_tokens == 7
    assert type(sc.draft_model_config.hf_config).__module__ == "vllm_dspark.config"


@pytest.mark.vllm_api
def test_hook_turns_on_the_attn_res_stream_and_refuses_a_conflict(
    tiny_mla_target, variant_checkpoints, monkeypatch
) -> None:
    """A drafter that reads the attn_res stream gets it before the target loads, unless the
    environment asks for the other stream, which is refused."""
    drafter = str(variant_checkpoints["fc-norm"])  # aux_hidden_stream: attn_res
    # setenv first, so that teardown removes whatever the hook set.
    monkeypatch.setenv(facts.AUX_STREAM_ENV, "1")
    monkeypatch.delenv(facts.AUX_STREAM_ENV)
    sc = build_spec_config(
        engine_args(tiny_mla_target, spec(model=drafter, attention_backend="TRITON_MLA"))
    )
    assert sc.draft_model_config.hf_config.aux_hidden_stream == "attn_res"
    import vllm.envs as envs

    assert envs.VLLM_KIMI_K3_AUX_ATTN_RES_STREAM is True
    monkeypatch.setenv(facts.AUX_STREAM_ENV, "0")
    args = engine_args(tiny_mla_target, spec(model=drafter, attention_backend="TRITON_MLA"))
    with pytest.raises(ValueError, match="AUX_ATTN_RES_STREAM=0"):
        build_spec_config(args)


@pytest.mark.vllm_api
def test_hook_lets_one_token_past_the_block_through(tiny_mla_target, drafter_dir) -> None:
    """block + 1 is a warning (wasted verification), not a refusal."""
    sc = build_spec_config(
        engine_args(
            tiny_mla_target,
            spec(model=str(drafter_dir), num_speculative_tokens=8, attention_backend="TRITON_MLA"),
        )
    )
    assert sc.num_speculative_tokens == 8


@pytest.mark.vllm_api
def test_without_the_hook_vllm_accepts_the_garbage_config(
    tiny_mla_target, drafter_dir, monkeypatch
) -> None:
    # What the hook is for: vLLM itself builds a 5-token config for a 7-token drafter without a word.
    monkeypatch.setenv(serve.DISABLE_ENV, "0")
    sc = build_spec_config(
        engine_args(
            tiny_mla_target,
            spec(model=str(drafter_dir), num_speculative_tokens=5, attention_backend="TRITON_MLA"),
        )
    )
    assert sc.num_speculative_tokens == 5


@pytest.mark.vllm_api
def test_hook_leaves_other_speculative_methods_alone(tiny_mla_target) -> None:
    sc = build_spec_config(
        engine_args(
            tiny_mla_target,
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        )
    )
    assert sc.method == "ngram"


def errors_of(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "error"]


# ----- what vLLM 0.34 added: the KV-balanced backend, K3.1 targets, decode graphs, specialized decode -----

K3 = preset_config_json("k3")  # the real geometry (MLA 128 / 64 / 128 / 512)
KV_BALANCED = spec(attention_backend="KIMI_K3_KV_BALANCED_MLA")


def test_a_valid_kv_balanced_config_passes() -> None:
    def problems(*args, **kwargs) -> list[Finding]:  # notes say what will run, not what is wrong
        return [f for f in diagnose(*args, **kwargs) if f.severity != "note"]

    from vllm_dspark.checkpoint.kv_scales import KV_CACHE_SCHEME

    # The backend's fp8 pages want the draft's KV scales: a build that has them passes clean.
    scaled = dict(K3, quantization_config={"kv_cache_scheme": dict(KV_CACHE_SCHEME)})
    for dtype in ("auto", "bfloat16", "bf16"):
        engine = EngineFacts(kv_cache_dtype="fp8", dtype=dtype)
        assert problems(KV_BALANCED, drafter=scaled, engine=engine, machine=GB300) == [], dtype
        [f] = problems(KV_BALANCED, drafter=K3, engine=engine, machine=GB300)
        assert f.severity == "warning" and f.where == "kv_cache_dtype" and "scale 1.0" in f.problem
    assert (
        problems(
            dict(KV_BALANCED, kv_cache_dtype="fp8_e4m3"),
            drafter=scaled,
            engine=EngineFacts(kv_cache_dtype="fp8_e4m3"),
            machine=GB300,
        )
        == []
    )


@pytest.mark.parametrize(
    "engine, machine, drafter, needle",
    [
        (EngineFacts(), GB300, K3, "does not support KV-cache dtype 'auto'"),
        (EngineFacts(kv_cache_dtype="fp8", dtype="float16"), GB300, K3, "not --dtype float16"),
        (EngineFacts(kv_cache_dtype="fp8", dtype="half"), GB300, K3, "not --dtype half"),
        (EngineFacts(kv_cache_dtype="fp8"), H200, K3, "needs compute capability 10.x"),
        (
            EngineFacts(kv_cache_dtype="fp8"),
            MachineFacts("rocm", (9, 4), "MI300X"),
            K3,
            "needs a CUDA GPU",
        ),
        (
            EngineFacts(kv_cache_dtype="fp8"),
            GB300,
            preset_config_json("tiny"),
            "(128, 64, 128, 512), the drafter has (16, 16, 32, 32)",
        ),
    ],
)
def test_invalid_kv_balanced_configs_are_refused_by_name(engine, machine, drafter, needle) -> None:
    [f] = errors_of(diagnose(KV_BALANCED, drafter=drafter, engine=engine, machine=machine))
    assert f.where == "attention_backend" and "KIMI_K3_KV_BALANCED_MLA" in f.problem
    assert needle in f.problem, f.problem


def test_kv_balanced_is_a_backend_of_the_vllm_versions_that_have_it(schema) -> None:
    """Against the installed vLLM's own backend list: known from 0.34, refused by name before."""
    from vllm_dspark.compat import DRAFT_ATTENTION_BACKENDS

    findings = diagnose(
        KV_BALANCED,
        drafter=K3,
        engine=EngineFacts(kv_cache_dtype="fp8"),
        machine=GB300,
        schema=schema,
    )
    if DRAFT_ATTENTION_BACKENDS["KIMI_K3_KV_BALANCED_MLA"].in_vllm(schema.version):
        assert errors_of(findings) == []
    else:
        [f] = errors_of(findings)
        assert f"not an attention backend in vLLM {schema.version}" in f.problem


K31_TARGET = {
    "model_type": "kimi_k31",
    "text_config": {"hidden_size": 64, "num_hidden_layers": 8, "dsa_config": {"index_topk": 2048}},
}


def test_a_k31_dsa_target_needs_an_explicit_dense_backend_and_fp8_pages(drafter) -> None:
    findings = only(
        diagnose(spec(attention_backend=None), drafter=drafter, machine=GB300, target=K31_TARGET),
        "target",
    )
    assert [f.severity for f in findings] == ["error", "error"]
    assert "FLASHINFER_MLA" in findings[0].fix and '"kv_cache_dtype": "fp8"' in findings[1].fix
    # Its own fp8 pages: no longer the target's KV group, so no dtype-match error either.
    ok = spec(kv_cache_dtype="fp8")
    assert errors_of(diagnose(ok, drafter=drafter, machine=GB300, target=K31_TARGET)) == []
    rocm = MachineFacts("rocm", (9, 4), "MI300X")
    [f, _] = only(diagnose(spec(), drafter=drafter, machine=rocm, target=K31_TARGET), "target")
    assert "ROCM_AITER_MLA" in f.fix
    # A dsa_config alone (no kimi_k31 model_type) is a DSA target too; a plain K3 target is not.
    dsa_only = {"text_config": K31_TARGET["text_config"]}
    assert checks.is_dsa_target(dsa_only) and not checks.is_dsa_target({"model_type": "kimi_k3"})


def test_adaptive_verification_needs_decode_graphs(drafter) -> None:
    adaptive = spec(enable_adaptive_verification=True)
    for mode in (None, "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"):
        engine = EngineFacts(cudagraph_mode=mode, decode_capture_sizes=())
        [f] = errors_of(diagnose(adaptive, drafter=drafter, engine=engine))
        assert "decode_cudagraph_capture_request_sizes is empty" in f.problem, mode
    # FULL replays one routine for both; listed sizes are decode graphs.
    for engine in (
        EngineFacts(cudagraph_mode="FULL", decode_capture_sizes=()),
        EngineFacts(decode_capture_sizes=(1, 2, 4)),
    ):
        assert errors_of(diagnose(adaptive, drafter=drafter, engine=engine)) == []


def test_engine_facts_read_the_flags_as_vllm_serve_takes_them() -> None:
    engine = facts.engine_facts_of(
        compilation_config={
            "cudagraph_mode": "full_decode_only",
            "decode_cudagraph_capture_request_sizes": [],
        },
        additional_config={"decode_backend": "latency_specialized"},
        dtype="bfloat16",
    )
    assert engine == EngineFacts(
        cudagraph_mode="FULL_DECODE_ONLY",
        decode_capture_sizes=(),
        decode_backend="latency_specialized",
        dtype="bfloat16",
    )
    assert (
        facts.engine_facts_of(compilation_config=None, additional_config=None, dtype="auto")
        == EngineFacts()
    )


SPECIALIZED = EngineFacts(decode_backend="latency_specialized")


def test_specialized_decode_refuses_a_quantized_drafter_and_notes_a_bf16_one(
    drafter, schema
) -> None:
    import dataclasses

    fp8 = dict(drafter, quantization_config={"quant_method": "compressed-tensors"})
    v034 = dataclasses.replace(schema, version="0.34.0")
    [f] = only(diagnose(spec(), drafter=fp8, engine=SPECIALIZED, schema=None), "decode_backend")
    assert (
        f.severity == "error"
        and "latency_specialized" in f.problem
        and "drop decode_backend" in f.fix
    )
    [g] = only(diagnose(spec(), drafter=drafter, engine=SPECIALIZED), "decode_backend")
    assert g.severity == "note"
    assert only(diagnose(spec(), drafter=fp8, engine=SPECIALIZED, schema=v034), "decode_backend")
    # vLLM 0.33 has no specialized drafter to swap in.
    v033 = dataclasses.replace(schema, version="0.33.0")
    assert (
        only(diagnose(spec(), drafter=fp8, engine=SPECIALIZED, schema=v033), "decode_backend") == []
    )


def test_dspark_draft_topk_in_the_drafters_config_is_refused(drafter) -> None:
    [f] = errors_of(diagnose(spec(), drafter=dict(drafter, dspark_draft_topk=8)))
    assert f.where == "dspark_draft_topk" and "in config.json" in f.problem


@pytest.mark.vllm_api
def test_vllm_itself_refuses_dspark_draft_topk_for_the_k3_drafter(
    tiny_mla_target, drafter_dir, monkeypatch
) -> None:
    """The doctor's refusal is vLLM's own rule (with the hook off, vLLM raises by itself)."""
    monkeypatch.setenv(serve.DISABLE_ENV, "0")
    args = engine_args(
        tiny_mla_target,
        spec(model=str(drafter_dir), attention_backend="TRITON_MLA", dspark_draft_topk=8),
    )
    with pytest.raises(ValueError, match="dspark_draft_topk"):
        build_spec_config(args)


@pytest.fixture(scope="module")
def fp8_drafter_dir(drafter_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_dspark.checkpoint_tools.quantize import quantize_checkpoint

    out = tmp_path_factory.mktemp("doctor-fp8") / "tiny-fp8"
    quantize_checkpoint(drafter_dir, out, "fp8", progress=False)
    return out


@pytest.mark.vllm_api
@pytest.mark.parametrize("build", ["bf16", "fp8"])
def test_hook_and_latency_specialized_on_the_installed_vllm(
    tiny_mla_target, drafter_dir, fp8_drafter_dir, build
) -> None:
    """Where the Kimi-K3 target swaps in vLLM's specialized drafter (0.34), a quantized build is
    refused before the target loads; a BF16 one, and every build on vLLM without it, goes through."""
    from vllm_dspark.compat import SPECIALIZED_DRAFTER

    model = fp8_drafter_dir if build == "fp8" else drafter_dir
    args = engine_args(
        tiny_mla_target,
        spec(model=str(model), attention_backend="TRITON_MLA"),
        additional_config={"decode_backend": "latency_specialized"},
    )
    if build == "fp8" and SPECIALIZED_DRAFTER.applies():
        with pytest.raises(ValueError, match="vllm_dspark doctor") as e:
            build_spec_config(args)
        assert "latency_specialized" in str(e.value) and "fix:" in str(e.value)
    else:
        sc = build_spec_config(args)
        assert sc.draft_model_config.architectures == ["K3DSparkModel"]


# ----- quantized layers on the serving GPU -----


def _quantization(quantization_config: dict[str, Any]) -> dict[str, Any]:
    return {**preset_config_json("tiny"), "quantization_config": quantization_config}


MODELOPT_FP8 = {"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["lm_head"]}
MODELOPT_NVFP4 = {"quant_method": "modelopt_fp4", "quant_algo": "NVFP4", "group_size": 16}
T4 = MachineFacts("cuda", (7, 5), "Tesla T4")
A100 = MachineFacts("cuda", (8, 0), "NVIDIA A100")


@pytest.mark.parametrize(
    ("quantization_config", "machine", "expected"),
    [
        # vLLM declares ModelOpt FP8 from sm_80: no kernel on a T4, weight-only on an A100.
        (MODELOPT_FP8, MachineFacts("cuda", (7, 0), "V100"), "error"),
        (MODELOPT_FP8, T4, "error"),
        (MODELOPT_FP8, A100, "warning"),
        (MODELOPT_FP8, MachineFacts("cuda", (8, 9), "L40S"), None),
        # NVFP4 W4A4: Marlin weight-only, then FP8 inputs on Hopper, NVFP4 GEMMs on Blackwell.
        (MODELOPT_NVFP4, T4, "warning"),
        (MODELOPT_NVFP4, H200, "warning"),
        (MODELOPT_NVFP4, GB300, None),
        # Weight-only NVFP4 runs as built from sm_75 up; ROCm and CPU are not judged here.
        ({**MODELOPT_NVFP4, "quant_algo": "W4A16_NVFP4"}, T4, None),
        (MODELOPT_FP8, MachineFacts("rocm", (9, 4), "MI300X"), None),
        (MODELOPT_FP8, NO_GPU, None),
    ],
)
def test_quantized_layers_are_judged_against_the_serving_gpu(
    quantization_config, machine, expected
) -> None:
    findings = checks.check_quantized_layers_on_gpu(_quantization(quantization_config), machine)
    assert [f.severity for f in findings] == ([expected] if expected else [])
    if expected == "error":
        (f,) = findings
        assert (
            f.where == "quantization"
            and "no kernel for the drafter's fp8-static layers" in f.problem
        )
        assert "compute capability 8.0 or newer" in f.problem and "serve the BF16 drafter" in f.fix
    if expected == "warning":
        assert "not as built" in findings[0].problem and "vllm-dspark accept" in findings[0].fix


def test_compressed_tensors_formats_each_get_their_own_finding() -> None:
    """A config group per format: each format the config names is judged on its own."""
    from vllm_dspark.checkpoint import quant_config

    qc = quant_config.compressed_tensors_config(
        {"fp8": ["model.layers.8.mlp.down_proj"], "mxfp4": ["model.layers.8.mlp.gate_up_proj"]},
        ignore=[],
    )
    (finding,) = checks.check_quantized_layers_on_gpu(_quantization(qc), T4)
    assert "mxfp4 layers (compressed-tensors)" in finding.problem
    assert "compute capability 8.0" in finding.problem and finding.fix.endswith("/ nvfp4-w4a4")
    assert checks.check_quantized_layers_on_gpu(_quantization(qc), A100) == []
    fp8_block = quant_config.compressed_tensors_config(
        {"fp8-block": ["model.layers.8.mlp.down_proj"]}, ignore=[]
    )
    (finding,) = checks.check_quantized_layers_on_gpu(
        _quantization(fp8_block), MachineFacts("cuda", (8, 9), "L40S")
    )
    assert finding.severity == "warning" and "fp8-block layers weight-only" in finding.problem


@pytest.fixture(scope="module")
def modelopt_fp8_dir(drafter_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ModelOpt FP8 build whose quantization config is only in hf_quant_config.json."""
    from vllm_dspark.checkpoint.layout import MODULE_SETS
    from vllm_dspark.checkpoint_tools.quantize import quantize_checkpoint

    out = tmp_path_factory.mktemp("doctor-modelopt") / "tiny-modelopt-fp8"
    quantize_checkpoint(
        drafter_dir, out, "fp8-static", MODULE_SETS["modelopt"], progress=False, export="modelopt"
    )
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    ("capability", "rc", "needle"), [("7.5", 1, "ERROR"), ("8.0", 0, "WARNING"), ("9.0", 0, None)]
)
def test_cli_judges_a_modelopt_build_against_the_named_gpu(
    capsys, modelopt_fp8_dir, capability, rc, needle
) -> None:
    config = spec(model=str(modelopt_fp8_dir), attention_backend="TRITON_MLA")
    code, out = run_cli(capsys, "-sc", json.dumps(config), "--compute-capability", capability)
    assert code == rc, out
    lines = [line for line in out.splitlines() if "quantization:" in line]
    assert [line.split()[0] for line in lines] == ([needle] if needle else []), out


@pytest.mark.vllm_api
def test_hook_refuses_a_build_the_gpu_has_no_kernel_for_before_the_target_loads(
    monkeypatch, tiny_mla_target, modelopt_fp8_dir
) -> None:
    """Inside vLLM's EngineArgs, on a T4 (the machine fact stands in for the GPU this CPU lacks)."""
    monkeypatch.setenv(serve.DISABLE_ENV, "1")
    monkeypatch.setattr(serve, "serving_machine", lambda: T4)
    args = engine_args(
        tiny_mla_target, spec(model=str(modelopt_fp8_dir), attention_backend="TRITON_MLA")
    )
    with pytest.raises(ValueError, match="no kernel for the drafter's fp8-static layers"):
        build_spec_config(args)
    monkeypatch.setattr(serve, "serving_machine", lambda: H200)
    assert build_spec_config(args).draft_model_config.architectures == ["K3DSparkModel"]


def test_hook_refuses_float32_on_a_cpu_with_amx_tiles_unless_cpu_mla_is_named(
    monkeypatch, tiny_mla_target, drafter_dir
) -> None:
    """Inside vLLM's EngineArgs: the target's backend read from --attention-backend or attention_config."""
    monkeypatch.setattr(serve, "serving_machine", lambda: MachineFacts("cpu", amx_tiles=True))
    config = spec(model=str(drafter_dir), attention_backend=None)
    with pytest.raises(ValueError, match="add --attention-backend CPU_MLA"):
        build_spec_config(engine_args(tiny_mla_target, config, dtype="float32"))
    for named in ({"attention_backend": "CPU_MLA"}, {"attention_config": {"backend": "CPU_MLA"}}):
        args = engine_args(tiny_mla_target, config, dtype="float32", **named)
        assert facts.engine_facts(args).attention_backend == "CPU_MLA"
        assert build_spec_config(args).draft_model_config.architectures == ["K3DSparkModel"]


def test_cli_reads_the_aux_stream_from_the_environment(capsys, drafter_dir, monkeypatch) -> None:
    """The CLI judges the environment it runs in, as the serve-time hook does."""
    monkeypatch.setenv(facts.AUX_STREAM_ENV, "1")  # the tiny drafter reads the prefix stream
    rc, out = run_cli(
        capsys, "-sc", json.dumps(spec(model=str(drafter_dir))), "--compute-capability", "10.0"
    )
    assert rc == 1 and "ERROR    aux_hidden_stream:" in out and "unset VLLM_KIMI_K3" in out


@pytest.mark.vllm_api
def test_the_serve_time_hook_sees_a_cpu_run_on_the_cpu_build() -> None:
    """`vllm-dspark serve-cpu` runs vLLM's CPU build: the hook's machine is a CPU run, not unknown."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        assert facts.serving_machine() == facts.cpu_run()
