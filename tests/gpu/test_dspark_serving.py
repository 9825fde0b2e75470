# SPDX-License-Identifier: Apache-2.0
"""Serving a tiny random MLA target with this drafter through ``vllm.LLM(speculative_config={"method": "dspark"})``.

GPU only (vLLM runs ``dspark`` in its V2 GPU model runner): skipped without CUDA. It checks what the
CPU tests cannot: the Kimi-K3 MLA draft layers on a real MLA backend, their KV pages in the
target's cache, FP8 weight-only linears, the speculator's Markov loop, and lossless verification.

The target is a random 8-layer DeepSeek-V3 (dense MLP, MLA with the Kimi-K3 latent: kv_lora_rank
512 + rope 64 = 576), written by transformers; the drafter is random too, in this project's on-disk
layout, with the target's geometry (hidden 256, aux layers 1, 2, 4, 5, 6). Random drafts are
mostly rejected: the assertions are about correctness (greedy output unchanged by speculation,
probabilistic/block runs complete with valid tokens), and that drafting really happened.

"Unchanged" is exact up to numerics: verifying 8 tokens per step runs the target's BF16 kernels on
other shapes than one-token decode, so where the target's top two logits nearly tie, either token
is the greedy answer. Each greedy output must equal the baseline's up to the first such near-tie
(top-2 gap under a tenth of the median gap, far above BF16 noise), and pick one of the tied two there.

Draft attention uses TRITON_MLA, the non-causal-capable MLA backend on Hopper (FLASHINFER_MLA needs
compute capability 10.x); the target uses it too so both share one KV-cache layout.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

VOCAB = 4096
MASK_TOKEN = 4093
BLOCK = 7
MAX_TOKENS = 48
ATTENTION_BACKEND = "TRITON_MLA"
PROMPTS = [[11, 250, 3000, 42, 7, 900, 12], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [4000, 17]]


def _drafter_config() -> dict:
    from vllm_dspark.presets import preset_config_json

    config = preset_config_json("small")
    config.update(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        vocab_size=VOCAB, draft_vocab_size=VOCAB, target_hidden_size=256, target_num_hidden_layers=8,
        target_layer_ids=[1, 2, 4, 5, 6], num_target_layers=5, mask_token_id=MASK_TOKEN, markov_rank=32,
        block_size=BLOCK,
    )
    config.pop("target_kv_latent_dim")  # the Kimi-K3 default, 576
    return config


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from vllm_dspark.checkpoint import save_drafter
    from vllm_dspark.config import K3DSparkConfig
    from vllm_dspark.make_random import random_drafter_tensors
    from vllm_dspark.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("dspark_serving")
    torch.manual_seed(0)
    target_config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=8, first_k_dense_replace=8, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        n_group=1, topk_group=1, max_position_embeddings=4096, tie_word_embeddings=False,
    )
    target_config.architectures = ["DeepseekV3ForCausalLM"]
    target = DeepseekV3ForCausalLM(target_config).to(torch.bfloat16)
    target.save_pretrained(root / "target")

    drafter_json = _drafter_config()
    tensors = random_drafter_tensors(K3DSparkConfig(**drafter_json), seed=0)
    save_drafter(root / "drafter", drafter_json, tensors)
    quantize_checkpoint(root / "drafter", root / "drafter-fp8", "fp8", progress=False)
    return {"target": root / "target", "drafter": root / "drafter", "drafter-fp8": root / "drafter-fp8"}


def _generate(target: Path, params: list, speculative_config: dict | None = None, *,
              enforce_eager: bool = True, inspect=None):
    """The outputs per prompt, the spec-decode counters, and ``inspect(worker)`` of the one worker."""
    from vllm import LLM

    llm = LLM(model=str(target), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512, max_num_seqs=4,
              gpu_memory_utilization=0.3, enforce_eager=enforce_eager, seed=0, disable_log_stats=False,
              attention_config={"backend": ATTENTION_BACKEND}, speculative_config=speculative_config)
    try:
        outputs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
        counters = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")
                    and hasattr(m, "value")}
        inspected = llm.collective_rpc(inspect)[0] if inspect is not None else None
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return outputs, counters, inspected


@dataclass
class Baseline:
    """Greedy output without speculation: tokens and, per step, the top-2 token ids and their gap."""

    tokens: list[list[int]]
    top2: list[list[tuple[int, int]]]
    gaps: list[list[float]]
    tie: float  # a gap below this is a near-tie

    def assert_matches(self, prompt: int, tokens: list[int]) -> int:
        """``tokens`` equal the baseline up to its first near-tie; returns how many were compared."""
        base = self.tokens[prompt]
        assert len(tokens) == len(base)
        first_tie = next((i for i, gap in enumerate(self.gaps[prompt]) if gap < self.tie), len(base))
        assert tokens[:first_tie] == base[:first_tie], f"prompt {prompt}: {tokens} != {base}"
        if first_tie < len(base):
            assert tokens[first_tie] in self.top2[prompt][first_tie], f"prompt {prompt}, step {first_tie}"
        return first_tie


def _greedy_matches(baseline: Baseline, outputs: list, prompts: list[int] | None = None) -> None:
    prompts = list(range(len(PROMPTS))) if prompts is None else prompts
    compared = sum(baseline.assert_matches(p, list(outputs[p].token_ids)) for p in prompts)
    # Not vacuous: a near-tie is rare (about 7 % of steps at this threshold), so most tokens count.
    assert compared >= 0.25 * MAX_TOKENS * len(prompts), f"only {compared} tokens before near-ties"


def _greedy(logprobs: int | None = None) -> list:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False,
                            logprobs=logprobs)
    return [params] * len(PROMPTS)


def _spec(drafter: Path, **extra) -> dict:
    return {"method": "dspark", "model": str(drafter), "num_speculative_tokens": BLOCK,
            "attention_backend": ATTENTION_BACKEND, **extra}


def _describe_drafter(worker) -> dict:
    """Runs inside the worker: the drafter class, its linears' quant schemes, its KV-cache group and specs."""
    runner = worker.model_runner
    drafter = runner.speculator.model
    draft_layers = drafter.get_draft_kv_cache_layer_names()
    groups = [list(g.layer_names) for g in runner.kv_cache_config.kv_cache_groups]
    layers = runner.vllm_config.compilation_config.static_forward_context

    def spec(name: str) -> tuple:
        s = layers[name].get_kv_cache_spec(runner.vllm_config)
        return type(s).__name__, s.head_size, s.page_size_bytes, getattr(s, "non_causal_multi_token_decode", None)

    from vllm.model_executor.layers.linear import LinearBase

    quant = {}
    for name, module in drafter.named_modules():
        # Linears only: the shared embed_tokens and lm_head and markov_w2 are embeddings.
        if isinstance(module, LinearBase):
            scheme = getattr(module, "scheme", None)
            quant[name] = type(scheme).__name__ if scheme is not None else type(module.quant_method).__name__
    shared = next((g for g in groups if set(draft_layers) <= set(g)), [])
    target_layers = [name for name in shared if name not in draft_layers]
    return {"class": type(drafter).__name__, "draft_layers": draft_layers, "groups": groups, "quant": quant,
            "draft_specs": [spec(n) for n in draft_layers], "target_specs": [spec(n) for n in target_layers],
            "embed_shared": drafter.model.embed_tokens is runner.get_model().model.embed_tokens,
            "lm_head_shared": drafter.lm_head is runner.get_model().lm_head}


