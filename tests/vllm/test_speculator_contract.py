# SPDX-License-Identifier: Apache-2.0
"""What vLLM's ``dspark`` speculator asks of the drafter, read from the installed wheel's source:
every drafter method or attribute it needs, for any option a user can set in --speculative-config,
is implemented by ``K3DSparkForCausalLM`` or refused by the doctor before the target loads. A
requirement a future wheel adds fails here, not in ``load_model`` after a 1 T-param target loaded."""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from vllm_dspark.doctor.checks import diagnose

pytestmark = pytest.mark.vllm_api

# The hooks the model class leaves out on purpose, each needed only under one speculative-config
# option, which the doctor must refuse (an error at that option) before the target loads.
REFUSED = {
    # DSpark samples its Markov chain from full draft logits; a local argmax never applies.
    "get_top_tokens": {"use_local_argmax_reduction": True},
    # Top-k Markov sampling is for Qwen3 DSpark drafters; vLLM refuses it for K3 drafters too.
    "apply_markov_bias_gathered": {"dspark_draft_topk": 8},
}
# The greedy recipe (the sampling one would be refused for other reasons with some options).
GREEDY = {
    "method": "dspark",
    "model": "Inferact/Kimi-K3-DSpark",
    "num_speculative_tokens": 7,
    "attention_backend": "TRITON_MLA",
}


@dataclass
class Needs:
    """What one wheel's speculator does with the drafter (``model.X`` is the inner module's X)."""

    used: dict[str, set[frozenset[str]]] = field(default_factory=dict)  # name -> guard probes
    probed: set[str] = field(default_factory=set)
    raises_without: set[str] = field(default_factory=set)

    def use(self, name: str, guards: frozenset[str]) -> None:
        self.used.setdefault(name, set()).add(guards)


def _probe(node: ast.AST, roots: dict[str, str]) -> str | None:
    """``hasattr(root, "X")`` or ``getattr(root, "X", default)`` on the drafter: its name."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return None
    if node.func.id not in ("hasattr", "getattr") or len(node.args) < 2:
        return None
    if node.func.id == "getattr" and len(node.args) == 2:
        return None  # no default: a use, not a probe
    prefix = _root(node.args[0], roots)
    name = node.args[1]
    if prefix is None or not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
        return None
    return prefix + name.value


def _root(node: ast.AST, roots: dict[str, str]) -> str | None:
    """The drafter's prefix ("" outer, "model." inner) if ``node`` is the drafter or its module."""
    text = ast.unparse(node)
    if text in roots:
        return roots[text]
    outer = text.removesuffix(".model")
    return "model." if outer != text and roots.get(outer) == "" else None


def _probes_in(test: ast.AST, roots: dict[str, str]) -> tuple[set[str], set[str]]:
    """The probes a condition requires true, and those it requires false (``not probe``)."""
    positive: set[str] = set()
    negative: set[str] = set()
    for node in ast.walk(test):
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            if (name := _probe(node.operand, roots)) is not None:
                negative.add(name)
        elif (name := _probe(node, roots)) is not None:
            positive.add(name)
    return positive - negative, negative


class _Collector(ast.NodeVisitor):
    def __init__(self, needs: Needs, roots: dict[str, str]) -> None:
        self.needs, self.roots, self.guards = needs, dict(roots), frozenset[str]()

    def visit_Assign(self, node: ast.Assign) -> None:
        # Aliases: draft_inner = draft_model.model, model = load_dspark_model(...).
        prefix = _root(node.value, self.roots)
        if prefix is None and "load_dspark_model(" in ast.unparse(node.value):
            prefix = ""
        for target in node.targets:
            if isinstance(target, ast.Name) and prefix is not None:
                self.roots[target.id] = prefix
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if (name := _probe(node, self.roots)) is not None:
            self.needs.probed.add(name)
            for arg in node.args[2:]:
                self.visit(arg)
            return
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Load) and not node.attr.startswith("__"):
            prefix = _root(node.value, self.roots)
            if prefix is not None:
                self.needs.use(prefix + node.attr, self.guards)
        self.generic_visit(node)

    def _guarded(self, test: ast.AST, body: list[ast.AST] | ast.AST) -> None:
        positive, negative = _probes_in(test, self.roots)
        body = body if isinstance(body, list) else [body]
        if negative and any(isinstance(n, ast.Raise) for b in body for n in ast.walk(b)):
            self.needs.raises_without |= negative
        outer, self.guards = self.guards, self.guards | positive
        for node in body:
            self.visit(node)
        self.guards = outer

    def visit_If(self, node: ast.If) -> None:
        self.visit(node.test)
        self._guarded(node.test, node.body)
        for n in node.orelse:
            self.visit(n)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self.visit(node.test)
        self._guarded(node.test, node.body)
        self.visit(node.orelse)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        if not isinstance(node.op, ast.And):
            self.generic_visit(node)
            return
        first, *rest = node.values
        self.visit(first)
        self._guarded(first, rest[0] if len(rest) == 1 else ast.BoolOp(op=ast.And(), values=rest))


