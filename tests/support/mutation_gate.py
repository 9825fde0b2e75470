# SPDX-License-Identifier: Apache-2.0
"""The mutation gate that pays only for what changed.

A record committed in the repo (``tests/data/mutation-record.json``) holds, for every function mutmut
mutates, the hash of its source, the tests that execute it (and a hash of their files), the functions
that call it, and each mutant's status keyed by its mutation (the lines it changes), not by mutmut's
number, so an edit elsewhere in the function does not shuffle the comparison. A run mutates again only
the functions whose source, whose tests (their own source and the module-level code they reach) or
whose mutated callees changed since the record, reads
the rest from it, and fails when a mutation the record has killed now survives.
``make test-mutation FULL=1`` reruns every function and rewrites the record.
"""

from __future__ import annotations

import ast
import difflib
import functools
import hashlib
import json
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from fnmatch import fnmatch
from importlib.metadata import version
from pathlib import Path

import tomllib

from vllm_dspark.safety import staged

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "tests" / "data" / "mutation-record.json"
KILLED = "killed"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def mutmut_settings(repo: Path) -> dict:
    """``[tool.mutmut]`` of ``repo``'s pyproject.toml."""
    return tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["mutmut"]


def config_fingerprint(settings: dict, patterns: tuple[str, ...]) -> str:
    """What every mutant's status depends on besides its function and tests: mutmut and its settings."""
    return _sha(json.dumps([version("mutmut"), settings, list(patterns)], sort_keys=True))


def module_name(path: str) -> str:
    """``vllm_dspark/ops/rope.py`` -> ``vllm_dspark.ops.rope``."""
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def function_sources(repo: Path, files: list[str]) -> dict[str, str]:
    """``{mutmut's function key: source}`` of the module functions and class methods in ``files``."""
    sources = {}
    for path in files:
        text = (repo / path).read_text()
        module = module_name(path)
        for node in ast.parse(text).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                sources[f"{module}.x_{node.name}"] = ast.get_source_segment(text, node, padded=True)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        key = f"{module}.x\u01c1{node.name}\u01c1{item.name}"
                        sources[key] = ast.get_source_segment(text, item, padded=True)
    return sources


def selected(function: str, patterns: tuple[str, ...]) -> bool:
    """Whether the mutant patterns select ``function``'s mutants."""
    return any(fnmatch(f"{function}__mutmut_1", pattern) for pattern in patterns)


def _bound_names(node: ast.stmt) -> set[str]:
    """The module-level names a statement binds."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    return {
        n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }


def _used_names(node: ast.AST) -> set[str]:
    """The names a statement reads, and a function's parameters (pytest fixtures by name)."""
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        names |= {a.arg for a in (*node.args.args, *node.args.kwonlyargs)}
    return names


@functools.lru_cache(maxsize=64)
def _test_sources(text: str) -> dict[str, str]:
    """``{test function: its source and that of every module-level statement it reaches by name}``:
    its helpers, fixtures, constants and imports, transitively; an edit elsewhere in the module
    leaves it alone."""
    body = ast.parse(text).body
    statements = [(node, ast.get_source_segment(text, node, padded=True) or "") for node in body]
    binders: dict[str, list[int]] = {}
    for i, (node, _) in enumerate(statements):
        for name in _bound_names(node):
            binders.setdefault(name, []).append(i)
    # Statements that bind nothing (a pytestmark-less expression, a module docstring) are shared.
    shared = {i for i, (node, _) in enumerate(statements) if not _bound_names(node)}
    sources = {}
    for i, (node, _) in enumerate(statements):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if not node.name.startswith("test_"):
            continue
        reached, todo = {i} | shared, [i]
        while todo:
            for name in _used_names(statements[todo.pop()][0]) | {"pytestmark"}:
                for j in binders.get(name, []):
                    if j not in reached:
                        reached.add(j)
                        todo.append(j)
        sources[node.name] = "\n".join(statements[j][1] for j in sorted(reached))
    return sources


def tests_fingerprint(repo: Path, tests: list[str]) -> str:
    """A hash of ``tests`` (pytest node ids): each test function's source with the module-level code it
    reaches by name. (conftest.py fixtures and tests/support are left to ``FULL=1``: hashing them
    would make every edit of the suite's plumbing a full rerun.)"""
    parts = {}
    for test in tests:
        file, _, name = test.partition("::")
        path = repo / file
        sources = _test_sources(path.read_text()) if path.exists() else {}
        parts[test] = sources.get(name.split("[")[0], "missing")
    return _sha(json.dumps(parts, sort_keys=True))


def stale_functions(record: dict, repo: Path, sources: dict[str, str]) -> list[str]:
    """The functions to mutate again: new ones, and those whose source, tests or mutated callees changed."""
    known = record.get("functions", {})
    changed_code = {f for f, src in sources.items() if known.get(f, {}).get("code") != _sha(src)}
    stale = set(changed_code)
    for name, entry in known.items():
        if name not in sources:
            continue
        if entry["tests_hash"] != tests_fingerprint(repo, entry["tests"]):
            stale.add(name)
        if changed_code.intersection(entry.get("callees", [])):
            stale.add(name)
    return sorted(stale)


def _functions_in(tree: ast.Module) -> dict[str, list[str]]:
    """``{name: its source lines, renamed f}`` of every function in ``tree``, as ``ast.unparse`` writes it."""
    functions = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name, node.name = node.name, "f"
            functions[name] = ast.unparse(node).splitlines()
            node.name = name
    return functions


