# SPDX-License-Identifier: Apache-2.0
"""One quantization plan for every tool: the encodings real builds use, served, warned about or refused alike.

The FP8 build is ``vllm-dspark quantize``'s (the published recipe) of the random ``tiny`` drafter; each
encoding of :mod:`tests.support.encodings` rewrites only its config.json. ``check``, ``doctor`` (CLI and the serve-time
hook inside vLLM's ``EngineArgs``) and vLLM's dspark loader must agree on every one.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.support.encodings import REFUSED, SERVED, WARNED, encoded
from tests.support.vllm_drafter import load_drafter
from vllm_dspark.checkpoint import quant_plan
from vllm_dspark.checkpoint.check import check_checkpoint
from vllm_dspark.checkpoint.layout import (
    FP8_RECIPE,
    checkpoint_modules,
    runtime_name,
    tensor_shapes,
)
from vllm_dspark.checkpoint.store import (
    load_config,
    load_drafter_state_dict,
    read_config_json,
    read_quantization_config,
    resolve_checkpoint,
)
from vllm_dspark.checkpoint_tools.quantize import quantize_checkpoint
from vllm_dspark.doctor import checks
from vllm_dspark.findings import Finding

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The runtime linears holding the recipe: gate_proj and up_proj are served fused as gate_up_proj.
RECIPE_RUNTIME = ("self_attn.q_b_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("builds")
    for fmt in ("fp8", "mxfp4", "nvfp4"):
        quantize_checkpoint(tiny_checkpoint, root / fmt, fmt, FP8_RECIPE, progress=False)
    return {fmt: root / fmt for fmt in ("fp8", "mxfp4", "nvfp4")}


@pytest.fixture(scope="module")
def encodings(tmp_path_factory: pytest.TempPathFactory, builds: dict[str, Path]):
    root = tmp_path_factory.mktemp("encodings")
    made: dict[tuple[str, str], Path] = {}

    def get(fmt: str, name: str) -> Path:
        if (fmt, name) not in made:
            encoding = {**SERVED, **WARNED, **{k: v for k, (v, _) in REFUSED.items()}}[name]
            made[fmt, name] = encoded(
                builds[fmt], root / f"{fmt}-{name}", encoding, list(FP8_RECIPE)
            )
        return made[fmt, name]

    return get


def _recipe_modules(model_dir: Path) -> set[str]:
    return {s.name for s in checkpoint_modules(load_config(model_dir)) if s.kind in FP8_RECIPE}


def _doctor(model_dir: Path) -> list[Finding]:
    return checks.check_checkpoint_findings(model_dir)


def _assert_config_plan_is_the_resolvers(model_dir: Path) -> None:
    """The model class's plan (config alone, before any tensor) is the one check finds in the tensors."""
    qc = read_quantization_config(model_dir, read_config_json(model_dir))
    said = quant_plan.config_plan(load_config(model_dir), qc)
    assert said == dataclasses.replace(resolve_checkpoint(model_dir), stray=())


# ----- served and warned: check, doctor, vLLM -----


@pytest.mark.parametrize("name", [*SERVED, *WARNED])
def test_check_and_doctor_pass_every_servable_encoding(encodings, name: str) -> None:
    model_dir = encodings("fp8", name)
    report = check_checkpoint(model_dir)
    assert report.ok, report.problems
    assert set(report.quantized_modules) == _recipe_modules(model_dir)
    _assert_config_plan_is_the_resolvers(model_dir)
    findings = _doctor(model_dir)
    assert not [f for f in findings if f.severity == "error"]
    if name in WARNED:
        (warning,) = report.warnings
        assert "match no module under compressed-tensors' rules" in warning.problem
        assert '"mlp.gate_proj" -> "re:.*layers\\\\.\\\\d+\\\\.mlp\\\\.gate_proj$"' in warning.fix
        assert [f.problem for f in findings] == [warning.problem]
        assert "mlp.gate_proj" in report.render().split("WARNING: ")[1]
    else:
        assert not report.warnings and not findings


@pytest.mark.parametrize("name", [*SERVED, *WARNED])
def test_vllm_serves_every_servable_encoding_with_fp8_on_exactly_the_recipe(
    encodings, tiny_mla_target: Path, name: str
) -> None:
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsW8A16Fp8,
    )

    served = load_drafter(tiny_mla_target, encodings("fp8", name))
    model = served.model
    fp8 = {
        n
        for n, m in model.named_modules()
        if isinstance(m, LinearBase)
        and isinstance(getattr(m, "scheme", None), CompressedTensorsW8A16Fp8)
    }
    # Module-tree names (the prefixes vLLM matched carry the runtime layer numbers 8 and 9).
    assert fp8 == {"model.context_proj"} | {
        f"model.layers.{i}.{kind}"
        for i in range(model.config.num_hidden_layers)
        for kind in RECIPE_RUNTIME
    }
    assert (
        model.quant_config.ignore == []
    )  # one normalized config: exact runtime names, nothing to ignore
    assert (model._quant_plan.warning is not None) == (name in WARNED)


# ----- refused: the same one line from all three -----


