"""The Gated DeltaNet decode step (one token) in two launches instead of ~45 small torch kernels.

Why: at batch 1 a DeltaNet layer's arithmetic is tiny (a 128x128 state per value head), so the
torch form's cost is its kernel count: concatenations, norms, exp/softplus/sigmoid, six
broadcast products and reductions over the state, the gated output norm, each a separate launch
and memory pass. Two kernels cover everything between the input projections and ``ssm_out``:

1. ``_conv_kernel``: the causal depthwise conv over the last ``K-1`` inputs plus the new one,
   SiLU, and the conv window shifted in place. One program per block of channels (each channel's
   window is read and rewritten by the same program).
2. ``_recurrence_kernel``: one program per value head: l2-normalise its q and k (key head
   ``h % n_k``, the converter's tiled order), beta = sigmoid, g = softplus(alpha + dt_bias) * a,
   then the delta rule on the head's ``[d_k, d_v]`` float32 state (decay, read, correct, write
   back, read out) and the gated RMSNorm of the output times SiLU(z).

Everything runs in float32 between the two bf16/f32 boundaries (projections in, ``ssm_out``
input out); the torch path (``runtime.models.qwen35moe``) rounds to the activation dtype in a
few places, so the two agree to that dtype's precision, not bit for bit. The torch path stays the
reference (CPU, prefill).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_kernel(x_ptr, win_ptr, w_ptr, out_ptr, C, KM1: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = c < C
    x = tl.load(x_ptr + c, mask=m, other=0.0).to(tl.float32)
    acc = x * tl.load(w_ptr + c * (KM1 + 1) + KM1, mask=m, other=0.0).to(tl.float32)
    prev = tl.load(win_ptr + c, mask=m, other=0.0)
    for j in tl.static_range(KM1):
        acc += prev.to(tl.float32) * tl.load(w_ptr + c * (KM1 + 1) + j, mask=m, other=0.0).to(tl.float32)
        if j + 1 < KM1:  # shift the window: row j takes row j+1, the last row takes the new input
            nxt = tl.load(win_ptr + (j + 1) * C + c, mask=m, other=0.0)
            tl.store(win_ptr + j * C + c, nxt, mask=m)
            prev = nxt
    tl.store(win_ptr + (KM1 - 1) * C + c, x.to(win_ptr.dtype.element_ty), mask=m)
    tl.store(out_ptr + c, acc / (1.0 + tl.exp(-acc)), mask=m)


@triton.jit
def _recurrence_kernel(act_ptr, z_ptr, beta_ptr, alpha_ptr, dt_ptr, a_ptr, state_ptr, norm_ptr, out_ptr,
                       N_K, D_K, D_V, q_scale, eps,
                       BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    h = tl.program_id(0)
    kh = h % N_K
    i = tl.arange(0, BLOCK_K)
    j = tl.arange(0, BLOCK_V)
    mi, mj = i < D_K, j < D_V
    kd = N_K * D_K
    q = tl.load(act_ptr + kh * D_K + i, mask=mi, other=0.0)
    k = tl.load(act_ptr + kd + kh * D_K + i, mask=mi, other=0.0)
    v = tl.load(act_ptr + 2 * kd + h * D_V + j, mask=mj, other=0.0)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale  # l2 norm: eps inside the rsqrt
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    b = tl.load(beta_ptr + h).to(tl.float32)
    beta = 1.0 / (1.0 + tl.exp(-b))
    pre = tl.load(alpha_ptr + h).to(tl.float32) + tl.load(dt_ptr + h).to(tl.float32)
    soft = tl.where(pre > 20.0, pre, tl.log(1.0 + tl.exp(tl.minimum(pre, 20.0))))  # torch softplus
    g = soft * tl.load(a_ptr + h).to(tl.float32)

    offs = h.to(tl.int64) * D_K * D_V + i[:, None] * D_V + j[None, :]
    mm = mi[:, None] & mj[None, :]
    s = tl.load(state_ptr + offs, mask=mm, other=0.0) * tl.exp(g)
    kv = tl.sum(s * k[:, None], axis=0)  # [d_v]
    delta = (v - kv) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(state_ptr + offs, s, mask=mm)
    o = tl.sum(s * q[:, None], axis=0)

    o = o * tl.rsqrt(tl.sum(o * o, axis=0) / D_V + eps) * tl.load(norm_ptr + j, mask=mj, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + h * D_V + j, mask=mj, other=0.0).to(tl.float32)
    o = o * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + h * D_V + j, o.to(out_ptr.dtype.element_ty), mask=mj)


def deltanet_decode(qkv: torch.Tensor, z: torch.Tensor, beta: torch.Tensor, alpha: torch.Tensor,
                    dt_bias: torch.Tensor, a: torch.Tensor, conv_w: torch.Tensor, conv_win: torch.Tensor,
                    state: torch.Tensor, norm_w: torch.Tensor, n_k: int, d_k: int, eps: float) -> torch.Tensor:
    """One token through a Gated DeltaNet layer, from its projections to ``ssm_out``'s input.

    qkv: ``[C]`` conv input (q | k | v channels, ``C = 2 n_k d_k + n_v d_v``); z: ``[n_v * d_v]``;
    beta, alpha: ``[n_v]`` (pre-sigmoid / pre-softplus projections); dt_bias, a: ``[n_v]``
    (``a`` = -exp(A_log), as the GGUF stores it); conv_w ``[C, K]``; conv_win ``[K-1, C]`` the
    last K-1 conv inputs (shifted in place); state ``[n_v, d_k, d_v]`` float32 (updated in place);
    norm_w ``[d_v]``. Returns ``[n_v * d_v]`` in ``z``'s dtype.
    """
    C = qkv.numel()
    n_v, dk, d_v = state.shape
    K = conv_w.shape[1]
    if K < 2 or dk != d_k or C != 2 * n_k * d_k + n_v * d_v or conv_win.shape != (K - 1, C) \
            or state.dtype != torch.float32:
        raise ValueError("DeltaNet decode: inconsistent shapes")
    for t, what in ((qkv, "qkv"), (z, "z"), (conv_w, "conv_w"), (conv_win, "conv window"), (state, "state")):
        if not t.is_contiguous():
            raise ValueError(f"DeltaNet decode: {what} must be contiguous")
    act = torch.empty(C, dtype=torch.float32, device=qkv.device)
    block = 1024
    _conv_kernel[(triton.cdiv(C, block),)](qkv, conv_win, conv_w, act, C, KM1=K - 1, BLOCK=block, num_warps=4)
    out = torch.empty(n_v * d_v, dtype=z.dtype, device=z.device)
    _recurrence_kernel[(n_v,)](act, z, beta, alpha, dt_bias, a, state, norm_w, out, n_k, d_k, d_v,
                               d_k ** -0.5, eps, BLOCK_K=triton.next_power_of_2(d_k),
                               BLOCK_V=triton.next_power_of_2(d_v), num_warps=8)
    return out
