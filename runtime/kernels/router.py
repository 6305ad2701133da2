"""Router top-k in one launch: softmax (Qwen) or sigmoid + correction bias (Laguna) over the
experts, the k largest, renormalised.

The torch forms are five to nine launches per MoE layer (widen, softmax or sigmoid and the bias
add, a sort-based top-k of two kernels, the gather of the unbiased scores, sum, divide, scale);
at batch 1 each costs more than its arithmetic. One
program per token holds the token's logits in registers and picks the k largest by repeated
arg-max (largest first, the lowest expert id on ties), the order ``torch.topk`` returns them in.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import wait_prior


@triton.jit
def route_topk_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, N, stride_l, scale, K: tl.constexpr,
                       K_P2: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    t = tl.program_id(0)
    n = tl.arange(0, BLOCK)
    m = n < N
    lg = tl.load(logits_ptr + t.to(tl.int64) * stride_l + n, mask=m, other=-float("inf")).to(tl.float32)
    if SIGMOID:  # scores are the sigmoids; the choice may add a per-expert correction bias
        p = 1.0 / (1.0 + tl.exp(-lg))
        cur = p
        if HAS_BIAS:
            cur = p + tl.load(bias_ptr + n, mask=m, other=0.0).to(tl.float32)
        cur = tl.where(m, cur, -float("inf"))
    else:
        p = tl.exp(lg - tl.max(lg, axis=0))
        p = tl.where(m, p, 0.0)
        p = p / tl.sum(p, axis=0)
        cur = tl.where(m, p, -1.0)
    ks = tl.arange(0, K_P2)
    wv = tl.zeros([K_P2], dtype=tl.float32)
    iv = tl.zeros([K_P2], dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(cur, axis=0)
        idx = tl.min(tl.where(cur == best, n, BLOCK), axis=0)  # the lowest id among equal maxima
        idx = tl.minimum(idx, N - 1)  # NaN logits match nothing: keep the id in range regardless
        if SIGMOID and HAS_BIAS:  # weighted by the unbiased score
            best = tl.sum(tl.where(n == idx, p, 0.0), axis=0)
        wv = tl.where(ks == j, best, wv)
        iv = tl.where(ks == j, idx.to(tl.int64), iv)
        cur = tl.where(n == idx, -float("inf"), cur)
    if NORM:
        wv = wv / tl.sum(tl.where(ks < K, wv, 0.0), axis=0)
    if SIGMOID:
        wv = wv * scale
    tl.store(w_ptr + t * K + ks, wv, mask=ks < K)
    tl.store(ids_ptr + t * K + ks, iv, mask=ks < K)


def softmax_topk(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``route_softmax`` of ``logits [T, n_expert]`` (last axis contiguous): float32 weights and
    int64 ids ``[T, k]``."""
    return _route(logits, None, k, norm, 1.0, sigmoid=False)


def sigmoid_topk(logits: torch.Tensor, bias: torch.Tensor | None, k: int, norm: bool,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``route_sigmoid`` of ``logits [T, n_expert]``: experts chosen on sigmoid +
    ``bias`` (float ``[n_expert]`` or None), weighted by the unbiased sigmoids, renormalised with
    ``norm``, times ``scale``."""
    if bias is not None and (bias.numel() != logits.shape[-1] or not bias.is_contiguous()):
        raise ValueError(f"the router bias must be a contiguous [{logits.shape[-1]}] vector")
    return _route(logits, bias, k, norm, scale, sigmoid=True)


def _route(logits: torch.Tensor, bias: torch.Tensor | None, k: int, norm: bool, scale: float,
           sigmoid: bool) -> tuple[torch.Tensor, torch.Tensor]:
    T, N = logits.shape
    if logits.stride(-1) != 1 or not 0 < k <= N:
        raise ValueError(f"the router top-k needs [T, N] logits with a contiguous last axis and 0 < k <= N, got k={k}")
    w = torch.empty((T, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((T, k), dtype=torch.int64, device=logits.device)
    if T:
        block = triton.next_power_of_2(N)
        # one warp up to 512 experts: the 2k + 2 reductions then stay inside a warp (shuffles);
        # with 4 warps each went through shared memory (slower)
        route_topk_kernel[(T,)](logits, bias if bias is not None else logits, w, ids, N, logits.stride(0), scale,
                                 K=k, K_P2=triton.next_power_of_2(k), SIGMOID=sigmoid, HAS_BIAS=bias is not None,
                                 NORM=norm, BLOCK=block, num_warps=1 if block <= 512 else 4, **pdl.flags(logits))
    return w, ids