@pytest.mark.parametrize("name", list(REFUSED))
def test_conflicting_encodings_are_refused_by_check_doctor_and_vllm_alike(
    encodings, tiny_mla_target: Path, name: str
) -> None:
    model_dir = encodings("fp8", name)
    with pytest.raises(quant_plan.QuantPlanError) as refused:
        resolve_checkpoint(model_dir)
    message, refusal = str(refused.value), refused.value.finding
    assert "\n" not in message and f" {REFUSED[name][1]}" in message and "Fix: " in message

    assert check_checkpoint(model_dir).problems[0] == refusal
    assert [(f.problem, f.fix) for f in _doctor(model_dir) if f.severity == "error"][0] == (
        refusal.problem,
        refusal.fix,
    )
    with pytest.raises(ValueError, match="K3 DSpark drafter") as e:
        load_drafter(tiny_mla_target, model_dir)
    assert message in str(e.value)
    with pytest.raises(ValueError) as e:
        load_drafter_state_dict(model_dir)  # the reference's and the drift harness's loader
    assert message in str(e.value)


def test_serve_time_hook_refuses_a_conflicting_build_before_the_target_loads(
    encodings, tiny_mla_target: Path
) -> None:
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    model_dir = encodings("fp8", "quantizes-bf16")
    args = EngineArgs(
        model=str(tiny_mla_target),
        skip_tokenizer_init=True,
        max_model_len=256,
        speculative_config={
            "method": "dspark",
            "model": str(model_dir),
            "num_speculative_tokens": 7,
            "attention_backend": "TRITON_MLA",
        },
    )
    with pytest.raises(ValueError, match="vllm_dspark doctor") as e:
        args.create_speculative_config(args.create_model_config(), ParallelConfig())
    assert check_checkpoint(model_dir).problems[0].problem in str(e.value)
    # A servable encoding of the same tensors goes through, warning included.
    ok = EngineArgs(
        model=str(tiny_mla_target),
        skip_tokenizer_init=True,
        max_model_len=256,
        speculative_config={
            "method": "dspark",
            "model": str(encodings("fp8", "include-layer-suffixes")),
            "num_speculative_tokens": 7,
            "attention_backend": "TRITON_MLA",
        },
    )
    assert (
        ok.create_speculative_config(ok.create_model_config(), ParallelConfig()).method == "dspark"
    )


# ----- MXFP4 and NVFP4 builds -----


