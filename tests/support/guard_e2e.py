# SPDX-License-Identifier: Apache-2.0
"""The acceptance guard (``vllm_dspark.runtime.guard``) in vLLM's real ``dspark`` speculator on CPU.

``python -m tests.support.guard_e2e --models DIR --out DIR`` serves the trained pair (``tests/data/pair``)
in one process, in-process engines one after another, and writes ``results.json``:

- ``bf16``: the pair without the guard (top-2 logprobs: the near-tie rule);
- ``bf16-guard``: the pair with the guard and a context prior (``max_draft_context``) between the
  prompts' lengths: short prompts (under the prior), a mixed batch (one prompt past it), long
  prompts only;
- ``perturbed-guard``: a copy of the drafter with perturbed weights, the guard with a flat
  threshold and a short back-off, stepped one engine step at a time with vLLM's counters read
  after each step.

Each run records outputs, vLLM's spec-decode counters (per batch: the difference across it) and
the guard's own counters. It runs in its own process: the Triton interpreter must be set before
vLLM is imported. ``tests/serving/test_acceptance_guard.py`` runs it and asserts.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from vllm_dspark.cpu_serving import engines
from vllm_dspark.cpu_serving.pair import BLOCK, heldout_prompts, sampling

PAIR = Path(__file__).resolve().parents[1] / "data" / "pair"
SCHEDULER = "vllm_dspark.runtime.guard.GuardedScheduler"
LONG, SHORT = 24, 12  # prompt lengths (tokens); the context prior sits between them
MAX_DRAFT_CONTEXT = 16
_P = heldout_prompts(PAIR, 2, LONG)
# Batches of prompts: each served by every run that names it.
BATCHES = {
    "short": [_P[0][:SHORT], _P[1][:SHORT]],
    "mixed": [_P[0], _P[1][:SHORT]],
    "long": [_P[0], _P[1]],
    "perturbed": [_P[0]],
}
# The perturbed run's prompt and length are the mixed batch's first: the unguarded run's output for it.
MAX_TOKENS = {"short": 8, "mixed": 14, "long": 4, "perturbed": 14}
# The perturbed drafter's guard: judge after 2 verified steps, probe for 2 after 3 guarded ones.
PERTURBED_GUARD = {"threshold": 0.1, "window": 4, "min_steps": 2, "backoff": 3, "probe_steps": 2}
PERTURB_SCALE = 2.0  # noise std over each weight's own std


def perturbed_drafter(source: Path, out: Path, seed: int = 0) -> Path:
    """A copy of the drafter at ``source`` in ``out`` (staged, then renamed), every matrix but the
    shared embedding given seeded Gaussian noise of :data:`PERTURB_SCALE` times its own std."""
    import torch

    from vllm_dspark.checkpoint.st_io import read_tensors, save_tensors
    from vllm_dspark.safety import staged

    shard = "model-00001-of-00001.safetensors"
    tensors = read_tensors(source / shard)
    generator = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if t.dim() == 2 and name != "embed_tokens.weight":
            w = t.float()
            noise = torch.randn(w.shape, generator=generator) * w.std() * PERTURB_SCALE
            tensors[name] = (w + noise).to(t.dtype)
    with staged(out, directory=True) as tmp:
        for name in ("config.json", "model.safetensors.index.json"):
            shutil.copy(source / name, tmp / name)
        shutil.copytree(source / "target", tmp / "target")
        save_tensors(tmp / shard, tensors)
    return out


def _scheduler(llm):
    """The engine core's scheduler (in-process engine)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def _generate(llm, batch: str, logprobs: bool = False) -> dict[str, Any]:
    """One batch: its outputs and vLLM's spec-decode counters across it."""
    prompts = BATCHES[batch]
    params = sampling("baseline" if logprobs else "bf16", len(prompts), MAX_TOKENS[batch])
    before = engines.acceptance(engines.counters(llm))
    done = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    after = engines.acceptance(engines.counters(llm))
    delta = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    delta["accepted_per_position"] = [
        a - b
        for a, b in zip(
            after["accepted_per_position"],
            before["accepted_per_position"] or [0] * len(after["accepted_per_position"]),
            strict=True,
        )
    ]
    return {
        "request_ids": [ro.request_id for ro in done],
        "outputs": engines.outputs(done),
        "counters": delta,
    }