@pytest.fixture(scope="module")
def baseline(models) -> Baseline:
    outputs, _, _ = _generate(models["target"], _greedy(logprobs=2))
    tokens, top2, gaps = [], [], []
    for out in outputs:
        assert len(out.token_ids) == MAX_TOKENS
        tokens.append(list(out.token_ids))
        steps = [sorted(step.items(), key=lambda kv: -kv[1].logprob)[:2] for step in out.logprobs]
        top2.append([(a[0], b[0]) for a, b in steps])
        gaps.append([a[1].logprob - b[1].logprob for a, b in steps])
    all_gaps = sorted(g for prompt in gaps for g in prompt)
    return Baseline(tokens, top2, gaps, tie=0.1 * all_gaps[len(all_gaps) // 2])


def _assert_drafted(counters: dict) -> None:
    assert counters.get("vllm:spec_decode_num_drafts", 0) > 0, f"no drafts were proposed: {counters}"
    assert counters.get("vllm:spec_decode_num_draft_tokens", 0) > 0, counters


def test_greedy_output_is_unchanged_by_dspark_speculation(models, baseline) -> None:
    outputs, counters, info = _generate(models["target"], _greedy(), _spec(models["drafter"]),
                                        inspect=_describe_drafter)
    _greedy_matches(baseline, outputs)
    _assert_drafted(counters)
    assert info["class"] == "K3DSparkForCausalLM"
    # Draft layers are numbered after the target's 8 and live in a KV-cache group with target layers.
    assert info["draft_layers"] == ["model.layers.8.self_attn", "model.layers.9.self_attn"]
    # They report the target's 576-wide MLA spec (plus the non-causal flag) and share its KV-cache group.
    assert info["target_specs"], f"no KV-cache group holds both draft and target layers: {info['groups']}"
    for kind, head_size, page_bytes, non_causal in info["draft_specs"]:
        assert (kind, head_size, non_causal) == ("MLAAttentionSpec", 576, True)
        assert page_bytes == info["target_specs"][0][2]
    assert info["embed_shared"] and info["lm_head_shared"]
    assert all(method == "UnquantizedLinearMethod" for method in info["quant"].values()), info["quant"]


def test_fp8_drafter_serves_losslessly_with_fp8_on_exactly_the_six_kinds(models, baseline) -> None:
    outputs, counters, info = _generate(models["target"], _greedy(), _spec(models["drafter-fp8"]),
                                        inspect=_describe_drafter)
    _greedy_matches(baseline, outputs)
    _assert_drafted(counters)
    fp8 = {name for name, scheme in info["quant"].items() if scheme == "CompressedTensorsW8A16Fp8"}
    expected = {"model.context_proj"} | {
        f"model.layers.{i}.{kind}" for i in range(2)
        for kind in ("self_attn.q_b_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    }
    assert fp8 == expected, info["quant"]


def test_greedy_output_is_unchanged_with_cuda_graphs(models, baseline) -> None:
    """The production path: the draft step (backbone + sequential Markov sampling) in a FULL CUDA graph."""
    outputs, counters, _ = _generate(models["target"], _greedy(), _spec(models["drafter"]), enforce_eager=False)
    _greedy_matches(baseline, outputs)
    _assert_drafted(counters)


def test_probabilistic_drafting_with_block_verification(models, baseline) -> None:
    """Sampled requests complete with valid tokens; the greedy one in the same batch (block
    verification falls back to argmax matching for it) still matches the baseline."""
    from vllm import SamplingParams

    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False),
        SamplingParams(temperature=0.8, seed=1, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False),
        SamplingParams(temperature=1.0, seed=2, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False),
    ]
    spec = _spec(models["drafter"], draft_sample_method="probabilistic", rejection_sample_method="block")
    outputs, counters, _ = _generate(models["target"], params, spec)
    _greedy_matches(baseline, outputs, prompts=[0])
    assert all(len(o.token_ids) == MAX_TOKENS and all(0 <= t < VOCAB for t in o.token_ids) for o in outputs)
    _assert_drafted(counters)