@pytest.mark.vllm_api
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize(
    "name", ["literal", "runtime-index", "linear-class", "include-layer-suffixes"]
)
def test_4bit_builds_resolve_to_the_recipe_at_vllm_runtime_names(
    encodings, fmt: str, name: str
) -> None:
    """vLLM's 4-bit schemes pick a GPU kernel when built, so on CPU this stops at vLLM's scheme lookup."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    from vllm_dspark.runtime.model import PACKED_MODULES_MAPPING

    model_dir = encodings(fmt, name)
    report = check_checkpoint(model_dir)
    assert report.ok, report.problems
    assert report.quantized_modules == dict.fromkeys(_recipe_modules(model_dir), fmt)
    assert bool(report.warnings) == (name in WARNED)
    config = load_config(model_dir)
    start = config.target_num_hidden_layers
    plan = resolve_checkpoint(model_dir)
    quant_config = CompressedTensorsConfig.from_config(
        quant_plan.vllm_quantization_config(plan, config, start_layer_id=start)
    )
    quant_config.packed_modules_mapping = PACKED_MODULES_MAPPING
    is_fmt = quant_config._is_mxfp4 if fmt == "mxfp4" else quant_config._is_nvfp4_format
    runtime = {
        f"model.layers.{start + i}.{kind}"
        for i in range(config.num_hidden_layers)
        for kind in (*RECIPE_RUNTIME, "self_attn.fused_qkv_a_proj", "self_attn.kv_b_proj")
    }
    runtime |= {
        "model.context_proj",
        "model.confidence_head.proj",
        f"model.layers.{start}.self_attn.fused_qkv_a_proj",
    }
    layer = torch.nn.Linear(1, 1)
    for layer_name in sorted(runtime):
        scheme = quant_config.get_scheme_dict(layer, layer_name=layer_name)
        quantized = layer_name == "model.context_proj" or layer_name.endswith(RECIPE_RUNTIME)
        assert (scheme is not None and is_fmt(scheme["weights"])) == quantized, layer_name


# ----- the resolver on its own -----


def _dtypes(config, stored: dict[str, str]) -> dict[str, str]:
    """Header dtypes of a build of ``config`` whose modules ``stored`` ({module: fmt}) are quantized."""
    from vllm_dspark.checkpoint import formats

    out = {}
    for spec in checkpoint_modules(config):
        fmt = stored.get(spec.name)
        if fmt is None:
            out[f"{spec.name}.weight"] = "BF16"
        else:
            out |= {
                f"{spec.name}.{s}": t.dtype_name
                for s, t in formats.get(fmt).tensor_specs(spec.shape).items()
            }
        if spec.bias:
            out[f"{spec.name}.bias"] = "BF16"
    return out


@pytest.fixture(scope="module")
def tiny_fp8(builds):
    config = load_config(builds["fp8"])
    qc = json.loads((builds["fp8"] / "config.json").read_text())["quantization_config"]
    recipe = {s.name: "fp8" for s in checkpoint_modules(config) if s.kind in FP8_RECIPE}
    return config, qc, recipe


def _with_targets(qc: dict, targets: list[str], ignore: list[str] | None = None) -> dict:
    qc = json.loads(json.dumps(qc))
    qc["config_groups"]["group_0"]["targets"] = targets
    if ignore is not None:
        qc["ignore"] = ignore
    return qc


def test_the_quantizers_own_encoding_is_served_as_is(tiny_fp8) -> None:
    config, qc, recipe = tiny_fp8
    plan = quant_plan.resolve(config, qc, _dtypes(config, recipe))
    assert plan.modules == recipe and plan.warning is None and plan.stray == ()


@pytest.mark.parametrize(
    ("entry", "rewrite"),
    [
        ("*.mlp.down_proj", r"re:.*\.mlp\.down_proj$"),
        ("layers.?.mlp.down_proj", r"re:layers\..\.mlp\.down_proj$"),
        ("layers.[!9].mlp.down_[p-p]roj", r"re:layers\.[^9]\.mlp\.down_[p-p]roj$"),
        (r"re:mlp\.down_proj$", r"re:.*(?:mlp\.down_proj$)"),
        (r"re:nothing|mlp\.down_proj$", r"re:.*(?:nothing|mlp\.down_proj$)"),
        ("down_proj", r"re:(.*\.)?down_proj$"),
    ],
)
def test_globs_unanchored_regexes_and_suffixes_are_served_with_their_rewrite(
    tiny_fp8, entry: str, rewrite: str
) -> None:
    config, qc, recipe = tiny_fp8
    targets = [t for t in qc["config_groups"]["group_0"]["targets"] if "down_proj" not in t]
    plan = quant_plan.resolve(config, _with_targets(qc, [*targets, entry]), _dtypes(config, recipe))
    assert plan.modules == recipe and plan.encoding == "compressed-tensors"
    assert plan.warning.fix == f"rewrite them: {json.dumps(entry)} -> {json.dumps(rewrite)}"
    # The model class reads the same config leniently before any tensor: the same plan and warning.
    assert quant_plan.config_plan(config, _with_targets(qc, [*targets, entry])) == plan
    # The rewrite is read by compressed-tensors' rules as meant: no warning any more.
    assert (
        quant_plan.resolve(
            config, _with_targets(qc, [*targets, rewrite]), _dtypes(config, recipe)
        ).warning
        is None
    )


def test_config_plan_names_a_rewrite_that_matches_at_the_runtime_layer_numbers(tiny_fp8) -> None:
    config, qc, recipe = tiny_fp8
    targets = [t for t in qc["config_groups"]["group_0"]["targets"] if "down_proj" not in t]
    last = config.target_num_hidden_layers + config.num_hidden_layers - 1
    entry = rf"re:{last}\.mlp\.down_proj$"  # unanchored: matches only the last layer's runtime name
    plan = quant_plan.config_plan(config, _with_targets(qc, [*targets, entry]))
    first = "layers.0.mlp.down_proj"
    assert plan.modules == {k: v for k, v in recipe.items() if k != first}
    assert (
        plan.warning.fix
        == f"rewrite them: {json.dumps(entry)} -> {json.dumps(f're:.*(?:{entry[3:]})')}"
    )


def test_fused_layer_names_match_their_checkpoint_modules(tiny_fp8) -> None:
    config, qc, recipe = tiny_fp8
    targets = [
        "re:.*gate_up_proj$",
        "re:.*down_proj$",
        "re:.*o_proj$",
        "re:.*q_b_proj$",
        "model.context_proj",
    ]
    plan = quant_plan.resolve(
        config, _with_targets(qc, targets, ["re:.*norm$"]), _dtypes(config, recipe)
    )
    assert plan.modules == recipe
    # Each fused layer by its exact name, at checkpoint and at runtime layer numbers.
    exact = [t for t in targets if "gate_up" not in t]
    exact += [
        "layers.0.mlp.gate_up_proj",
        f"layers.{config.target_num_hidden_layers + 1}.mlp.gate_up_proj",
    ]
    plan = quant_plan.resolve(config, _with_targets(qc, exact, []), _dtypes(config, recipe))
    assert plan.modules == recipe
    assert quant_plan.config_plan(config, _with_targets(qc, exact, [])) == plan
    # A config naming one member of a fused layer builds the whole fused layer in its format.
    halves = [t for t in targets if "gate_up" not in t] + ["re:.*gate_proj$"]
    assert quant_plan.config_plan(config, _with_targets(qc, halves, [])).modules == recipe
    # context_kv_proj names every layer's kv_a_proj_with_mqa, which is stored BF16: a conflict.
    with pytest.raises(
        quant_plan.QuantPlanError,
        match=r"layers\.0\.self_attn\.kv_a_proj_with_mqa is stored BF16, "
        r"but quantization_config quantizes it as fp8 \(target 'context_kv_proj'\)",
    ):
        quant_plan.resolve(
            config, _with_targets(qc, [*targets, "context_kv_proj"], []), _dtypes(config, recipe)
        )


@pytest.mark.parametrize(
    ("stored", "message"),
    [
        (
            {"layers.0.mlp.gate_proj": "fp8"},
            r"layers\.0\.mlp\.gate_up_proj: the shards store layers\.0\.mlp\.gate_proj as "
            r"fp8, layers\.0\.mlp\.up_proj as BF16, but vLLM fuses them into one layer",
        ),
        (
            {"layers.0.self_attn.q_a_proj": "fp8", "layers.0.self_attn.kv_a_proj_with_mqa": "fp8"},
            r"self_attn\.fused_qkv_a_proj: .* \(context_kv_proj stacks every layer's kv_a_proj_with_mqa\)",
        ),
        (
            {"markov_head.markov_w2": "fp8"},
            r"markov_head\.markov_w2 is stored as fp8, but the Markov head's bias",
        ),
    ],
)
def test_storage_no_config_can_serve_is_refused(
    tiny_fp8, stored: dict[str, str], message: str
) -> None:
    config, qc, _ = tiny_fp8
    with pytest.raises(quant_plan.QuantPlanError, match=message):
        quant_plan.resolve(config, _with_targets(qc, ["Linear"], []), _dtypes(config, stored))


def test_format_and_missing_config_conflicts(tiny_fp8) -> None:
    config, qc, recipe = tiny_fp8
    mxfp4 = dict.fromkeys(recipe, "mxfp4")
    with pytest.raises(
        quant_plan.QuantPlanError,
        match=r"context_proj is stored as mxfp4, but quantization_config "
        r"says fp8 .* \(and 10 more module\(s\)\)",
    ):
        quant_plan.resolve(config, qc, _dtypes(config, mxfp4))
    with pytest.raises(
        quant_plan.QuantPlanError,
        match=r"context_proj is stored as fp8 \(11 quantized modules\), but "
        "config.json has no quantization_config",
    ):
        quant_plan.resolve(config, None, _dtypes(config, recipe))
    assert quant_plan.resolve(config, None, _dtypes(config, {})).modules == {}


def _refusal(config, qc, dtypes) -> Finding:
    with pytest.raises(quant_plan.QuantPlanError) as e:
        quant_plan.resolve(config, qc, dtypes)
    return e.value.finding


def _without(dtypes: dict[str, str], *modules: str) -> dict[str, str]:
    return {k: v for k, v in dtypes.items() if k.rpartition(".")[0] not in modules}


def test_modules_without_tensors_or_in_no_format_are_left_to_the_tensor_checks(tiny_fp8) -> None:
    """A module with no tensors, or tensors of no format, is neither BF16 nor quantized here:
    ``check``'s tensor list names it (the plan must not turn it into a config conflict)."""
    config, qc, recipe = tiny_fp8
    missing = ("layers.0.mlp.down_proj", "layers.0.mlp.up_proj", "layers.0.input_layernorm")
    dtypes = _without(_dtypes(config, recipe), *missing)
    dtypes |= {"layers.1.mlp.down_proj.weight": "I8"}  # not F8: no format, not BF16
    dtypes |= {"layers.1.mlp.up_proj.weight": "BF16", "layers.1.mlp.up_proj.weight_packed": "I32"}
    del dtypes["layers.1.mlp.up_proj.weight_scale"]
    plan = quant_plan.resolve(config, qc, dtypes)
    unknown = {*missing, "layers.1.mlp.down_proj", "layers.1.mlp.up_proj"}
    assert plan.modules == {m: f for m, f in recipe.items() if m not in unknown}
    assert plan.encoding == "compressed-tensors" and plan.warning is None


