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