def _functions(cls: type) -> Iterator[Callable[..., Any]]:
    """The methods a ``cls`` instance runs: each name's resolved one, and those its ``super()``
    calls reach further down the MRO."""
    mro = [c for c in cls.__mro__ if c.__module__.startswith("vllm.")]
    for name in {n for c in mro for n, v in vars(c).items() if inspect.isfunction(v)}:
        owners = [c for c in mro if inspect.isfunction(vars(c).get(name))]
        for owner in owners:
            fn = vars(owner)[name]
            yield fn
            if f"super().{name}(" not in inspect.getsource(fn):
                break


def speculator_needs() -> Needs:
    """The installed vLLM's ``DSparkSpeculator`` and its drafter loader, collected."""
    from vllm.v1.worker.gpu.spec_decode.dspark import utils
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    needs = Needs()
    for fn in _functions(DSparkSpeculator):
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        _Collector(needs, {"self.model": ""}).visit(tree)
    loader = ast.parse(textwrap.dedent(inspect.getsource(utils.load_dspark_model)))
    returned = [n.value for n in ast.walk(loader) if isinstance(n, ast.Return) and n.value]
    _Collector(needs, {ast.unparse(r): "" for r in returned}).visit(loader)
    return needs


def _provides(name: str) -> bool:
    """Whether the model class (``model.X``: its inner module) has ``name``."""
    from vllm_dspark.runtime.model import K3DSparkForCausalLM, K3DSparkModel

    cls = K3DSparkModel if name.startswith("model.") else K3DSparkForCausalLM
    attr = name.removeprefix("model.")
    init = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    assigned = {
        t.attr
        for n in ast.walk(init)
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"
    }
    return hasattr(cls, attr) or attr in assigned


def required(needs: Needs) -> set[str]:
    """The names some run of the speculator reaches with the plugin's model class: unguarded uses,
    uses behind a probe the class answers yes to, and names whose absence raises."""
    reached = {
        name
        for name, guards in needs.used.items()
        if any(all(_provides(g) for g in gs) for gs in guards)
    }
    return reached | needs.raises_without


def test_the_collector_sees_what_the_speculator_needs() -> None:
    """The enumeration is not empty-handed: the core hooks every wheel calls, and the probes."""
    needs = speculator_needs()
    needed = required(needs)
    for hook in ("precompute_and_store_context_kv", "markov_embed", "markov_bias"):
        assert hook in needed, sorted(needed)
    assert "get_top_tokens" in needs.raises_without
    assert "get_draft_kv_cache_layer_names" in needs.probed


def test_every_drafter_hook_is_implemented_or_its_option_refused() -> None:
    from vllm import __version__

    needs = speculator_needs()
    missing = sorted(n for n in required(needs) if not _provides(n) and n not in REFUSED)
    assert missing == [], (
        f"vLLM {__version__}'s dspark speculator needs {missing} of the drafter, which "
        "K3DSparkForCausalLM lacks and the doctor does not refuse: implement them, or refuse the "
        "option that needs them (and name it in REFUSED)"
    )


@pytest.mark.parametrize("hook", sorted(REFUSED))
def test_the_doctor_refuses_each_option_whose_hook_the_drafter_lacks(hook: str) -> None:
    from vllm_dspark.runtime.model import K3DSparkForCausalLM

    assert not _provides(hook), f"{hook} is implemented now: drop it from REFUSED"
    [(option, value)] = REFUSED[hook].items()
    refused = [
        f
        for f in diagnose({**GREEDY, option: value}, drafter=None)
        if f.severity == "error" and f.where == option
    ]
    assert refused, f"{option}={value!r} needs {K3DSparkForCausalLM.__name__}.{hook}"