def test_split_fused_layers_name_why(tiny_fp8) -> None:
    config, qc, _ = tiny_fp8
    gate = _refusal(
        config,
        _with_targets(qc, ["Linear"], []),
        _dtypes(config, {"layers.0.mlp.gate_proj": "fp8"}),
    )
    assert gate.problem == (
        "the shards store layers.0.mlp.gate_proj as fp8, layers.0.mlp.up_proj as BF16, but vLLM "
        "fuses them into one layer, which takes one scheme"
    )
    stored = {"layers.0.self_attn.q_a_proj": "fp8", "layers.0.self_attn.kv_a_proj_with_mqa": "fp8"}
    qkv_a = _refusal(config, _with_targets(qc, ["Linear"], []), _dtypes(config, stored))
    assert qkv_a.problem.endswith(
        "one scheme (context_kv_proj stacks every layer's kv_a_proj_with_mqa)"
    )


def test_disagreements_name_the_first_module_and_count_the_rest(tiny_fp8) -> None:
    config, qc, recipe = tiny_fp8
    targets = qc["config_groups"]["group_0"]["targets"]
    no_context = _with_targets(qc, [t for t in targets if "context_proj" not in t])
    one = _refusal(config, no_context, _dtypes(config, recipe))
    assert one.problem == (
        "quantization_config and the stored tensors disagree: context_proj is stored as fp8, but "
        "quantization_config leaves it unquantized (no target matches it)"
    )
    assert one.fix.startswith("use the config.json written with these shards")
    no_down = [t for t in targets if "context_proj" not in t and "down_proj" not in t]
    three = _refusal(config, _with_targets(qc, no_down), _dtypes(config, recipe))
    assert three.problem.endswith(
        "leaves it unquantized (no target matches it) (and 2 more module(s))"
    )
    two = _refusal(
        config, _with_targets(qc, [*no_down, "layers.1.mlp.down_proj"]), _dtypes(config, recipe)
    )
    assert two.problem.endswith("(and 1 more module(s))")


