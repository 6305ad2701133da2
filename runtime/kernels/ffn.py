"""The small elementwise steps around a one-token MoE block, one launch each instead of several.

Why: at batch 1 these steps move a few kilobytes, so each torch kernel costs its launch (40
layers over) and nothing else. Two kernels:

1. ``silu_mul_kernel``: the shared expert's activation ``silu(gate) * up`` (torch: two kernels),
   plus, for the int8 products that read it, its int8 form (``q8dot.store_q8``; a third kernel).
2. ``ffn_residual_kernel``: the block's output ``x + routed + sigmoid(g) * shared`` (torch: the
   routed sum's cast, sigmoid, two multiplies-adds and the residual add, five kernels). ``routed``
   may also be the MoE kernels' k weighted expert outputs per token, unsummed: the kernel sums
   them in choice order (as ``moe.sum_topk_kernel`` would, the same float32 additions), which
   saves that kernel's launch and its memory pass.

Both round where the torch forms (``runtime.layers.silu_mul`` / ``ffn_residual``) round: every
intermediate to the activation dtype, so the two agree to the last bit up to the float32
``exp`` inside sigmoid and SiLU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import wait_prior
from .norm import normed_row, row_launch
from .q8dot import QBLOCK, Int8Rows, as_rows, new_q8, store_q8


@triton.jit
def silu_mul_kernel(g_ptr, u_ptr, y_ptr, xq, xd, xs, N, stride_g, stride_u, Q8: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    wait_prior(PDL)
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = n < N
    g = tl.load(g_ptr + t * stride_g + n, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + t * stride_u + n, mask=m, other=0.0).to(tl.float32)
    dt = y_ptr.dtype.element_ty
    y = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u).to(dt)
    tl.store(y_ptr + t * N + n, y, mask=m)
    if Q8:
        blocks = tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
        store_q8(tl.reshape(y.to(tl.float32), [BLOCK // 32, 32]), blocks, N, xq + t * N, xd + t * (N // 32),
                 xs + t * (N // 16))


@triton.jit
def ffn_residual_kernel(x_ptr, r_ptr, s_ptr, g_ptr, y_ptr, w_ptr, h_ptr, hq, hd, hs, N, TOPK, stride_s, stride_g, eps,
                         HAS_SHARED: tl.constexpr, HAS_GATE: tl.constexpr, NORM: tl.constexpr, Q8: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = n < N
    dt = y_ptr.dtype.element_ty
    routed = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(0, TOPK):  # in choice order: the same additions as the MoE's own per-token sum
        routed += tl.load(r_ptr + (t * TOPK + j).to(tl.int64) * N + n, mask=m, other=0.0).to(tl.float32)
    out = routed.to(dt).to(tl.float32)
    if HAS_SHARED:
        s = tl.load(s_ptr + t * stride_s + n, mask=m, other=0.0).to(tl.float32)
        if HAS_GATE:
            g = tl.load(g_ptr + t * stride_g).to(tl.float32)
            s = (s * (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        out = (out + s).to(dt).to(tl.float32)
    x = tl.load(x_ptr + t * N + n, mask=m, other=0.0).to(tl.float32)
    y = (x + out).to(dt)
    tl.store(y_ptr + t * N + n, y, mask=m)
    if NORM:  # the next block's input norm on the new residual row (one program holds the row)
        normed_row(tl.where(m, y.to(tl.float32), 0.0), w_ptr, h_ptr, hq, hd, hs, t, n, m, N, eps, True, Q8, BLOCK)


def silu_mul_rows(gate: torch.Tensor, up: torch.Tensor, q8: bool = False
                  ) -> "torch.Tensor | tuple[torch.Tensor, Int8Rows]":
    """``silu(gate) * up`` for ``[T, N]`` rows with unit inner stride (e.g. column bands of one
    stacked projection's output); ``q8`` (N a multiple of 32): also the result's int8 form,
    ``(y, Int8Rows)``."""
    if gate.shape != up.shape or gate.dim() != 2 or gate.stride(-1) != 1 or up.stride(-1) != 1 \
            or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul takes two [T, N] row sets of one dtype, got {tuple(gate.shape)} and {tuple(up.shape)}")
    T, N = gate.shape
    if q8 and N % QBLOCK:
        raise ValueError(f"an int8 output needs rows of a multiple of {QBLOCK}, got {N}")
    y = torch.empty(T, N, dtype=gate.dtype, device=gate.device)
    codes = new_q8(T, N, gate.device) if q8 else (y, y, y)
    block = min(max(triton.next_power_of_2(N), QBLOCK), 1024)
    if T:
        silu_mul_kernel[(T, triton.cdiv(N, block))](gate, up, y, *codes, N, gate.stride(0), up.stride(0), Q8=q8,
                                                    BLOCK=block, num_warps=4, **pdl.flags(gate))
    return (y, as_rows(codes)) if q8 else y


def ffn_residual_rows(x: torch.Tensor, routed: torch.Tensor, shared: torch.Tensor | None = None,
                      shared_gate: torch.Tensor | None = None, norm: tuple[torch.Tensor, float] | None = None,
                      q8: bool = False) -> "torch.Tensor | tuple[torch.Tensor, ...]":
    """``x + routed + sigmoid(shared_gate) * shared`` for ``x [T, N]`` (contiguous, the residual
    stream's dtype); ``routed`` contiguous, any float dtype: ``[T, N]``, or ``[T, k, N]`` (the
    weighted expert outputs, summed here in choice order), rounded to x's dtype once summed;
    ``shared [T, N]`` unit inner stride or None; ``shared_gate [T, 1]`` (one logit per token) or None.

    ``norm`` = (weight, eps): also the RMSNorm of the result that opens the next block (bit for bit
    ``norm.rms_norm_rows(y, weight, eps, q8=q8)``); returns ``(y, normed)``, with ``q8``
    ``(y, normed, Int8Rows)``. One launch instead of two, for one-token steps."""
    T, N = x.shape
    topk = routed.shape[1] if routed.dim() == 3 else 1
    if not x.is_contiguous() or routed.shape not in ((T, N), (T, topk, N)) or not routed.is_contiguous():
        raise ValueError(f"ffn_residual takes contiguous x [T, N] and routed [T, N] or [T, k, N], got "
                         f"{tuple(x.shape)} and {tuple(routed.shape)}")
    if shared is not None and (shared.shape != x.shape or shared.stride(-1) != 1):
        raise ValueError(f"shared must be [T, N] rows with unit inner stride, got {tuple(shared.shape)}")
    if shared_gate is not None and (shared is None or shared_gate.shape != (T, 1)):
        raise ValueError("shared_gate must be one logit per token [T, 1] beside a shared output")
    if norm is not None and (norm[0].numel() != N or not norm[0].is_contiguous()):
        raise ValueError("the norm weight must be a contiguous vector of the row size")
    if q8 and (norm is None or N % QBLOCK):
        raise ValueError(f"an int8 form needs the norm and rows of a multiple of {QBLOCK}")
    y = torch.empty_like(x)
    h = torch.empty_like(x) if norm is not None else y
    codes = new_q8(T, N, x.device) if q8 else (y, y, y)
    block, warps = row_launch(N) if norm is not None else (min(triton.next_power_of_2(N), 1024), 4)
    if T:
        s = shared if shared is not None else x
        g = shared_gate if shared_gate is not None else x
        w, eps = norm if norm is not None else (x, 0.0)
        ffn_residual_kernel[(T, triton.cdiv(N, block))](x, routed, s, g, y, w, h, *codes, N, topk, s.stride(0),
                                                        g.stride(0), eps, HAS_SHARED=shared is not None,
                                                        HAS_GATE=shared_gate is not None, NORM=norm is not None,
                                                        Q8=q8, BLOCK=block, num_warps=warps, **pdl.flags(x))
    if norm is None:
        return y
    return (y, h, as_rows(codes)) if q8 else (y, h)
