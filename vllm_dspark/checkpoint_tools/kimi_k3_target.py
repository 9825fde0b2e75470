# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark make-random --target kimi-k3``: a tiny random-weight Kimi-K3 target checkpoint that vLLM's
own ``KimiK3ForConditionalGeneration`` loads (docs/tools/make-random.md).

The layout is the real one: a top-level ``kimi_k3`` config.json whose ``text_config`` is a ``kimi_linear``
config (KDA layers from ``linear_attn_config.kda_layers``, MLA layers from ``full_attn_layers``, both
1-based; NoPE MLA with a 512 + 64 latent; MoE with a shared expert; AttnRes blocks), and tensors under the
names vLLM's Kimi-K3 loader consumes (``vllm/models/kimi_k3/nvidia/model.py``): the text model's weights
prefixed ``language_model.`` (``KimiK3ForConditionalGeneration`` hands them to its ``language_model``,
a ``KimiLinearForCausalLM``), each layer's projections as the checkpoint stores them before
``KimiLinearModel.load_weights`` stacks them (``q/k/v/g_proj``, ``f_a_proj``, ``b_proj`` into
``in_proj_qkvgfab``; ``q/k/v_conv1d`` into ``conv1d``; ``q_a_proj``, ``kv_a_proj_with_mqa``, ``g_proj`` into
``fused_qkv_a_g_proj``; ``gate/up_proj`` into ``gate_up_proj``) and the routed experts as
``experts.{e}.w1/w2/w3``; and a one-block vision tower with its projector (``vision_tower.*``,
``mm_projector.*``), so vLLM loads it with or without ``limit_mm_per_prompt`` 0 for images and videos.

