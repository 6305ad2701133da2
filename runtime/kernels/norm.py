"""RMSNorm in one launch (the torch form is seven: widen, square, mean, add, rsqrt, scale, narrow,
then the weight), for every norm of the GPU forward: block inputs, per-head q/k norms, the output
norm. Same rounding points as ``runtime.layers.rms_norm``: the statistic in float32, the
normalised value rounded to the activation dtype, then multiplied by the weight and rounded again,
so results differ from the torch form only by the order of the float32 sum of squares.

Two more jobs ride in the same launch for one-token decode, where each saved launch is time off
a launch-bound token: the residual add in front of the norm (``x + r``, rounded to the dtype as torch's add
rounds, written out as the new residual stream), and the int8 form of the normed row
(``q8dot.store_q8``), which the projections and the MoE kernels that read the row would
otherwise each compute in a launch of their own. The int8 form is computed from the rounded
output, so it is bit for bit ``q8dot.quantize`` of it; the kernel returns it beside the output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import wait_prior
from .q8dot import QBLOCK, Int8Rows, as_rows, new_q8, store_q8


@triton.jit
def rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, xq, xd, xs, N, B, stride_a, stride_b, eps,
                     HAS_W: tl.constexpr, HAS_RES: tl.constexpr, Q8: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    wait_prior(PDL)
    r = tl.program_id(0)
    n = tl.arange(0, BLOCK)
    m = n < N
    base = (r // B).to(tl.int64) * stride_a + (r % B).to(tl.int64) * stride_b
    x = tl.load(x_ptr + base + n, mask=m, other=0.0)
    if HAS_RES:  # the residual add, rounded like torch's, is also the new residual stream
        x = (x.to(tl.float32) + tl.load(r_ptr + r.to(tl.int64) * N + n, mask=m, other=0.0).to(tl.float32))
        x = x.to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + r.to(tl.int64) * N + n, x, mask=m)
    normed_row(x.to(tl.float32), w_ptr, y_ptr, xq, xd, xs, r, n, m, N, eps, HAS_W, Q8, BLOCK)


@triton.jit
def normed_row(x, w_ptr, y_ptr, xq, xd, xs, r, n, m, N, eps, HAS_W: tl.constexpr, Q8: tl.constexpr,
               BLOCK: tl.constexpr):
    """Row ``r`` of the norm from its float32 values ``x [BLOCK]`` (0 past N): written to ``y_ptr``
    and, with ``Q8``, its int8 form. Shared by every kernel that ends in a norm, so that all of
    them round exactly as this one (same block size and warps: the same sum order)."""
    y = (x * tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)).to(y_ptr.dtype.element_ty)
    if HAS_W:
        y = (y.to(tl.float32) * tl.load(w_ptr + n, mask=m, other=0.0).to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + r.to(tl.int64) * N + n, y, mask=m)
    if Q8:
        blocks = tl.arange(0, BLOCK // 32)
        store_q8(tl.reshape(y.to(tl.float32), [BLOCK // 32, 32]), blocks, N, xq + r * N, xd + r * (N // 32),
                 xs + r * (N // 16))


def row_launch(N: int) -> tuple[int, int]:
    """(BLOCK, warps) of a one-program-per-row norm over N values: every kernel using
    ``normed_row`` launches with these, so its sums run in the same order."""
    block = max(triton.next_power_of_2(N), QBLOCK)
    return block, 4 if block <= 1024 else 8


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None,
                  q8: bool = False) -> "torch.Tensor | tuple[torch.Tensor, ...]":
    """RMSNorm over the last axis of a 2-D or 3-D ``x`` whose last axis is contiguous (strided
    rows, e.g. the query half of a fused query|gate projection, are read in place); returns a
    contiguous tensor of ``x``'s shape and dtype.

    ``residual`` (2-D ``x`` only, same shape and dtype, contiguous): normalise ``x + residual``
    and return ``(x + residual, norm)``. ``q8`` (2-D, rows a multiple of 32): the int8 form of
    the output (``q8dot.Int8Rows``) comes from the same launch and is returned last."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"rms_norm_rows takes [R, N] or [A, B, N] with a contiguous last axis, got {tuple(x.shape)}")
    N = x.shape[-1]
    if weight is not None and (weight.numel() != N or not weight.is_contiguous()):
        raise ValueError("weight must be a contiguous vector of the normalised size")
    if (residual is not None or q8) and x.dim() != 2:
        raise ValueError("a residual or an int8 output needs 2-D rows")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or not residual.is_contiguous()):
        raise ValueError("residual must be contiguous, of x's shape and dtype")
    if q8 and N % QBLOCK:
        raise ValueError(f"an int8 output needs rows of a multiple of {QBLOCK}, got {N}")
    A, B = (x.shape[0], 1) if x.dim() == 2 else (x.shape[0], x.shape[1])
    stride_a, stride_b = x.stride(0), (x.stride(1) if x.dim() == 3 else 0)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty_like(y) if residual is not None else y
    codes = new_q8(A, N, x.device) if q8 else (y, y, y)
    if A * B:
        block, warps = row_launch(N)
        rms_norm_kernel[(A * B,)](x, residual if residual is not None else x, weight if weight is not None else x,
                                   y, s, *codes, N, B, stride_a, stride_b, eps, HAS_W=weight is not None,
                                   HAS_RES=residual is not None, Q8=q8, BLOCK=block, num_warps=warps, **pdl.flags(x))
    out: tuple[torch.Tensor | Int8Rows, ...] = (s, y) if residual is not None else (y,)
    if q8:
        out += (as_rows(codes),)
    return out if len(out) > 1 else y
