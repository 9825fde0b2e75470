# SPDX-License-Identifier: Apache-2.0
"""What the docs and the doctor's fixes tell a pip user to run ships in the wheel: a command naming a
file under ``examples/`` (which the wheel lacks) appears only where the text says it is for a
checkout, every such file exists, and every ``vllm-dspark COMMAND`` they name is a command.
(examples/README.md is left out: the wheel lacks it, so it is for a checkout throughout.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from vllm_dspark.tools.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FIXES = ROOT / "vllm_dspark" / "doctor" / "checks.py"

EXAMPLE_FILE = re.compile(r"(?<![\w./-])(?:\.\./|\./)?examples/[\w./-]*\w")
# Text that is for a checkout alone; "from a checkout or its wheel" is for pip users too.
CHECKOUT = re.compile(r"\b(?:in|from) a checkout\b(?! or)", re.I)
FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
VLLM_DSPARK = re.compile(r"\bvllm-dspark ([a-z][\w-]*)")


def blocks(text: str) -> list[str]:
    """The page's fenced code blocks and its blank-line separated paragraphs, in order."""
    found, start = [], 0
    for fence in FENCE.finditer(text):
        found += re.split(r"\n[ \t]*\n", text[start : fence.start()])
        found.append(fence.group())
        start = fence.end()
    return [b for b in [*found, *re.split(r"\n[ \t]*\n", text[start:])] if b.strip()]


def code(block: str) -> list[str]:
    """What a block shows as code: a fenced or indented block whole, else its inline code spans."""
    if block.startswith("```") or all(
        line.startswith(("    ", "\t")) for line in block.splitlines() if line.strip()
    ):
        return [block]
    return INLINE_CODE.findall(block)


def pip_user_example_commands(text: str) -> list[str]:
    """Each ``examples/`` file the text shows as code outside a checkout's context (this block or
    the one before it)."""
    found, previous = [], ""
    for block in blocks(text):
        if not CHECKOUT.search(previous + block):
            found += [m for snippet in code(block) for m in EXAMPLE_FILE.findall(snippet)]
        previous = block
    return found


def fix_strings() -> list[str]:
    """Every string the doctor's checks hold, its f-strings' literal parts joined."""
    strings = []
    for node in ast.walk(ast.parse(FIXES.read_text())):
        if isinstance(node, ast.JoinedStr):
            strings.append("".join(v.value for v in node.values if isinstance(v, ast.Constant)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            strings.append(node.value)
    return strings


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_sends_a_pip_user_to_examples(page: Path) -> None:
    text = page.read_text()
    assert pip_user_example_commands(text) == [], (
        f"{page.name} shows these as code outside a checkout's context; name the `vllm-dspark` "
        "command, or say the text is for a checkout ('in a checkout', 'from a checkout')"
    )
    missing = {p for p in EXAMPLE_FILE.findall(text) if not (ROOT / p.lstrip("./")).exists()}
    assert not missing, f"{page.name} names files that are not there: {sorted(missing)}"


def test_no_doctor_fix_names_a_file_the_wheel_lacks() -> None:
    strings = fix_strings()
    assert any("vllm-dspark serve-cpu" in s for s in strings)  # the walk reads the fixes
    offending = [s for s in strings if "examples/" in s or re.search(r"\w\.(?:sh|py)\b", s)]
    assert offending == []


@pytest.mark.parametrize("source", [*PAGES, FIXES], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_vllm_dspark_command_named_exists(source: Path) -> None:
    named = set(VLLM_DSPARK.findall(source.read_text()))
    assert named <= set(COMMANDS), sorted(named - set(COMMANDS))


def test_the_rules_catch_what_they_are_for() -> None:
    """A pip user's command is caught; a link, a folder, and a checkout's command are not."""
    assert pip_user_example_commands("Run `python examples/run.py`.") == ["examples/run.py"]
    assert pip_user_example_commands("    MODEL=m examples/serve.sh\n") == ["examples/serve.sh"]
    fenced = "Serve it:\n\n```bash\nbash ../examples/serve.sh  # go\n```\n"
    assert pip_user_example_commands(fenced) == ["../examples/serve.sh"]
    assert pip_user_example_commands("From a checkout or its wheel: `examples/x.sh`") == [
        "examples/x.sh"
    ]
    assert pip_user_example_commands("See [the file](../examples/run.py), `examples/`.") == []
    assert pip_user_example_commands("In a checkout:\n\n```bash\npython examples/run.py\n```") == []
    assert pip_user_example_commands("Run `examples/run.py` (from a checkout).") == []
