# SPDX-License-Identifier: Apache-2.0
"""Serve the trained pair through vLLM's real ``dspark`` speculator, and record it.

``python -m tests.dspark_e2e --platform {cpu,cuda} --models DIR --out DIR`` runs, in one process and
in-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), every engine the end-to-end tests check:
the target without speculation (greedy, with top-2 logprobs), the BF16 and FP8 drafters greedy,
and the BF16 drafter drafting probabilistically with block verification. It writes
``results.json`` (outputs, spec-decode counters, what the worker holds) and ``captures.pt``: for
each drafting step, what the speculator was given (aux hidden states, positions, rejected counts)
and what it drafted (anchors, anchor positions, the backbone's hidden states at the block, the
block), captured inside the engine. Two more
captures come from the BF16 engine with a deliberately broken hook (Markov bias sign flipped; aux
layers in the wrong order), which the reference check must reject.

On CPU it first enables :mod:`tests.triton_interpreter` (Model Runner V2 needs Triton), so it runs
in its own process: the interpreter must be set before vLLM is imported, and must not leak into
other tests. ``tests/test_dspark_serving.py`` builds the models, runs this and asserts.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

PAIR = Path(__file__).resolve().parent / "data" / "pair"
BLOCK = 7
PROMPT_TOKENS = 24
# Held-out prompts of the trained pair (vllm-dspark train-pair), cut short: the CPU run is slow.
PROMPTS = [
    p["token_ids"][:PROMPT_TOKENS]
    for p in json.loads((PAIR / "heldout_prompts.json").read_text())["prompts"][:3]
]
# Per platform: prompts and tokens per request. The CPU run interprets vLLM's Triton kernels
# (about a second per decoding step on 2 cores), so it is sized to stay within CI's budget.
SIZES = {
    "cpu": {"prompts": 2, "max_tokens": 10, "broken_tokens": 3},
    "cuda": {"prompts": 3, "max_tokens": 48, "broken_tokens": 8},
}
# TRITON_MLA: the non-causal-capable MLA backend on Hopper, for target and draft on GPUs (one layout).
CUDA_ATTENTION_BACKEND = "TRITON_MLA"


def build_models(root: Path) -> dict[str, Path]:
    """The trained pair (a 7-layer DeepSeek-V3 MLA target with Kimi-K3's 576-wide latent and its
    2-layer drafter, ``tests/data/pair``) linked into ``root``, and the drafter quantized to FP8
    there."""
    from vllm_dspark.checkpoint.quantize import quantize_checkpoint

    for name in ("target", "drafter"):
        (root / name).symlink_to(PAIR / name, target_is_directory=True)
    quantize_checkpoint(root / "drafter", root / "drafter-fp8", "fp8", progress=False)
    return {
        "target": root / "target",
        "drafter": root / "drafter",
        "drafter-fp8": root / "drafter-fp8",
    }


def _engine(
    platform: str, target: Path, speculative_config: dict | None, *, enforce_eager: bool = True
):
    from vllm import LLM

    if platform == "cuda":
        extra: dict[str, Any] = {
            "gpu_memory_utilization": 0.3,
            "attention_config": {"backend": CUDA_ATTENTION_BACKEND},
        }
        if speculative_config is not None:
            speculative_config = {**speculative_config, "attention_backend": CUDA_ATTENTION_BACKEND}
    else:
        # Small token budgets: MRV2's input-preparation kernels loop over them, interpreted.
        extra = {"max_num_batched_tokens": 128}
    return LLM(
        model=str(target),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=128,
        max_num_seqs=4,
        enforce_eager=enforce_eager,
        seed=0,
        disable_log_stats=False,
        speculative_config=speculative_config,
        # A cached prefix would skip the target forward that hands the drafter its aux states.
        enable_prefix_caching=False,
        **extra,
    )


def _worker(llm):
    """The in-process worker (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one rank)."""
    return llm.llm_engine.model_executor.driver_worker.worker


class Capture:
    """Wraps the speculator's ``propose``: records its inputs, the draft backbone's output at the
    block's rows and the blocks it drafted, per step (eager runs: a CUDA graph replays no Python)."""

    def __init__(self, speculator) -> None:
        import inspect

        self.steps: list[dict[str, Any]] = []
        self._speculator = speculator
        self._propose = speculator.propose
        self._sample_sequential = speculator._sample_sequential
        self._signature = inspect.signature(self._propose)
        self._hidden = None
        speculator.propose = self._wrapped_propose
        speculator._sample_sequential = self._wrapped_sample_sequential

    def _wrapped_sample_sequential(self, num_reqs: int, head_hidden):
        spec = self._speculator
        rows = spec.sample_indices[: num_reqs * spec.num_speculative_steps]
        self._hidden = (
            head_hidden[rows].float().cpu().view(num_reqs, spec.num_speculative_steps, -1)
        )
        return self._sample_sequential(num_reqs, head_hidden)

    def _wrapped_propose(self, *args, **kwargs):
        import torch

        call = self._signature.bind(*args, **kwargs).arguments
        self._hidden = None
        drafted = self._propose(*args, **kwargs)
        if call.get("dummy_run") or call.get("is_profile"):
            return drafted
        spec = self._speculator
        batch = call["input_batch"]
        num_reqs, num_tokens = batch.num_reqs, batch.num_tokens
        anchor_idx = spec._anchor_idx[:num_reqs]
        self.steps.append(
            {
                "req_ids": list(batch.req_ids[:num_reqs]),
                "query_start_loc": batch.query_start_loc[: num_reqs + 1].cpu().clone(),
                "positions": batch.positions[:num_tokens].cpu().clone(),
                "aux": torch.cat(call["aux_hidden_states"], dim=-1)[:num_tokens].float().cpu(),
                "num_rejected": call["num_rejected"][:num_reqs].cpu().clone(),
                "anchors": spec.input_buffers.input_ids[anchor_idx].cpu().clone(),
                "anchor_positions": spec.input_buffers.positions[anchor_idx].cpu().clone(),
                "hidden": self._hidden,
                "drafted": drafted[:num_reqs].cpu().clone(),
            }
        )
        return drafted

    def close(self) -> list[dict[str, Any]]:
        # Back to the class's methods.
        del self._speculator.propose, self._speculator._sample_sequential
        return self.steps


