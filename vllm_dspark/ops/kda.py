# SPDX-License-Identifier: Apache-2.0
"""Kimi Delta Attention (KDA) over whole prompts, token by token: the torch reference of vLLM's
chunked prefill kernel (``chunk_kda_with_fused_gate``) and of its recurrent decode kernel.

Per head, with the state ``S`` a ``[V, K]`` matrix and the per-channel log decay ``g_t`` (:func:`kda_gate`)::

    S <- S * exp(g_t)[None, :]
    S <- S + beta_t * (v_t - S k_t) k_t^T
    o_t = S (scale * q_t)

``q`` and ``k`` L2-normalized first, ``beta_t = sigmoid(raw_beta_t)``. The chunked kernel computes the
same in 64-token chunks (a WY representation of the rank-one updates); this is the plain recurrence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The epsilon of vLLM's l2norm_fwd and of the recurrent kernel, inside the square root.
L2NORM_EPS = 1e-6


def l2_normalize(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension, in float32."""
    x = x.float()
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def kda_gate(
    raw_g: torch.Tensor,
    A_log: torch.Tensor,
    g_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """KDA's per-channel log decay ``[..., H, K]`` (float32) from the raw gate projection ``[..., H, K]``.

    ``lower_bound * sigmoid(exp(A_log) * (raw_g + g_bias))`` where a lower bound is set (Kimi-K3),
    else ``-exp(A_log) * softplus(raw_g + g_bias)``; ``A_log`` holds one value per head.
    """
    heads, dim = raw_g.shape[-2:]
    g = raw_g.float()
    if g_bias is not None:
        g = g + g_bias.float().reshape(heads, dim)
    a = A_log.float().reshape(heads, 1).exp()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * g)
    return -a * F.softplus(g)


def kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    g_bias: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    lower_bound: float | None = None,
    use_qk_l2norm: bool = True,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA over each sequence: ``(o [B, T, H, V] in v's dtype, final states [N, H, V, K] float32)``.

    Arguments as ``chunk_kda_with_fused_gate`` takes them: ``q``, ``k``, ``raw_g`` ``[B, T, H, K]``,
    ``v`` ``[B, T, H, V]``, ``raw_beta`` ``[B, T, H]``; sequences are the batch rows, or with
    ``cu_seqlens`` (``B == 1``) the spans it packs along ``T``. ``initial_state`` ``[N, H, V, K]``
    (zeros where None), ``scale`` ``K ** -0.5`` where None. Computed in float32; inputs are not written.
    """
    batch, length, heads, dim = q.shape
    if cu_seqlens is None:
        bounds = [(b * length, (b + 1) * length) for b in range(batch)]
    else:
        if batch != 1:
            raise ValueError(f"cu_seqlens packs sequences along T of one batch row, got B={batch}")
        starts = cu_seqlens.tolist()
        bounds = list(zip(starts[:-1], starts[1:]))
    tokens = batch * length
    q, k = (x.reshape(tokens, heads, dim) for x in (q, k))
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q.float() * (dim**-0.5 if scale is None else scale)
    k = k.float()
    values = v.reshape(tokens, heads, -1).float()
    decay = kda_gate(raw_g.reshape(tokens, heads, dim), A_log, g_bias, lower_bound).exp()
    beta = raw_beta.reshape(tokens, heads).float().sigmoid()

    out = torch.empty_like(values)
    finals = []
    for n, (start, end) in enumerate(bounds):
        if initial_state is None:
            state = values.new_zeros(heads, values.shape[-1], dim)
        else:
            state = initial_state[n].float().clone()
        for t in range(start, end):
            state = state * decay[t][:, None, :]
            delta = beta[t][:, None] * (values[t] - torch.einsum("hvk,hk->hv", state, k[t]))
            state = state + delta[:, :, None] * k[t][:, None, :]
            out[t] = torch.einsum("hvk,hk->hv", state, q[t])
        finals.append(state)
    return out.reshape(batch, length, heads, -1).to(v.dtype), torch.stack(finals)