def _external(req_id: str) -> str:
    """The id a request was given (``RequestOutput.request_id``): the engine appends ``-<random>``."""
    return req_id.rsplit("-", 1)[0]


def _batches(llm, batches: list[str], logprobs: bool = False, guarded: bool = False) -> dict:
    out: dict[str, Any] = {}
    for batch in batches:
        before = len(_scheduler(llm).guard.finished) if guarded else 0
        out[batch] = _generate(llm, batch, logprobs)
        if guarded:
            guard = _scheduler(llm).guard
            out[batch]["guard"] = {_external(rid): c for rid, c in list(guard.finished)[before:]}
            out[batch]["undrafted_steps"] = guard.undrafted_steps
    return out


def _stepped(llm, batch: str) -> dict[str, Any]:
    """``batch`` served one engine step at a time: vLLM's drafts counter after each step."""
    engine = llm.llm_engine
    params = sampling("bf16", 1, MAX_TOKENS[batch])[0]
    for i, prompt in enumerate(BATCHES[batch]):
        engine.add_request(f"{batch}-{i}", {"prompt_token_ids": prompt}, params)
    drafts, tokens, finished = [], {}, []
    while engine.has_unfinished_requests():
        for ro in engine.step():
            tokens[ro.request_id] = list(ro.outputs[0].token_ids)
            if ro.finished:
                finished.append(ro)
        drafts.append(engines.acceptance(engines.counters(llm))["drafts"])
    guard = _scheduler(llm).guard
    return {
        "outputs": [{"tokens": tokens[f"{batch}-{i}"]} for i in range(len(BATCHES[batch]))],
        "drafts_after_step": drafts,
        "guard": {_external(rid): c for rid, c in guard.finished},
        "undrafted_steps": guard.undrafted_steps,
    }


def run(models: dict[str, Path], out: Path) -> None:
    target = models["target"]

    def spec(drafter: Path) -> dict:
        return engines.dspark_config(drafter, BLOCK)

    def guarded(config: dict) -> dict:
        return {"scheduler_cls": SCHEDULER, "additional_config": {"dspark_guard": config}}

    results: dict[str, Any] = {
        "block": BLOCK,
        "max_draft_context": MAX_DRAFT_CONTEXT,
        "perturbed_guard": PERTURBED_GUARD,
        "batches": BATCHES,
        "max_tokens": MAX_TOKENS,
    }
    results["bf16"] = engines.served(
        "cpu",
        target,
        spec(models["drafter"]),
        lambda llm: _batches(llm, ["short", "mixed"], logprobs=True),
    )
    results["bf16-guard"] = engines.served(
        "cpu",
        target,
        spec(models["drafter"]),
        lambda llm: _batches(llm, ["short", "mixed", "long"], guarded=True),
        **guarded({"max_draft_context": MAX_DRAFT_CONTEXT}),
    )
    results["perturbed-guard"] = engines.served(
        "cpu",
        target,
        spec(models["perturbed"]),
        lambda llm: {"perturbed": _stepped(llm, "perturbed")},
        **guarded(PERTURBED_GUARD),
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--models", type=Path, required=True, help="where the perturbed drafter goes"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from vllm_dspark.cpu_serving import enable

    enable()
    models = {
        "target": PAIR / "target",
        "drafter": PAIR / "drafter",
        "perturbed": perturbed_drafter(PAIR / "drafter", args.models / "drafter-perturbed"),
    }
    run(models, args.out)


if __name__ == "__main__":
    main()
