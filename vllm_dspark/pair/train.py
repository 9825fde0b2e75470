# SPDX-License-Identifier: Apache-2.0
"""Train a small MLA target and its K3 DSpark drafter from scratch on CPU.

Text: the Python standard library's source (offline everywhere), held out by path hash. Tokenizer: a
byte-level BPE. Target: transformers' dense ``DeepseekV3ForCausalLM`` with Kimi-K3's 512 + 64 latent.
Drafter: :class:`ReferenceDrafter`, trained on the frozen (BF16-rounded) target's aux hidden states.
DSpark recipe (arXiv 2607.05147; github.com/deepseek-ai/DeepSpec), as followed here:
- anchors per sequence; block [anchor ; mask x 6] sees the context before its anchor: dspark/common.py
- loss 0.1 CE(data) + 0.9 L1(p_draft, p_target) + 1.0 confidence BCE, weights exp(-k/4): dspark/loss.py
- Markov head teacher-forced on the previous data token: dspark/qwen3/modeling.py (prev_token_ids)
- confidence target: greedy acceptance of the drafter's argmax (DeepSpec's is 1 - TV; we verify greedily)
- AdamW, 4 % warmup, grad-norm clip 1.0: config/dspark/dspark_qwen3_4b.py (cosine decay is ours)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import sysconfig
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from vllm_dspark.pair import PairSizes
from vllm_dspark.reference.target import target_states

SPECIALS = ("<|endoftext|>", "<|pad|>", "<|mask|>")
HELDOUT_MODULUS = 10  # sha256(relative path) % 10 == 0 -> held out (about 10 % of files)
# DSpark's loss weights (DeepSpec config/dspark/dspark_qwen3_4b.py).
CE_ALPHA, L1_ALPHA, CONFIDENCE_ALPHA, DECAY_GAMMA = 0.1, 0.9, 1.0, 4.0
WARMUP = 0.04
TARGET_SHARE = 0.6  # of a --minutes cap, the part the target phase may use


# ----- data -----


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[str]:
    """The ``*.py`` files of the standard library at ``root`` (site-packages excluded), sorted."""
    found = []
    for folder, subfolders, names in os.walk(root):
        if Path(folder) == root:  # third-party packages live under the stdlib folder: never read
            subfolders[:] = [d for d in subfolders if d not in ("site-packages", "dist-packages")]
        rel = Path(folder).relative_to(root)
        found += [(rel / n).as_posix() for n in names if n.endswith(".py")]
    return sorted(found)


def is_heldout(relative_path: str) -> bool:
    digest = hashlib.sha256(relative_path.encode()).hexdigest()
    return int(digest, 16) % HELDOUT_MODULUS == 0


def split_files(root: Path, max_files: int = 0) -> tuple[list[str], list[str]]:
    """``(train, heldout)`` relative paths; ``max_files`` > 0 keeps the first files (tests)."""
    files = stdlib_files(root)
    if max_files > 0:
        files = files[:max_files]
    if not files:
        raise ValueError(
            f"no *.py files under {root}. Fix: run with a Python whose stdlib is on disk."
        )
    train = [f for f in files if not is_heldout(f)]
    heldout = [f for f in files if is_heldout(f)]
    return train, heldout


def read_texts(root: Path, files: list[str]) -> list[str]:
    return [(root / f).read_text(encoding="utf-8", errors="replace") for f in files]


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (``tokenizers.Tokenizer``) with :data:`SPECIALS` at ids 0, 1, 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer, out_dir: Path) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json``, loadable by ``AutoTokenizer``."""
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=SPECIALS[0],
        eos_token=SPECIALS[0],
        pad_token=SPECIALS[1],
        mask_token=SPECIALS[2],
    ).save_pretrained(out_dir)


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """Every text's ids followed by ``<|endoftext|>``, concatenated (int64)."""
    eos = tokenizer.token_to_id(SPECIALS[0])
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


