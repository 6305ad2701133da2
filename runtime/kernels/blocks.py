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

import inspect
import re

import torch
import triton
import triton.language as tl
from gguf.constants import GGMLQuantizationType as T

from sparkpack.formats.quant_grids import GRID_AT, GRID_TABLE, IQ1_DELTA
from sparkpack.formats.quants import KERNEL_QUANTS

Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, MXFP4 = (int(q) for q in (T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K,
                                                                    T.IQ4_XS, T.MXFP4))
# qtype -> (elements per block, bytes per block) of the types the kernels read (the registry's)
BLOCK_LAYOUT: dict[int, tuple[int, int]] = {q: (k.block, k.type_size) for q, k in KERNEL_QUANTS.items()}
SUPPORTED_QTYPES = tuple(BLOCK_LAYOUT)
# Every kernel walks K in chunks of 256 elements (one K-quant super-block, eight 32-blocks).
# Types whose sub-blocks have an additive term (the registry's ``offset``), as one bit per GGML id:
# the dots test ``(_OFFSET_BITS >> QTYPE) & 1`` in the condition itself, an expression of constexprs
# that every Triton folds at compile time (3.6 does not fold a @triton.jit helper's return value).
_OFFSET_BITS = tl.constexpr(sum(1 << q for q, k in KERNEL_QUANTS.items() if k.offset))
# Where each of gguf's lattices starts in the grid table (``grid_table``) the kernels index.
_KSIGNS, _IQ2XXS, _IQ2XS, _IQ2S, _IQ3XXS, _IQ3S, _IQ1S = (
    tl.constexpr(GRID_AT[n]) for n in ("ksigns", "iq2xxs", "iq2xs", "iq2s", "iq3xxs", "iq3s", "iq1s"))
_IQ1_DELTA = tl.constexpr(IQ1_DELTA)
_GRIDS: dict[str, torch.Tensor] = {}


def grid_table(device: torch.device) -> torch.Tensor:
    """gguf's IQ lattices and sign table (``formats.quant_grids``) as one uint8 tensor on
    ``device``, made once per device: kernels keep its address (CUDA graphs replay it)."""
    key = str(device)
    t = _GRIDS.get(key)
    if t is None:
        t = _GRIDS[key] = torch.from_numpy(GRID_TABLE.copy()).to(device)
    return t


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
def _unpack_iq4_nl(row, c, K, rmask):
    # block_iq4_nl (18 B): d @0, qs[16] @2 (nibbles as Q4_0); w = d * kvalues_iq4nl[code].
    l, base, mask = _block32(row, c, K, rmask, 18)
    d = _f16(base, mask)
    return _iq4_nl_value(_nibble(base + 2, l, mask)).to(tl.float32), d, tl.zeros_like(d)


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
def _unpack_q4_1(row, c, K, rmask):
    # block_q4_1 (20 B): d @0, m @2, qs[16] @4 (nibbles as Q4_0); w = d * code + m.
    l, base, mask = _block32(row, c, K, rmask, 20)
    q = _nibble(base + 4, l, mask)
    return q.to(tl.float32), _f16(base, mask), -_f16(base + 2, mask)


