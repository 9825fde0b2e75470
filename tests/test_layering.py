# SPDX-License-Identifier: Apache-2.0
"""The package's layers, as the README's code map draws them: each module imports only from the
layers below it (or its own), and nothing imports in a cycle. Read from the source, not by importing."""

from __future__ import annotations

import ast
import fnmatch
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_dspark"

# layer -> module patterns; the first layer with a matching pattern owns a module.
LAYERS: dict[str, tuple[str, ...]] = {
    "leaf": ("version", "findings", "fields", "config", "safety", "finite", "compat", "ops", "ops.*"),
    "contract": ("checkpoint", "checkpoint.layout", "checkpoint.formats", "checkpoint.st_io",
                 "checkpoint.presets"),
    "loading": ("checkpoint.store", "checkpoint.quant_plan", "checkpoint.check"),
    "tools": ("checkpoint.quantize", "checkpoint.make_random", "tools", "tools.*", "pair", "pair.*", "drift",
              "drift.*", "doctor.cli"),
    "plugin": ("", "model", "attention", "attention_*", "cpu_*", "doctor", "doctor.*"),
    "reference": ("reference", "reference.*"),
}  # fmt: skip
# What each layer may import from the package.
ALLOWED: dict[str, set[str]] = {
    "leaf": {"leaf"},
    "contract": {"leaf", "contract"},
    "loading": {"leaf", "contract", "loading"},
    "plugin": {"leaf", "contract", "loading", "plugin"},
    "reference": {"leaf", "contract", "loading", "reference"},
    "tools": set(LAYERS),
}
# The pure math runs anywhere: the standard library and torch only.
OPS_THIRD_PARTY = {"torch", "numpy"}


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
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


def _graph() -> dict[str, set[str]]:
    modules = {_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for imported in _imports(ast.parse(path.read_text()), skip_type_checking=False):
            if imported == "vllm_dspark" or imported.startswith("vllm_dspark."):
                dotted = imported.removeprefix("vllm_dspark").removeprefix(".")
                # `from vllm_dspark.x import y` names module x.y when that is a module, else x
                if dotted in modules:
                    deps.add(dotted)
        deps.discard(name)
        graph[name] = deps
    return graph


def _layer(module: str) -> str:
    for layer, patterns in LAYERS.items():
        if any(fnmatch.fnmatchcase(module, p) for p in patterns):
            return layer
    raise AssertionError(f"vllm_dspark.{module} belongs to no layer: add it to LAYERS")


GRAPH = _graph()


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_a_module_imports_only_from_its_own_layer_or_below(module: str) -> None:
    layer = _layer(module)
    wrong = sorted(d for d in GRAPH[module] if _layer(d) not in ALLOWED[layer])
    assert not wrong, f"vllm_dspark.{module} ({layer}) imports {wrong}, from layers above it"


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


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m == "ops" or m.startswith("ops.")))
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
