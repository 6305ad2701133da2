"""Dense (non-expert) projections straight from GGUF bytes: the one-token GEMV and a dequantizer.

Why: a decode step reads every dense weight once. Held expanded in bf16, the dense weights of
the Qwen3.6-35B-A3B shape are ~4.6 GiB (the output head alone 1 GB); as their Q4_K/Q6_K bytes
~1.5 GiB, which leaves ~3 GiB more of a ``--vram`` budget to experts. The kernel reads the
codes as 32-bit words (Q4_K) or 16-bit halves (Q6_K, whose 210-byte blocks are only 2-aligned)
and expands each word with constant shifts in registers. With a float activation it matches
cuBLAS on the bf16 copy at a third of the bytes; with the activation quantized to int8
(``q8dot``, the runtime's default) the Q4_K/Q6_K bands use int8 dot products on the packed
words (the low-bit bands too: ``q8dot.LOW_BIT_Q8``) and run faster on the larger groups
(docs/benchmarks-history.md, session 9). Byte-per-weight loads (``blocks._row_dot``) were slower
than either.

One launch computes the projections of one input that a layer stacks (q/k/v, DeltaNet qkv/z/beta/
alpha, router + shared expert): up to ``MAX_SEGMENTS`` row bands, each with its own type, write
adjacent column bands of one output. Types without a word kernel here take ``blocks``'
per-byte unpacking in the same launch, so every GGUF type the runtime reads works.

For more than one token (prefill), ``dequantize_into`` expands a band of rows into a scratch
matrix for cuBLAS: a prefill call multiplies each weight by hundreds of tokens, so the expansion
is a small share of it, and the scratch is transient (``formats.memory.DEQUANT_SCRATCH_ELEMENTS``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dequant import FLOAT_DTYPES
from . import pdl
from .blocks import Q4_K, Q6_K, _row_dot, _unpack, grid_table, row_bytes_of
from .pdl import prefetch_l2, wait_prior
from .q8dot import (LOW_BIT_BITS, LOW_BIT_UNIT, check_codes, chunks_per_iteration, low_bit_rows_q8, q4_k_rows_q8,
                    q4_k_scales, q6_k_rows_q8, q6_k_scales, readable, use_asm)

# Plain float matrices (the routers stay F32 in GGUF files) are read as their dtype
# (``dequant.FLOAT_DTYPES``); the kernels below name them by GGML id (F32 0, F16 1, BF16 30).
MAX_SEGMENTS = 4
# Float activations: rows per program (8 from ``WIDE_ROWS`` output rows, 4 below) and warps of the
# one-token kernel, and Q4_K chunks per loop iteration (Q6_K takes one: two spill). Int8
# activations: rows, warps and chunks per iteration for every band (few rows per program with a
# row's whole K in flight: these kernels wait on memory latency). Chosen with
# ``bench/kernels_bench.py --only dense --gemv-tiles ...`` (docs/benchmarks-history.md).
GEMV_WARPS = 4
WIDE_ROWS = 8192
Q4_K_CHUNKS = 2
Q8_TILE = (2, 1, 4)


# ----------------------------------------------------------------------------- per-type row dots
# Each returns [BN] fp32 dots of BN rows (``rows`` [BN,1,...] element offsets into ``w``, the
# weight viewed in the type's load unit) with the activation row ``x`` over all of K.

@triton.jit
def _q4_k_rows(w, rows, rmask, x, K, BN: tl.constexpr, CPI: tl.constexpr):
    # block_q4_K as 36 words: word 0 = d | dmin << 16 (f16 bits), words 1-3 the scales, words
    # 4 + 8i + m = qs[32i + 4m .. 32i + 4m + 3]. Nibble j of that word is element
    # 64i + 32(j % 2) + 4m + j // 2, sub-block 2i + j % 2 (low nibbles, then high, as in ggml).
    # CPI chunks per iteration: more bytes in flight per program.
    cc = tl.arange(0, CPI)[None, :, None, None]
    i = tl.arange(0, 4)[None, None, :, None]
    m = tl.arange(0, 8)[None, None, None, :]
    r3 = tl.reshape(rows, [BN, 1, 1])
    m3 = tl.reshape(rmask, [BN, 1, 1])
    i3 = tl.arange(0, 4)[None, None, :]
    acc = tl.zeros([BN], dtype=tl.float32)
    for c0 in range(0, K // 256, CPI):
        c = c0 + cc  # [1, CPI, 1, 1]
        xm = c * 256 < K
        qs = tl.load(w + rows + c * 36 + 4 + 8 * i + m, mask=rmask & xm, other=0)  # [BN, CPI, 4, 8]
        xb = x + c * 256 + 64 * i + 4 * m
        p_lo = tl.zeros([BN, CPI, 4, 8], dtype=tl.float32)
        p_hi = tl.zeros([BN, CPI, 4, 8], dtype=tl.float32)
        x_lo = tl.zeros([1, CPI, 4, 8], dtype=tl.float32)
        x_hi = tl.zeros([1, CPI, 4, 8], dtype=tl.float32)
        for j in tl.static_range(8):
            q = ((qs >> (4 * j)) & 15).to(tl.float32)
            xv = tl.load(xb + 32 * (j % 2) + j // 2, mask=xm, other=0.0).to(tl.float32)
            if j % 2 == 0:
                p_lo += q * xv
                x_lo += xv
            else:
                p_hi += q * xv
                x_hi += xv
        c3 = c0 + tl.arange(0, CPI)[None, :, None]
        sc_lo, sc_hi, mn_lo, mn_hi = q4_k_scales(w + r3 + c3 * 36, m3 & (c3 * 256 < K), i3)
        part = sc_lo * tl.sum(p_lo, axis=3) + sc_hi * tl.sum(p_hi, axis=3) \
            - (mn_lo * tl.sum(x_lo, axis=3) + mn_hi * tl.sum(x_hi, axis=3))
        acc += tl.sum(tl.sum(part, axis=2), axis=1)
    return acc


@triton.jit
def _q6_k_half(ql, qh, u, xb, n: tl.constexpr):
    """Sums of code x activation per 16-element sub-block for nibble ``n`` of the ql bytes."""
    p = tl.zeros(ql.shape, dtype=tl.float32)
    for e in tl.static_range(2):
        lo = (ql >> (8 * e + 4 * n)) & 15
        hi = (qh >> (8 * e + 4 * n + 2 * (u // 16))) & 3
        q = ((lo | (hi << 4)) - 32).to(tl.float32)
        p += q * tl.load(xb + 64 * n + e).to(tl.float32)
    return tl.sum(p, axis=3)


@triton.jit
def _q6_k_rows(w, rows, rmask, x, K, BN: tl.constexpr):
    # block_q6_K as 105 int16 halves (210-byte blocks are only 2-aligned): ql = halves 0-63,
    # qh = 64-95, int8 scales = 96-103, d = 104. Half 32h + u of ql holds bytes p = 64h + 2u + e
    # (e = 0, 1); nibble n of byte p is element 128h + 64n + 2u + e, whose top two bits are bits
    # 2(2n + u // 16) of qh byte 32h + (2u + e) % 32, i.e. byte e of qh half 64 + 16h + u % 16;
    # its 16-element sub-block is 8h + 4n + u // 8. u = 8g + v: g picks the sub-block.
    h = tl.arange(0, 2)[None, :, None, None]
    g = tl.arange(0, 4)[None, None, :, None]
    v = tl.arange(0, 8)[None, None, None, :]
    u = 8 * g + v
    r3 = tl.reshape(rows, [BN, 1, 1])
    m3 = tl.reshape(rmask, [BN, 1, 1])
    h3 = tl.arange(0, 2)[None, :, None]
    g3 = tl.arange(0, 4)[None, None, :]
    acc = tl.zeros([BN], dtype=tl.float32)
    for c in range(0, K // 256):
        blk = w + rows + c * 105
        ql = tl.load(blk + 32 * h + u, mask=rmask, other=0).to(tl.int32) & 0xFFFF  # [BN, 2, 4, 8]
        qh = tl.load(blk + 64 + 16 * h + u % 16, mask=rmask, other=0).to(tl.int32) & 0xFFFF
        xb = x + c * 256 + 128 * h + 2 * u
        sub0 = _q6_k_half(ql, qh, u, xb, 0)  # [BN, 2, 4]
        sub1 = _q6_k_half(ql, qh, u, xb, 1)
        sc0, sc1 = q6_k_scales(w + r3 + c * 105, m3, h3, g3)  # sub-blocks 8h + g and 8h + 4 + g
        acc += tl.sum(tl.sum(sc0 * sub0 + sc1 * sub1, axis=2), axis=1)
    return acc


@triton.jit
def _float_rows(w, rows, rmask, x, K, BN: tl.constexpr):
    k = tl.arange(0, 256)[None, :]
    acc = tl.zeros([BN, 256], dtype=tl.float32)
    for k0 in range(0, K, 256):
        kk = k0 + k
        wv = tl.load(w + rows + kk, mask=rmask & (kk < K), other=0.0).to(tl.float32)
        acc += wv * tl.load(x + kk, mask=kk < K, other=0.0).to(tl.float32)
    return tl.sum(acc, axis=1)


@triton.jit
def _segment(QT: tl.constexpr, w, row_stride, N, blk, x, xq, xd, xs, y, col, K, BN: tl.constexpr,
             CPI: tl.constexpr, ACT_Q8: tl.constexpr, ASM: tl.constexpr, grids):
    """Rows ``blk * BN ..`` of one segment, written to output columns ``col + row``."""
    n = blk * BN + tl.arange(0, BN)
    if QT == 12:
        n4 = n[:, None, None, None]
        if ACT_Q8:
            acc = q4_k_rows_q8(w, n4.to(tl.int64) * row_stride, n4 < N, xq, xd, xs, K, BN, CPI, ASM)
        else:
            acc = _q4_k_rows(w, n4.to(tl.int64) * row_stride, n4 < N, x, K, BN, CPI)
    elif QT == 14:
        n4 = n[:, None, None, None]
        if ACT_Q8:
            acc = q6_k_rows_q8(w, n4.to(tl.int64) * row_stride, n4 < N, xq, xd, xs, K, BN, CPI, ASM)
        else:
            acc = _q6_k_rows(w, n4.to(tl.int64) * row_stride, n4 < N, x, K, BN)
    elif ACT_Q8 and (LOW_BIT_BITS >> (QT % 64)) & 1:  # q8dot.LOW_BIT_Q8, folded at compile time
        n2 = n[:, None]
        acc = low_bit_rows_q8(QT, w, n2.to(tl.int64) * row_stride, n2 < N, xq, xd, xs, K, BN, CPI, ASM, grids)
    elif QT == 0 or QT == 1 or QT == 30:
        n2 = n[:, None]
        acc = _float_rows(w, n2.to(tl.int64) * row_stride, n2 < N, x, K, BN)
    else:  # any other quant type: the byte-wise unpacking of ``blocks``
        n3 = n[:, None, None]
        acc = _row_dot(QT, w + n3.to(tl.int64) * row_stride, n3 < N, x, K, BN, grids)
    tl.store(y + col + n, acc, mask=n < N)


@triton.jit
def _band(QT: tl.constexpr, w, row_stride, N, blk, x, xq, xd, xs, y, col, K, BN: tl.constexpr, CPI: tl.constexpr,
          ACT_Q8: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr, grids):
    """One program's rows of one segment: its weight rows into L2 while the previous kernel
    finishes (they depend on no kernel), then the wait, then the rows."""
    if PDL:
        r0 = blk.to(tl.int64) * BN
        prefetch_l2(w + r0 * row_stride, w + tl.minimum(r0 + BN, N) * row_stride, True)
    wait_prior(PDL)
    _segment(QT, w, row_stride, N, blk, x, xq, xd, xs, y, col, K, BN, CPI, ACT_Q8, ASM, grids)


@triton.jit(do_not_specialize=["B"])
def gemv_kernel(x, xq, xd, xs, y, grids_ptr, K, B, stride_y, w0, n0, s0, w1, n1, s1, w2, n2, s2, w3, n3, s3,
                 QT0: tl.constexpr, QT1: tl.constexpr, QT2: tl.constexpr, QT3: tl.constexpr,
                 NSEG: tl.constexpr, BN: tl.constexpr, CPI: tl.constexpr, ACT_Q8: tl.constexpr,
                 ASM: tl.constexpr, PDL: tl.constexpr):
    # The grid is exactly the segments' blocks times the B activation rows, the row the fastest
    # axis: the B programs of one weight block run next to each other (its bytes come from L2
    # for all but the first), and each runs the one-row program on its own row. B is not
    # specialized (B = 1 would be compiled apart): one binary for every B, so a row's sums are
    # the same instructions alone or batched. Every program takes one branch (and waits once).
    row = tl.program_id(0) % B
    pid = tl.program_id(0) // B
    x = x + row * K
    xq = xq + row * (K // 4)
    xd = xd + row * (K // 32)
    xs = xs + row * (K // 16)
    y = y + row.to(tl.int64) * stride_y
    e0 = tl.cdiv(n0, BN)
    if pid < e0:
        _band(QT0, w0, s0, n0, pid, x, xq, xd, xs, y, 0, K, BN, CPI, ACT_Q8, ASM, PDL, grids_ptr)
    elif NSEG > 1:
        e1 = e0 + tl.cdiv(n1, BN)
        if pid < e1:
            _band(QT1, w1, s1, n1, pid - e0, x, xq, xd, xs, y, n0, K, BN, CPI, ACT_Q8, ASM, PDL, grids_ptr)
        elif NSEG > 2:
            e2 = e1 + tl.cdiv(n2, BN)
            if pid < e2:
                _band(QT2, w2, s2, n2, pid - e1, x, xq, xd, xs, y, n0 + n1, K, BN, CPI, ACT_Q8, ASM, PDL, grids_ptr)
            elif NSEG > 3:
                _band(QT3, w3, s3, n3, pid - e2, x, xq, xd, xs, y, n0 + n1 + n2, K, BN, CPI, ACT_Q8, ASM, PDL,
                      grids_ptr)


@triton.jit(do_not_specialize=["N"])
def dequant_kernel(w, ids, out, grids_ptr, N, K, row_bytes, stride_out, QT: tl.constexpr,
                    HAS_IDS: tl.constexpr, BR: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1)
    rmask = r < N
    src = tl.load(ids + r, mask=rmask, other=0).to(tl.int64) if HAS_IDS else r.to(tl.int64)
    r3, src3, m3 = r[:, None, None], src[:, None, None], rmask[:, None, None]
    q, scale, offset = _unpack(QT, w + src3 * row_bytes, c, K, m3, grids_ptr)
    NSUB: tl.constexpr = q.shape[1]
    SUB: tl.constexpr = q.shape[2]
    k = c * 256 + tl.arange(0, NSUB)[None, :, None] * SUB + tl.arange(0, SUB)[None, None, :]
    tl.store(out + r3.to(tl.int64) * stride_out + k, q * scale - offset, mask=m3 & (k < K))


# ----------------------------------------------------------------------------- Python side

def load_view(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """The view the GEMV kernel reads a segment through: words for Q4_K, halves for Q6_K, the
    float dtype for float matrices, bytes otherwise. ``raw`` is ``[N, row_bytes]`` uint8."""
    if qtype == Q4_K:
        return raw.view(torch.int32)
    if qtype == Q6_K:
        return raw.view(torch.int16)
    if qtype in FLOAT_DTYPES:
        return raw.view(FLOAT_DTYPES[qtype])
    return raw


def row_bytes(qtype: int, K: int) -> int:
    """``blocks.row_bytes_of``, plus the float types."""
    return K * FLOAT_DTYPES[qtype].itemsize if qtype in FLOAT_DTYPES else row_bytes_of(qtype, K)


def gemv(x: torch.Tensor, segments: list[tuple[torch.Tensor, int]], out: torch.Tensor,
         tile: tuple[int, ...] | None = None,  # (rows, warps[, chunks per iteration]) for tuning
         q8: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``out[b] = x[b] @ [W_0; W_1; ...]^T`` for one-token rows ``x [B, K]`` (B = 1: one token;
    more: the tokens of a batched decode step, each row computed exactly as alone: the tile
    depends on the weights, never on B): the segments ``(raw [N_i, row_bytes] uint8, qtype)``
    are stacked row bands, written to ``out``'s column bands in order (``out [B, sum N_i]``, unit
    inner stride, any float dtype: the fp32 sums are cast on store). ``q8``: x as
    ``q8dot.quantize`` gives it; the bands of ``q8dot.Q8_TYPES`` then multiply the int8
    activation (``q8dot``), the others still x."""
    if not 1 <= len(segments) <= MAX_SEGMENTS:
        raise ValueError(f"1 to {MAX_SEGMENTS} segments per launch, got {len(segments)}")
    if x.dim() != 2 or x.shape[0] < 1 or not x.is_contiguous():
        raise ValueError(f"x must be contiguous rows [B, K], got {tuple(x.shape)}")
    B, K = x.shape
    rows = sum(r.shape[0] for r, _ in segments)
    if tile is None:  # (the interpreter's cost is per program: few, wide ones there)
        tile = (64, 4) if not x.is_cuda else Q8_TILE if q8 is not None else (8 if rows >= WIDE_ROWS else 4, GEMV_WARPS)
    bn, warps, cpi = (*tile, 0)[:3]
    cpi = cpi or (chunks_per_iteration(K, 4) if q8 is not None else Q4_K_CHUNKS)
    args, qts, blocks = [], [], 0
    for raw, qt in segments:
        if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes(qt, K) or not raw.is_contiguous():
            raise ValueError(f"segment of type {qt} must be contiguous uint8 [N, {row_bytes(qt, K)}], "
                             f"got {raw.dtype} {tuple(raw.shape)}")
        if q8 is not None and qt in LOW_BIT_UNIT and not readable(qt, raw):
            raise ValueError(f"segment of type {qt}: the int8 kernel loads it in {LOW_BIT_UNIT[qt]}-byte units, "
                             f"its rows are not aligned to them")
        view = load_view(raw, qt)
        args += [view, raw.shape[0], view.shape[1]]
        qts.append(qt)
        blocks += triton.cdiv(raw.shape[0], bn)
    if out.shape != (B, rows) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{B}, {rows}] with unit inner stride, got {tuple(out.shape)}")
    while len(qts) < MAX_SEGMENTS:  # unused segments: never reached (NSEG), any pointer will do
        args += [x, 0, 0]
        qts.append(-1)
    if q8 is not None and (q8[0].shape != (B, K // 4) or q8[0].dtype != torch.int32
                           or not all(t.is_contiguous() for t in q8)):
        raise ValueError(f"q8 must be x quantized by q8dot.quantize ([{B}, {K // 4}] int32 words)")
    if q8 is not None:
        check_codes(q8[0])
    xq, xd, xs = q8 if q8 is not None else (x, x, x)
    gemv_kernel[(blocks * B,)](x, xq, xd, xs, out, grid_table(x.device), K, B, out.stride(0), *args, QT0=qts[0], QT1=qts[1], QT2=qts[2], QT3=qts[3],
                            NSEG=len(segments), BN=bn, CPI=cpi, ACT_Q8=q8 is not None, ASM=use_asm(x), num_warps=warps,
                            **pdl.flags(x))
    return out


def dequantize_into(raw: torch.Tensor, qtype: int, K: int, out: torch.Tensor,
                    ids: torch.Tensor | None = None) -> torch.Tensor:
    """Expand rows of ``raw [N, row_bytes]`` into ``out [n, K]`` (its dtype): all rows, or rows
    ``ids`` (an embedding lookup). Float matrices are cast copies."""
    if qtype in FLOAT_DTYPES:
        src = load_view(raw, qtype)
        return out.copy_(src if ids is None else src[ids])
    n = raw.shape[0] if ids is None else ids.numel()
    if n == 0:
        return out
    br = 4 if out.is_cuda else 64
    grid = (triton.cdiv(n, br), triton.cdiv(K, 256))
    dequant_kernel[grid](raw, raw if ids is None else ids, out, grid_table(raw.device), n, K, raw.shape[1], out.stride(0),
                          QT=qtype, HAS_IDS=ids is not None, BR=br, **pdl.flags(raw))
    return out
