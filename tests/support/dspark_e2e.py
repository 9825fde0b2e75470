# SPDX-License-Identifier: Apache-2.0
"""Serve the trained pair through vLLM's real ``dspark`` speculator, and record what it drafted.

``python -m tests.support.dspark_e2e --platform {cpu,cuda} --models DIR --out DIR`` runs, in one process and
in-process engines, :func:`vllm_dspark.cpu_serving.pair.serve_pair` (the target without
speculation with top-2 logprobs, the BF16 and FP8 drafters greedy, the BF16 drafter drafting
probabilistically with block verification: what ``make demo`` serves). It writes ``results.json``
(outputs, spec-decode counters, what the worker holds) and ``captures.pt``: for each drafting step,
what the speculator was given (aux hidden states, positions, rejected counts) and what it drafted
(anchors, anchor positions, the backbone's hidden states at the block, the block), captured inside
the engine. Two more captures come from the BF16 engine with a deliberately broken hook (Markov
bias sign flipped; aux layers in the wrong order), which the reference check must reject.

On CPU it first enables :mod:`vllm_dspark.cpu_serving` (Model Runner V2 needs Triton), so it runs
in its own process: the interpreter must be set before vLLM is imported, and must not leak into
other tests. ``tests/serving/test_dspark_serving.py`` builds the models, runs this and asserts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from vllm_dspark.cpu_serving import engines
from vllm_dspark.cpu_serving.pair import (
    BLOCK,
    DEFAULT_RUNS,
    heldout_prompts,
    sampling,
    serve_pair,
)

PAIR = Path(__file__).resolve().parents[1] / "data" / "pair"
# A causal-block drafter trained on the same target (tests/data/pair-causal/README.md).
CAUSAL_PAIR = PAIR.with_name("pair-causal")
# The drafter's builds served beside it, by run: (format, layout). The published FP8 one, a W8A8 one
# (fp8-dynamic), and the same W8A8 numerics in ModelOpt's layout.
QUANTIZED = {
    "fp8": ("fp8", "compressed-tensors"),
    "fp8-dynamic": ("fp8-dynamic", "compressed-tensors"),
    "modelopt": ("fp8-dynamic", "modelopt"),
}
MODELS = ("target", "drafter", "drafter-causal", *(f"drafter-{run}" for run in QUANTIZED))
# Held-out prompts of the trained pair (vllm-dspark train-pair), cut short: the CPU run is slow.
PROMPTS = heldout_prompts(PAIR, 3, 24)
# Per platform: prompts and tokens per request. The CPU run interprets vLLM's Triton kernels
# (about a second per decoding step on 2 cores), so it is sized to stay within CI's budget.
SIZES = {
    "cpu": {"prompts": 2, "max_tokens": 10, "broken_tokens": 3},
    "cuda": {"prompts": 3, "max_tokens": 48, "broken_tokens": 8},
}


def build_models(root: Path) -> dict[str, Path]:
    """The trained pair (a 7-layer DeepSeek-V3 MLA target with Kimi-K3's 576-wide latent and its
    2-layer drafter, ``tests/data/pair``) linked into ``root``, and the drafter quantized there to each
    of :data:`QUANTIZED`."""
    from vllm_dspark.checkpoint_tools.quantize import quantize_checkpoint

    for name in ("target", "drafter"):
        (root / name).symlink_to(PAIR / name, target_is_directory=True)
    (root / "drafter-causal").symlink_to(CAUSAL_PAIR / "drafter", target_is_directory=True)
    for run, (fmt, export) in QUANTIZED.items():
        quantize_checkpoint(
            root / "drafter", root / f"drafter-{run}", fmt, progress=False, export=export
        )
    return {name: root / name for name in MODELS}


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


class DraftMasks:
    """Records the ``causal`` flag of the attention metadata each draft layer's impl is given: what
    vLLM's metadata builder made of the drafter's causality (``use_non_causal``)."""

    def __init__(self, worker) -> None:
        runner = worker.model_runner
        layers = runner.vllm_config.compilation_config.static_forward_context
        names = runner.speculator.model.get_draft_kv_cache_layer_names()
        self.impls = [layers[name].impl for name in names]
        self.flags: set[bool] = set()
        for impl in self.impls:
            forward = impl.forward_mqa

            def recorded(q, cache, attn_metadata, layer, forward=forward):
                self.flags.add(bool(attn_metadata.causal))
                return forward(q, cache, attn_metadata, layer)

            impl.forward_mqa = recorded

    def close(self) -> list[bool]:
        for impl in self.impls:
            del impl.forward_mqa  # back to the class's method
        return sorted(self.flags)


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

    from vllm_dspark.runtime.model import linear_kernel

    quant, kernels = {}, set()
    for name, module in drafter.named_modules():
        # Linears only: the shared embed_tokens and lm_head and markov_w2 are embeddings.
        if isinstance(module, LinearBase):
            # compressed-tensors keeps a scheme per layer; ModelOpt's linear method holds the kernel.
            scheme = getattr(module, "scheme", None) or module.quant_method
            quant[name] = type(scheme).__name__
            if not quant[name].startswith("Unquantized"):
                kernels.add(type(linear_kernel(scheme)).__name__)
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


def run(platform: str, models: dict[str, Path], out: Path) -> None:
    import torch

    size = SIZES[platform]
    prompts = PROMPTS[: size["prompts"]]
    captures: dict[str, list] = {}

    def observe(run: str, llm):
        if run not in ("bf16", "causal", *QUANTIZED):
            return dict
        worker = engines.worker(llm)
        capture = Capture(worker.model_runner.speculator)
        masks = DraftMasks(worker)

        def finish() -> dict:
            captures[run] = capture.close()
            causal_flags = masks.close()
            if run == "bf16":
                requests = [{"prompt_token_ids": prompts[0]}]
                captures.update(
                    _broken_hook_captures(
                        llm, worker, requests, sampling(run, 1, size["broken_tokens"])
                    )
                )
            return {"worker": _describe(worker), "draft_attention_causal": causal_flags}

        return finish

    results: dict[str, Any] = {"platform": platform, "block": BLOCK, **size}
    results.update(
        serve_pair(
            models,
            prompts,
            size["max_tokens"],
            runs=(*DEFAULT_RUNS, "fp8-dynamic", "modelopt", "causal"),
            platform=platform,
            observe=observe,
        )
    )
    if platform == "cuda":
        # The production path: the draft step (backbone + sequential Markov sampling) in a FULL CUDA graph.
        results["cudagraphs"] = engines.served(
            platform,
            models["target"],
            engines.dspark_config(models["drafter"], BLOCK),
            lambda llm: {
                "outputs": engines.outputs(
                    llm.generate(
                        [{"prompt_token_ids": p} for p in prompts],
                        sampling("bf16", len(prompts), size["max_tokens"]),
                    )
                ),
                "counters": engines.counters(llm),
            },
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
        from vllm_dspark.cpu_serving import enable

        enable()
    models = {name: args.models / name for name in MODELS}
    run(args.platform, models, args.out)


if __name__ == "__main__":
    main()
