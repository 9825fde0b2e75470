# SPDX-License-Identifier: Apache-2.0
"""vLLM's ``dspark`` speculator against vLLM's own tiny Kimi-K3 target on CPU, and what it did.

``python -m tests.support.kimi_k3_e2e --models DIR --out DIR`` serves, per layer pattern, in one
process and in-process engines (:mod:`vllm_dspark.cpu_serving` enabled first: Model Runner V2 under
Triton's interpreter and the Kimi-K3 emulations):

- the target without speculation, the prompts concurrently (top-2 logprobs), then each prompt
  extended by the first :data:`PREFIX` tokens it generated (prefill of what was decoded), for
  :data:`RESUMED` more;
- the target with vLLM's ``dspark`` speculator and a random drafter (``make-random --like`` the
  target), the prompts concurrently, with *oracle drafts*: each block the drafter drafted replaced by
  the baseline's next tokens, some right (:data:`RIGHT`) and the next one wrong, so verification
  accepts 0 to :data:`BLOCK` drafts and rolls the KDA states back by each amount (a random drafter's
  own blocks would all be rejected).

The two patterns' drafters read the target's two aux streams: :data:`ATTN_RES`'s is lightseekorg's
variant (per-tap ``fc_norm``, ``aux_hidden_stream: attn_res``), for which the plugin's serve hook sets
``VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1`` and vLLM's Kimi-K3 class hands over, at each tap, the AttnRes
mixture its next layer would read (softmax over the completed blocks and the running prefix); the
other's reads the default residual prefix stream.

Every target logits tensor is checked for NaN inside the engine. In the speculative run it captures each
drafting step (:class:`tests.support.dspark_e2e.Capture`: aux hidden states, positions, rejected
counts, anchors, the drafter's own blocks before the oracle replaces them), at each aux tap the stream
handed over against the prefix and a torch reading of the AttnRes mixture (:class:`AuxStreamWatch`),
and, at each draft layer's attention, the latents read back from that layer's own pages through its
own block table (that of the KV-cache group holding the layer: the draft layers' own groups where
their spec differs from the target MLA layers' (CPU_MLA's kernel-block stride), groups shared with
them where it is the same (AMX_MLA), as vLLM groups any equal MLA specs). It writes ``results.json`` and
``captures.pt``; ``tests/serving/test_kimi_k3_serving.py`` builds the models, runs this and asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from tests.support.checkpoints import TINY_VARIANTS
from tests.support.dspark_e2e import Capture
from vllm_dspark.cpu_serving import engines
from vllm_dspark.doctor.facts import AUX_STREAM_ENV

BLOCK = 3
PREFIX = 2
MAX_TOKENS = 6
# Tokens generated after that prefill: the first from the whole prefill, the next from a decode step.
RESUMED = 2
# Two layer patterns: KDA, KDA, MLA, KDA with AttnRes blocks of 2 (the maker's default), and
# MLA first with a KDA layer between two MLA ones, AttnRes blocks of 3.
PATTERNS: dict[str, dict[str, Any]] = {
    "kkmk": {},
    "mkmk": {"full_attn_layers": (1, 3), "attn_res_block_size": 3},
}
PROMPTS = [[5, 17, 300, 42, 99, 7, 1000, 12], [3, 250, 64, 8, 900, 33, 1]]
# Oracle drafts right per request and block (then none): 3 and 0 accepted for the first request,
# 2 and 1 for the second, within MAX_TOKENS (1 + 4 + 1 and 1 + 3 + 2 tokens).
RIGHT = ((BLOCK, 0), (2, 1))
VOCAB = 4096  # the target maker's
# The pattern whose drafter reads the attn_res aux stream (its taps mix 2 and 3 AttnRes sources).
ATTN_RES = "kkmk"


def build_models(root: Path) -> dict[str, Path]:
    """Per pattern, a random Kimi-K3 target and a random drafter like it, under ``root``."""
    from vllm_dspark.checkpoint_tools.kimi_k3_target import make_kimi_k3_target
    from vllm_dspark.checkpoint_tools.make_random import make_random_like

    models = {}
    for name, config in PATTERNS.items():
        target = make_kimi_k3_target(root / f"target-{name}", **config)
        # Its block is the one served, so that the reference drafts the same block.
        variant = {"block_size": BLOCK, **(TINY_VARIANTS["fc-norm"] if name == ATTN_RES else {})}
        make_random_like(root / f"drafter-{name}", target, progress=False, variant=variant)
        models[f"target-{name}"], models[f"drafter-{name}"] = target, root / f"drafter-{name}"
    return models


class NaNWatch:
    """Counts the target's logits tensors, and those with a NaN, as the runner computes them."""

    def __init__(self, model) -> None:
        self.model, self.calls, self.nan = model, 0, 0
        compute = model.compute_logits

        def compute_logits(*args, **kwargs):
            logits = compute(*args, **kwargs)
            self.calls += 1
            self.nan += int(bool(logits.isnan().any()))
            return logits

        model.compute_logits = compute_logits

    def close(self) -> dict[str, int]:
        del self.model.compute_logits  # back to the class's method
        return {"logits": self.calls, "with_nan": self.nan}


