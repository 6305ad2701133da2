"""One-token products on int8 activations: the activation quantized once per input, then four
weight codes times four activations per ``dp4a`` instruction.

Why: the one-token kernels (dense GEMV, MoE decode) unpacked each weight code on its own (shift,
mask, convert to float, multiply-add: ~5 instructions a weight) and reached a fraction of the
GPU's copy bandwidth. With the activation as int8 in blocks of 32 (one fp32 scale each, as llama.cpp's
``q8_1``), a 32-bit word of Q4_K codes is two masks and two ``dp4a``: eight weights in ~5
instructions. The block scales and the activation's per-block sums turn the integer dots back
into ``sum w x`` once per sub-block. With fewer instructions a program can also hold a row's
whole K in flight (``chunks_per_iteration``), which these latency-bound kernels need as much:
together faster GEMVs and one-token MoE layers (docs/benchmarks-history.md).

The price is the activation's rounding (relative error ~0.5% per element, the same as llama.cpp's
quantized matmuls); the weights are used exactly as stored. The result depends only on the
activation and the weight bytes, so residency (which pool an expert's bytes sit in) still never
changes it. Triton's interpreter has no inline assembly: there ``dot4`` is the same integer sum
written with shifts, bit for bit the instruction's result, so CI runs these kernels too.

The low-bit types (Q2_K, Q3_K, IQ1-IQ3: ``low_bit_rows_q8``) build their words of four signed
codes from the packed bits or from gguf's lattice tables with their signs, as llama.cpp's
vecdotq does, and take the same int8 activation.

Quantized activation of a row of K elements (``quantize``): ``xq`` int8 ``[K]`` (read as int32
words of four), ``xd`` fp32 ``[K/32]`` block scales (x ~ xd * xq), ``xs`` fp32 ``[K/16]`` =
xd * (sum of xq over each 16 elements): the sub-block sums the K-quant offsets need.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..decode_rows import one_token_rows
from . import pdl
from .pdl import wait_prior
from .blocks import (_IQ1S, _IQ2S, _IQ2XS, _IQ2XXS, _IQ3S, _IQ3XXS, _KSIGNS, Q4_K, Q6_K, _f16, _u8, _u32,
                     iq1_m_d, iq2_scale, k_scale_min)
from gguf.constants import GGMLQuantizationType as _T

QBLOCK = 32  # activation elements per int8 scale
# The low-bit types whose codes the int8 kernels build as words of four signed bytes
# (``low_bit_rows_q8``): Q2_K, Q3_K and the IQ1/IQ2/IQ3 lattices.
LOW_BIT_Q8 = tuple(int(q) for q in (_T.Q2_K, _T.Q3_K, _T.IQ2_XXS, _T.IQ2_XS, _T.IQ2_S, _T.IQ3_XXS, _T.IQ3_S,
                                    _T.IQ1_S, _T.IQ1_M))
Q8_TYPES = (Q4_K, Q6_K, *LOW_BIT_Q8)  # weight types with an int8-activation kernel
# LOW_BIT_Q8 as one bit per GGML id, for a kernel's type dispatch: ``(LOW_BIT_BITS >> (QT % 64)) & 1``
# written in the condition itself (negative ids: no). Triton 3.6 folds a condition only when it is
# an expression of constexprs: a @triton.jit helper's return value is a tensor there, so the branch
# would be compiled for every type (and its static_assert fire).
LOW_BIT_BITS = tl.constexpr(sum(1 << q for q in LOW_BIT_Q8))


class Int8Rows(NamedTuple):
    """Rows ``[T, K]`` quantized for the int8 products (see the module docstring). A kernel that
    writes an activation row can return this beside it (``new_q8`` / ``store_q8``), and the
    products that read the row then skip their own ``quantize`` launch."""

    q: torch.Tensor  # int32 [T, K/4]: the int8 codes, four to a word
    d: torch.Tensor  # fp32 [T, K/32]: block scales (x ~ d * code)
    s: torch.Tensor  # fp32 [T, K/16]: d times the sum of the codes of each 16 elements


def wanted(rows: int, unit: int) -> bool:
    """Whether a kernel writing ``rows`` activation rows should also write their int8 form: one
    row, or a batched decode step's rows (only one-token products read it:
    ``runtime.decode_rows``), in whole blocks of 32 (``unit``: the width, or the piece of it one
    program writes)."""
    return one_token_rows(rows) and unit % QBLOCK == 0


def use_asm(t: torch.Tensor) -> bool:
    """``dot4``'s form for kernels on ``t``'s device: the instruction when compiled for a GPU,
    shifts under Triton's interpreter (which has no inline assembly)."""
    return t.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1"