@pytest.mark.parametrize("entry", [r"re:^nothing|mlp\.down_proj$", r"re:.*nothing|mlp\.down_proj$"])
def test_anchored_regexes_are_meant_literally(tiny_fp8, entry: str) -> None:
    """A dead ``re:`` entry that starts with ``^`` or ``.*`` was anchored on purpose: refused, not reread."""
    config, qc, recipe = tiny_fp8
    targets = [t for t in qc["config_groups"]["group_0"]["targets"] if "down_proj" not in t]
    finding = _refusal(config, _with_targets(qc, [*targets, entry]), _dtypes(config, recipe))
    assert "layers.0.mlp.down_proj is stored as fp8" in finding.problem


def test_lenient_readings_list_only_the_entries_they_use(tiny_fp8) -> None:
    """Runtime layer numbers count: an exact runtime name is live, a glob over runtime names is used."""
    config, qc, recipe = tiny_fp8
    first, second = config.target_num_hidden_layers, config.target_num_hidden_layers + 1
    targets = [t for t in qc["config_groups"]["group_0"]["targets"] if "down_proj" not in t]
    targets += [
        f"layers.{first}.mlp.down_proj",
        f"layers.[{second}].mlp.down_proj",
        "*.no_such_proj",
    ]
    dtypes = {**_dtypes(config, recipe), "lm_head.weight": "BF16"}
    plan = quant_plan.resolve(config, _with_targets(qc, targets), dtypes)
    assert plan.modules == recipe and plan.stray == ("lm_head.weight",)
    assert plan.warning.fix == (
        f'rewrite them: "layers.[{second}].mlp.down_proj" -> "re:layers\\\\.[{second}]\\\\.mlp\\\\.down_proj$"'
    )
    both = [t for t in targets if t.startswith("re:")] + ["*.mlp.down_proj", "down_proj"]
    plan = quant_plan.resolve(config, _with_targets(qc, both), dtypes)
    assert plan.warning.fix == (
        'rewrite them: "*.mlp.down_proj" -> "re:.*\\\\.mlp\\\\.down_proj$", '
        '"down_proj" -> "re:(.*\\\\.)?down_proj$"'
    )


def test_stray_tensors_are_kept_aside_on_every_path(tiny_fp8) -> None:
    config, qc, recipe = tiny_fp8
    stray = {"lm_head.weight": "BF16"}
    assert quant_plan.resolve(config, None, {**_dtypes(config, {}), **stray}).stray == tuple(stray)
    assert quant_plan.resolve(config, qc, {**_dtypes(config, recipe), **stray}).stray == tuple(
        stray
    )


def test_is_stray_is_the_lm_head_and_a_disabled_confidence_head(tiny_fp8) -> None:
    config, _, _ = tiny_fp8
    assert config.enable_confidence_head
    disabled = copy.deepcopy(config)
    disabled.enable_confidence_head = False
    for cfg in (config, disabled):
        assert quant_plan.is_stray("lm_head.weight", cfg)
        assert not quant_plan.is_stray("layers.0.mlp.up_proj.weight", cfg)
    assert not quant_plan.is_stray("confidence_head.proj.weight", config)
    assert quant_plan.is_stray("confidence_head.proj.weight", disabled)


def test_a_config_without_the_targets_depth_reads_checkpoint_names(tiny_fp8) -> None:
    from vllm_dspark.config import K3DSparkConfig

    config, qc, recipe = tiny_fp8
    fields = {k: v for k, v in config.to_dict().items() if k != "target_num_hidden_layers"}
    shallow = K3DSparkConfig.from_dict(fields)
    assert not hasattr(shallow, "target_num_hidden_layers")
    assert quant_plan.resolve(shallow, qc, _dtypes(config, recipe)).modules == recipe
    assert quant_plan.declared(shallow, qc) == recipe
    assert quant_plan.config_plan(shallow, qc) == quant_plan.QuantPlan(recipe)


def test_declared_reads_the_config_alone(tiny_fp8) -> None:
    config, qc, recipe = tiny_fp8
    assert quant_plan.declared(config, qc) == recipe
    assert quant_plan.config_plan(config, qc) == quant_plan.QuantPlan(recipe)
    assert quant_plan.config_plan(config, None) == quant_plan.QuantPlan()
    runtime = [f"layers.{config.target_num_hidden_layers}.mlp.down_proj"]
    assert quant_plan.declared(config, _with_targets(qc, runtime, [])) == {
        "layers.0.mlp.down_proj": "fp8"
    }


def test_fused_scale_conflicts_name_each_differing_fused_layer() -> None:
    scales = {
        "layers.0.mlp.gate_proj": 1.0,
        "layers.0.mlp.up_proj": 2.5,
        "layers.1.mlp.gate_proj": 3.0,
        "layers.1.mlp.up_proj": 3.0,
    }
    (finding,) = quant_plan.fused_scale_conflicts(scales, "weight_scale_2")
    assert finding.where == "layers.0.mlp.gate_up_proj"
    assert finding.problem == (
        "NVFP4 weight_scale_2 differs across the fused modules (layers.0.mlp.gate_proj=1, "
        "layers.0.mlp.up_proj=2.5), but vLLM applies one global scale to the fused layer (without "
        "rescaling the block scales)"
    )