Weights follow :func:`vllm_dspark.checkpoint_tools.make_random.random_tensor` (channel structure, a small
embedding, a sharp lm_head), with KDA's decay parameters (``A_log``, ``dt_bias``) and the router's
correction bias in their trained ranges, so greedy text varies (vLLM's dummy init is +-1e-3)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from vllm_dspark.checkpoint.save import save_drafter
from vllm_dspark.checkpoint.st_io import Entry
from vllm_dspark.findings import Finding, FindingError
from vllm_dspark.safety import refuse_nonempty, staged

# Where KimiK3ForConditionalGeneration's text weights live in its checkpoint (its `language_model`).
TEXT_PREFIX = "language_model."
EMBED_KEY = f"{TEXT_PREFIX}model.embed_tokens.weight"
LM_HEAD_KEY = f"{TEXT_PREFIX}lm_head.weight"

# The tiny default: hidden 256, 4 layers (KDA, KDA, MLA, KDA), 8 experts + 1 shared, vocab 4096.
DEFAULT_LAYERS = 4
DEFAULT_FULL_ATTN_LAYERS = (3,)  # 1-based, as Kimi-Linear configs count them


def kimi_k3_config_json(
    *,
    hidden_size: int = 256,
    num_hidden_layers: int = DEFAULT_LAYERS,
    full_attn_layers: Sequence[int] = DEFAULT_FULL_ATTN_LAYERS,
    vocab_size: int = 4096,
    num_experts: int = 8,
    attn_res_block_size: int | None = 2,
) -> dict[str, Any]:
    """A ``KimiK3ForConditionalGeneration`` config.json: ``kimi_k3`` around a ``kimi_linear`` text config.

    ``full_attn_layers`` are the 1-based MLA layers; every other layer is a KDA layer.
    """
    full = sorted(set(full_attn_layers))
    if not full or full[0] < 1 or full[-1] > num_hidden_layers or len(full) == num_hidden_layers:
        raise FindingError(
            Finding(
                f"full_attn_layers {list(full_attn_layers)} must name some but not all of layers "
                f"1..{num_hidden_layers}",
                "a Kimi-K3 target interleaves KDA and MLA layers; name at least one of each",
            )
        )
    kda = [i for i in range(1, num_hidden_layers + 1) if i not in full]
    heads = max(1, hidden_size // 64)
    text_config = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        # MLA: NoPE (Kimi-K3's MultiHeadLatentAttention is NoPE-only), q-LoRA, the 512 + 64 latent
        # the drafter's pages share, and the output gate.
        "q_lora_rank": 128,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 64,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        # MoE from layer 2 on (layer 1 dense), sigmoid router with a correction bias, one shared expert.
        "num_experts": num_experts,
        "num_experts_per_token": 2,
        "moe_intermediate_size": hidden_size // 2,
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 2.5,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "attn_res_block_size": attn_res_block_size,
        "linear_attn_config": {
            "kda_layers": kda,
            "full_attn_layers": full,
            "num_heads": heads,
            "head_dim": 64,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
        },
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": text_config,
        # A one-block MoonViT tower and its patch-merger projector (KimiK3VisionConfig's fields).
        "vision_config": {
            "patch_size": 14,
            "init_pos_emb_height": 16,
            "init_pos_emb_width": 16,
            "merge_kernel_size": [2, 2],
            "vt_hidden_size": 64,
            "vt_intermediate_size": 128,
            "vt_num_attention_heads": 2,
            "vt_num_hidden_layers": 1,
            "qkv_hidden_size": 64,
            "mm_projector_type": "patchmergerv2",
            "norm_type": "rmsnorm",
            "text_hidden_size": hidden_size,
        },
        "media_placeholder_token_id": vocab_size - 1,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    }


def kimi_k3_tensor_specs(config_json: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{checkpoint name: (shape, role)}`` of every tensor of the target, in checkpoint order.

    Roles: ``embedding``, ``linear``, ``norm``, and Kimi-K3's own ``a_log``, ``dt_bias``, ``conv``,
    ``router_bias``.
    """
    t = config_json["text_config"]
    h, vocab = t["hidden_size"], t["vocab_size"]
    kda = t["linear_attn_config"]
    p = kda["num_heads"] * kda["head_dim"]
    heads = t["num_attention_heads"]
    specs: dict[str, tuple[tuple[int, ...], str]] = {EMBED_KEY: ((vocab, h), "embedding")}
    for i in range(t["num_hidden_layers"]):
        pre = f"{TEXT_PREFIX}model.layers.{i}."
        if (i + 1) in kda["kda_layers"]:
            for proj in ("q_proj", "k_proj", "v_proj", "g_proj"):
                specs[f"{pre}self_attn.{proj}.weight"] = ((p, h), "linear")
            specs[f"{pre}self_attn.f_a_proj.weight"] = ((kda["head_dim"], h), "linear")
            specs[f"{pre}self_attn.f_b_proj.weight"] = ((p, kda["head_dim"]), "linear")
            specs[f"{pre}self_attn.b_proj.weight"] = ((kda["num_heads"], h), "linear")
            for conv in ("q_conv1d", "k_conv1d", "v_conv1d"):
                specs[f"{pre}self_attn.{conv}.weight"] = (
                    (p, 1, kda["short_conv_kernel_size"]),
                    "conv",
                )
            specs[f"{pre}self_attn.A_log"] = ((kda["num_heads"],), "a_log")
            specs[f"{pre}self_attn.dt_bias"] = ((p,), "dt_bias")
            specs[f"{pre}self_attn.o_norm.weight"] = ((kda["head_dim"],), "norm")
            specs[f"{pre}self_attn.o_proj.weight"] = ((h, p), "linear")
        else:
            q_lora, kv_lora = t["q_lora_rank"], t["kv_lora_rank"]
            nope, rope, v = t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
            specs[f"{pre}self_attn.q_a_proj.weight"] = ((q_lora, h), "linear")
            specs[f"{pre}self_attn.q_a_layernorm.weight"] = ((q_lora,), "norm")
            specs[f"{pre}self_attn.q_b_proj.weight"] = ((heads * (nope + rope), q_lora), "linear")
            specs[f"{pre}self_attn.kv_a_proj_with_mqa.weight"] = ((kv_lora + rope, h), "linear")
            specs[f"{pre}self_attn.kv_a_layernorm.weight"] = ((kv_lora,), "norm")
            specs[f"{pre}self_attn.kv_b_proj.weight"] = ((heads * (nope + v), kv_lora), "linear")
            if t.get("mla_use_output_gate"):
                specs[f"{pre}self_attn.g_proj.weight"] = ((heads * v, h), "linear")
            specs[f"{pre}self_attn.o_proj.weight"] = ((h, heads * v), "linear")
        moe = (
            t.get("num_experts") is not None
            and i >= t["first_k_dense_replace"]
            and i % t["moe_layer_freq"] == 0
        )
        if moe:
            mi, experts = t["moe_intermediate_size"], t["num_experts"]
            specs[f"{pre}block_sparse_moe.gate.weight"] = ((experts, h), "linear")
            specs[f"{pre}block_sparse_moe.gate.e_score_correction_bias"] = (
                (experts,),
                "router_bias",
            )
            si = mi * t["num_shared_experts"]
            if si:
                shared = f"{pre}block_sparse_moe.shared_experts."
                specs[f"{shared}gate_proj.weight"] = ((si, h), "linear")
                specs[f"{shared}up_proj.weight"] = ((si, h), "linear")
                specs[f"{shared}down_proj.weight"] = ((h, si), "linear")
            for e in range(experts):
                expert = f"{pre}block_sparse_moe.experts.{e}."
                specs[f"{expert}w1.weight"] = ((mi, h), "linear")
                specs[f"{expert}w3.weight"] = ((mi, h), "linear")
                specs[f"{expert}w2.weight"] = ((h, mi), "linear")
        else:
            specs[f"{pre}mlp.gate_proj.weight"] = ((t["intermediate_size"], h), "linear")
            specs[f"{pre}mlp.up_proj.weight"] = ((t["intermediate_size"], h), "linear")
            specs[f"{pre}mlp.down_proj.weight"] = ((h, t["intermediate_size"]), "linear")
        specs[f"{pre}input_layernorm.weight"] = ((h,), "norm")
        specs[f"{pre}post_attention_layernorm.weight"] = ((h,), "norm")
        if t.get("attn_res_block_size") is not None:
            specs[f"{pre}self_attention_res_norm.weight"] = ((h,), "norm")
            specs[f"{pre}mlp_res_norm.weight"] = ((h,), "norm")
            specs[f"{pre}self_attention_res_proj.weight"] = ((1, h), "linear")
            specs[f"{pre}mlp_res_proj.weight"] = ((1, h), "linear")
    specs[f"{TEXT_PREFIX}model.norm.weight"] = ((h,), "norm")
    if t.get("attn_res_block_size") is not None:
        specs[f"{TEXT_PREFIX}model.output_attn_res_norm.weight"] = ((h,), "norm")
        specs[f"{TEXT_PREFIX}model.output_attn_res_proj.weight"] = ((1, h), "linear")
    specs[LM_HEAD_KEY] = ((vocab, h), "linear")
    specs.update(_vision_specs(config_json["vision_config"], h))
    return specs


def _vision_specs(v: Mapping[str, Any], text_hidden: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """The vision tower (vLLM's ``MoonViT3dPretrainedModel``) and the ``patchmergerv2`` projector, as the
    checkpoint names them (``mm_projector.proj.0/2``: vLLM maps them to ``linear_1/2``)."""
    d, patch = v["vt_hidden_size"], v["patch_size"]
    merged = d * v["merge_kernel_size"][0] * v["merge_kernel_size"][1]
    specs = {
        "vision_tower.patch_embed.proj.weight": ((d, 3, patch, patch), "conv2d"),
        "vision_tower.patch_embed.pos_emb.weight": (
            (v["init_pos_emb_height"], v["init_pos_emb_width"], d),
            "pos_emb",
        ),
    }
    for i in range(v["vt_num_hidden_layers"]):
        block = f"vision_tower.encoder.blocks.{i}."
        specs[f"{block}norm0.weight"] = ((d,), "norm")
        specs[f"{block}norm1.weight"] = ((d,), "norm")
        specs[f"{block}wqkv.weight"] = ((3 * v["qkv_hidden_size"], d), "linear")
        specs[f"{block}wo.weight"] = ((d, v["qkv_hidden_size"]), "linear")
        specs[f"{block}mlp.fc0.weight"] = ((v["vt_intermediate_size"], d), "linear")
        specs[f"{block}mlp.fc1.weight"] = ((d, v["vt_intermediate_size"]), "linear")
    specs["vision_tower.encoder.final_layernorm.weight"] = ((d,), "norm")
    specs["mm_projector.proj.0.weight"] = ((merged, merged), "linear")
    specs["mm_projector.proj.2.weight"] = ((text_hidden, merged), "linear")
    specs["mm_projector.post_norm.weight"] = ((text_hidden,), "norm")
    return specs


def _kimi_tensor(name: str, shape: tuple[int, ...], role: str, *, seed: int) -> torch.Tensor:
    from vllm_dspark.checkpoint_tools.make_random import random_tensor, tensor_generator

    if role in ("embedding", "linear", "norm"):
        gain = {EMBED_KEY: 0.02, LM_HEAD_KEY: 4.0}.get(name)
        return random_tensor(name, shape, role, seed=seed, gain=gain)
    if role in ("conv2d", "pos_emb"):  # generated as a matrix of their rows
        rows = (
            (shape[0], math.prod(shape[1:]))
            if role == "conv2d"
            else (math.prod(shape[:-1]), shape[-1])
        )
        kind = "linear" if role == "conv2d" else "embedding"
        gain = None if role == "conv2d" else 0.02
        return random_tensor(name, rows, kind, seed=seed, gain=gain).reshape(shape)
    generator = tensor_generator(seed, name)
    # log/exp/expm1 in float64, rounded once below: torch's float32 ones run MKL's VML, whose
    # CPU-chosen kernels round some values to the other neighbour on another host.
    if role == "a_log":  # A in [1, 16], as Mamba/KDA initialise the decay rates
        value = torch.empty(shape).uniform_(1.0, 16.0, generator=generator).double().log()
    elif role == "dt_bias":  # softplus^-1 of dt in [1e-3, 1e-1], log-uniform
        log_dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=generator)
        dt = log_dt.double().exp()
        value = dt + torch.log(-torch.expm1(-dt))
    elif role == "conv":  # a depthwise conv's default init: U(-1/sqrt(k), 1/sqrt(k))
        bound = 1.0 / math.sqrt(shape[-1])
        value = torch.empty(shape).uniform_(-bound, bound, generator=generator)
    elif role == "router_bias":
        value = 0.01 * torch.randn(shape, generator=generator)
    else:
        raise ValueError(f"unknown tensor role {role!r} for {name}")
    # The parameters vLLM keeps in FP32 (A_log, dt_bias, conv1d, the router bias) are stored FP32.
    return value.to(torch.float32)


def random_kimi_k3_tensors(
    config_json: Mapping[str, Any], *, seed: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the target in checkpoint order; a tensor's value depends only on its name and seed."""
    for name, (shape, role) in kimi_k3_tensor_specs(config_json).items():
        yield name, _kimi_tensor(name, shape, role, seed=seed)


def _entries(config_json: Mapping[str, Any]) -> list[Entry]:
    fp32 = ("a_log", "dt_bias", "conv", "router_bias")
    return [
        Entry.planned(name, torch.float32 if role in fp32 else torch.bfloat16, shape)
        for name, (shape, role) in kimi_k3_tensor_specs(config_json).items()
    ]


def make_kimi_k3_target(
    out_dir: str | Path,
    *,
    seed: int = 0,
    overwrite: bool = False,
    **config: Any,
) -> Path:
    """Write a random Kimi-K3 target to ``out_dir`` (shards, their index, config.json written last and
    generation_config.json), built beside it and renamed into place; ``config`` goes to
    :func:`kimi_k3_config_json`."""
    out_dir = Path(out_dir)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise FindingError(Finding(f"seed must be an integer, got {seed!r}", "pass a whole number"))
    config_json = kimi_k3_config_json(**config)
    refuse_nonempty(out_dir, overwrite=overwrite, flag="--out")
    with staged(out_dir, directory=True) as staging:
        text = config_json["text_config"]
        (staging / "generation_config.json").write_text(
            '{\n  "bos_token_id": %d,\n  "eos_token_id": %d,\n  "do_sample": false\n}\n'
            % (text["bos_token_id"], text["eos_token_id"])
        )
        save_drafter(
            staging,
            config_json,
            random_kimi_k3_tensors(config_json, seed=seed),
            entries=_entries(config_json),
        )
    return out_dir