def _describe(worker) -> dict:
    """The drafter class, its linears' quant schemes, its KV-cache group and specs, as the worker holds them."""
    runner = worker.model_runner
    drafter = runner.speculator.model
    draft_layers = drafter.get_draft_kv_cache_layer_names()
    groups = [list(g.layer_names) for g in runner.kv_cache_config.kv_cache_groups]
    layers = runner.vllm_config.compilation_config.static_forward_context

    def spec(name: str) -> list:
        s = layers[name].get_kv_cache_spec(runner.vllm_config)
        return [
            type(s).__name__,
            s.head_size,
            s.page_size_bytes,
            getattr(s, "non_causal_multi_token_decode", None),
        ]

    from vllm.model_executor.layers.linear import LinearBase

    quant, kernels = {}, set()
    for name, module in drafter.named_modules():
        # Linears only: the shared embed_tokens and lm_head and markov_w2 are embeddings.
        if isinstance(module, LinearBase):
            scheme = getattr(module, "scheme", None)
            quant[name] = (
                type(scheme).__name__ if scheme is not None else type(module.quant_method).__name__
            )
            if hasattr(scheme, "linear_kernel"):
                kernels.add(type(scheme.linear_kernel).__name__)
    shared = next((g for g in groups if set(draft_layers) <= set(g)), [])
    target_layers = [name for name in shared if name not in draft_layers]
    return {
        "class": type(drafter).__name__,
        "draft_layers": draft_layers,
        "groups": groups,
        "quant": quant,
        "quant_kernels": sorted(kernels),
        "attention": sorted(
            {
                type(layers[n]).__name__ + "/" + layers[n].get_attn_backend().get_name()
                for n in draft_layers
            }
        ),
        "draft_specs": [spec(n) for n in draft_layers],
        "target_specs": [spec(n) for n in target_layers],
        "embed_shared": drafter.model.embed_tokens is runner.get_model().model.embed_tokens,
        "lm_head_shared": drafter.lm_head is runner.get_model().lm_head,
    }


def _counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = m.values if hasattr(m, "values") else m.value
    return out


def _outputs(request_outputs) -> list[dict]:
    outs = []
    for ro in request_outputs:
        o = ro.outputs[0]
        entry: dict[str, Any] = {"tokens": list(o.token_ids)}
        if o.logprobs:
            steps = [sorted(step.items(), key=lambda kv: -kv[1].logprob)[:2] for step in o.logprobs]
            entry["top2"] = [[a[0], b[0]] for a, b in steps]
            entry["gaps"] = [a[1].logprob - b[1].logprob for a, b in steps]
        outs.append(entry)
    return outs