def windows(stream: torch.Tensor, batch: int, length: int, generator: torch.Generator):
    """``[batch, length]`` windows of ``stream`` at seeded random offsets."""
    starts = torch.randint(0, len(stream) - length, (batch,), generator=generator)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def heldout_prompts(
    tokenizer, root: Path, heldout: list[str], sizes: PairSizes, seed: int
) -> list[dict]:
    """Up to ``num_prompts`` prompts of ``prompt_tokens`` ids, one per held-out file, at seeded offsets."""
    need = sizes.prompt_tokens + sizes.check_tokens + 8
    generator = torch.Generator().manual_seed(seed + 2)
    prompts = []
    for name, text in zip(heldout, read_texts(root, heldout)):
        ids = tokenizer.encode(text).ids
        if len(ids) < need:
            continue
        offset = int(torch.randint(0, len(ids) - need + 1, (1,), generator=generator))
        token_ids = ids[offset : offset + sizes.prompt_tokens]
        prompts.append(
            {
                "file": name,
                "offset": offset,
                "token_ids": token_ids,
                "text": tokenizer.decode(token_ids),
            }
        )
    if len(prompts) > sizes.num_prompts:  # evenly spread over the sorted files
        step = len(prompts) / sizes.num_prompts
        prompts = [prompts[int(i * step)] for i in range(sizes.num_prompts)]
    return prompts


# ----- models -----


def target_config(sizes: PairSizes, vocab_size: int):
    """A dense DeepSeek-V3 MLA config with Kimi-K3's latent (kv_lora_rank 512 + rope 64)."""
    from vllm_dspark.checkpoint.save import mla_target_config

    geometry = {
        "vocab_size": vocab_size,
        "hidden_size": sizes.hidden_size,
        "intermediate_size": sizes.intermediate_size,
        "num_hidden_layers": sizes.target_layers,
        "num_attention_heads": sizes.heads,
        "q_lora_rank": sizes.q_lora_rank,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": sizes.qk_nope_head_dim,
        "v_head_dim": sizes.v_head_dim,
    }
    return mla_target_config(geometry, bos_token_id=0, eos_token_id=0, pad_token_id=1)