def mutation_signatures(mutated_file: Path) -> dict[str, str]:
    """``{mutant's mutmut name: the lines it changes}`` from a mutmut-generated module: the mutant
    diffed against its ``__mutmut_orig`` copy, numbered where one function has the same diff twice."""
    functions = _functions_in(ast.parse(mutated_file.read_text()))
    signatures, seen = {}, Counter()
    for name, lines in functions.items():
        base, sep, number = name.rpartition("__mutmut_")
        if not sep or not number.isdigit():
            continue
        diff = difflib.unified_diff(functions[f"{base}__mutmut_orig"], lines, lineterm="", n=0)
        change = "\n".join(d for d in diff if d[:1] in "+-" and not d.startswith(("+++", "---")))
        seen[(base, change)] += 1
        signatures[name] = f"{change}\n#{seen[(base, change)]}"
    return signatures


def read_run(work: Path, files: list[str], functions: list[str]) -> dict[str, dict]:
    """``functions``' record entries from a mutmut run in ``work``: tests, callees and mutant statuses."""
    from mutmut.stats import status_by_exit_code

    stats = json.loads((work / "mutants" / "mutmut-stats.json").read_text())
    tests = stats["tests_by_mangled_function_name"]
    callers = stats.get("function_dependencies", {})
    callees: dict[str, list[str]] = {}
    for callee, names in callers.items():
        for caller in names:
            callees.setdefault(caller, []).append(callee)
    sources = function_sources(work, files)
    entries = {
        f: {
            "code": _sha(sources[f]),
            "tests": sorted(tests.get(f, [])),
            "tests_hash": tests_fingerprint(work, sorted(tests.get(f, []))),
            "callees": sorted(callees.get(f, [])),
            "mutants": {},
        }
        for f in functions
    }
    for path in files:
        meta = work / "mutants" / f"{path}.meta"
        if not meta.exists():
            continue
        signatures = mutation_signatures(work / "mutants" / path)
        module = module_name(path)
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            function, _, number = name.rpartition("__mutmut_")
            if function in entries:
                short = f"{function.removeprefix(module + '.')}__mutmut_{number}"
                entries[function]["mutants"][name] = {
                    "change": _sha(signatures[short]),
                    "status": status_by_exit_code[code],
                }
    return entries


def regressions(before: dict[str, dict], after: dict[str, dict]) -> list[str]:
    """Mutations the record had killed that now survive (matched by the lines they change)."""
    found = []
    for function, entry in after.items():
        killed = {
            m["change"]
            for m in before.get(function, {}).get("mutants", {}).values()
            if m["status"] == KILLED
        }
        for name, m in entry["mutants"].items():
            if m["change"] in killed and m["status"] != KILLED:
                found.append(f"{name} ({m['status']})")
    return sorted(found)


@dataclass
class GateResult:
    """What one gate run did and found."""

    rerun: list[str]
    record: dict
    regressions: list[str] = field(default_factory=list)

    def statuses(self) -> dict[str, str]:
        """``{mutant: status}`` of every mutant, the rerun ones' fresh."""
        return statuses(self.record)


def statuses(record: dict) -> dict[str, str]:
    """``{mutant: status}`` of every mutant in ``record``."""
    return {
        name: m["status"]
        for entry in record["functions"].values()
        for name, m in entry["mutants"].items()
    }


def tally(record: dict) -> tuple[int, int]:
    """(killed, total) over a record's mutants."""
    found = list(statuses(record).values())
    return found.count(KILLED), len(found)


def load_record(path: Path = RECORD) -> dict:
    """The committed record, or an empty one."""
    return json.loads(path.read_text()) if path.exists() else {"config": None, "functions": {}}


def write_text(path: Path, text: str) -> None:
    """Write ``path`` atomically: staged beside it, then renamed."""
    with staged(path, directory=False) as staging:
        staging.write_text(text)


def write_record(record: dict, path: Path = RECORD) -> None:
    """Write ``record`` atomically."""
    write_text(path, json.dumps(record, indent=1, sort_keys=True, ensure_ascii=False) + "\n")


def run_gate(
    repo: Path, patterns: tuple[str, ...], record: dict, work: Path, full: bool = False
) -> GateResult:
    """Mutate ``repo``'s stale functions (every one if ``full`` or mutmut's settings changed) in a copy
    made in ``work``; the record merged with the fresh results, and any regression against it."""
    settings = mutmut_settings(repo)
    files = list(settings["only_mutate"])
    config = config_fingerprint(settings, patterns)
    sources = {f: s for f, s in function_sources(repo, files).items() if selected(f, patterns)}
    if full or record.get("config") != config:
        record = {"config": config, "functions": {}}
    rerun = stale_functions(record, repo, sources)
    functions = {f: e for f, e in record["functions"].items() if f in sources}
    if rerun:
        for name in ("vllm_dspark", "tests"):
            shutil.copytree(
                repo / name, work / name, ignore=shutil.ignore_patterns("__pycache__", "mutants")
            )
        shutil.copy2(repo / "pyproject.toml", work)
        names = [f"{f}__mutmut_*" for f in rerun]
        # mutmut's progress goes to the terminal (make test-mutation runs pytest -s).
        run = subprocess.run(
            [sys.executable, "-m", "mutmut", "run", *names], cwd=work, timeout=3600
        )
        if run.returncode != 0:
            raise RuntimeError(f"mutmut run exited with {run.returncode}")
        fresh = read_run(work, files, rerun)
        found = regressions(record["functions"], fresh)
        functions.update(fresh)
    else:
        found = []
    return GateResult(
        rerun, {"config": config, "functions": dict(sorted(functions.items()))}, found
    )