def test_normalized_config_names_runtime_modules(tiny_fp8) -> None:
    config, qc, recipe = tiny_fp8
    plan = quant_plan.resolve(config, qc, _dtypes(config, recipe))
    normalized = quant_plan.vllm_quantization_config(plan, config, start_layer_id=93)
    (group,) = normalized["config_groups"].values()
    specs = [s for s in checkpoint_modules(config) if s.name in recipe]
    assert group["targets"] == [runtime_name(s, 93) for s in specs] and normalized["ignore"] == []
    assert "model.layers.94.mlp.up_proj" in group["targets"]
    drafted = quant_plan.vllm_quantization_config(plan, config, start_layer_id=93, prefix="draft")
    assert next(iter(drafted["config_groups"].values()))["targets"] == [
        runtime_name(s, 93, "draft") for s in specs
    ]
    assert (
        quant_plan.vllm_quantization_config(quant_plan.QuantPlan(), config, start_layer_id=93)
        is None
    )


# ----- stray tensors -----


def test_stray_lm_head_and_disabled_confidence_head_are_skipped_with_one_warning(
    tmp_path: Path, builds, tiny_mla_target: Path
) -> None:
    model_dir = tmp_path / "stray"
    shutil.copytree(builds["fp8"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["enable_confidence_head"]
    config["enable_confidence_head"] = config["confidence_head_with_markov"] = False
    (model_dir / "config.json").write_text(json.dumps(config))
    lm_head = torch.zeros(config["vocab_size"], config["hidden_size"], dtype=torch.bfloat16)
    save_file(
        {"lm_head.weight": lm_head},
        model_dir / "model-extra.safetensors",
        metadata={"format": "pt"},
    )
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "model-extra.safetensors"
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))

    report = check_checkpoint(model_dir)
    assert report.ok, report.problems
    (warning,) = report.warnings
    assert (
        "skipping 3 stored tensor(s) the drafter does not use (confidence_head.proj.bias, "
        "confidence_head.proj.weight, lm_head.weight)" in warning.problem
    )
    loaded_config, state_dict = load_drafter_state_dict(model_dir)
    assert set(state_dict) == set(tensor_shapes(loaded_config))
    served = load_drafter(tiny_mla_target, model_dir)
    assert served.model.model.confidence_head is None and len(served.model._quant_plan.stray) == 3


def test_eval_reads_builds_through_the_resolver(encodings, builds, tiny_checkpoint: Path) -> None:
    from vllm_dspark.drift.variants import load_reference, load_variant

    with pytest.raises(ValueError, match="is quantized; --model must be the unquantized drafter"):
        load_reference(str(encodings("fp8", "linear-class")))
    config, reference, heads = load_reference(str(tiny_checkpoint))
    _, source = load_variant(
        str(encodings("fp8", "include-layer-suffixes")),
        str(tiny_checkpoint),
        config,
        heads,
        reference,
    )
    assert "(quantized: fp8), in BF16" in source


# ----- ModelOpt -----

_ATTN_A = ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")


@pytest.fixture(scope="module")
def modelopt_builds(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path):
    """ModelOpt-layout builds of ``tiny``: every linear, or all but q_a/kv_a, or all but context_proj."""
    from vllm_dspark.checkpoint.layout import MODULE_SETS

    root = tmp_path_factory.mktemp("modelopt")
    made: dict[tuple[str, tuple[str, ...]], Path] = {}

    def get(fmt: str, leave_out: tuple[str, ...] = ()) -> Path:
        if (fmt, leave_out) not in made:
            kinds = [k for k in MODULE_SETS["modelopt"] if k not in leave_out]
            out = root / f"{fmt}-{len(made)}"
            quantize_checkpoint(tiny_checkpoint, out, fmt, kinds, progress=False, export="modelopt")
            made[fmt, leave_out] = out
        return made[fmt, leave_out]

    return get


def _modelopt_rewritten(source: Path, dest: Path, edit) -> Path:
    """A copy of ModelOpt build ``source`` whose config.json's quantization_config ``edit`` rewrites."""
    shutil.copytree(source, dest)
    raw = json.loads((dest / "config.json").read_text())
    edit(raw["quantization_config"])
    (dest / "config.json").write_text(json.dumps(raw))
    return dest


@pytest.mark.parametrize("fmt", ["fp8-static", "fp8-dynamic", "nvfp4-w4a4", "nvfp4"])
@pytest.mark.parametrize(
    "leave_out", [(), _ATTN_A, ("context_proj",)], ids=["full", "qa-kva", "ctx"]
)
def test_modelopt_builds_check_doctor_and_resolver_agree(
    modelopt_builds, fmt: str, leave_out: tuple[str, ...]
) -> None:
    model_dir = modelopt_builds(fmt, leave_out)
    plan = resolve_checkpoint(model_dir)
    config = load_config(model_dir)
    expected = {
        s.name for s in checkpoint_modules(config) if s.quantizable and s.kind not in leave_out
    }
    assert plan.encoding == "modelopt" and plan.modules == dict.fromkeys(expected, fmt)
    _assert_config_plan_is_the_resolvers(model_dir)
    report = check_checkpoint(model_dir)
    assert report.ok, report.problems
    assert report.quantized_modules == plan.modules and "ModelOpt" in report.render()
    assert not [f for f in _doctor(model_dir) if f.severity == "error"]
    # The reference dequantizes every module (nothing left quantized, nothing missing).
    _, state = load_drafter_state_dict(model_dir, dtype=None)
    assert all(state[f"{m}.weight"].dtype == torch.float32 for m in expected)


