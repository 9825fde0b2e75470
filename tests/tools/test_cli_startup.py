# SPDX-License-Identifier: Apache-2.0
"""Each command pays only for what it uses: ``--help`` imports no torch, transformers,
compressed-tensors, safetensors' torch half or vLLM (the register benchmark times it)."""

from __future__ import annotations

import json
import subprocess
import sys

from vllm_dspark.tools.cli import COMMANDS

HEAVY = ("torch", "transformers", "compressed_tensors", "safetensors.torch", "vllm", "numpy")

_PROBE = """
import contextlib, io, json, sys
from vllm_dspark.tools.cli import main
helps = {}
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    helps[" ".join(argv)] = [code, out.getvalue()]
print(json.dumps({"helps": helps, "heavy": [m for m in json.loads(sys.argv[2]) if m in sys.modules]}))
"""


def test_help_of_every_command_imports_no_heavy_library() -> None:
    argvs = [["--help"], *([name, "--help"] for name in COMMANDS)]
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(argvs), json.dumps(HEAVY)],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for argv, (code, text) in report["helps"].items():
        assert code in (0, None) and "usage:" in text, (argv, code, text[:200])
    assert report["heavy"] == []


def test_running_a_command_still_loads_what_it_needs(tmp_path) -> None:
    """The lazy imports are real: a command past its parser imports its libraries and works."""
    from vllm_dspark.tools.cli import main

    out = tmp_path / "drafter"
    assert main(["make-random", "--preset", "tiny", "--out", str(out), "--quiet"]) == 0
    assert main(["check", str(out)]) == 0


def test_every_command_spells_the_shared_flags_the_same_way() -> None:
    """--out, --seed, --overwrite, --no-progress and --debug come from one place; old spellings still parse."""
    import importlib

    from vllm_dspark.tools.cli import COMMANDS

    helps = {}
    for name, (module, _) in COMMANDS.items():
        parser = importlib.import_module(module).build_parser()
        helps[name] = {a.dest: a for a in parser._actions}
    assert all("debug" in h for h in helps.values())
    seen = {
        dest: {repr((a.option_strings, a.help)) for h in helps.values() if (a := h.get(dest))}
        for dest in ("seed", "overwrite", "no_progress", "debug")
    }
    assert all(len(spellings) == 1 for spellings in seen.values()), seen

    quantize = importlib.import_module(COMMANDS["quantize"][0]).build_parser()
    base = ["--model-dir", "m", "--quant-format", "fp8"]
    for flag in ("--out", "--output-dir", "--output_dir"):
        assert str(quantize.parse_args([*base, flag, "o"]).out) == "o"
    make_random = importlib.import_module(COMMANDS["make-random"][0]).build_parser()
    for flag in ("--no-progress", "--quiet"):
        assert make_random.parse_args(["--preset", "tiny", "--out", "o", flag]).no_progress


def test_every_command_spells_the_model_directory_the_same_way(capsys) -> None:
    """--model DIR names the model directory a command works on; --model-dir (quantize's older
    spelling, --model_dir too) is an alias everywhere, and check and serve-cpu also take it bare."""
    import importlib

    import pytest

    def parser(name: str):
        return importlib.import_module(COMMANDS[name][0]).build_parser()

    rest = {
        "check": [],
        "quantize": ["--quant-format", "fp8", "--out", "o"],
        "eval": ["--out", "o"],
        "draft": ["--inputs", "i", "--out", "o"],
        "serve-cpu": ["--drafter", "d"],
    }
    for name, extra in rest.items():
        for flag in ("--model", "--model-dir", "--model_dir"):
            args, _ = parser(name).parse_known_args([flag, "m", *extra])
            assert str(args.model) == "m", (name, flag)
    for name in ("check", "serve-cpu"):
        args, _ = parser(name).parse_known_args(["m", *rest[name]])
        assert str(args.model) == "m" and "_model_positional" not in vars(args)
        for argv in ([], ["m", "--model", "n"]):
            with pytest.raises(SystemExit) as e:
                parser(name).parse_known_args([*argv, *rest[name]])
            assert e.value.code == 2, (name, argv)
    assert "--model-dir is an alias" in " ".join(parser("check").format_help().split())


def test_bare_command_prints_the_usage_and_exits_2(capsys) -> None:
    from vllm_dspark.tools.cli import main

    assert main([]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("usage: vllm-dspark COMMAND")
    assert main(["--help"]) == 0 and capsys.readouterr().out.startswith("usage:")


def test_help_is_plain_text_with_every_default_shown() -> None:
    """Help built from a module docstring shows no reST (``x``, :mod:`x`); serve-cpu names its defaults."""
    import importlib
    import re

    for name, (module, _) in COMMANDS.items():
        text = importlib.import_module(module).build_parser().format_help()
        assert "``" not in text and not re.search(r":[a-z]+:`", text), name
    serve = " ".join(
        importlib.import_module(COMMANDS["serve-cpu"][0]).build_parser().format_help().split()
    )
    assert "(default 127.0.0.1)" in serve and "(default 8000)" in serve


_CHECK_PROBE = """
import json, sys
from vllm_dspark.tools.cli import main
code = main(["check", sys.argv[1]])
print(json.dumps({"code": code, "heavy": [m for m in json.loads(sys.argv[2]) if m in sys.modules]}))
"""


def _check_imports(model_dir) -> tuple[int, list[str]]:
    """``vllm-dspark check MODEL_DIR`` in a fresh interpreter: its exit code and the heavy modules it imported."""
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK_PROBE, str(model_dir), json.dumps(HEAVY)],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return report["code"], report["heavy"]


# What a check of a BF16 or FP8 drafter does without: it reads headers and scales with the standard
# library and numpy.
_NOT_FOR_CHECK = {"torch", "transformers", "compressed_tensors", "vllm"}


def test_check_imports_what_the_drafters_format_needs(tmp_path) -> None:
    """`check` reads config.json, shard headers and scales without torch, transformers,
    compressed-tensors or vLLM: a BF16 drafter (the trained pair's: not even numpy, it has no scales),
    `vllm-dspark quantize`'s compressed-tensors FP8 build and a ModelOpt one. Only a compressed-tensors
    config written otherwise needs compressed-tensors (which imports torch and transformers) to read
    it, and still no vLLM. The benchmarks time it (`python -m benchmarks check`)."""
    from pathlib import Path

    from vllm_dspark.checkpoint_tools.quantize import quantize_checkpoint

    pair = Path(__file__).resolve().parents[1] / "data" / "pair" / "drafter"
    code, heavy = _check_imports(pair)
    assert code == 0 and heavy == [], heavy

    modelopt = tmp_path / "modelopt"
    quantize_checkpoint(pair, modelopt, "fp8-static", progress=False, export="modelopt")
    code, heavy = _check_imports(modelopt)
    assert code == 0 and not _NOT_FOR_CHECK & set(heavy), heavy

    fp8 = tmp_path / "fp8"
    quantize_checkpoint(pair, fp8, "fp8", progress=False)
    code, heavy = _check_imports(fp8)
    assert code == 0 and not _NOT_FOR_CHECK & set(heavy), heavy

    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"]["version"] = "0.12.2"  # as llm-compressor writes it
    (fp8 / "config.json").write_text(json.dumps(config))
    code, heavy = _check_imports(fp8)
    assert code == 0 and "compressed_tensors" in heavy and "vllm" not in heavy, heavy