def _served(platform: str, target: Path, speculative_config: dict | None, use, **engine) -> Any:
    """``use(llm)`` on a fresh engine, released before returning: an engine that outlives the next
    one's start tears down the process-wide parallel state that the next one uses."""
    import torch

    llm = _engine(platform, target, speculative_config, **engine)
    try:
        return use(llm)
    finally:
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run(platform: str, models: dict[str, Path], out: Path) -> None:
    import torch
    from vllm import SamplingParams

    size = SIZES[platform]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[: size["prompts"]]]

    def greedy(n: int = size["max_tokens"], logprobs: int | None = None) -> SamplingParams:
        return SamplingParams(
            temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False, logprobs=logprobs
        )

    def spec(drafter: str, **extra) -> dict:
        return {
            "method": "dspark",
            "model": str(models[drafter]),
            "num_speculative_tokens": BLOCK,
            **extra,
        }

    results: dict[str, Any] = {"platform": platform, "block": BLOCK, **size}
    captures: dict[str, list] = {}

    def timed(use):
        def run_timed(llm) -> dict:
            start = time.perf_counter()
            result = use(llm)
            return {**result, "generate_seconds": time.perf_counter() - start}

        return run_timed

    results["baseline"] = _served(
        platform,
        models["target"],
        None,
        timed(lambda llm: {"outputs": _outputs(llm.generate(prompts, greedy(logprobs=2)))}),
    )

    for name, drafter in (("bf16", "drafter"), ("fp8", "drafter-fp8")):

        def serve(llm, name=name) -> dict:
            worker = _worker(llm)
            capture = Capture(worker.model_runner.speculator)
            start = time.perf_counter()
            outputs = _outputs(llm.generate(prompts, greedy()))
            seconds = time.perf_counter() - start
            captures[name] = capture.close()
            counters = _counters(llm)
            if name == "bf16":
                captures.update(
                    _broken_hook_captures(llm, worker, prompts[:1], greedy(size["broken_tokens"]))
                )
            return {
                "outputs": outputs,
                "counters": counters,
                "worker": _describe(worker),
                "generate_seconds": seconds,
            }

        results[name] = _served(platform, models["target"], spec(drafter), serve)

    params = [greedy()] + [
        SamplingParams(
            temperature=0.8 + 0.2 * i,
            seed=1 + i,
            max_tokens=size["max_tokens"],
            ignore_eos=True,
            detokenize=False,
        )
        for i in range(len(prompts) - 1)
    ]
    results["probabilistic"] = _served(
        platform,
        models["target"],
        spec("drafter", draft_sample_method="probabilistic", rejection_sample_method="block"),
        timed(
            lambda llm: {
                "outputs": _outputs(llm.generate(prompts, params)),
                "counters": _counters(llm),
            }
        ),
    )

    if platform == "cuda":
        # The production path: the draft step (backbone + sequential Markov sampling) in a FULL CUDA graph.
        results["cudagraphs"] = _served(
            platform,
            models["target"],
            spec("drafter"),
            timed(
                lambda llm: {
                    "outputs": _outputs(llm.generate(prompts, greedy())),
                    "counters": _counters(llm),
                }
            ),
            enforce_eager=False,
        )

    out.mkdir(parents=True, exist_ok=True)
    torch.save(captures, out / "captures.pt")
    (out / "results.json").write_text(json.dumps(results, indent=1))


def _broken_hook_captures(llm, worker, prompts: list, params) -> dict[str, list]:
    """Drafting steps with one hook of the loaded drafter deliberately broken (then restored)."""
    drafter = worker.model_runner.speculator.model
    width = drafter.config.target_hidden_size
    markov_bias, combine = drafter.markov_bias, drafter.combine_hidden_states
    breaks = {
        "broken_markov_sign": ("markov_bias", lambda m: -markov_bias(m)),
        # Each aux slot gets the next tapped layer's states: a wrong target_layer_ids.
        "broken_aux_layer": ("combine_hidden_states", lambda h: combine(h.roll(-width, dims=-1))),
    }
    captures = {}
    for name, (hook, broken) in breaks.items():
        setattr(drafter, hook, broken)
        capture = Capture(worker.model_runner.speculator)
        llm.generate(prompts, params)
        captures[name] = capture.close()
        delattr(drafter, hook)
    return captures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--platform", choices=sorted(SIZES), required=True)
    parser.add_argument("--models", type=Path, required=True, help="directory from build_models")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.platform == "cpu":
        from tests import triton_interpreter

        triton_interpreter.enable()
    models = {name: args.models / name for name in ("target", "drafter", "drafter-fp8")}
    run(args.platform, models, args.out)


if __name__ == "__main__":
    main()
