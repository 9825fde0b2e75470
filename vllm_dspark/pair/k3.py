# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark train-pair --target kimi-k3``: a random Kimi-K3 target and a DSpark drafter distilled on
its aux hidden states, captured from vLLM serving the target on CPU.

No torch Kimi-K3 forward exists outside vLLM (KDA, NoPE MLA, MoE, AttnRes), and training one on the
stdlib as ``train-pair`` trains its DeepSeek-V3 target would take hours on CPU. So the target is
``make-random --target kimi-k3``'s (smaller: hidden 128, vocab 512), and the drafter learns it:

1. vLLM serves the target with the ``dspark`` speculator and a random drafter (which only makes vLLM
   collect the aux states) on CPU (:mod:`vllm_dspark.cpu_serving`); each random-token sequence is
   prefilled once, and the speculator's inputs are captured: the aux states and the target's final
   hidden states, whose logits (the target's own ``compute_logits``) are the distillation target;
2. the drafter trains on them with ``train-pair``'s DSpark loss (:func:`.train.dspark_loss`);
3. vLLM serves held-out prompts without speculation and with the trained drafter (greedy), and τ comes
   from vLLM's own spec-decode counters, as ``make demo`` measures it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

# The target: the maker's layer pattern (KDA, KDA, MLA, KDA), smaller than its default so the pair
# stays a few MiB and the few sequences vLLM can prefill on CPU under Triton's interpreter (about a
# second per token on 2 busy cores) show the drafter each token often.
TARGET_CONFIG = {"hidden_size": 128, "vocab_size": 128}
# Sequences prefilled per engine step (vLLM's max_num_seqs in these engines).
PER_STEP = 4
FIRST_TOKEN = 3  # ids 0..2 are pad, bos and eos


@dataclass(frozen=True)
class K3PairSizes:
    """Every size and step count of a K3 pair run; the defaults make the committed pair."""

    sequences: int = 12
    seq_len: int = 32
    draft_layers: int = 2
    batch_size: int = 8
    anchors: int = 8
    drafter_steps: int = 400
    lr: float = 3e-3
    eval_prompts: int = 3
    eval_prompt_tokens: int = 16
    eval_tokens: int = 16
    threads: int = 1


def random_sequences(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` seeded sequences of ``length`` token ids, none of the target's or drafter's specials
    (the drafter's mask is ``vocab - 3``, the media placeholder ``vocab - 1``)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(FIRST_TOKEN, vocab - 3, (count, length), generator=generator)
    return ids.tolist()


class StateCapture:
    """Wraps the speculator's ``propose``: per request, the target's aux states and logits of every
    prefilled token, by position (the target's final hidden states go through its ``compute_logits``)."""

    def __init__(self, runner) -> None:
        import inspect

        self.speculator, self.model = runner.speculator, runner.model
        self._propose = propose = self.speculator.propose
        signature = inspect.signature(propose)
        self.rows: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, int]]] = {}

        def captured(*args, **kwargs):
            call = signature.bind(*args, **kwargs).arguments
            if not (call.get("dummy_run") or call.get("is_profile")):
                self._record(call)
            return propose(*args, **kwargs)

        self.speculator.propose = captured

    @torch.no_grad()
    def _record(self, call: dict[str, Any]) -> None:
        batch = call["input_batch"]
        n = batch.num_tokens
        aux = torch.cat(call["aux_hidden_states"], dim=-1)[:n].float().cpu()
        logits = self.model.compute_logits(call["last_hidden_states"][:n]).float().cpu()
        positions = batch.positions[:n].cpu().tolist()
        ids = batch.input_ids[:n].cpu().tolist()
        starts = batch.query_start_loc[: batch.num_reqs + 1].cpu().tolist()
        for r, req in enumerate(batch.req_ids[: batch.num_reqs]):
            rows = self.rows.setdefault(req, {})
            for i in range(starts[r], starts[r + 1]):
                rows.setdefault(positions[i], (aux[i], logits[i], ids[i]))

    def close(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(aux [N, T, W], logits [N, T, V])`` of ``sequences`` (each matched to its request by its
        tokens); refuses a sequence some position of which was not captured."""
        del self.speculator.propose  # back to the class's method
        by_tokens = {}
        for rows in self.rows.values():
            key = tuple(rows[p][2] for p in sorted(rows))
            by_tokens[key] = rows
        aux, logits = [], []
        for seq in sequences:
            rows = by_tokens.get(tuple(seq))
            if rows is None:
                raise RuntimeError(f"no complete capture of a {len(seq)}-token sequence")
            aux.append(torch.stack([rows[p][0] for p in range(len(seq))]))
            logits.append(torch.stack([rows[p][1] for p in range(len(seq))]))
        return torch.stack(aux), torch.stack(logits)


def capture_states(
    target: Path, drafter: Path, sequences: list[list[int]], *, log=print
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM prefills each of ``sequences`` on ``target`` with ``drafter`` (any drafter with the
    trained one's aux layers) through ``dspark``; ``(aux, logits)`` of every token."""
    from vllm import SamplingParams

    from vllm_dspark.cpu_serving import engines

    def use(llm) -> tuple[torch.Tensor, torch.Tensor]:
        capture = StateCapture(engines.worker(llm).model_runner)
        params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": s} for s in sequences], params)
        log(f"captured {len(sequences)} sequences in {time.perf_counter() - start:.0f} s")
        return capture.close(sequences)

    config = engines.dspark_config(drafter, 7)
    return engines.served("cpu", target, config, use, max_model_len=PER_STEP * len(sequences[0]))


def measure_tau(
    target: Path, drafter: Path, prompts: list[list[int]], max_tokens: int, *, log=print
) -> dict[str, Any]:
    """Greedy text without speculation and with ``drafter`` (vLLM's ``dspark``, greedy drafting),
    each prompt's agreement (the near-tie rule of ``make demo``) and τ from vLLM's own counters."""
    from vllm_dspark.cpu_serving import pair

    models = {"target": target, "drafter": drafter}
    results = pair.serve_pair(models, prompts, max_tokens, runs=("baseline", "bf16"), log=log)
    from vllm_dspark.cpu_serving.engines import acceptance, greedy_agreement, near_tie

    base = results["baseline"]["outputs"]
    cutoff = near_tie([g for o in base for g in o["gaps"]])
    greedy, parted = [], []
    for o, b in zip(results["bf16"]["outputs"], base, strict=True):
        at, verdict = greedy_agreement(o["tokens"], b["tokens"], b["top2"], b["gaps"], cutoff)
        greedy.append(verdict)
        # Where the text parts: the generated token (1-based) and the baseline's top-2 gap there.
        parted.append(None if verdict == "equal" else {"token": at + 1, "gap": b["gaps"][at]})
    return {
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "greedy": greedy,
        "parted": parted,
        "near_tie_cutoff": cutoff,
        "generate_seconds": {r: results[r]["generate_seconds"] for r in results},
        **acceptance(results["bf16"]["counters"]),
    }


def train_on_states(drafter, ids, aux, logits, sizes: K3PairSizes, seed: int, progress: bool):
    """DSpark training on captured states; returns the per-step curve."""
    from vllm_dspark.pair.train import PairSizes, _train, dspark_loss, sample_anchors

    generator = torch.Generator().manual_seed(seed + 1)

    def batch_loss() -> dict[str, torch.Tensor]:
        rows = torch.randint(0, ids.shape[0], (sizes.batch_size,), generator=generator)
        anchors = sample_anchors(
            sizes.batch_size,
            sizes.seq_len,
            sizes.anchors,
            drafter.config.draft_block_size,
            generator,
        )
        out = dspark_loss(drafter, ids[rows], anchors, logits[rows], aux[rows])
        tau = 1 + out["accepted"].cumprod(-1).sum(-1).mean()
        return {"tau_train": tau} | {k: out[k] for k in ("loss", "ce", "l1", "bce")}

    schedule = PairSizes(lr=sizes.lr, drafter_steps=sizes.drafter_steps)
    return _train(drafter, sizes.drafter_steps, batch_loss, "drafter", schedule, math.inf, progress)


README = """# Kimi-K3 target + DSpark drafter pair

Made by `{command}` (seed {seed}) in {minutes:.1f} min on this machine ({threads} torch threads).

- `target/`: a random-weight `KimiK3ForConditionalGeneration` (`make-random --target kimi-k3`'s maker,
  hidden {hidden}, vocab {vocab}: KDA, KDA, MLA, KDA; MoE; AttnRes), BF16, no tokenizer (token ids).
- `drafter/`: the K3 DSpark drafter ({draft_layers} layers, block 7, aux layers {aux}), distilled for
  {steps} steps on the aux states and logits vLLM computed for {sequences} random sequences of
  {seq_len} tokens (prefilled through the `dspark` speculator on CPU, {capture_minutes:.1f} min).
- Measured through vLLM (greedy, {prompts} held-out random prompts of {prompt_tokens} tokens, {tokens}
  generated each): τ = {tau} from vLLM's spec-decode counters ({drafts} drafts, accepted per position
  {per_position}); greedy text vs no speculation: {greedy}.
- `train_log.json`: sizes, versions, the loss curve and the measurement; `manifest.json`: every
  file's sha256 and each tensor's dtype and shape.
"""


def train_k3_pair(
    out_dir: Path,
    sizes: K3PairSizes,
    *,
    seed: int = 0,
    progress: bool = True,
    overwrite: bool = False,
    command: str = "vllm-dspark train-pair --target kimi-k3",
    log=print,
) -> dict:
    """Make the K3 pair into ``out_dir`` (built beside it, renamed into place); returns the log."""
    from vllm_dspark import cpu_serving

    # In-process engines under Triton's interpreter, with the Kimi-K3 emulations: before anything
    # imports Triton (transformers may), which reads the interpreter setting as kernels are defined.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cpu_serving.enable()
    from vllm_dspark.checkpoint.store import load_target_heads
    from vllm_dspark.checkpoint_tools.kimi_k3_target import make_kimi_k3_target
    from vllm_dspark.checkpoint_tools.make_random import make_random_like, save_drafter_with_heads
    from vllm_dspark.pair.train import _checkpoint_keys, _versions, drafter_like, write_manifest
    from vllm_dspark.safety import refuse_nonempty, staged

    refuse_nonempty(out_dir, overwrite=overwrite, flag="--out")
    torch.set_num_threads(sizes.threads)
    torch.manual_seed(seed)
    start = time.monotonic()
    vocab = TARGET_CONFIG["vocab_size"]
    sequences = random_sequences(sizes.sequences, sizes.seq_len, vocab, seed)
    prompts = [
        s[: sizes.eval_prompt_tokens]
        for s in random_sequences(sizes.eval_prompts, sizes.eval_prompt_tokens, vocab, seed + 1000)
    ]
    with staged(out_dir, directory=True) as staging:
        target = make_kimi_k3_target(staging / "target", seed=seed, **TARGET_CONFIG)
        collector = make_random_like(
            staging / "collector",
            target,
            num_layers=sizes.draft_layers,
            seed=seed,
            progress=False,
        )
        aux, logits = capture_states(target, collector, sequences, log=log)
        capture_seconds = time.monotonic() - start
        target_config = json.loads((target / "config.json").read_text())
        embed, lm_head = load_target_heads(target)
        drafter, config_json = drafter_like(
            target_config,
            embed,
            lm_head,
            mask_token_id=vocab - 3,
            num_layers=sizes.draft_layers,
            seed=seed,
        )
        curve = train_on_states(
            drafter, torch.tensor(sequences), aux, logits, sizes, seed, progress
        )
        state = drafter.state_dict()
        save_drafter_with_heads(
            staging / "drafter",
            config_json,
            [(k, state[k].to(torch.bfloat16)) for k in _checkpoint_keys(drafter.config)],
            embed_tokens=embed,
            lm_head=lm_head,
            target_config=target / "config.json",
        )
        shutil.rmtree(collector)  # it only made vLLM collect the aux states
        train_seconds = time.monotonic() - start
        measured = measure_tau(target, staging / "drafter", prompts, sizes.eval_tokens, log=log)
        (staging / "heldout_prompts.json").write_text(
            json.dumps(
                {
                    "prompt_tokens": sizes.eval_prompt_tokens,
                    "seed": seed + 1000,
                    "prompts": [{"token_ids": p} for p in prompts],
                },
                indent=1,
            )
            + "\n"
        )
        result = {
            "command": command,
            "seed": seed,
            "sizes": asdict(sizes),
            "target_config": TARGET_CONFIG,
            "versions": _versions(),
            "capture_seconds": capture_seconds,
            "train_seconds": train_seconds,
            "drafter": {"steps_run": len(curve), "curve": curve},
            "measured": measured,
        }
        (staging / "train_log.json").write_text(json.dumps(result, indent=1) + "\n")
        (staging / "README.md").write_text(_readme(result, config_json))
        write_manifest(staging)
    return result


def _readme(result: dict, config_json: dict) -> str:
    m, sizes = result["measured"], result["sizes"]
    return README.format(
        command=result["command"],
        seed=result["seed"],
        minutes=(result["train_seconds"] + sum(m["generate_seconds"].values())) / 60,
        threads=sizes["threads"],
        hidden=result["target_config"]["hidden_size"],
        vocab=result["target_config"]["vocab_size"],
        draft_layers=sizes["draft_layers"],
        aux=config_json["target_layer_ids"],
        steps=result["drafter"]["steps_run"],
        sequences=sizes["sequences"],
        seq_len=sizes["seq_len"],
        capture_minutes=result["capture_seconds"] / 60,
        prompts=m["prompts"],
        prompt_tokens=sizes["eval_prompt_tokens"],
        tokens=m["max_tokens"],
        tau="-" if m["tau"] is None else f"{m['tau']:.2f}",
        drafts=m["drafts"],
        per_position=" ".join(map(str, m["accepted_per_position"])),
        greedy=", ".join(m["greedy"]),
    )
