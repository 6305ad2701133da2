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
vecdotq does, and take the same int8 activation. They read their blocks as Q4_K does: each field
loaded once in 16- or 32-bit units, cut up with shifts in registers, one gather per lattice
entry (8 weights for the IQ2/IQ1 lattices); byte-by-byte loads with a table lookup per 4 weights
issued 2-4x more load instructions per weight (see the section's comment).

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
from .blocks import _IQ1S, _IQ2S, _IQ2XS, _IQ2XXS, _IQ3S, _IQ3XXS, Q4_K, Q6_K, _ksign, k_scale_min
from gguf.constants import GGMLQuantizationType as _T
from sparkpack.formats.quant_grids import GRID_AT, GRID_WIDTH, KSIGNS

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
# The unit the low-bit kernels load their blocks in: 32-bit words where every block is 4-aligned
# (Q2_K's 84 bytes, IQ1_M's 56), else 16-bit halves (all the others' sizes are even).
LOW_BIT_UNIT = {q: 4 if q in (int(_T.Q2_K), int(_T.IQ1_M)) else 2 for q in LOW_BIT_Q8}
# What the kernels assume of gguf's tables instead of reading them: ksigns[i] is i with the
# parity of its bits as bit 7 (``_ksign``), and each 8-wide lattice starts on an 8-byte boundary
# (``_entry8``'s int64 gathers; the table itself is a fresh allocation).
if any(int(KSIGNS[i]) != i | (bin(i).count("1") & 1) << 7 for i in range(128)) or \
        any(GRID_AT[n] % 8 for n, w in GRID_WIDTH.items() if w == 8):
    raise ImportError("gguf's ksigns or lattice layout is not what q8dot's low-bit kernels compute")


class Int8Rows(NamedTuple):
    """Rows ``[T, K]`` quantized for the int8 products (see the module docstring). A kernel that
    writes an activation row can return this beside it (``new_q8`` / ``store_q8``), and the
    products that read the row then skip their own ``quantize`` launch."""

    q: torch.Tensor  # int32 [T, K/4]: the int8 codes, four to a word (8-byte aligned: eight at a time)
    d: torch.Tensor  # fp32 [T, K/32]: block scales (x ~ d * code)
    s: torch.Tensor  # fp32 [T, K/16]: d times the sum of the codes of each 16 elements


def check_codes(q: torch.Tensor) -> None:
    """The low-bit kernels load eight activation codes as one int64: ``Int8Rows.q`` must start
    8-byte aligned (its rows then are too: K is a multiple of 32). Fresh tensors always are."""
    if q.data_ptr() % 8:
        raise ValueError("int8 activation codes must start 8-byte aligned")


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
    with rows (and slots) aligned to the unit they load (4 bytes for Q4_K, 2 for Q6_K, the
    low-bit types' ``LOW_BIT_UNIT``)."""
    if int(qtype) not in Q8_TYPES:
        return False
    unit = 4 if int(qtype) == Q4_K else 2 if int(qtype) == Q6_K else LOW_BIT_UNIT[int(qtype)]
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
    masked). Shared by ``quantize_kernel`` and the kernels that produce an activation and its
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
def quantize_kernel(x, xq, xd, xs, K, stride_x, BLOCKS: tl.constexpr, PDL: tl.constexpr):
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
        quantize_kernel[(T, triton.cdiv(K // 32, blocks))](x, xq, xd, xs, K, x.stride(0), BLOCKS=blocks,
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
# bytes, one ``dot4`` with the activation's word, and the sub-block's scale (16 or 32 elements)
# applied to the integer sum: sum_k w x = scale * xd * sum_k code * xq.
#
# How the bytes are read (the Q4_K kernel is the model): a block is loaded in its widest aligned
# unit (``LOW_BIT_UNIT``: 16-bit halves, since most of these blocks are 2-aligned only; 32-bit
# words for Q2_K and IQ1_M), each field of a sub-block once, and the per-group fields (grid
# indices, sign bits, index high bits, scales) are cut out of those registers with shifts. The
# lattice types work on one 32-element sub-block per tensor element and unroll its groups of
# eight (``tl.static_range``): an 8-wide lattice entry is one int64 gather (two words), a 4-wide
# one an int32 gather; ksigns are computed (bit 7 = parity of the 7 stored bits: gguf's table,
# checked at import by ``formats.quant_grids``) instead of looked up. Per 32 weights of IQ2_XXS
# that is 4 halves + 4 gathers + 8 activation words (~0.5 loads a weight, like Q4_K's) where
# the byte-wise version issued ~2.2.

@triton.jit
def _half(b, at, m):
    """Half ``at`` of the blocks at int16 pointers ``b``, unsigned, as int32."""
    return tl.load(b + at, mask=m, other=0).to(tl.int32) & 0xFFFF


@triton.jit
def _pair(b, at, m):
    """The little-endian 32-bit word of halves ``at`` and ``at + 1`` (a 2-aligned u32 field)."""
    return _half(b, at, m) | (tl.load(b + at + 1, mask=m, other=0).to(tl.int32) << 16)


@triton.jit
def _f16_of(bits):
    """An f16 given by the low 16 bits of an int32, as fp32."""
    return (bits & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _signed_word(g, bits):
    """The four bytes of ``g`` (each 1..127) negated where bits 0-3 of ``bits`` are set."""
    ones = ((bits & 15) * 0x00204081) & 0x01010101  # bit j -> byte j
    return (g ^ (ones * 255)) + ones


@triton.jit
def _entry8(grids, at: tl.constexpr, entry):
    """The two words (elements 0-3, 4-7) of entry ``entry`` of the 8-wide lattice at byte ``at``:
    one int64 gather."""
    g = tl.load(grids.to(tl.pointer_type(tl.int64)) + at // 8 + entry)
    return g.to(tl.int32), (g >> 32).to(tl.int32)


@triton.jit
def _entry4(grids, at: tl.constexpr, entry):
    """Entry ``entry`` (one word) of the 4-wide lattice at byte ``at``."""
    return tl.load(grids.to(tl.pointer_type(tl.int32)) + at // 4 + entry)


@triton.jit
def _dot8(lo, hi, x, ASM: tl.constexpr):
    """Dot of the words of eight codes with eight activation codes ``x`` (int64: one load)."""
    return dot4(lo, x.to(tl.int32), ASM) + dot4(hi, (x >> 32).to(tl.int32), ASM)


@triton.jit
def _lattice8_dot(grids, at: tl.constexpr, entry, signs, a, ok, ASM: tl.constexpr):
    """A group of eight: lattice entry ``entry`` with sign bits ``signs`` (bit j: element j
    negative) times the activation words at ``a``."""
    lo, hi = _entry8(grids, at, entry)
    return _dot8(_signed_word(lo, signs), _signed_word(hi, signs >> 4), tl.load(a, mask=ok, other=0), ASM)


@triton.jit
def _iq2_xxs_sub(b, s, m, a, ok, grids, ASM: tl.constexpr):
    # block_iq2_xxs as 33 halves: d @0; sub-block s: halves 1 + 4s, 2 + 4s its four grid
    # indices (a byte per group of 8), 3 + 4s, 4 + 4s the aux u32 (ksigns indices at bits
    # 0, 7, 14, 21, scale at 28): d (0.5 + sc) / 4 * sum grid * sign * x.
    idx = _pair(b, 1 + 4 * s, m)
    aux = _pair(b, 3 + 4 * s, m)
    dot = tl.zeros(idx.shape, dtype=tl.int32)
    for g in tl.static_range(4):
        dot += _lattice8_dot(grids, _IQ2XXS, (idx >> (8 * g)) & 255, _ksign(aux >> (7 * g)), a + g, ok, ASM)
    return _f16_of(_half(b, 0, m)) * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.25 * dot.to(tl.float32)


@triton.jit
def _iq2_xs_s_sub(QTYPE: tl.constexpr, b, s, m, a, ok, grids, ASM: tl.constexpr):
    # IQ2_XS (17), block_iq2_xs as 37 halves: d @0, group g's u16 @1 + g (9-bit grid index,
    # 7-bit ksigns index above it), the scale byte of sub-block s in halves 33-36.
    # IQ2_S (22), block_iq2_s as 41 halves: d @0, low index bytes (one per group of 8) @1 + 2s,
    # sign bytes @17 + 2s, index bits 8-9 in byte s of halves 33-36 (2 bits a group), the scale
    # byte of sub-block s in halves 37-40. Both: d (0.5 + sc) / 4, a scale nibble per 16 elements.
    if QTYPE == 22:
        idx = _pair(b, 1 + 2 * s, m)
        sign = _pair(b, 17 + 2 * s, m)
        qh = _half(b, 33 + s // 2, m) >> (8 * (s % 2))
    lo16 = tl.zeros(s.shape, dtype=tl.int32) + tl.zeros(b.shape, dtype=tl.int32)
    hi16 = lo16
    for g in tl.static_range(4):
        if QTYPE == 17:
            q16 = _half(b, 1 + 4 * s + g, m)
            dot = _lattice8_dot(grids, _IQ2XS, q16 & 511, _ksign(q16 >> 9), a + g, ok, ASM)
        else:
            entry = ((idx >> (8 * g)) & 255) | (((qh >> (2 * g)) & 3) << 8)
            dot = _lattice8_dot(grids, _IQ2S, entry, sign >> (8 * g), a + g, ok, ASM)
        if g < 2:
            lo16 += dot
        else:
            hi16 += dot
    sc = _half(b, (33 if QTYPE == 17 else 37) + s // 2, m) >> (8 * (s % 2))
    return _f16_of(_half(b, 0, m)) * 0.25 * ((0.5 + (sc & 15).to(tl.float32)) * lo16.to(tl.float32) +
                                             (0.5 + ((sc >> 4) & 15).to(tl.float32)) * hi16.to(tl.float32))


@triton.jit
def _iq3_xxs_sub(b, s, m, a, ok, grids, ASM: tl.constexpr):
    # block_iq3_xxs as 49 halves: d @0, sub-block s's eight grid indices (a byte per group of 4)
    # @1 + 4s .. 4 + 4s, its aux u32 @33 + 2s (ksigns indices at 0, 7, 14, 21, scale at 28):
    # d (0.5 + sc) / 2 * sum grid * sign * x.
    aux = _pair(b, 33 + 2 * s, m)
    dot = tl.zeros(aux.shape, dtype=tl.int32)
    for h in tl.static_range(2):
        idx = _pair(b, 1 + 4 * s + 2 * h, m)
        for g in tl.static_range(2):
            signs = _ksign(aux >> (7 * (2 * h + g)))
            lo = _signed_word(_entry4(grids, _IQ3XXS, (idx >> (16 * g)) & 255), signs)
            hi = _signed_word(_entry4(grids, _IQ3XXS, (idx >> (16 * g + 8)) & 255), signs >> 4)
            dot += _dot8(lo, hi, tl.load(a + 2 * h + g, mask=ok, other=0), ASM)
    return _f16_of(_half(b, 0, m)) * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.5 * dot.to(tl.float32)


@triton.jit
def _iq3_s_sub(b, s, m, a, ok, grids, ASM: tl.constexpr):
    # block_iq3_s as 55 halves: d @0, sub-block s's eight low index bytes (one per group of 4)
    # @1 + 4s .. 4 + 4s, their index bit 8 in byte s of halves 33-36, its 32 sign bits @37 + 2s,
    # its scale nibble in byte s // 2 of halves 53-54: d (1 + 2 sc) * sum grid * sign * x.
    qh = _half(b, 33 + s // 2, m) >> (8 * (s % 2))
    sign = _pair(b, 37 + 2 * s, m)
    dot = tl.zeros(sign.shape, dtype=tl.int32)
    for h in tl.static_range(2):
        idx = _pair(b, 1 + 4 * s + 2 * h, m)
        for g in tl.static_range(2):
            j = 4 * h + 2 * g  # the sub-block's group of 4 (word) of the low half
            lo = _entry4(grids, _IQ3S, ((idx >> (16 * g)) & 255) | (((qh >> j) & 1) << 8))
            hi = _entry4(grids, _IQ3S, ((idx >> (16 * g + 8)) & 255) | (((qh >> (j + 1)) & 1) << 8))
            signs = sign >> (4 * j)
            x = tl.load(a + j // 2, mask=ok, other=0)
            dot += _dot8(_signed_word(lo, signs), _signed_word(hi, signs >> 4), x, ASM)
    sc = (_half(b, 53 + s // 4, m) >> (4 * (s % 4))) & 15
    return _f16_of(_half(b, 0, m)) * (1 + 2 * sc).to(tl.float32) * dot.to(tl.float32)


@triton.jit
def _iq1_dot(grids, entry, neg, a, ok, ASM: tl.constexpr):
    """A group of eight IQ1 weights (lattice -1/0/1 plus a delta of -+1/8, ``neg`` its sign) times
    the activation words at ``a``, times 8 (an integer): 8 sum grid x + -+ sum x."""
    lo, hi = _entry8(grids, _IQ1S, entry)
    ones = tl.full(lo.shape, 0x01010101, tl.int32)
    x = tl.load(a, mask=ok, other=0)
    return 8 * _dot8(lo, hi, x, ASM) + (1 - 2 * neg) * _dot8(ones, ones, x, ASM)


@triton.jit
def _iq1_s_sub(b, s, m, a, ok, grids, ASM: tl.constexpr):
    # block_iq1_s as 25 halves: d @0, low index bytes (a byte per group of 8) @1 + 2s, the
    # sub-block's u16 @17 + s (index bits 8-10 of group g at 3g, scale at 12, delta sign at 15):
    # d (2 sc + 1) * sum (grid + delta) x.
    idx = _pair(b, 1 + 2 * s, m)
    qh = _half(b, 17 + s, m)
    dot = tl.zeros(idx.shape, dtype=tl.int32)
    for g in tl.static_range(4):
        dot += _iq1_dot(grids, ((idx >> (8 * g)) & 255) | (((qh >> (3 * g)) & 7) << 8), qh >> 15, a + g, ok,
                        ASM)
    return _f16_of(_half(b, 0, m)) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32) * 0.125 * dot.to(tl.float32)


@triton.jit
def _iq1_m_sub(b, s, m, a, ok, grids, ASM: tl.constexpr):
    # block_iq1_m as 14 words: low index bytes (a byte per group of 8) word s, a nibble per group
    # @32 (index bits 8-10, bit 3 the delta's sign: half s % 2 of word 8 + s // 2), scales u16[4]
    # words 12-13 (3 bits per 16 elements at 3 (j % 4) of u16 j // 4; d = the u16s' top nibbles).
    idx = tl.load(b + s, mask=m, other=0)
    qn = tl.load(b + 8 + s // 2, mask=m, other=0) >> (16 * (s % 2))
    lo16 = tl.zeros(idx.shape, dtype=tl.int32)
    hi16 = lo16
    for g in tl.static_range(4):
        n = qn >> (4 * g)
        dot = _iq1_dot(grids, ((idx >> (8 * g)) & 255) | ((n & 7) << 8), (n >> 3) & 1, a + g, ok, ASM)
        if g < 2:
            lo16 += dot
        else:
            hi16 += dot
    w12 = tl.load(b + 12, mask=m, other=0)
    w13 = tl.load(b + 13, mask=m, other=0)
    d = _f16_of(((w12 >> 12) & 15) | (((w12 >> 28) & 15) << 4) | (((w13 >> 12) & 15) << 8) | (((w13 >> 28) & 15) << 12))
    u = tl.where(s < 4, w12, w13) >> (16 * ((s // 2) % 2) + 6 * (s % 2))  # scale of sub-16 2s at bit 0, 2s + 1 at 3
    return d * 0.125 * ((2 * (u & 7) + 1).to(tl.float32) * lo16.to(tl.float32) +
                        (2 * ((u >> 3) & 7) + 1).to(tl.float32) * hi16.to(tl.float32))


@triton.jit
def _q2_q3_k_chunk(QTYPE: tl.constexpr, b, m, xq, xd, xs, c, ok, ASM: tl.constexpr):
    """Q2_K (words ``b``) / Q3_K (halves ``b``) chunks ``c [1, CPI, 1, 1, 1]``: [BN, CPI, 2, 2]
    partial sums. Element 128i + 32j + 4(4h + k) + e is bits 2j of byte e of code word 8i + 4h + k,
    in the 16-element sub-block 8i + 2j + h: each code word is loaded once and gives four words
    of codes (one per j) by shifts, as Q4_K's gives two."""
    i = tl.arange(0, 2)[None, None, :, None, None]
    h = tl.arange(0, 2)[None, None, None, :, None]
    k = tl.arange(0, 4)[None, None, None, None, :]
    mw = 4 * h + k
    i4 = tl.reshape(i, [1, 1, 2, 1])
    h4 = tl.reshape(h, [1, 1, 1, 2])
    b4 = tl.reshape(b, [b.shape[0], b.shape[1], 1, 1])
    m4 = tl.reshape(m, [m.shape[0], m.shape[1], 1, 1])
    c4 = tl.reshape(c, [1, c.shape[1], 1, 1])
    ok4 = tl.reshape(ok, [1, ok.shape[1], 1, 1])
    if QTYPE == 10:
        # block_q2_K as 21 words: scales[16] words 0-3 (low nibble scale, high nibble min of
        # sub-block s in byte s), code words 4-19, d | dmin << 16 word 20: d sc code - dmin mn.
        qs = tl.load(b + 4 + 8 * i + mw, mask=m, other=0)
        dd = tl.load(b4 + 20, mask=m4, other=0)
    else:
        # block_q3_K as 55 halves: hmask[32] halves 0-15 (bit 4i + j of byte m: the code's third
        # bit), code words at halves 16 + 2 (8i + w), scales[12] halves 48-53, d half 54;
        # d (sc - 32) (code - 4), the 6-bit scale of sub-block s: nibble s // 8 of byte s % 8,
        # high bits 2 (s // 4) of byte 8 + s % 4.
        qs = _pair(b, 16 + 2 * (8 * i + mw), m)
        hm = _pair(b, 2 * mw, m)
        dd = _half(b4, 54, m4)
    acc = tl.zeros([b.shape[0], b.shape[1], 2, 2], dtype=tl.float32)
    for j in tl.static_range(4):
        code = (qs >> (2 * j)) & 0x03030303
        if QTYPE == 11:
            code = code | (((hm >> (4 * i + j)) & 0x01010101) << 2)
        a = tl.load(xq + c * 64 + 32 * i + 8 * j + mw, mask=ok, other=0)
        dot = tl.sum(dot4(code, a, ASM), axis=4).to(tl.float32)  # [BN, CPI, 2, 2]: sub-blocks 8i + 2j + h
        x32 = tl.load(xd + c4 * 8 + 4 * i4 + j, mask=ok4, other=0.0)
        x16 = tl.load(xs + c4 * 16 + 8 * i4 + 2 * j + h4, mask=ok4, other=0.0)
        if QTYPE == 10:
            sc = tl.load(b4 + 2 * i4 + j // 2, mask=m4, other=0) >> (8 * (2 * (j % 2) + h4))
            acc += _f16_of(dd) * (sc & 15).to(tl.float32) * x32 * dot - \
                _f16_of(dd >> 16) * ((sc >> 4) & 15).to(tl.float32) * x16
        else:
            sc = ((_half(b4, 48 + j, m4) >> (8 * h4 + 4 * i4)) & 15) | \
                (((_half(b4, 52 + j % 2, m4) >> (8 * h4 + 2 * (2 * i4 + j // 2))) & 3) << 4)
            acc += _f16_of(dd) * (sc - 32).to(tl.float32) * (x32 * dot - 4.0 * x16)
    return acc


@triton.jit
def low_bit_rows_q8(QTYPE: tl.constexpr, w, rows, rmask, xq, xd, xs, K, BN: tl.constexpr, CPI: tl.constexpr,
                    ASM: tl.constexpr, grids):
    """[BN] dots of the rows at byte offsets ``rows [BN, 1]`` of ``w`` (uint8, aligned to the
    type's ``LOW_BIT_UNIT``) with one quantized activation row, for the types of ``LOW_BIT_Q8``;
    CPI chunks of 256 per iteration (more bytes in flight)."""
    TS: tl.constexpr = 84 if QTYPE == 10 else 110 if QTYPE == 11 or QTYPE == 21 else 66 if QTYPE == 16 else \
        74 if QTYPE == 17 else 82 if QTYPE == 22 else 50 if QTYPE == 19 else 56 if QTYPE == 29 else 98
    UNIT: tl.constexpr = 4 if QTYPE == 10 or QTYPE == 29 else 2
    wu = w.to(tl.pointer_type(tl.int32 if UNIT == 4 else tl.int16))
    rows3 = tl.reshape(rows // UNIT, [BN, 1, 1])
    rmask3 = tl.reshape(rmask, [BN, 1, 1])
    acc = tl.zeros([BN], dtype=tl.float32)
    if QTYPE == 10 or QTYPE == 11:
        rows5 = tl.reshape(rows // UNIT, [BN, 1, 1, 1, 1])
        rmask5 = tl.reshape(rmask, [BN, 1, 1, 1, 1])
        cc = tl.arange(0, CPI)[None, :, None, None, None]
        for c0 in range(0, K // 256, CPI):
            c = c0 + cc
            ok = c * 256 < K
            part = _q2_q3_k_chunk(QTYPE, wu + rows5 + c * (TS // UNIT), rmask5 & ok, xq, xd, xs, c, ok, ASM)
            acc += tl.sum(tl.sum(tl.sum(part, axis=3), axis=2), axis=1)
    else:
        cc = tl.arange(0, CPI)[None, :, None]
        s = tl.arange(0, 8)[None, None, :]  # the 32-element sub-blocks of a chunk
        for c0 in range(0, K // 256, CPI):
            c = c0 + cc  # [1, CPI, 1]
            ok = c * 256 < K
            m = rmask3 & ok
            b = wu + rows3 + c * (TS // UNIT)  # [BN, CPI, 1]
            a = xq.to(tl.pointer_type(tl.int64)) + c * 32 + 4 * s  # its 32 activation codes (``check_codes``)
            if QTYPE == 16:
                part = _iq2_xxs_sub(b, s, m, a, ok, grids, ASM)
            elif QTYPE == 17 or QTYPE == 22:
                part = _iq2_xs_s_sub(QTYPE, b, s, m, a, ok, grids, ASM)
            elif QTYPE == 18:
                part = _iq3_xxs_sub(b, s, m, a, ok, grids, ASM)
            elif QTYPE == 21:
                part = _iq3_s_sub(b, s, m, a, ok, grids, ASM)
            elif QTYPE == 19:
                part = _iq1_s_sub(b, s, m, a, ok, grids, ASM)
            else:
                tl.static_assert(QTYPE == 29, "q8dot has no int8 kernel for this quant type")
                part = _iq1_m_sub(b, s, m, a, ok, grids, ASM)
            acc += tl.sum(tl.sum(part * tl.load(xd + c * 8 + s, mask=ok, other=0.0), axis=2), axis=1)
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