@triton.jit
def _unpack_q5_1(row, c, K, rmask):
    # block_q5_1 (24 B): d @0, m @2, qh u32 @4 (bit l: 5th bit of element l), qs[16] @8; w = d * code + m.
    l, base, mask = _block32(row, c, K, rmask, 24)
    qh = (_u8(base + 4 + l // 8, mask) >> (l % 8)) & 1
    q = _nibble(base + 8, l, mask) | (qh << 4)
    return q.to(tl.float32), _f16(base, mask), -_f16(base + 2, mask)


@triton.jit
def _sub16():
    """Sub-block ``s`` [1,16,1] and element ``l`` [1,1,16] of a 256-chunk in 16-element sub-blocks,
    with the K-quants' 2-bit code layout: element 16s + l is bits 2j of byte 32h + m of the codes,
    h = s // 8 (128-element half), j = (s % 8) // 2 (shift), m = 16 (s % 2) + l."""
    s = tl.arange(0, 16)[None, :, None]
    l = tl.arange(0, 16)[None, None, :]
    return s, l, s // 8, (s % 8) // 2, (s % 2) * 16 + l


@triton.jit
def _unpack_q2_k(row, c, K, rmask):
    # block_q2_K (84 B): scales[16] @0 (low nibble: scale, high: min of sub-block s), qs[64] @16,
    # d @80, dmin @82; w = d * scale * code - dmin * min.
    s, l, h, j, m = _sub16()
    base = row + c * 84
    q = (_u8(base + 16 + 32 * h + m, rmask) >> (2 * j)) & 3
    sc = _u8(base + s, rmask)
    return q.to(tl.float32), _f16(base + 80, rmask) * (sc & 15).to(tl.float32), \
        _f16(base + 82, rmask) * (sc >> 4).to(tl.float32)


@triton.jit
def _unpack_q3_k(row, c, K, rmask):
    # block_q3_K (110 B): hmask[32] @0, qs[64] @32, scales[12] @96, d @108. Low two bits as Q2_K;
    # element 32i + m (i = 4h + j) subtracts 4 unless bit i of hmask[m] is set. 6-bit scale of
    # sub-block s = nibble s // 8 of byte s % 8, high bits = bits 2 (s // 4) of byte 8 + s % 4; minus 32.
    s, l, h, j, m = _sub16()
    base = row + c * 110
    lo = (_u8(base + 32 + 32 * h + m, rmask) >> (2 * j)) & 3
    hb = (_u8(base + m, rmask) >> (4 * h + j)) & 1
    q = lo - 4 * (1 - hb)
    sc = ((_u8(base + 96 + s % 8, rmask) >> (4 * (s // 8))) & 15) | \
        (((_u8(base + 104 + s % 4, rmask) >> (2 * (s // 4))) & 3) << 4)
    d = _f16(base + 108, rmask) * (sc - 32).to(tl.float32)
    return q.to(tl.float32), d, tl.zeros_like(d)


@triton.jit
def _u32(ptr, mask):
    """A little-endian u32 at a byte address (as int32: shift with ``>>`` then mask)."""
    return _u8(ptr, mask) | (_u8(ptr + 1, mask) << 8) | (_u8(ptr + 2, mask) << 16) | (_u8(ptr + 3, mask) << 24)


@triton.jit
def _ksign(k):
    """``ksigns[k & 127]``: the 7 stored sign bits and their parity as the eighth (an even
    count of negatives per group of 8; gguf's table, as ``q8dot`` checks at import)."""
    k = k & 127
    p = k ^ (k >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return k | ((p & 1) << 7)


@triton.jit
def _signed(grids, sign_index, l):
    """+1/-1 for bit ``l % 8`` of ``ksigns[sign_index]`` (set: negative)."""
    bit = (tl.load(grids + _KSIGNS + sign_index).to(tl.int32) >> (l % 8)) & 1
    return 1 - 2 * bit


@triton.jit
def _sub32():
    return tl.arange(0, 8)[None, :, None], tl.arange(0, 32)[None, None, :]


@triton.jit
def _unpack_iq2_xxs(row, c, K, rmask, grids):
    # block_iq2_xxs (66 B): d @0, then per 32-element sub-block s eight bytes @2 + 8s: bytes 0-3
    # the iq2xxs_grid entries of its four groups of 8, bytes 4-7 a u32 holding the groups'
    # 7-bit ksigns indices at bits 0, 7, 14, 21 and the 4-bit scale at 28: w = d (0.5 + sc) / 4 * grid * sign.
    s, l = _sub32()
    base = row + c * 66 + 2 + 8 * s
    aux = _u32(base + 4, rmask)  # [BN, 8, 1]
    idx = _u8(base + l // 8, rmask)
    g = tl.load(grids + _IQ2XXS + idx * 8 + l % 8).to(tl.int32)
    q = g * _signed(grids, (aux >> (7 * (l // 8))) & 127, l)
    d = _f16(row + c * 66, rmask) * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.25
    return q.to(tl.float32), d, tl.zeros_like(d)


@triton.jit
def iq2_scale(row_c, at, s, rmask):
    """d (0.5 + sc) / 4 with sc = nibble s % 2 of byte ``at + s // 2`` (IQ2_XS/IQ2_S, per 16)."""
    sc = (_u8(row_c + at + s // 2, rmask) >> (4 * (s % 2))) & 15
    return _f16(row_c, rmask) * (0.5 + sc.to(tl.float32)) * 0.25


@triton.jit
def _groups16(row, c, TS: tl.constexpr):
    """For the lattice types with a scale per 16 elements: sub-block ``s`` [1,16,1], element
    ``l`` [1,1,16], the chunk's block ``b`` and each element's group of 8, ``2 s + l // 8``."""
    s = tl.arange(0, 16)[None, :, None]
    l = tl.arange(0, 16)[None, None, :]
    return s, l, row + c * TS, 2 * s + l // 8


@triton.jit
def _unpack_iq2_xs(row, c, K, rmask, grids):
    # block_iq2_xs (74 B): d @0, qs u16[32] @2 (group g of 8: 9-bit iq2xs_grid index, 7-bit ksigns
    # index above it), scales[8] @66 (a nibble per 16 elements).
    s, l, b, grp = _groups16(row, c, 74)
    at = b + 2 + 2 * grp
    q16 = _u8(at, rmask) | (_u8(at + 1, rmask) << 8)
    g = tl.load(grids + _IQ2XS + (q16 & 511) * 8 + l % 8).to(tl.int32)
    d = iq2_scale(b, 66, s, rmask)
    return (g * _signed(grids, q16 >> 9, l)).to(tl.float32), d, tl.zeros_like(d)


@triton.jit
def _unpack_iq2_s(row, c, K, rmask, grids):
    # block_iq2_s (82 B): d @0, qs[32] @2 (low 8 bits of group g's iq2s_grid index), signs[32] @34
    # (one sign bit per element), qh[8] @66 (bits 2 (g % 4) of byte g // 4: index bits 8-9),
    # scales[8] @74 (a nibble per 16 elements).
    s, l, b, grp = _groups16(row, c, 82)
    idx = _u8(b + 2 + grp, rmask) | (((_u8(b + 66 + grp // 4, rmask) >> (2 * (grp % 4))) & 3) << 8)
    g = tl.load(grids + _IQ2S + idx * 8 + l % 8).to(tl.int32)
    neg = (_u8(b + 34 + grp, rmask) >> (l % 8)) & 1
    d = iq2_scale(b, 74, s, rmask)
    return (g * (1 - 2 * neg)).to(tl.float32), d, tl.zeros_like(d)


@triton.jit
def _unpack_iq3_xxs(row, c, K, rmask, grids):
    # block_iq3_xxs (98 B): d @0, qs[64] @2 (an iq3xxs_grid entry of 4 per byte), then a u32 per
    # 32-element sub-block @66 + 4s: ksigns indices of its groups of 8 at bits 0, 7, 14, 21 and the
    # 4-bit scale at 28: w = d (0.5 + sc) / 2 * grid * sign.
    s, l = _sub32()
    b = row + c * 98
    aux = _u32(b + 66 + 4 * s, rmask)
    idx = _u8(b + 2 + 8 * s + l // 4, rmask)
    g = tl.load(grids + _IQ3XXS + idx * 4 + l % 4).to(tl.int32)
    q = g * _signed(grids, (aux >> (7 * (l // 8))) & 127, l)
    d = _f16(b, rmask) * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.5
    return q.to(tl.float32), d, tl.zeros_like(d)


@triton.jit
def _unpack_iq3_s(row, c, K, rmask, grids):
    # block_iq3_s (110 B): d @0, qs[64] @2 (low 8 bits of the iq3s_grid index of each group of 4),
    # qh[8] @66 (bit g % 8 of byte g // 8: index bit 8), signs[32] @74 (a bit per element),
    # scales[4] @106 (a nibble per sub-block of 32): w = d (1 + 2 sc) * grid * sign.
    s, l = _sub32()
    b = row + c * 110
    grp = 8 * s + l // 4
    idx = _u8(b + 2 + grp, rmask) | (((_u8(b + 66 + s, rmask) >> (l // 4)) & 1) << 8)
    g = tl.load(grids + _IQ3S + idx * 4 + l % 4).to(tl.int32)
    neg = (_u8(b + 74 + 4 * s + l // 8, rmask) >> (l % 8)) & 1
    sc = (_u8(b + 106 + s // 2, rmask) >> (4 * (s % 2))) & 15
    d = _f16(b, rmask) * (1 + 2 * sc).to(tl.float32)
    return (g * (1 - 2 * neg)).to(tl.float32), d, tl.zeros_like(d)


@triton.jit
def _iq1_value(grids, idx, l, neg_delta):
    """iq1s_grid[idx][l % 8] (-1, 0, 1) plus the group's delta (-0.125 when ``neg_delta``)."""
    g = tl.load(grids + _IQ1S + idx * 8 + l % 8).to(tl.int8, bitcast=True).to(tl.float32)
    return g + tl.where(neg_delta != 0, -_IQ1_DELTA, _IQ1_DELTA)


@triton.jit
def _unpack_iq1_s(row, c, K, rmask, grids):
    # block_iq1_s (50 B): d @0, qs[32] @2 (low 8 bits of each group of 8's iq1s_grid index), qh
    # u16[8] @34, one per sub-block of 32: index bits 8-10 of group j at bits 3j, the scale at
    # 12-14, the delta's sign at 15: w = d (2 sc + 1) * (grid + delta).
    s, l = _sub32()
    b = row + c * 50
    qh = _u8(b + 34 + 2 * s, rmask) | (_u8(b + 35 + 2 * s, rmask) << 8)  # [BN, 8, 1]
    idx = _u8(b + 2 + 4 * s + l // 8, rmask) | (((qh >> (3 * (l // 8))) & 7) << 8)
    q = _iq1_value(grids, idx, l, qh >> 15)
    d = _f16(b, rmask) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
    return q, d, tl.zeros_like(d)


@triton.jit
def iq1_m_d(b, rmask):
    """The f16 ``d`` of the IQ1_M blocks at ``b``: the top nibbles of its four scale u16s @48
    (u16 i gives bits 4i..4i+3), as fp32."""
    bits = (_u8(b + 49, rmask) >> 4) | (_u8(b + 51, rmask) & 0xF0) | ((_u8(b + 53, rmask) >> 4) << 8) | \
        ((_u8(b + 55, rmask) & 0xF0) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _unpack_iq1_m(row, c, K, rmask, grids):
    # block_iq1_m (56 B): qs[32] @0 (low index bits per group of 8), qh[16] @32 (nibble g % 2 of
    # byte g // 2: index bits 8-10, bit 3 the delta's sign), scales u16[4] @48: 3-bit scale of
    # sub-block s (16 elements) at bits 3 (s % 4) of u16 s // 4; the f16 d is the four u16s' top
    # nibbles (u16 i gives bits 4i..4i+3): w = d (2 sc + 1) * (grid + delta).
    s, l, b, grp = _groups16(row, c, 56)
    qn = (_u8(b + 32 + grp // 2, rmask) >> (4 * (grp % 2))) & 15
    q = _iq1_value(grids, _u8(b + grp, rmask) | ((qn & 7) << 8), l, qn & 8)
    u = _u8(b + 48 + 2 * (s // 4), rmask) | (_u8(b + 49 + 2 * (s // 4), rmask) << 8)
    d = iq1_m_d(b, rmask) * (2 * ((u >> (3 * (s % 4))) & 7) + 1).to(tl.float32)
    return q, d, tl.zeros_like(d)


@triton.jit
def _unpack(QTYPE: tl.constexpr, row, c, K, rmask, grids):
    """Dispatch on the (compile-time) quant type: each type compiles to its own kernel. A type
    without a branch stops the compile (never another type's math)."""
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
    elif QTYPE == 3:
        return _unpack_q4_1(row, c, K, rmask)
    elif QTYPE == 6:
        return _unpack_q5_0(row, c, K, rmask)
    elif QTYPE == 7:
        return _unpack_q5_1(row, c, K, rmask)
    elif QTYPE == 10:
        return _unpack_q2_k(row, c, K, rmask)
    elif QTYPE == 11:
        return _unpack_q3_k(row, c, K, rmask)
    elif QTYPE == 16:
        return _unpack_iq2_xxs(row, c, K, rmask, grids)
    elif QTYPE == 17:
        return _unpack_iq2_xs(row, c, K, rmask, grids)
    elif QTYPE == 18:
        return _unpack_iq3_xxs(row, c, K, rmask, grids)
    elif QTYPE == 19:
        return _unpack_iq1_s(row, c, K, rmask, grids)
    elif QTYPE == 21:
        return _unpack_iq3_s(row, c, K, rmask, grids)
    elif QTYPE == 22:
        return _unpack_iq2_s(row, c, K, rmask, grids)
    elif QTYPE == 20:
        return _unpack_iq4_nl(row, c, K, rmask)
    elif QTYPE == 23:
        return _unpack_iq4_xs(row, c, K, rmask)
    elif QTYPE == 29:
        return _unpack_iq1_m(row, c, K, rmask, grids)
    elif QTYPE == 39:
        return _unpack_mxfp4(row, c, K, rmask)
    else:
        tl.static_assert(QTYPE < 0, "blocks._unpack has no branch for this quant type")
        return _unpack_q8_0(row, c, K, rmask)


@triton.jit
def _chunk_dot(QTYPE: tl.constexpr, q, scale, offset, x_row_ptr, c, K):
    """Per-row dot of one unpacked chunk with one activation row -> [BN] fp32.

    sum_i w_i x_i = sum_s scale_s * sum_l q x  -  sum_s offset_s * sum_l x.
    """
    NSUB: tl.constexpr = q.shape[1]
    SUB: tl.constexpr = q.shape[2]
    s = tl.arange(0, NSUB)[None, :, None]
    l = tl.arange(0, SUB)[None, None, :]
    k = c * 256 + s * SUB + l
    x = tl.load(x_row_ptr + k, mask=k < K, other=0.0).to(tl.float32)  # [1,NSUB,SUB]
    qx = tl.sum(q * x, axis=2)  # [BN,NSUB]
    part = tl.sum(qx * tl.sum(scale, axis=2), axis=1)
    if (_OFFSET_BITS >> QTYPE) & 1:
        xs = tl.sum(x, axis=2)  # [1,NSUB]
        part -= tl.sum(xs * tl.sum(offset, axis=2), axis=1)
    return part


@triton.jit
def _row_dot(QTYPE: tl.constexpr, w_rows, rmask, x_row_ptr, K, BLOCK_N: tl.constexpr, grids):
    """[BN] dots of BLOCK_N quantized rows with one activation row (one token), over all of K.
    ``grids``: ``grid_table`` on the weights' device (read by the IQ types only)."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c in range(0, tl.cdiv(K, 256)):
        q, scale, offset = _unpack(QTYPE, w_rows, c, K, rmask, grids)
        acc += _chunk_dot(QTYPE, q, scale, offset, x_row_ptr, c, K)
    return acc


@triton.jit
def _tile_dot(QTYPE: tl.constexpr, w_rows, rmask, a_rows, amask, c, K, acc,
              DOT_FP32: tl.constexpr, BLOCK_N: tl.constexpr, grids):
    """``acc [BM, BN] += A[:, chunk c] @ W[:, chunk c]^T`` for one 256-element chunk of K: the
    weight tile is unpacked once in registers and fed to ``tl.dot``, fp32 ``ieee`` with
    ``DOT_FP32``, else on half-precision operands (the activations' own, bf16 for fp32 ones)
    with fp32 accumulation. ``a_rows [BM, 1]`` are row pointers, ``amask [BM, 1]`` their mask."""
    q, scale, offset = _unpack(QTYPE, w_rows, c, K, rmask, grids)
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


def unpack_branches() -> set[int]:
    """The GGML ids ``_unpack`` has a branch for, read from its source."""
    return {int(m) for m in re.findall(r"QTYPE == (\d+)", inspect.getsource(_unpack.fn))}


if unpack_branches() != set(KERNEL_QUANTS):  # the registry and the kernels must agree, loudly
    raise ImportError(f"blocks._unpack branches {sorted(unpack_branches())} != the registry's kernel types "
                      f"{sorted(KERNEL_QUANTS)} (formats/quants.py KERNEL_QUANTS)")
