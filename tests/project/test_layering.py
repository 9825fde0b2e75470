# SPDX-License-Identifier: Apache-2.0
"""The package's layers are its folders: each module imports only from its own layer or those below,
nothing outside ``tools`` imports it, and nothing imports in a cycle. Read from the source, not by importing."""

from __future__ import annotations

import ast
import shutil
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_dspark"

# layer -> its folders under vllm_dspark/ ("" is the package root's own modules), lowest first.
LAYERS: dict[str, tuple[str, ...]] = {
    "math": ("ops",),
    "core": ("",),  # config.json's fields and config, findings, safety, finite, version, compat
    "checkpoint": ("checkpoint",),  # the on-disk contract and loading
    "reference": ("reference",),
    "runtime": ("runtime", "doctor", "cpu_serving"),  # what vLLM loads
    "tools": ("tools", "checkpoint_tools", "drift", "pair"),
}
# What each layer may import from the package: its own and those below (the reference sits beside
# the runtime, not under it); only tools import tools.
ALLOWED: dict[str, set[str]] = {
    "math": {"math"},
    "core": {"math", "core"},
    "checkpoint": {"math", "core", "checkpoint"},
    "reference": {"math", "core", "checkpoint", "reference"},
    "runtime": {"math", "core", "checkpoint", "runtime"},
    "tools": set(LAYERS),
}
# The entry point, vllm_dspark/__init__.py (register()), may reach the runtime, never the tools.
ENTRY_ALLOWED = set(LAYERS) - {"tools"}
# The pure math runs anywhere: the standard library and torch only.
OPS_THIRD_PARTY = {"torch", "numpy"}


def _name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__")


def _is_main_guard(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST, *, skip_type_checking: bool) -> set[str]:
    """Dotted names imported anywhere in ``tree`` (functions included), outside ``__main__`` guards."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _is_main_guard(node) or (skip_type_checking and _is_type_checking(node)):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.update(f"{node.module}.{a.name}" for a in node.names)
            found.add(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _folder(path: Path, package: Path) -> str:
    """The folder under the package a module file lies in ("" for the root's own modules)."""
    parts = path.relative_to(package).parts
    return parts[0] if len(parts) > 1 else ""


def _graph(package: Path = PACKAGE) -> tuple[dict[str, set[str]], dict[str, str], set[str]]:
    """``(module -> package modules it imports, module -> folder, modules importing test code)``."""
    paths = {_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    test_code = set()
    for name, path in paths.items():
        deps = set()
        for imported in _imports(ast.parse(path.read_text()), skip_type_checking=False):
            if imported == "tests" or imported.startswith("tests."):
                test_code.add(name)
            if imported == "vllm_dspark" or imported.startswith("vllm_dspark."):
                dotted = imported.removeprefix("vllm_dspark").removeprefix(".")
                # `from vllm_dspark.x import y` names module x.y when that is a module, else x
                if dotted in paths:
                    deps.add(dotted)
        deps.discard(name)
        graph[name] = deps
    return graph, {n: _folder(p, package) for n, p in paths.items()}, test_code


def _layer(folder: str) -> str:
    for layer, folders in LAYERS.items():
        if folder in folders:
            return layer
    raise AssertionError(f"vllm_dspark/{folder}/ belongs to no layer: add it to LAYERS")


def upward_imports(package: Path = PACKAGE) -> list[str]:
    """Every import from a layer its importer may not reach, as ``importer (layer) -> imported (layer)``."""
    graph, folders, _ = _graph(package)
    wrong = []
    for module, deps in sorted(graph.items()):
        allowed = ENTRY_ALLOWED if module == "" else ALLOWED[_layer(folders[module])]
        for dep in sorted(deps):
            if _layer(folders[dep]) not in allowed:
                wrong.append(
                    f"vllm_dspark.{module} ({_layer(folders[module])}) -> vllm_dspark.{dep} "
                    f"({_layer(folders[dep])})"
                )
    return wrong


GRAPH, FOLDERS, TEST_CODE_IMPORTERS = _graph()


def test_every_folder_is_a_layer() -> None:
    for folder in set(FOLDERS.values()):
        _layer(folder)


def test_no_module_imports_from_a_layer_above_it() -> None:
    assert not upward_imports()


def test_only_the_tools_folder_imports_it() -> None:
    """The one-line rule: nothing outside ``tools/`` imports ``tools/`` (command modules are entry points)."""
    wrong = {
        m: sorted(d for d in deps if FOLDERS[d] == "tools")
        for m, deps in GRAPH.items()
        if FOLDERS[m] != "tools" and any(FOLDERS[d] == "tools" for d in deps)
    }
    assert not wrong


def test_a_planted_upward_import_is_caught(tmp_path: Path) -> None:
    """The check is live: the checkpoint layer importing the tools' CLI fails it."""
    package = tmp_path / "vllm_dspark"
    shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__", "data"))
    layout = package / "checkpoint" / "layout.py"
    layout.write_text(layout.read_text() + "\nfrom vllm_dspark.tools.cli import main\n")
    assert upward_imports(package) == [
        "vllm_dspark.checkpoint.layout (checkpoint) -> vllm_dspark.tools.cli (tools)"
    ]


def test_the_package_never_imports_test_code() -> None:
    assert not TEST_CODE_IMPORTERS


def test_nothing_imports_in_a_cycle() -> None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(GRAPH[node]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep]
                raise AssertionError(
                    "import cycle: " + " -> ".join(f"vllm_dspark.{m}".rstrip(".") for m in cycle)
                )
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize("module", sorted(m for m, f in FOLDERS.items() if f == "ops"))
def test_the_pure_math_needs_only_torch(module: str) -> None:
    path = PACKAGE.joinpath(*module.split(".")).with_suffix(".py")
    if not path.exists():
        path = PACKAGE.joinpath(*module.split("."), "__init__.py")
    roots = {
        i.split(".")[0] for i in _imports(ast.parse(path.read_text()), skip_type_checking=True)
    }
    extra = roots - set(sys.stdlib_module_names) - OPS_THIRD_PARTY - {"__future__"}
    assert not extra, (
        f"vllm_dspark.{module} imports {sorted(extra)}: ops/ is torch and the standard library only"
    )


def test_tests_share_code_only_through_tests_support() -> None:
    """No test module imports another; what several share lives in ``tests/support/``."""
    tests = Path(__file__).resolve().parents[1]
    modules = [p for p in tests.rglob("*.py") if "support" not in p.relative_to(tests).parts]
    local = {p.stem for p in modules}
    wrong = {}
    for path in sorted(modules):
        imported = _imports(ast.parse(path.read_text()), skip_type_checking=False)
        bad = sorted(
            i
            for i in imported
            if i.split(".")[0] in local
            or (i.startswith("tests.") and not i.startswith("tests.support"))
        )
        if bad:
            wrong[str(path.relative_to(tests))] = bad
    assert modules and not wrong