def _schedule(steps: int):
    warmup = max(1, round(WARMUP * steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    return factor


def _optimizer(params, sizes: PairSizes, steps: int):
    optimizer = torch.optim.AdamW(params, lr=sizes.lr, betas=(0.9, 0.95), weight_decay=0.0)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(steps))


def _step(loss: torch.Tensor, params, optimizer, scheduler) -> None:
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def _train(
    model: torch.nn.Module,
    steps: int,
    batch_loss: Callable[[], dict[str, torch.Tensor]],
    name: str,
    sizes: PairSizes,
    deadline: float,
    progress: bool,
) -> list[dict]:
    """AdamW on ``batch_loss()["loss"]`` for ``steps`` (or until ``deadline``); every other entry
    it returns is logged per step. Returns ``[{"step", "loss", ...}]``."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = _optimizer(params, sizes, steps)
    curve = []
    model.train()
    bar = tqdm(range(steps), desc=f"train-pair {name}", disable=not progress)
    for step in bar:
        if time.monotonic() > deadline:
            break
        out = batch_loss()
        _step(out["loss"], params, optimizer, scheduler)
        curve.append({"step": step} | {k: float(v.detach()) for k, v in out.items()})
        bar.set_postfix({k: f"{v:.3f}" for k, v in curve[-1].items() if k != "step"})
    model.eval()
    return curve


def train_target(target, stream, sizes: PairSizes, generator, deadline: float, progress: bool):
    """Next-token cross-entropy; returns ``[{"step", "loss"}]``."""

    def batch_loss() -> dict[str, torch.Tensor]:
        ids = windows(stream, sizes.batch_size, sizes.seq_len, generator)
        return {"loss": target(input_ids=ids, labels=ids).loss}

    return _train(target, sizes.target_steps, batch_loss, "target", sizes, deadline, progress)


def sample_anchors(batch: int, length: int, count: int, block: int, generator) -> torch.Tensor:
    """``[batch, count]`` distinct sorted anchors in ``[1, length - block - 1]``: every label fits."""
    span = length - block - 1
    if span < count:
        raise ValueError(
            f"--seq-len {length} leaves {span} anchor positions for --anchors {count} blocks of "
            f"{block}. Fix: a longer --seq-len or fewer --anchors."
        )
    rows = [torch.randperm(span, generator=generator)[:count].sort().values for _ in range(batch)]
    return torch.stack(rows) + 1


def drafter_loss(drafter, target, ids: torch.Tensor, anchors: torch.Tensor) -> dict:
    """The DSpark loss of one batch on a transformers ``target``'s logits and aux states."""
    target_logits, aux = target_states(
        target, ids, drafter.config.target_layer_ids, aux_dtype=torch.float32
    )
    return dspark_loss(drafter, ids, anchors, target_logits, aux)


def dspark_loss(
    drafter,
    ids: torch.Tensor,
    anchors: torch.Tensor,
    target_logits: torch.Tensor,
    aux: torch.Tensor,
) -> dict:
    """The DSpark loss of one batch and its parts, given the target's ``logits [B, T, V]`` and ``aux
    [B, T, W]`` over ``ids [B, T]``; ``accepted [B*A, N]`` is the greedy match."""
    from vllm_dspark.ops.sampling import markov_rollout

    config = drafter.config
    batch, length = ids.shape
    block = config.draft_block_size
    positions = torch.arange(length).expand(batch, length)
    context_kv = drafter.context_kv(drafter.combine_hidden_states(aux), positions)
    hidden = drafter.blocks_hidden(ids, anchors, context_kv).flatten(0, 1)  # [B*A, N, H]
    label_idx = anchors[..., None] + torch.arange(1, block + 1)  # [B, A, N]
    labels = ids.gather(1, label_idx.flatten(1)).view_as(label_idx).flatten(0, 1)
    anchor_ids = ids.gather(1, anchors).flatten()
    prev = torch.cat([anchor_ids[:, None], labels[:, :-1]], dim=1)
    rollout = markov_rollout(
        drafter.base_logits(hidden),
        anchor_ids,
        drafter.markov_embed,
        drafter.markov_bias,
        forced_prev=prev,
    )
    logits = rollout.logits  # [B*A, N, V], teacher-forced Markov bias included
    rows = torch.arange(batch)[:, None, None]
    aligned = target_logits[rows, label_idx - 1].flatten(0, 1)  # the target's p at each slot
    weights = torch.exp(-torch.arange(block, dtype=torch.float32) / DECAY_GAMMA)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return (x * weights).sum() / (weights.sum() * x.shape[0])

    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    l1 = (logits.softmax(-1) - aligned.softmax(-1)).abs().sum(-1)
    accepted = (logits.argmax(-1) == aligned.argmax(-1)).float()
    confidence = drafter.confidence_head(hidden, rollout.markov_embeds)
    bce = F.binary_cross_entropy_with_logits(confidence, accepted, reduction="none")
    parts = {"ce": mean(ce), "l1": mean(l1), "bce": mean(bce)}
    loss = CE_ALPHA * parts["ce"] + L1_ALPHA * parts["l1"] + CONFIDENCE_ALPHA * parts["bce"]
    return {"loss": loss, **parts, "accepted": accepted}


def build_drafter(target, mask_token_id: int, sizes: PairSizes, seed: int, causal: bool = False):
    """A trainable FP32 :class:`ReferenceDrafter` like a transformers ``target``; its shared heads stay frozen."""
    return drafter_like(
        target.config.to_dict(),
        target.model.embed_tokens.weight.detach(),
        target.lm_head.weight.detach(),
        mask_token_id=mask_token_id,
        num_layers=sizes.draft_layers,
        seed=seed,
        causal=causal,
    )


def drafter_like(
    target_config: dict,
    embed_tokens: torch.Tensor,
    lm_head: torch.Tensor,
    *,
    mask_token_id: int,
    num_layers: int,
    seed: int,
    causal: bool = False,
):
    """A trainable FP32 :class:`ReferenceDrafter` for a target's config.json and shared heads (frozen),
    and its config.json."""
    from vllm_dspark.checkpoint_tools.make_random import like_config_json, random_drafter_tensors
    from vllm_dspark.config import K3DSparkConfig
    from vllm_dspark.fields import DEFAULT_DRAFT_BLOCK
    from vllm_dspark.reference.drafter import ReferenceDrafter

    config_json = like_config_json(target_config, num_layers=num_layers)
    # The block it is trained on is known, so the config states it; a causal block as Block5 / K3.1-Pro.
    config_json.update(mask_token_id=mask_token_id, block_size=DEFAULT_DRAFT_BLOCK)
    if causal:
        config_json["is_causal"] = True
    config = K3DSparkConfig(**config_json)
    state = {k: v.float() for k, v in random_drafter_tensors(config, seed=seed)}
    drafter = ReferenceDrafter.from_state_dict(
        config, state, embed_tokens=embed_tokens.float(), lm_head=lm_head.float()
    )
    for name, param in drafter.named_parameters():
        param.requires_grad_(name not in ("embed_tokens.weight", "lm_head.weight"))
    return drafter, config_json


def train_drafter(drafter, target, stream, sizes, generator, deadline: float, progress: bool):
    """DSpark training on the frozen target; returns the per-step curve."""

    def batch_loss() -> dict[str, torch.Tensor]:
        ids = windows(stream, sizes.batch_size, sizes.seq_len, generator)
        anchors = sample_anchors(
            sizes.batch_size,
            sizes.seq_len,
            sizes.anchors,
            drafter.config.draft_block_size,
            generator,
        )
        out = drafter_loss(drafter, target, ids, anchors)
        # Greedy tau of a block under teacher forcing: 1 + its accepted prefix.
        tau = 1 + out["accepted"].cumprod(-1).sum(-1).mean()
        return {"tau_train": tau} | {k: out[k] for k in ("loss", "ce", "l1", "bce")}

    return _train(drafter, sizes.drafter_steps, batch_loss, "drafter", sizes, deadline, progress)


@torch.no_grad()
def greedy_acceptance(target, drafter, prompts: list[dict], new_tokens: int) -> dict:
    """Greedy speculative decoding simulated on ``prompts``: mean tau (bonus included) and per-slot rates.

    The target's greedy continuation is decoded first; each step drafts a block from the target's aux
    states before the anchor and accepts the prefix that equals the continuation, as a greedy verifier would.
    """
    block = drafter.config.draft_block_size
    accepted_lengths, slot_hits, slot_tries = [], [0] * block, [0] * block
    for prompt in prompts:
        seq = torch.tensor([prompt["token_ids"]])
        for _ in range(new_tokens):
            seq = torch.cat([seq, target(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
        _, aux = target_states(
            target, seq, drafter.config.target_layer_ids, aux_dtype=torch.float32
        )
        anchor = len(prompt["token_ids"])  # the first token the target sampled
        while anchor + block < seq.shape[1]:
            draft = drafter.draft(
                aux[:, :anchor], torch.arange(anchor)[None], seq[:, anchor], temperature=0.0
            )
            match = (draft.tokens[0] == seq[0, anchor + 1 : anchor + 1 + block]).long()
            k = int(match.cumprod(0).sum())
            for i in range(min(k + 1, block)):
                slot_tries[i] += 1
                slot_hits[i] += int(i < k)
            accepted_lengths.append(k + 1)
            anchor += k + 1
    taus = torch.tensor(accepted_lengths, dtype=torch.float64)
    return {
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "steps": len(accepted_lengths),
        "tau": float(taus.mean()),
        "tau_ci95": float(1.96 * taus.std() / math.sqrt(len(taus))) if len(taus) > 1 else None,
        "per_position_acceptance": [h / t if t else None for h, t in zip(slot_hits, slot_tries)],
    }


# ----- outputs -----


def _plot(path: Path, target_curve: list[dict], drafter_curve: list[dict]) -> None:
    from vllm_dspark.plots import pyplot

    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot([r["step"] for r in target_curve], [r["loss"] for r in target_curve])
    axes[0].set(title="target: next-token cross-entropy", xlabel="step", ylabel="nats")
    steps = [r["step"] for r in drafter_curve]
    for key, label in (
        ("loss", "total"),
        ("ce", "CE (data)"),
        ("l1", "L1 to target"),
        ("bce", "confidence BCE"),
    ):
        axes[1].plot(steps, [r[key] for r in drafter_curve], label=label)
    axes[1].set(title="drafter: DSpark loss parts", xlabel="step")
    axes[1].legend()
    axes[2].plot(steps, [r["tau_train"] for r in drafter_curve])
    axes[2].set(title="drafter: greedy tau on training blocks", xlabel="step", ylabel="tau")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write_manifest(out_dir: Path) -> dict:
    """``manifest.json``: every file's size and sha256, and each safetensors tensor's dtype and shape."""
    from vllm_dspark.checkpoint.st_io import read_header

    files = {}
    for path in sorted(p for p in out_dir.rglob("*") if p.is_file() and p.name != "manifest.json"):
        entry = {
            "bytes": path.stat().st_size,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        }
        if path.suffix == ".safetensors":
            entry["tensors"] = {
                k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)}
                for k, v in read_header(path).items()
            }
        files[path.relative_to(out_dir).as_posix()] = entry
    manifest = {"files": files}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _versions() -> dict:
    import tokenizers
    import transformers

    from vllm_dspark.version import __version__

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "vllm_dspark": __version__,
        "torch_threads": torch.get_num_threads(),
    }


README = """# Trained target + DSpark drafter pair

Made by `{command}` (seed {seed}) in {minutes:.1f} min on this machine ({threads} torch threads):
{target_line}, drafter
{drafter_run}/{drafter_planned} steps.
`train_log.json` has the versions, sizes, step counts and every loss; `loss_curves.png` plots them.

- `target/`: transformers `DeepseekV3ForCausalLM` (dense, {target_layers} layers, hidden {hidden},
  MLA latent 512 + 64), BF16, with its byte-level BPE tokenizer (vocab {vocab}).
- `drafter/`: the K3 DSpark drafter ({draft_layers} layers, {causal} block {block}, aux layers {aux}, mask
  token {mask}, Markov and confidence heads); `drafter/target/` holds the target's shared heads.
- Text: the standard library of Python {python}: {train_files} files to train on, {heldout_files}
  held out (`heldout_files.txt`, sha256(path) % {modulus} == 0).
- `heldout_prompts.json`: {prompts} prompts of {prompt_tokens} tokens from held-out files.
- Greedy check (reference drafter vs the target's greedy decode, {check_prompts} held-out prompts,
  {check_tokens} new tokens each): tau = {tau:.2f} (bonus token included).
- `manifest.json`: every file's sha256 and each tensor's dtype and shape.
"""


def train_pair(
    out_dir: Path,
    sizes: PairSizes,
    *,
    seed: int = 0,
    minutes: float | None = None,
    progress: bool = True,
    overwrite: bool = False,
    command: str = "vllm-dspark train-pair",
    causal: bool = False,
    target_pair: Path | None = None,
) -> dict:
    """Train the pair into ``out_dir`` (built beside it, renamed into place); returns the log.

    ``causal`` trains a causal-block drafter. ``target_pair`` (a pair this command wrote) reuses its
    target and tokenizer instead of training them: ``out_dir/target`` links to it.
    """
    from tokenizers import Tokenizer
    from transformers import DeepseekV3ForCausalLM

    from vllm_dspark.checkpoint.save import save_drafter
    from vllm_dspark.checkpoint_tools.make_random import save_drafter_with_heads
    from vllm_dspark.reference.drafter import ReferenceDrafter
    from vllm_dspark.safety import check_output, refuse_nonempty, staged

    root = stdlib_root()
    check_output(out_dir, [root, *([target_pair] if target_pair else [])], flag="--out")
    refuse_nonempty(out_dir, overwrite=overwrite, flag="--out")
    torch.set_num_threads(sizes.threads)
    start = time.monotonic()
    budget = math.inf if minutes is None else minutes * 60
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed + 1)

    train_files, heldout_files = split_files(root, sizes.max_files)
    texts = read_texts(root, train_files)
    if target_pair is None:
        tokenizer = train_tokenizer(texts, sizes.vocab_size)
    else:
        tokenizer = Tokenizer.from_file(str(target_pair / "target" / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size()
    stream = token_stream(tokenizer, texts)
    prompts = heldout_prompts(tokenizer, root, heldout_files, sizes, seed)

    if target_pair is None:
        target = DeepseekV3ForCausalLM(target_config(sizes, vocab_size))
        target_curve = train_target(
            target, stream, sizes, generator, start + TARGET_SHARE * budget, progress
        )
    else:
        target = DeepseekV3ForCausalLM.from_pretrained(
            target_pair / "target", dtype=torch.float32
        ).eval()
        target_curve = []
    # The drafter learns the target vLLM serves: BF16 weights (computed here in FP32).
    with torch.no_grad():
        for param in target.parameters():
            param.copy_(param.to(torch.bfloat16))
            param.requires_grad_(False)
    drafter, config_json = build_drafter(
        target, tokenizer.token_to_id(SPECIALS[2]), sizes, seed, causal
    )
    drafter_curve = train_drafter(
        drafter, target, stream, sizes, generator, start + budget, progress
    )
    train_seconds = time.monotonic() - start

    with staged(out_dir, directory=True) as staging:
        state = drafter.state_dict()
        drafter_tensors = [
            (k, state[k].to(torch.bfloat16)) for k in _checkpoint_keys(drafter.config)
        ]
        if target_pair is None:
            target.to(torch.bfloat16).save_pretrained(staging / "target")
            save_tokenizer(tokenizer, staging / "target")
            save_drafter_with_heads(
                staging / "drafter",
                config_json,
                drafter_tensors,
                embed_tokens=state["embed_tokens.weight"].to(torch.bfloat16),
                lm_head=state["lm_head.weight"].to(torch.bfloat16),
                target_config=staging / "target" / "config.json",
            )
        else:
            # Links, not copies: the target's file holds the shared heads under the names read.
            (staging / "target").symlink_to(
                os.path.relpath(target_pair.resolve() / "target", Path(out_dir).resolve()),
                target_is_directory=True,
            )
            save_drafter(staging / "drafter", config_json, drafter_tensors)
            (staging / "drafter" / "target").symlink_to("../target", target_is_directory=True)
        (staging / "heldout_files.txt").write_text("".join(f + "\n" for f in heldout_files))
        prompt_file = {"prompt_tokens": sizes.prompt_tokens, "seed": seed, "prompts": prompts}
        (staging / "heldout_prompts.json").write_text(json.dumps(prompt_file, indent=1) + "\n")
        # The check reads back what was written: the BF16 files the tests and tools will load.
        served = ReferenceDrafter.from_pretrained(staging / "drafter")
        served_target = DeepseekV3ForCausalLM.from_pretrained(
            staging / "target", dtype=torch.float32
        ).eval()
        check = greedy_acceptance(
            served_target, served, prompts[: sizes.check_prompts], sizes.check_tokens
        )
        log = {
            "command": command,
            "seed": seed,
            "minutes_cap": minutes,
            "sizes": asdict(sizes),
            "versions": _versions(),
            "data": {
                "stdlib": str(root),
                "train_files": len(train_files),
                "heldout_files": len(heldout_files),
                "train_tokens": len(stream),
                "vocab_size": vocab_size,
            },
            "target": {
                "from": None if target_pair is None else str(target_pair),
                "steps_planned": 0 if target_pair else sizes.target_steps,
                "steps_run": len(target_curve),
                "curve": target_curve,
            },
            "drafter": {
                "steps_planned": sizes.drafter_steps,
                "steps_run": len(drafter_curve),
                "curve": drafter_curve,
            },
            "train_seconds": train_seconds,
            "greedy_check": check,
        }
        (staging / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
        _plot(staging / "loss_curves.png", target_curve, drafter_curve)
        (staging / "README.md").write_text(_readme(log, drafter.config, prompts))
        write_manifest(staging)
    return log


def _checkpoint_keys(config) -> list[str]:
    from vllm_dspark.checkpoint.layout import tensor_shapes

    return list(tensor_shapes(config))


def _readme(log: dict, config, prompts: list[dict]) -> str:
    sizes = log["sizes"]
    return README.format(
        command=log["command"],
        seed=log["seed"],
        minutes=log["train_seconds"] / 60,
        threads=log["versions"]["torch_threads"],
        target_line=(
            f"target {log['target']['steps_run']}/{log['target']['steps_planned']} steps (final loss "
            f"{log['target']['curve'][-1]['loss']:.3f})"
            if log["target"]["from"] is None
            else f"target reused from {log['target']['from']} (`target/` links to it)"
        ),
        causal="causal" if config.causal else "non-causal",
        drafter_run=log["drafter"]["steps_run"],
        drafter_planned=log["drafter"]["steps_planned"],
        target_layers=sizes["target_layers"],
        hidden=sizes["hidden_size"],
        vocab=log["data"]["vocab_size"],
        draft_layers=sizes["draft_layers"],
        block=config.draft_block_size,
        aux=config.target_layer_ids,
        mask=config.mask_token_id,
        python=log["versions"]["python"],
        train_files=log["data"]["train_files"],
        heldout_files=log["data"]["heldout_files"],
        modulus=HELDOUT_MODULUS,
        prompts=len(prompts),
        prompt_tokens=sizes["prompt_tokens"],
        check_prompts=log["greedy_check"]["prompts"],
        check_tokens=sizes["check_tokens"],
        tau=log["greedy_check"]["tau"],
    )