def test_modelopt_config_only_in_hf_quant_config_json_reads_the_same(
    modelopt_builds, tmp_path: Path
) -> None:
    source = modelopt_builds("fp8-dynamic", _ATTN_A)
    model_dir = tmp_path / "hf_quant_config_only"
    shutil.copytree(source, model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    del raw["quantization_config"]
    (model_dir / "config.json").write_text(json.dumps(raw))
    assert resolve_checkpoint(model_dir) == resolve_checkpoint(source)
    assert check_checkpoint(model_dir).ok
    (model_dir / "hf_quant_config.json").unlink()
    with pytest.raises(quant_plan.QuantPlanError, match="config.json has no quantization_config"):
        resolve_checkpoint(model_dir)


def _drop_excludes(words: tuple[str, ...]):
    def edit(qc: dict) -> None:
        for key in ("ignore", "exclude_modules"):
            qc[key] = [e for e in qc[key] if not any(w in e for w in words)]

    return edit


def _exclude(entry: str):
    def edit(qc: dict) -> None:
        for key in ("ignore", "exclude_modules"):
            qc[key].append(entry)

    return edit


def _algo(algo: str):
    def edit(qc: dict) -> None:
        qc["quant_algo"] = algo

    return edit


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (_drop_excludes(("q_a_proj", "kv_a_proj")), "is stored BF16, but quantization_config"),
        (_exclude("*mlp.down_proj"), "but quantization_config leaves it unquantized"),
        (_drop_excludes(("markov_head",)), "so it is stored BF16 and must stay so"),
        (_algo("NVFP4"), "but quantization_config says nvfp4-w4a4"),
    ],
    ids=["qa-kva-not-excluded", "down-excluded", "heads-not-excluded", "algo"],
)
def test_conflicting_modelopt_builds_are_refused_by_check_doctor_and_vllm_alike(
    modelopt_builds, tmp_path: Path, tiny_mla_target: Path, edit, said: str
) -> None:
    model_dir = _modelopt_rewritten(modelopt_builds("fp8-dynamic", _ATTN_A), tmp_path / "b", edit)
    with pytest.raises(quant_plan.QuantPlanError) as refused:
        resolve_checkpoint(model_dir)
    message, refusal = str(refused.value), refused.value.finding
    assert "\n" not in message and said in message and "Fix: " in message
    assert check_checkpoint(model_dir).problems[0] == refusal
    doctor = [(f.problem, f.fix) for f in _doctor(model_dir) if f.severity == "error"]
    assert doctor[0] == (refusal.problem, refusal.fix)
    with pytest.raises(ValueError, match="K3 DSpark drafter") as e:
        load_drafter(tiny_mla_target, model_dir, dtype="bfloat16")
    assert message in str(e.value)


def test_modelopt_normalized_config_excludes_the_runtime_names(modelopt_builds) -> None:
    model_dir = modelopt_builds("fp8-dynamic", _ATTN_A)
    config, plan = load_config(model_dir), resolve_checkpoint(model_dir)
    normalized = quant_plan.vllm_quantization_config(plan, config, start_layer_id=93)
    assert normalized["quant_method"] == "modelopt"
    assert normalized["quant_algo"] == "FP8_PER_CHANNEL_PER_TOKEN"
    bf16 = [
        s for s in checkpoint_modules(config) if s.role == "linear" and s.name not in plan.modules
    ]
    assert normalized["ignore"] == [runtime_name(s, 93) for s in bf16]
    assert "model.layers.94.self_attn.q_a_proj" in normalized["ignore"]
    assert not any(".layers.0." in e or e.startswith("*") for e in normalized["ignore"])
    drafted = quant_plan.vllm_quantization_config(plan, config, start_layer_id=93, prefix="draft")
    assert drafted["ignore"] == [runtime_name(s, 93, "draft") for s in bf16]
    # The formats vLLM needs kernels for, read from the config alone.
    assert quant_plan.config_formats(normalized) == ("modelopt", {"fp8-dynamic"})
    qc = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    assert quant_plan.config_formats(qc) == ("modelopt", {"fp8-dynamic"})


def test_config_formats_names_every_group_of_a_compressed_tensors_config() -> None:
    from vllm_dspark.checkpoint import quant_config

    qc = quant_config.compressed_tensors_config(
        {
            "fp8": ["model.layers.8.mlp.down_proj"],
            "nvfp4-w4a4": ["model.layers.8.mlp.gate_up_proj"],
        },
        ignore=[],
    )
    assert quant_plan.config_formats(qc) == ("compressed-tensors", {"fp8", "nvfp4-w4a4"})
    with pytest.raises(quant_plan.QuantPlanError, match="quant_method"):
        quant_plan.config_formats({"quant_method": "gptq"})


