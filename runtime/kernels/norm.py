"""RMSNorm in one launch (the torch form is seven: widen, square, mean, add, rsqrt, scale, narrow,
then the weight), for every norm of the GPU forward: block inputs, per-head q/k norms, the output
norm. Same rounding points as ``runtime.layers.rms_norm``: the statistic in float32, the
normalised value rounded to the activation dtype, then multiplied by the weight and rounded again,
so results differ from the torch form only by the order of the float32 sum of squares.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, B, stride_a, stride_b, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    n = tl.arange(0, BLOCK)
    m = n < N
    base = (r // B).to(tl.int64) * stride_a + (r % B).to(tl.int64) * stride_b
    x = tl.load(x_ptr + base + n, mask=m, other=0.0).to(tl.float32)
    y = (x * tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)).to(y_ptr.dtype.element_ty)
    if HAS_W:
        y = (y.to(tl.float32) * tl.load(w_ptr + n, mask=m, other=0.0).to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + r.to(tl.int64) * N + n, y, mask=m)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis of a 2-D or 3-D ``x`` whose last axis is contiguous (strided
    rows, e.g. the query half of a fused query|gate projection, are read in place); returns a
    contiguous tensor of ``x``'s shape and dtype."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"rms_norm_rows takes [R, N] or [A, B, N] with a contiguous last axis, got {tuple(x.shape)}")
    N = x.shape[-1]
    if weight is not None and (weight.numel() != N or not weight.is_contiguous()):
        raise ValueError("weight must be a contiguous vector of the normalised size")
    A, B = (x.shape[0], 1) if x.dim() == 2 else (x.shape[0], x.shape[1])
    stride_a, stride_b = x.stride(0), (x.stride(1) if x.dim() == 3 else 0)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if A * B:
        block = triton.next_power_of_2(N)
        _rms_norm_kernel[(A * B,)](x, weight if weight is not None else x, y, N, B, stride_a, stride_b, eps,
                                   HAS_W=weight is not None, BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return y
