"""GGUF quant blocks unpacked in registers, and the dot products built on them.

Why: decode at batch 1 is bound by the bytes of weights read per token, so the runtime never keeps
a dequantized copy of a weight in VRAM. A weight is a uint8 tensor ``[N, row_bytes]`` (row n =
the GGUF blocks of output row n) and the kernels expand the blocks in registers.

Every quant family has one ``@triton.jit`` unpacking helper that turns a 256-element chunk of
``BLOCK_N`` rows into integer codes ``q`` shaped ``[BLOCK_N, NSUB, SUB]`` plus one scale (and,
for the K-quants with mins, one offset) per sub-block, so that ``w = scale * q - offset``. The
sub-block structure is kept because the scale math then runs once per sub-block instead of once
per weight (llama.cpp's mmvq does the same): per weight the kernels only load a byte, shift, mask
and multiply-add. Two dots consume the helpers: ``_row_dot`` (one activation row: the per-pair
MoE decode kernels of ``moe.py`` and, for the types without a word kernel, the dense GEMV of
``dense.py``) and ``_tile_dot`` (a ``tl.dot`` tile: the grouped prefill kernels of
``moe_grouped.py``). ``k_scale_min`` is the one place the K-quants' packed 6-bit scales are
unpacked; ``q8dot.py`` reads them through it too.

The types and their block sizes are gguf's (``formats.quants``); the byte offsets are written
next to each helper (ggml-common.h) and checked against ``gguf.quants.dequantize`` by the tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from sparkpack.formats.quants import KERNEL_QTYPES

Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, MXFP4 = (int(q) for q in (T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K,
                                                                    T.IQ4_XS, T.MXFP4))
# qtype -> (elements per block, bytes per block) of the types the kernels read
BLOCK_LAYOUT: dict[int, tuple[int, int]] = {int(q): GGML_QUANT_SIZES[T(q)] for q in KERNEL_QTYPES}
SUPPORTED_QTYPES = tuple(BLOCK_LAYOUT)
# Every kernel walks K in chunks of 256 elements (one K-quant super-block, eight 32-blocks).


# ----------------------------------------------------------------------------- byte helpers

@triton.jit
def _u8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr, mask):
    """A little-endian f16 at a possibly unaligned byte address, as fp32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble(qs, l, mask):
    """Code ``l`` (0..31) of a 32-element block packed in 16 bytes at ``qs``, ggml's common
    order: the low nibbles of the 16 bytes, then their high nibbles."""
    return (_u8(qs + l % 16, mask) >> ((l // 16) * 4)) & 15


@triton.jit
def k_scale_min(b0, b1, b2, s):
    """6-bit scale and min (int32) of sub-block ``s`` (0..7) of a Q4_K/Q5_K block, from byte
    ``s % 4`` of each of its three groups of four packed scale bytes: ``b0`` of bytes 0-3 (low 6
    bits: scales 0-3; top 2 bits: the high bits of scales 4-7), ``b1`` of bytes 4-7 (the same
    for the mins), ``b2`` of bytes 8-11 (low nibble: low 4 bits of scales 4-7, high nibble: of
    mins 4-7)."""
    low = s < 4
    sc = tl.where(low, b0 & 63, (b2 & 15) | ((b0 >> 6) << 4))
    mn = tl.where(low, b1 & 63, (b2 >> 4) | ((b1 >> 6) << 4))
    return sc, mn


@triton.jit
def _k_scale_min(base, s, mask):
    """``k_scale_min`` of sub-block ``s`` from the 12 packed bytes at ``base``, as fp32."""
    j = s % 4
    sc, mn = k_scale_min(_u8(base + j, mask), _u8(base + 4 + j, mask), _u8(base + 8 + j, mask), s)
    return sc.to(tl.float32), mn.to(tl.float32)


# ----------------------------------------------------------------------------- per-family unpacking
# Each helper: row (int64 byte offsets [BN,1,1] of each row start, already added to w_ptr),
# c = index of the 256-element chunk, K = row length, rmask [BN,1,1].
# Returns q [BN,NSUB,SUB] float32 codes, scale [BN,NSUB,1], offset [BN,NSUB,1] (w = scale*q - offset).

@triton.jit
def _unpack_q4_k(row, c, K, rmask):
    # block_q4_K (144 B): d f16 @0, dmin f16 @2, scales[12] @4, qs[128] @16;
    # element 64*i + l (l<32) = low nibble of qs[32*i + l], 64*i + 32 + l = its high nibble.
    s = tl.arange(0, 8)[None, :, None]
    l = tl.arange(0, 32)[None, None, :]
    base = row + c * 144
    q = (_u8(base + 16 + (s // 2) * 32 + l, rmask) >> ((s % 2) * 4)) & 15
    sc, mn = _k_scale_min(base + 4, s, rmask)
    return q.to(tl.float32), _f16(base, rmask) * sc, _f16(base + 2, rmask) * mn


@triton.jit
def _unpack_q5_k(row, c, K, rmask):
    # block_q5_K (176 B): d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48;
    # low 4 bits as in Q4_K, 5th bit of element 32*s + l = bit s of qh[l].
    s = tl.arange(0, 8)[None, :, None]
    l = tl.arange(0, 32)[None, None, :]
    base = row + c * 176
    ql = (_u8(base + 48 + (s // 2) * 32 + l, rmask) >> ((s % 2) * 4)) & 15
    qh = (_u8(base + 16 + l, rmask) >> s) & 1
    sc, mn = _k_scale_min(base + 4, s, rmask)
    q = ql | (qh << 4)
    return q.to(tl.float32), _f16(base, rmask) * sc, _f16(base + 2, rmask) * mn


@triton.jit
def _unpack_q6_k(row, c, K, rmask):
    # block_q6_K (210 B): ql[128] @0, qh[64] @128, scales int8[16] @192, d f16 @208; sub-blocks of 16.
    # Element 128*h + r: low 4 bits = nibble (r // 64) of ql[64*h + r % 64],
    # high 2 bits = bits 2*(r // 32) of qh[32*h + r % 32]; code - 32.
    s = tl.arange(0, 16)[None, :, None]
    l = tl.arange(0, 16)[None, None, :]
    base = row + c * 210
    h = s // 8
    r = (s % 8) * 16 + l
    ql = (_u8(base + h * 64 + r % 64, rmask) >> ((r // 64) * 4)) & 15
    qh = (_u8(base + 128 + h * 32 + r % 32, rmask) >> ((r // 32) * 2)) & 3
    q = (ql | (qh << 4)) - 32
    sc = tl.load(base + 192 + s, mask=rmask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    return q.to(tl.float32), _f16(base + 208, rmask) * sc, tl.zeros_like(sc)


@triton.jit
def _block32(row, c, K, rmask, BLOCK_BYTES: tl.constexpr):
    """For the 32-element block types, a chunk is 8 blocks (axis 1): element index ``l``
    ``[1,1,32]``, each block's start ``base`` ``[BN,8,1]`` and the mask of blocks inside K."""
    s = tl.arange(0, 8)[None, :, None]
    l = tl.arange(0, 32)[None, None, :]
    return l, row + (c * 8 + s) * BLOCK_BYTES, rmask & ((c * 8 + s) * 32 < K)


@triton.jit
def _unpack_q8_0(row, c, K, rmask):
    # block_q8_0 (34 B): d f16 @0, qs int8[32] @2. A chunk is 8 blocks; blocks past K are masked.
    l, base, mask = _block32(row, c, K, rmask, 34)
    q = tl.load(base + 2 + l, mask=mask, other=0).to(tl.int8, bitcast=True)
    d = _f16(base, mask)
    return q.to(tl.float32), d, tl.zeros_like(d)


@triton.jit
def _unpack_q4_0(row, c, K, rmask):
    # block_q4_0 (18 B): d @0, qs[16] @2; element l<16 = low nibble of qs[l], l>=16 = high nibble
    # of qs[l-16]; code - 8.
    l, base, mask = _block32(row, c, K, rmask, 18)
    q = _nibble(base + 2, l, mask) - 8
    d = _f16(base, mask)
    return q.to(tl.float32), d, tl.zeros_like(d)


@triton.jit
def _unpack_q5_0(row, c, K, rmask):
    # block_q5_0 (22 B): d @0, qh u32 little-endian @2 (bit l = 5th bit of element l), qs[16] @6
    # (nibbles as Q4_0); code - 16.
    l, base, mask = _block32(row, c, K, rmask, 22)
    ql = _nibble(base + 6, l, mask)
    qh = (_u8(base + 2 + l // 8, mask) >> (l % 8)) & 1
    q = (ql | (qh << 4)) - 16
    d = _f16(base, mask)
    return q.to(tl.float32), d, tl.zeros_like(d)


@triton.jit
def _iq4_nl_value(i):
    """ggml's ``kvalues_iq4nl[i]`` for codes i in 0..15, from constants instead of a table in
    memory: the 16 values plus 128 are bytes, 7 to an int64 (so each constant stays positive)."""
    word = tl.where(i < 7, 29938942475048961, tl.where(i < 14, 55650297557385590, 61913))
    first = tl.where(i < 7, 0, tl.where(i < 14, 7, 14))
    return ((word >> ((i - first) * 8)) & 255).to(tl.int32) - 128


@triton.jit
def _unpack_iq4_xs(row, c, K, rmask):
    # block_iq4_xs (136 B): d f16 @0, scales_h u16 @2, scales_l[4] @4, qs[128] @8; sub-block s of 32:
    # 6-bit scale = (nibble s%2 of scales_l[s//2]) | (bits 2s..2s+1 of scales_h) << 4, minus 32;
    # element l = kvalues_iq4nl[nibble l//16 of qs[16*s + l%16]].
    s = tl.arange(0, 8)[None, :, None]
    l = tl.arange(0, 32)[None, None, :]
    base = row + c * 136
    code = _nibble(base + 8 + s * 16, l, rmask)
    sh = _u8(base + 2, rmask) | (_u8(base + 3, rmask) << 8)
    ls = ((_u8(base + 4 + s // 2, rmask) >> ((s % 2) * 4)) & 15) | (((sh >> (2 * s)) & 3) << 4)
    scale = _f16(base, rmask) * (ls - 32).to(tl.float32)
    return _iq4_nl_value(code).to(tl.float32), scale, tl.zeros_like(scale)


@triton.jit
def _unpack_mxfp4(row, c, K, rmask):
    # block_mxfp4 (17 B): e8m0 exponent e @0, qs[16] @1 (nibbles as Q4_0); value = kvalues_mxfp4[code]
    # (e2m1 doubled: 0 1 2 3 4 6 8 12, bit 3 the sign) * 2^(e - 128), built from its float bits as
    # ggml_e8m0_to_fp32_half does (e < 2 gives the subnormals 2^-128, 2^-127).
    l, base, mask = _block32(row, c, K, rmask, 17)
    code = _nibble(base + 1, l, mask)
    m = code & 7
    mag = tl.where(m < 5, m, tl.where(m == 5, 6, tl.where(m == 6, 8, 12)))
    e = _u8(base, mask)
    bits = tl.where(e < 2, 0x00200000 << tl.minimum(e, 1), (e - 1) << 23)
    d = bits.to(tl.float32, bitcast=True)
    return tl.where(code >= 8, -mag, mag).to(tl.float32), d, tl.zeros_like(d)


@triton.jit
def _unpack(QTYPE: tl.constexpr, row, c, K, rmask):
    """Dispatch on the (compile-time) quant type: each type compiles to its own kernel."""
    if QTYPE == 12:
        return _unpack_q4_k(row, c, K, rmask)
    elif QTYPE == 13:
        return _unpack_q5_k(row, c, K, rmask)
    elif QTYPE == 14:
        return _unpack_q6_k(row, c, K, rmask)
    elif QTYPE == 8:
        return _unpack_q8_0(row, c, K, rmask)
    elif QTYPE == 2:
        return _unpack_q4_0(row, c, K, rmask)
    elif QTYPE == 23:
        return _unpack_iq4_xs(row, c, K, rmask)
    elif QTYPE == 39:
        return _unpack_mxfp4(row, c, K, rmask)
    else:
        return _unpack_q5_0(row, c, K, rmask)


@triton.jit
def _chunk_dot(QTYPE: tl.constexpr, q, scale, offset, x_row_ptr, c, K):
    """Per-row dot of one unpacked chunk with one activation row -> [BN] fp32.

    sum_i w_i x_i = sum_s scale_s * sum_l q x  -  sum_s offset_s * sum_l x.
    """
    NSUB: tl.constexpr = 16 if QTYPE == 14 else 8
    SUB: tl.constexpr = 256 // NSUB
    s = tl.arange(0, NSUB)[None, :, None]
    l = tl.arange(0, SUB)[None, None, :]
    k = c * 256 + s * SUB + l
    x = tl.load(x_row_ptr + k, mask=k < K, other=0.0).to(tl.float32)  # [1,NSUB,SUB]
    qx = tl.sum(q * x, axis=2)  # [BN,NSUB]
    part = tl.sum(qx * tl.sum(scale, axis=2), axis=1)
    if QTYPE == 12 or QTYPE == 13:
        xs = tl.sum(x, axis=2)  # [1,NSUB]
        part -= tl.sum(xs * tl.sum(offset, axis=2), axis=1)
    return part


@triton.jit
def _row_dot(QTYPE: tl.constexpr, w_rows, rmask, x_row_ptr, K, BLOCK_N: tl.constexpr):
    """[BN] dots of BLOCK_N quantized rows with one activation row (one token), over all of K."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c in range(0, tl.cdiv(K, 256)):
        q, scale, offset = _unpack(QTYPE, w_rows, c, K, rmask)
        acc += _chunk_dot(QTYPE, q, scale, offset, x_row_ptr, c, K)
    return acc


@triton.jit
def _tile_dot(QTYPE: tl.constexpr, w_rows, rmask, a_rows, amask, c, K, acc,
              DOT_FP32: tl.constexpr, BLOCK_N: tl.constexpr):
    """``acc [BM, BN] += A[:, chunk c] @ W[:, chunk c]^T`` for one 256-element chunk of K: the
    weight tile is unpacked once in registers and fed to ``tl.dot``, fp32 ``ieee`` with
    ``DOT_FP32``, else on half-precision operands (the activations' own, bf16 for fp32 ones)
    with fp32 accumulation. ``a_rows [BM, 1]`` are row pointers, ``amask [BM, 1]`` their mask."""
    q, scale, offset = _unpack(QTYPE, w_rows, c, K, rmask)
    w = tl.reshape(q * scale - offset, [BLOCK_N, 256])
    k = c * 256 + tl.arange(0, 256)
    a = tl.load(a_rows + k[None, :], mask=amask & (k[None, :] < K), other=0.0)
    if DOT_FP32:
        acc += tl.dot(a.to(tl.float32), tl.trans(w), input_precision="ieee")
    else:
        if a.dtype == tl.float32:
            a = a.to(tl.bfloat16)
        acc += tl.dot(a, tl.trans(w.to(a.dtype)))
    return acc


# ----------------------------------------------------------------------------- Python wrappers

def row_bytes_of(qtype: int, K: int) -> int:
    """Bytes of one quantized row of K elements (K a whole number of blocks)."""
    qk, ts = BLOCK_LAYOUT[int(qtype)]
    if K % qk:
        raise ValueError(f"K={K} is not a whole number of {qk}-element blocks")
    return K // qk * ts


def rows_per_program(device: torch.device, gpu_rows: int) -> int:
    """Rows per program: the GPU choice, or 256 on the CPU, where only Triton's interpreter runs
    kernels and its cost is per program (each one re-enters Python), not per row."""
    return 256 if device.type == "cpu" else gpu_rows


def _output(out: torch.Tensor | None, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """A caller-given fp32 output (reused buffers; tests poison it) or a fresh one."""
    if out is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    if tuple(out.shape) != shape or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"out must be float32 {shape} with unit inner stride, got {out.dtype} {tuple(out.shape)}")
    return out