@pytest.mark.vllm_api
@pytest.mark.parametrize("fmt", ["fp8-static", "fp8-dynamic", "nvfp4-w4a4", "nvfp4"])
def test_vllms_modelopt_config_excludes_exactly_the_bf16_modules_at_runtime_names(
    modelopt_builds, fmt: str
) -> None:
    """Each wheel's own ModelOpt config, from the normalized one, quantizes exactly the stored-quantized
    runtime layers; read from the checkpoint's excludes (checkpoint layer numbers) it would quantize
    the BF16 q_a/kv_a too: the in-tree mis-build the normalization prevents."""
    from vllm.model_executor.layers.quantization.modelopt import (
        ModelOptFp8Config,
        ModelOptNvFp4Config,
    )

    from vllm_dspark.runtime.model import PACKED_MODULES_MAPPING

    model_dir = modelopt_builds(fmt, _ATTN_A)
    config, plan = load_config(model_dir), resolve_checkpoint(model_dir)
    start = config.target_num_hidden_layers
    normalized = quant_plan.vllm_quantization_config(plan, config, start_layer_id=start)
    stored = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    cls = ModelOptNvFp4Config if "nvfp4" in fmt else ModelOptFp8Config
    ours, in_tree = cls.from_config(normalized), cls.from_config(stored)
    for quant_config in (ours, in_tree):
        quant_config.packed_modules_mapping = PACKED_MODULES_MAPPING
    fused_a = [
        f"model.layers.{start + i}.self_attn.fused_qkv_a_proj"
        for i in range(config.num_hidden_layers)
    ]
    quantized = [
        f"model.layers.{start + i}.{kind}"
        for i in range(config.num_hidden_layers)
        for kind in (*RECIPE_RUNTIME, "self_attn.kv_b_proj")
    ] + ["model.context_proj"]
    for prefix in fused_a:
        assert ours.is_layer_excluded(prefix) and not in_tree.is_layer_excluded(prefix), prefix
    for prefix in quantized:
        assert not ours.is_layer_excluded(prefix) and not in_tree.is_layer_excluded(prefix), prefix


def test_modelopt_nvfp4_with_its_own_scale_per_fused_shard_is_refused_by_check_doctor_and_vllm(
    modelopt_builds, tiny_checkpoint: Path, tiny_mla_target: Path, tmp_path: Path
) -> None:
    """ModelOpt's drafter quantizer scales gate and up alone; vLLM's NVFP4 linear takes the larger
    weight_scale_2 for the fused layer without rescaling the block scales: a silently wrong model."""
    from safetensors.torch import load_file

    from vllm_dspark.checkpoint import modelopt

    model_dir = tmp_path / "own-scales"
    shutil.copytree(modelopt_builds("nvfp4"), model_dir)
    (shard,) = model_dir.glob("*.safetensors")
    tensors = load_file(shard)
    source = load_file(next(tiny_checkpoint.glob("*.safetensors")))
    # The shard with the smaller amax gets its own, smaller scale.
    shard_name = min(
        ("layers.0.mlp.gate_proj", "layers.0.mlp.up_proj"),
        key=lambda m: float(source[f"{m}.weight"].float().abs().max()),
    )
    own = modelopt.quantize(source[f"{shard_name}.weight"], "nvfp4")
    tensors.update({f"{shard_name}.{suffix}": t for suffix, t in own.items()})
    save_file(tensors, shard, metadata={"format": "pt"})

    (problem,) = [p for p in check_checkpoint(model_dir).problems if "differs" in p.problem]
    assert problem.problem.startswith("NVFP4 weight_scale_2 differs across the fused modules")
    assert problem.where == "layers.0.mlp.gate_up_proj"
    (doctor,) = [f for f in _doctor(model_dir) if f.severity == "error"]
    assert doctor.problem.endswith(problem.problem) and doctor.fix == problem.fix
    with pytest.raises(ValueError, match="NVFP4 weight_scale_2 differs across the fused modules"):
        load_drafter(tiny_mla_target, model_dir, dtype="bfloat16")


@pytest.mark.parametrize(
    "entry",
    [
        "Linear",
        "Embedding",
        "RMSNorm",
        "Module",
        "LinearBase",
        "layers.0.mlp.down_proj",
        "mlp.down_proj",
        "re:.*mlp\\.down_proj$",
        "re:layers\\.0\\..*",
        "re:mlp",
        "re:.*norm",
    ],
)
def test_is_match_is_compressed_tensors_own(entry: str) -> None:
    """quant_plan matches config entries as compressed-tensors does, without importing it."""
    from compressed_tensors.utils.match import is_match

    names = ["layers.0.mlp.down_proj", "model.layers.0.mlp.down_proj", "norm", "embed_tokens"]
    for role in ("linear", "embedding", "norm"):
        module = quant_plan._stand_in(role)
        for name in names:
            assert quant_plan.is_match(name, role, entry) == is_match(name, module, entry), (
                role,
                name,
            )


def test_the_quantizers_own_config_is_read_without_compressed_tensors() -> None:
    """`vllm-dspark quantize`'s quantization_config gives the formats compressed-tensors' reading
    gives; any other config (a field more, a group changed) goes to compressed-tensors."""
    from vllm_dspark.checkpoint import formats, quant_config

    for fmt in formats.REGISTRY:
        qc = quant_config.compressed_tensors_config(
            {fmt: ["re:.*mlp\\.down_proj$"]}, ignore=["re:.*embed_tokens$"]
        )
        assert (
            quant_config.own_group_formats(qc) == quant_config.group_formats(qc) == {"group_0": fmt}
        )
        assert quant_config.own_group_formats({**qc, "version": "0.12"}) is None
        changed = copy.deepcopy(qc)
        changed["config_groups"]["group_0"]["weights"]["num_bits"] = 3
        assert quant_config.own_group_formats(changed) is None
    mixed = quant_config.compressed_tensors_config(
        {"fp8": ["re:.*o_proj$"], "nvfp4": ["re:.*down_proj$"]}, ignore=[]
    )
    assert quant_config.own_group_formats(mixed) == quant_config.group_formats(mixed)