def readable(qtype: int, *pools: torch.Tensor) -> bool:
    """Whether the int8 kernels can read these uint8 weight views of ``qtype``: a type they have,
    with rows (and slots) aligned to the unit they load (4 bytes for Q4_K, 2 for Q6_K)."""
    if int(qtype) not in Q8_TYPES:
        return False
    unit = 4 if int(qtype) == Q4_K else 2 if int(qtype) == Q6_K else 1  # the low-bit kernels load bytes
    return all(p.data_ptr() % unit == 0 and all(s % unit == 0 for s in p.stride()[:-1]) for p in pools)


@triton.jit
def dot4(a, b, ASM: tl.constexpr):
    """Per element, the dot of the four signed bytes of int32 ``a`` with those of ``b``."""
    if ASM:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        s = ((a << 24) >> 24) * ((b << 24) >> 24)
        for j in tl.static_range(1, 4):
            s += ((a << (24 - 8 * j)) >> 24) * ((b << (24 - 8 * j)) >> 24)
        return s


@triton.jit
def store_q8(v, b, K, xq, xd, xs):
    """Quantize ``v [BLOCKS, 32]`` fp32, blocks ``b [BLOCKS]`` of one row of K elements, and store
    its codes, scales and 16-element sums at that row's ``xq`` / ``xd`` / ``xs`` (blocks past K
    masked). Shared by ``_quantize_kernel`` and the kernels that produce an activation and its
    int8 form in one pass (``norm.py``, ``ffn.py``, ``deltanet.py``, ``attention.py``)."""
    k = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    amax = tl.max(tl.abs(v), axis=1)
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    q = tl.floor(v * inv[:, None] + 0.5).to(tl.int32)  # |q| <= 127: the block's largest maps to 127
    tl.store(xq + k, q.to(tl.int8), mask=k < K)
    d = amax / 127.0
    bm = b * 32 < K
    tl.store(xd + b, d, mask=bm)
    half = tl.sum(tl.reshape(q, [v.shape[0], 2, 16]), axis=2).to(tl.float32) * d[:, None]  # [BLOCKS, 2]
    tl.store(xs + 2 * b[:, None] + tl.arange(0, 2)[None, :], half, mask=bm[:, None])