def attn_res_mixture(
    prefix: torch.Tensor,
    blocks: torch.Tensor,
    norm_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """AttnRes in torch: the softmax mixture of the completed ``blocks`` ``[T, n, H]`` and the running
    ``prefix`` ``[T, H]``, each source scored by ``proj_weight`` on its RMS-normed self."""
    sources = torch.cat([blocks, prefix[:, None]], dim=1).float()
    normed = sources * torch.rsqrt(sources.pow(2).mean(-1, keepdim=True) + eps)
    scores = normed @ (norm_weight.float() * proj_weight.float())
    return (scores.softmax(-1)[..., None] * sources).sum(1)


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


class AuxStreamWatch:
    """At each aux tap of the target: the relative L2 distance of the stream vLLM hands the drafter from
    the residual prefix and from :func:`attn_res_mixture` as the tap's consumer (the next layer's
    attention, or the output after the last layer) would read it."""

    def __init__(self, model) -> None:
        import vllm.envs as envs

        self.text = next(m for m in model.modules() if hasattr(m, "_capture_aux_hidden_stream"))
        self.mode, self.calls = bool(envs.VLLM_KIMI_K3_AUX_ATTN_RES_STREAM), []
        capture = self.text._capture_aux_hidden_stream

        def recorded(layer_idx, prefix_sum, pending_mlp_out, block_residual):
            stream = capture(layer_idx, prefix_sum, pending_mlp_out, block_residual)
            prefix = prefix_sum if pending_mlp_out is None else prefix_sum + pending_mlp_out
            norm, proj, num_blocks = self._consumer(layer_idx)
            mixed = attn_res_mixture(
                prefix,
                block_residual[:, :num_blocks],
                norm.weight,
                proj.weight[0],
                norm.variance_epsilon,
            )
            self.calls.append(
                {
                    "layer": layer_idx,
                    "blocks": num_blocks,
                    "vs_prefix": _distance(stream, prefix),
                    "vs_mixture": _distance(stream, mixed),
                }
            )
            return stream

        self.text._capture_aux_hidden_stream = recorded

    def _consumer(self, layer_idx: int):
        """The AttnRes score norm and projection that read the stream after ``layer_idx``, and its blocks."""
        text = self.text
        if layer_idx + 1 < text.end_layer:
            layer = text.layers[layer_idx + 1]
            return (
                layer.self_attention_res_norm,
                layer.self_attention_res_proj,
                layer.prev_valid_blocks,
            )
        return text.output_attn_res_norm, text.output_attn_res_proj, text.num_attn_res_blocks

    def close(self) -> dict[str, Any]:
        del self.text._capture_aux_hidden_stream  # back to the class's method
        return {"attn_res": self.mode, "calls": self.calls}


class OracleDrafts:
    """Replaces each drafted block by the baseline's next tokens, :data:`RIGHT` of them right (by
    request and block), the next one wrong; a request is found by its anchor (its last token, at its
    position)."""

    def __init__(self, speculator, prompts: list[list[int]], baseline: list[list[int]]) -> None:
        self.speculator, self.prompts, self.baseline = speculator, prompts, baseline
        self.steps, self.blocks = 0, [0] * len(prompts)
        self._propose = propose = speculator.propose

        def oracle_propose(*args, **kwargs):
            drafted = propose(*args, **kwargs)
            spec = self.speculator
            anchors = spec._anchor_idx[: drafted.shape[0]]
            tokens = spec.input_buffers.input_ids[anchors].tolist()
            positions = spec.input_buffers.positions[anchors].tolist()
            for row, (token, position) in enumerate(zip(tokens, positions, strict=True)):
                block = self._block(token, position)
                if block is not None:
                    drafted[row, : len(block)] = torch.tensor(block, dtype=drafted.dtype)
            self.steps += 1
            return drafted

        speculator.propose = oracle_propose

    def _block(self, token: int, position: int) -> list[int] | None:
        for r, (prompt, out) in enumerate(zip(self.prompts, self.baseline, strict=True)):
            done = position - len(prompt) + 1  # generated tokens up to the anchor
            if not 0 < done < len(out) or out[done - 1] != token:
                continue
            right = RIGHT[r][self.blocks[r]] if self.blocks[r] < len(RIGHT[r]) else 0
            block = out[done : done + right]
            if len(block) < BLOCK and done + len(block) < len(out):
                block.append((out[done + len(block)] + 1) % VOCAB)
            self.blocks[r] += 1
            return block
        return None

    def close(self) -> dict[str, Any]:
        self.speculator.propose = self._propose
        return {"steps": self.steps, "blocks": self.blocks}


class LatentReadback:
    """Records, at each draft layer's attention, every request's latents read back from that layer's
    own pages through its own block table (its metadata's): positions ``0 .. seq_len - 1``."""

    def __init__(self, worker) -> None:
        runner = worker.model_runner
        layers = runner.vllm_config.compilation_config.static_forward_context
        names = runner.speculator.model.get_draft_kv_cache_layer_names()
        self.impls = [layers[name].impl for name in names]
        self.reads: list[list[list]] = [
            [] for _ in names
        ]  # [layer][call][request] -> [seq_len, latent]
        for layer, impl in enumerate(self.impls):
            forward = impl.forward_mqa

            def recorded(q, cache, attn_metadata, attn_layer, forward=forward, layer=layer):
                decode = attn_metadata.decode
                block_size = cache.shape[1]
                rows = []
                for r, seq_len in enumerate(decode.seq_lens.tolist()):
                    pos = torch.arange(seq_len)
                    blocks = decode.block_table[r, pos // block_size].long()
                    rows.append(cache[blocks, pos % block_size].float().clone())
                self.reads[layer].append(rows)
                return forward(q, cache, attn_metadata, attn_layer)

            impl.forward_mqa = recorded

    def close(self) -> list[list[list]]:
        for impl in self.impls:
            del impl.forward_mqa  # back to the class's method
        return self.reads


def _spec_kinds(group) -> list[str]:
    """The KV-cache spec classes of a group's layers (one spec, or a packed group's per-layer ones)."""
    spec = group.kv_cache_spec
    specs = spec.kv_cache_specs.values() if hasattr(spec, "kv_cache_specs") else [spec]
    return sorted({type(s).__name__ for s in specs})


def _generate(llm, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs)
    return engines.outputs(llm.generate([{"prompt_token_ids": p} for p in prompts], params))


def _served(target: Path, spec: dict | None, use) -> dict[str, Any]:
    """``use(llm)`` on a fresh engine, and its wall and CPU seconds, with vLLM's environment read
    afresh: an earlier engine froze it (vLLM caches its env vars once an engine starts), and the
    attn_res drafter's serve hook sets ``VLLM_KIMI_K3_AUX_ATTN_RES_STREAM``, unset after its engine."""
    import vllm.envs as envs

    envs.disable_envs_cache()
    start, cpu = time.perf_counter(), time.process_time()
    try:
        result = engines.served("cpu", target, spec, use, max_model_len=64)
    finally:
        os.environ.pop(AUX_STREAM_ENV, None)
    seconds = {"wall": time.perf_counter() - start, "cpu": time.process_time() - cpu}
    return {**result, "seconds": {key: round(value, 1) for key, value in seconds.items()}}


def serve_pattern(target: Path, drafter: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Baseline (with prefill of decoded tokens), then dspark with oracle drafts, on one pattern's
    target; the results, and the speculative run's drafting steps and latent read-backs."""

    def baseline(llm) -> dict[str, Any]:
        watch = NaNWatch(engines.worker(llm).model_runner.model)
        outs = _generate(llm, PROMPTS, MAX_TOKENS, logprobs=2)
        extended = [p + o["tokens"][:PREFIX] for p, o in zip(PROMPTS, outs, strict=True)]
        resumed = _generate(llm, extended, RESUMED)
        return {"outputs": outs, "resumed": resumed, "nan": watch.close()}

    results = {"baseline": _served(target, None, baseline)}
    expected = [o["tokens"] for o in results["baseline"]["outputs"]]
    captures: dict[str, Any] = {}

    def speculative(llm) -> dict[str, Any]:
        worker = engines.worker(llm)
        runner = worker.model_runner
        watch, readback = NaNWatch(runner.model), LatentReadback(worker)
        stream = AuxStreamWatch(runner.model)
        # The capture sees the drafter's own blocks; the oracle then replaces them.
        capture = Capture(runner.speculator)
        oracle = OracleDrafts(runner.speculator, PROMPTS, expected)
        outs = _generate(llm, PROMPTS, MAX_TOKENS)
        drafts = oracle.close()
        captures.update(steps=capture.close(), latents=readback.close())
        return {
            "outputs": outs,
            "acceptance": engines.acceptance(engines.counters(llm)),
            "drafts": drafts,
            "nan": watch.close(),
            "aux_stream": stream.close(),
            "groups": [list(g.layer_names) for g in runner.kv_cache_config.kv_cache_groups],
            "group_specs": [_spec_kinds(g) for g in runner.kv_cache_config.kv_cache_groups],
            "draft_layers": runner.speculator.model.get_draft_kv_cache_layer_names(),
        }

    results["oracle"] = _served(target, engines.dspark_config(drafter, BLOCK), speculative)
    return results, captures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=Path, required=True, help="directory from build_models")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--patterns", nargs="+", choices=sorted(PATTERNS), default=list(PATTERNS))
    args = parser.parse_args()
    from vllm_dspark.cpu_serving import enable

    enable()
    results, captures = {}, {}
    for name in args.patterns:
        results[name], captures[name] = serve_pattern(
            args.models / f"target-{name}", args.models / f"drafter-{name}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    torch.save(captures, args.out / "captures.pt")


if __name__ == "__main__":
    main()