@triton.jit
def _quantize_kernel(x, xq, xd, xs, K, stride_x, BLOCKS: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    t = tl.program_id(0)
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    k = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    v = tl.load(x + t * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
    store_q8(v, b, K, xq + t * K, xd + t * (K // 32), xs + t * (K // 16))


def new_q8(T: int, K: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty ``(codes int8 [T, K], xd [T, K/32], xs [T, K/16])`` for a kernel's ``store_q8``
    (``as_rows`` turns them into the ``Int8Rows`` the kernel returns)."""
    return (torch.empty(T, K, dtype=torch.int8, device=device),
            torch.empty(T, K // 32, dtype=torch.float32, device=device),
            torch.empty(T, K // 16, dtype=torch.float32, device=device))


def as_rows(codes: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> Int8Rows:
    """``new_q8``'s buffers, once a kernel has written them, as the products read them."""
    return Int8Rows(codes[0].view(torch.int32), codes[1], codes[2])


def quantize(x: torch.Tensor) -> Int8Rows:
    """Rows of ``x [T, K]`` (K a multiple of 32, any float dtype, unit inner stride) in their
    int8 form: see the module docstring."""
    T, K = x.shape
    if K % QBLOCK or x.stride(-1) != 1:
        raise ValueError(f"int8 activations need rows of a multiple of {QBLOCK} contiguous elements, got {tuple(x.shape)}")
    xq, xd, xs = new_q8(T, K, x.device)
    blocks = 8 if x.is_cuda else 64
    if T:
        _quantize_kernel[(T, triton.cdiv(K // 32, blocks))](x, xq, xd, xs, K, x.stride(0), BLOCKS=blocks,
                                                             num_warps=2, **pdl.flags(x))
    return as_rows((xq, xd, xs))


# ----------------------------------------------------------------------------- per-type row dots
# Each returns [BN] fp32 dots of BN rows (``rows`` [BN,1,1,1] element offsets into ``w``, the
# weight viewed in its load unit: int32 for Q4_K, int16 for Q6_K) with one quantized activation
# row (``xq`` int32 words, ``xd``, ``xs`` as ``quantize`` writes them) over all of K.

@triton.jit
def _k_scale_min_words(s0, s1, s2, s):
    """``blocks.k_scale_min`` of sub-block ``s`` from the three 32-bit words of a Q4_K block's 12
    scale bytes (byte ``s % 4`` of each), as fp32."""
    sh = 8 * (s % 4)
    sc, mn = k_scale_min((s0 >> sh) & 255, (s1 >> sh) & 255, (s2 >> sh) & 255, s)
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def q4_k_scales(b3, ok3, i3):
    """``(d * scale, dmin * min)`` of sub-blocks ``2i`` and ``2i + 1`` (four tensors: scale 2i,
    scale 2i + 1, min 2i, min 2i + 1) of the Q4_K blocks at word pointers ``b3``."""
    hdr = tl.load(b3, mask=ok3, other=0)
    s0 = tl.load(b3 + 1, mask=ok3, other=0)
    s1 = tl.load(b3 + 2, mask=ok3, other=0)
    s2 = tl.load(b3 + 3, mask=ok3, other=0)
    d = (hdr & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((hdr >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    sc_lo, mn_lo = _k_scale_min_words(s0, s1, s2, 2 * i3)
    sc_hi, mn_hi = _k_scale_min_words(s0, s1, s2, 2 * i3 + 1)
    return d * sc_lo, d * sc_hi, dmin * mn_lo, dmin * mn_hi


@triton.jit
def q4_k_rows_q8(w, rows, rmask, xq, xd, xs, K, BN: tl.constexpr, CPI: tl.constexpr, ASM: tl.constexpr):
    # block_q4_K as 36 words: word 0 = d | dmin << 16 (f16 bits), words 1-3 the scales, word
    # 4 + 8i + m = qs[32i + 4m .. +3]: its low nibbles are elements 64i + 4m .. +3 (sub-block 2i),
    # its high nibbles elements 64i + 32 + 4m .. +3 (sub-block 2i + 1), i.e. activation words
    # 16i + m and 16i + 8 + m of the chunk. CPI chunks per iteration: more bytes in flight.
    cc = tl.arange(0, CPI)[None, :, None, None]
    i = tl.arange(0, 4)[None, None, :, None]
    m = tl.arange(0, 8)[None, None, None, :]
    r3 = tl.reshape(rows, [BN, 1, 1])
    m3 = tl.reshape(rmask, [BN, 1, 1])
    c3 = tl.arange(0, CPI)[None, :, None]
    i3 = tl.arange(0, 4)[None, None, :]
    acc = tl.zeros([BN], dtype=tl.float32)
    for c0 in range(0, K // 256, CPI):
        c = c0 + cc  # [1, CPI, 1, 1]
        xm = c * 256 < K
        qs = tl.load(w + rows + c * 36 + 4 + 8 * i + m, mask=rmask & xm, other=0)  # [BN, CPI, 4, 8]
        a_lo = tl.load(xq + c * 64 + 16 * i + m, mask=xm, other=0)
        a_hi = tl.load(xq + c * 64 + 16 * i + 8 + m, mask=xm, other=0)
        d_lo = tl.sum(dot4(qs & 0x0F0F0F0F, a_lo, ASM), axis=3).to(tl.float32)  # [BN, CPI, 4]
        d_hi = tl.sum(dot4((qs >> 4) & 0x0F0F0F0F, a_hi, ASM), axis=3).to(tl.float32)
        cb = c0 + c3
        ok = cb * 256 < K
        sc_lo, sc_hi, mn_lo, mn_hi = q4_k_scales(w + r3 + cb * 36, m3 & ok, i3)
        sub = cb * 8 + 2 * i3  # 32-element sub-blocks 2i and 2i + 1 of the chunk
        x_lo = tl.load(xd + sub, mask=ok, other=0.0)
        x_hi = tl.load(xd + sub + 1, mask=ok, other=0.0)
        sum_lo = tl.load(xs + 2 * sub, mask=ok, other=0.0) + tl.load(xs + 2 * sub + 1, mask=ok, other=0.0)
        sum_hi = tl.load(xs + 2 * sub + 2, mask=ok, other=0.0) + tl.load(xs + 2 * sub + 3, mask=ok, other=0.0)
        part = sc_lo * x_lo * d_lo + sc_hi * x_hi * d_hi - (mn_lo * sum_lo + mn_hi * sum_hi)
        acc += tl.sum(tl.sum(part, axis=2), axis=1)
    return acc


@triton.jit
def _word(w, at, mask):
    """The 32-bit little-endian word at int16 offset ``at`` (Q6_K blocks are only 2-aligned)."""
    lo = tl.load(w + at, mask=mask, other=0).to(tl.int32) & 0xFFFF
    hi = tl.load(w + at + 1, mask=mask, other=0).to(tl.int32)
    return lo | (hi << 16)


@triton.jit
def q6_k_scales(b, ok, h, g):
    """``d * scale`` of sub-blocks ``8h + g`` and ``8h + 4 + g`` of the Q6_K blocks at int16
    pointers ``b``: the int8 scale of sub-block j is byte j % 2 of half 96 + j // 2."""
    d = tl.load(b + 104, mask=ok, other=0).to(tl.float16, bitcast=True).to(tl.float32)
    sh_lo = tl.load(b + 96 + 4 * h + g // 2, mask=ok, other=0).to(tl.int32)
    sh_hi = tl.load(b + 98 + 4 * h + g // 2, mask=ok, other=0).to(tl.int32)
    sc_lo = ((sh_lo >> (8 * (g % 2))) & 255).to(tl.int8).to(tl.float32)
    sc_hi = ((sh_hi >> (8 * (g % 2))) & 255).to(tl.int8).to(tl.float32)
    return d * sc_lo, d * sc_hi


@triton.jit
def q6_k_rows_q8(w, rows, rmask, xq, xd, xs, K, BN: tl.constexpr, CPI: tl.constexpr, ASM: tl.constexpr):
    # block_q6_K as 105 int16 halves: ql = bytes 0-127, qh = 128-191, int8 scales = 192-207,
    # d = half 104. ql word v = 16h + 4g + t (bytes 4v .. +3): low nibbles are elements
    # 128h + 16g + 4t .. +3 (sub-block 8h + g), high nibbles the same + 64 (sub-block 8h + 4 + g).
    # Their top two bits sit in qh word 8h + 4(g % 2) + t at bit 2(g // 2) (low) and 4 + 2(g // 2)
    # (high). Codes are 0..63 (the stored code; the value is code - 32).
    cc = tl.arange(0, CPI)[None, :, None, None, None]
    h = tl.arange(0, 2)[None, None, :, None, None]
    g = tl.arange(0, 4)[None, None, None, :, None]
    t = tl.arange(0, 4)[None, None, None, None, :]
    r4 = tl.reshape(rows, [BN, 1, 1, 1])
    m4 = tl.reshape(rmask, [BN, 1, 1, 1])
    r5 = tl.reshape(rows, [BN, 1, 1, 1, 1])
    m5 = tl.reshape(rmask, [BN, 1, 1, 1, 1])
    c4 = tl.arange(0, CPI)[None, :, None, None]
    h4 = tl.arange(0, 2)[None, None, :, None]
    g4 = tl.arange(0, 4)[None, None, None, :]
    acc = tl.zeros([BN], dtype=tl.float32)
    for c0 in range(0, K // 256, CPI):
        c = c0 + cc
        ok = m5 & (c * 256 < K)
        blk = w + r5 + c * 105
        ql = _word(blk, 2 * (16 * h + 4 * g + t), ok)  # [BN, CPI, 2, 4, 4]
        qh = _word(blk, 64 + 2 * (8 * h + 4 * (g % 2) + t), ok)
        shift = 2 * (g // 2)
        lo = (ql & 0x0F0F0F0F) | (((qh >> shift) & 0x03030303) << 4)
        hi = ((ql >> 4) & 0x0F0F0F0F) | (((qh >> (shift + 4)) & 0x03030303) << 4)
        a = xq + c * 64 + 32 * h + 4 * g + t
        xm = c * 256 < K
        d_lo = tl.sum(dot4(lo, tl.load(a, mask=xm, other=0), ASM), axis=4).to(tl.float32)  # [BN, CPI, 2, 4]
        d_hi = tl.sum(dot4(hi, tl.load(a + 16, mask=xm, other=0), ASM), axis=4).to(tl.float32)
        cb = c0 + c4
        okc = cb * 256 < K
        sub = cb * 16 + 8 * h4 + g4  # 16-element sub-blocks of the low nibbles; + 4 for the high
        dot_lo = tl.load(xd + sub // 2, mask=okc, other=0.0) * d_lo - 32.0 * tl.load(xs + sub, mask=okc, other=0.0)
        dot_hi = tl.load(xd + (sub + 4) // 2, mask=okc, other=0.0) * d_hi \
            - 32.0 * tl.load(xs + sub + 4, mask=okc, other=0.0)
        sc_lo, sc_hi = q6_k_scales(w + r4 + cb * 105, m4 & okc, h4, g4)
        acc += tl.sum(tl.sum(tl.sum(sc_lo * dot_lo + sc_hi * dot_hi, axis=3), axis=2), axis=1)
    return acc


# ----------------------------------------------------------------------------- low-bit types
# As llama.cpp's vecdotq does for them: each 4 elements' codes become one int32 word of signed
# bytes (lattice entries are read as words of gguf's grid table, their signs applied to the
# word), one ``dot4`` with the activation's word, and the sub-block's scale (16 or 32 elements)
# applied to the integer sum: sum_k w x = scale * xd * sum_k code * xq.

@triton.jit
def _signed_word(g, bits):
    """The four bytes of ``g`` (each 1..127) negated where bits 0-3 of ``bits`` are set."""
    ones = (bits * 0x00204081) & 0x01010101  # bit j -> byte j
    return (g ^ (ones * 255)) + ones


@triton.jit
def _ksign_bits(grids, sign_index, half):
    """Four sign bits (of elements 4 half .. +3 of a group of 8) from ``ksigns[sign_index]``."""
    return (tl.load(grids + _KSIGNS + sign_index).to(tl.int32) >> (4 * half)) & 15


@triton.jit
def _grid_word(grids, at: tl.constexpr, entry, words: tl.constexpr, half):
    """Word ``half`` of lattice entry ``entry`` (``words`` int32 words each) of the grid at ``at``."""
    return tl.load(grids.to(tl.pointer_type(tl.int32)) + at // 4 + entry * words + half)


@triton.jit
def _low_bit_words(QTYPE: tl.constexpr, b, v, rmask, grids):
    """Words ``[BN, 64]`` of the signed codes of elements 4v .. 4v + 3 of the 256-element blocks
    at byte pointers ``b [BN, 1]`` (Q3_K's codes are stored + 4: 0..7)."""
    g8 = v // 2
    h = v % 2
    if QTYPE == 16:  # IQ2_XXS: sub-block s = v // 8: grid bytes @2 + 8s, aux u32 @2 + 8s + 4
        at = b + 2 + 8 * (v // 8)
        aux = _u32(at + 4, rmask)
        g = _grid_word(grids, _IQ2XXS, _u8(at + g8 % 4, rmask), 2, h)
        return _signed_word(g, _ksign_bits(grids, (aux >> (7 * (g8 % 4))) & 127, h))
    elif QTYPE == 17:  # IQ2_XS: u16 per group of 8 @2: 9-bit index, 7-bit ksigns index
        q16 = _u8(b + 2 + 2 * g8, rmask) | (_u8(b + 3 + 2 * g8, rmask) << 8)
        return _signed_word(_grid_word(grids, _IQ2XS, q16 & 511, 2, h), _ksign_bits(grids, q16 >> 9, h))
    elif QTYPE == 22:  # IQ2_S: index bytes @2, sign bytes @34, high index bits @66
        idx = _u8(b + 2 + g8, rmask) | (((_u8(b + 66 + g8 // 4, rmask) >> (2 * (g8 % 4))) & 3) << 8)
        return _signed_word(_grid_word(grids, _IQ2S, idx, 2, h), (_u8(b + 34 + g8, rmask) >> (4 * h)) & 15)
    elif QTYPE == 18:  # IQ3_XXS: an index byte per word @2, aux u32 per sub-block @66
        aux = _u32(b + 66 + 4 * (v // 8), rmask)
        g = _grid_word(grids, _IQ3XXS, _u8(b + 2 + v, rmask), 1, 0)
        return _signed_word(g, _ksign_bits(grids, (aux >> (7 * (g8 % 4))) & 127, h))
    elif QTYPE == 21:  # IQ3_S: index bytes @2, index bit 8 @66, sign bits @74
        idx = _u8(b + 2 + v, rmask) | (((_u8(b + 66 + v // 8, rmask) >> (v % 8)) & 1) << 8)
        return _signed_word(_grid_word(grids, _IQ3S, idx, 1, 0), (_u8(b + 74 + g8, rmask) >> (4 * h)) & 15)
    elif QTYPE == 10:  # Q2_K: elements 128i + 32j + m are bits 2j of qs[32i + m] @16
        return (_u32(b + 16 + 32 * (v // 32) + 4 * (v % 8), rmask) >> (2 * ((v % 32) // 8))) & 0x03030303
    else:  # Q3_K: low bits as Q2_K @32, bit 4i + j of hmask[m] @0 the third
        tl.static_assert(QTYPE == 11, "q8dot has no int8 words for this quant type")
        j = (v % 32) // 8
        lo = (_u32(b + 32 + 32 * (v // 32) + 4 * (v % 8), rmask) >> (2 * j)) & 0x03030303
        hb = (_u32(b + 4 * (v % 8), rmask) >> (4 * (v // 32) + j)) & 0x01010101
        return lo | (hb << 2)


@triton.jit
def _iq1_dots(QTYPE: tl.constexpr, b, v, rmask, a, grids, ASM: tl.constexpr):
    """IQ1_S / IQ1_M: 8 x the integer dot of each word's lattice values (-1, 0, 1) with the
    activation's, plus or minus (the group's delta sign) the sum of its activation codes: a
    weight is (grid + delta) with delta = +-1/8, so this is 8 x sum (grid + delta) x code."""
    g8 = v // 2
    if QTYPE == 19:  # IQ1_S: index bytes @2, u16 per sub-block of 32 @34 (index bits 3j, sign 15)
        qh = _u8(b + 34 + 2 * (v // 8), rmask) | (_u8(b + 35 + 2 * (v // 8), rmask) << 8)
        idx = _u8(b + 2 + g8, rmask) | (((qh >> (3 * (g8 % 4))) & 7) << 8)
        neg = (qh >> 15) & 1
    else:  # IQ1_M: index bytes @0, a nibble per group @32 (index bits, bit 3 the sign)
        qn = (_u8(b + 32 + g8 // 2, rmask) >> (4 * (g8 % 2))) & 15
        idx = _u8(b + g8, rmask) | ((qn & 7) << 8)
        neg = qn >> 3
    g = _grid_word(grids, _IQ1S, idx, 2, v % 2)
    return 8 * dot4(g, a, ASM) + (1 - 2 * neg) * dot4(tl.full(g.shape, 0x01010101, tl.int32), a, ASM)


@triton.jit
def low_bit_rows_q8(QTYPE: tl.constexpr, w, rows, rmask, xq, xd, xs, K, BN: tl.constexpr, CPI: tl.constexpr,
                    ASM: tl.constexpr, grids):
    """[BN] dots of the rows at byte offsets ``rows [BN, 1]`` of ``w`` (uint8) with one
    quantized activation row, for the types of ``LOW_BIT_Q8``; CPI chunks of 256 per iteration
    (more bytes in flight)."""
    TS: tl.constexpr = 84 if QTYPE == 10 else 110 if QTYPE == 11 or QTYPE == 21 else 66 if QTYPE == 16 else \
        74 if QTYPE == 17 else 82 if QTYPE == 22 else 50 if QTYPE == 19 else 56 if QTYPE == 29 else 98
    NS: tl.constexpr = 16 if QTYPE == 10 or QTYPE == 11 or QTYPE == 17 or QTYPE == 22 or QTYPE == 29 else 8
    cc = tl.arange(0, CPI)[None, :, None]
    v = tl.arange(0, 64)[None, None, :]
    s = tl.arange(0, NS)[None, None, :]
    rows3 = tl.reshape(rows, [BN, 1, 1])
    rmask3 = tl.reshape(rmask, [BN, 1, 1])
    acc = tl.zeros([BN], dtype=tl.float32)
    for c0 in range(0, K // 256, CPI):
        c = c0 + cc  # [1, CPI, 1]
        ok = c * 256 < K
        m = rmask3 & ok
        b = w + rows3 + c * TS  # [BN, CPI, 1]
        a = tl.load(xq + c * 64 + v, mask=ok, other=0)
        if QTYPE == 19 or QTYPE == 29:
            dots = _iq1_dots(QTYPE, b, v, m, a, grids, ASM)
        else:
            dots = dot4(_low_bit_words(QTYPE, b, v, m, grids), a, ASM)
        dots = tl.sum(tl.reshape(dots, [BN, CPI, NS, 64 // NS]), axis=3).to(tl.float32)  # per sub-block
        xsc = tl.load(xd + c * 8 + s * 8 // NS, mask=ok, other=0.0)  # the activation scale of each sub-block
        if QTYPE == 10:  # Q2_K: d * sc * code - dmin * mn, scales[16] @0, d @80, dmin @82
            sc = _u8(b + s, m)
            part = _f16(b + 80, m) * (sc & 15).to(tl.float32) * xsc * dots - \
                _f16(b + 82, m) * (sc >> 4).to(tl.float32) * tl.load(xs + c * 16 + s, mask=ok, other=0.0)
        elif QTYPE == 11:  # Q3_K: d * (sc - 32) * (code - 4), 6-bit scales @96, d @108
            sc = ((_u8(b + 96 + s % 8, m) >> (4 * (s // 8))) & 15) | \
                (((_u8(b + 104 + s % 4, m) >> (2 * (s // 4))) & 3) << 4)
            part = _f16(b + 108, m) * (sc - 32).to(tl.float32) * \
                (xsc * dots - 4.0 * tl.load(xs + c * 16 + s, mask=ok, other=0.0))
        elif QTYPE == 16:  # IQ2_XXS: d (0.5 + aux >> 28) / 4 per 32
            part = _f16(b, m) * (0.5 + ((_u32(b + 6 + 8 * s, m) >> 28) & 15).to(tl.float32)) * 0.25 * xsc * dots
        elif QTYPE == 18:  # IQ3_XXS: d (0.5 + aux >> 28) / 2 per 32
            part = _f16(b, m) * (0.5 + ((_u32(b + 66 + 4 * s, m) >> 28) & 15).to(tl.float32)) * 0.5 * xsc * dots
        elif QTYPE == 19:  # IQ1_S: d (2 sc + 1) / 8, sc = bits 12-14 of the sub-block's u16 @34
            part = _f16(b, m) * (2 * ((_u8(b + 35 + 2 * s, m) >> 4) & 7) + 1).to(tl.float32) * 0.125 * xsc * dots
        elif QTYPE == 29:  # IQ1_M: d (2 sc + 1) / 8, 3-bit sc per 16 in u16s @48, d their top nibbles
            u = _u8(b + 48 + 2 * (s // 4), m) | (_u8(b + 49 + 2 * (s // 4), m) << 8)
            part = iq1_m_d(b, m) * (2 * ((u >> (3 * (s % 4))) & 7) + 1).to(tl.float32) * 0.125 * xsc * dots
        elif QTYPE == 21:  # IQ3_S: d (1 + 2 sc), a nibble per 32 @106
            sc = (_u8(b + 106 + s // 2, m) >> (4 * (s % 2))) & 15
            part = _f16(b, m) * (1 + 2 * sc).to(tl.float32) * xsc * dots
        else:  # IQ2_XS / IQ2_S: d (0.5 + sc) / 4, a nibble per 16 @66 / @74
            part = iq2_scale(b, 66 if QTYPE == 17 else 74, s, m) * xsc * dots
        acc += tl.sum(tl.sum(part, axis=2), axis=1)
    return acc


@triton.jit
def row_dot_q8(QTYPE: tl.constexpr, w_bytes, rows, rmask, row_bytes, xq, xd, xs, K, BN: tl.constexpr,
               CPI: tl.constexpr, ASM: tl.constexpr, grids):
    """[BN] dots of rows ``rows [BN,1,1,1]`` (row indices) of a byte pointer ``w_bytes`` whose
    rows are ``row_bytes`` long, for the MoE pools (uint8): the pointer is retyped here."""
    if QTYPE == 12:
        return q4_k_rows_q8(w_bytes.to(tl.pointer_type(tl.int32)), rows.to(tl.int64) * (row_bytes // 4), rmask,
                            xq, xd, xs, K, BN, CPI, ASM)
    elif QTYPE == 14:
        return q6_k_rows_q8(w_bytes.to(tl.pointer_type(tl.int16)), rows.to(tl.int64) * (row_bytes // 2), rmask,
                            xq, xd, xs, K, BN, CPI, ASM)
    else:
        return low_bit_rows_q8(QTYPE, w_bytes, tl.reshape(rows, [BN, 1]).to(tl.int64) * row_bytes,
                               tl.reshape(rmask, [BN, 1]), xq, xd, xs, K, BN, CPI, ASM, grids)


def chunks_per_iteration(K: int, cap: int = 16) -> int:
    """Chunks of 256 a one-token program loads per loop iteration: all of K up to ``cap``
    (a power of two). Loading a row's whole K at once keeps the most bytes in flight: the
    one-token kernels wait on memory latency, with few loads outstanding per program."""
    return min(cap, 1 << max(0, (K // 256 - 1).bit_length()))
