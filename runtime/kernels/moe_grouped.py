"""Grouped mixture-of-experts kernels for prefill: (token, choice) pairs sorted by expert, each
program multiplying one block of an expert's pairs by a tile of its weights on tensor cores.

Why grouped: the one-token kernels (``moe.py``) unpack an expert's weights for every pair routed
to it; at 512 tokens that is ~16-32 unpacks of every expert per layer. Here the pairs are sorted
by expert into blocks of ``BLOCK_M`` rows of one expert (padded; built on the device in one
launch, ``group_pairs``, no host sync), and each program unpacks a weight tile once for its block.

Why sub-blocks (``_sub_*`` kernels, the K-quants and the low-bit types of ``SUB_TYPES``): the first grouped kernels (``_tile_*``,
kept for the other types) expanded each 256-element chunk of weights to ``scale * q - offset`` in
fp32, rounded it to bf16 and fed one ``tl.dot``: per weight a byte load, shifts, an int-to-float
conversion (a quarter-rate instruction), a multiply-add and a rounding, and at 512 tokens that
unpacking, not the bytes or the tensor cores, was ~3/4 of a prefill layer. The sub-block kernels
keep the K-quant structure instead, as llama.cpp's mmq does: for each sub-block (32 elements for
Q4_K/Q5_K, 16 for Q6_K) the integer codes themselves are the dot's operand and the sub-block's
scale and offset are applied to the fp32 product afterwards::

    sum_k w[n,k] a[k,m] = scale[n] * sum_k code[n,k] a[k,m] - offset[n] * sum_k a[k,m]

A code (0..63) becomes a bf16/f16 operand without a conversion: OR-ed into the mantissa of 128.0
(bf16) or 1024.0 (f16) it *is* ``bias + code``, exactly, and the bias comes off with the column
sums (``- scale * bias * sum_k a``). The low-bit types fit the same form: Q2_K/Q3_K codes are
0..3/0..7 per 16-element sub-block, and a lattice weight is its sub-block's scale times a signed
integer (grid * sign, or for IQ1 8 * grid +- 1, its delta of +-1/8 scaled by 8), stored as the
code ``v + 64`` with ``64 * scale`` in the offset. The products are exact (integer codes, no rounded weights),
so these kernels are more accurate than the expanded ones, not less. The weight tile is the dot's
first operand (``[BLOCK_N, KS] @ [KS, BLOCK_M]``): Hopper's wgmma wants 64 rows there and takes it
from registers, where the codes are made, and a block of an expert's pairs is often fewer than 64.

Residency never changes results: the arithmetic depends only on an expert's bytes, never on the
slot (``slots.py``) or pool they are read from.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf.constants import GGMLQuantizationType as T

from sparkpack.formats.quants import KERNEL_QUANTS

from . import pdl
from .pdl import wait_prior
from .blocks import (_IQ1S, _IQ2S, _IQ2XS, _IQ2XXS, _IQ3S, _IQ3XXS, Q4_K, Q5_K, Q6_K, _f16, _k_scale_min, _ksign,
                     _tile_dot, _u8, _u32, grid_table, iq1_m_d, iq2_scale)
from .slots import slot_base

# types with a sub-block kernel (the K-quants and the low-bit types: Q2_K, Q3_K, the IQ1-IQ3
# lattices); the others take the ``_tile_*`` kernels
SUB_TYPES = (Q4_K, Q5_K, Q6_K, *(int(q) for q in (T.Q2_K, T.Q3_K, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S,
                                                   T.IQ1_S, T.IQ1_M)))
GROUPED_MIN_PAIRS = 64  # (token, choice) pairs from which the grouped (prefill) kernels run
# dot operand kinds of the sub-block kernels: fp32 (exact ``ieee`` products: fp32 activations and
# Triton's interpreter, which gets bf16 tl.dot wrong), bf16, f16
OPER_F32, OPER_BF16, OPER_F16 = 0, 1, 2


# ----------------------------------------------------------------------------- sub-block kernels

@triton.jit
def _operand(code, OPER: tl.constexpr):
    """Integer codes (int32, 0..127) as an exact dot operand: ``code`` in fp32, ``128 + code`` in
    bf16, ``1024 + code`` in f16 (the code OR-ed into the mantissa: no conversion instruction)."""
    if OPER == 0:
        return code.to(tl.float32)
    elif OPER == 1:
        return (code | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return (code | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _sub_block(QTYPE: tl.constexpr, rows, nmask, c, ST: tl.constexpr, KS: tl.constexpr, grids):
    """Codes ``[BN, KS]`` (int32) of elements ``c*256 + ST*KS ...`` of the byte rows ``rows
    [BN, 1]``, with their sub-block's scale and offset ``[BN, 1]`` (value = scale * code - offset).
    ``KS`` divides the sub-block (the registry's ``sub``: 32 for Q4_K/Q5_K, 16 for Q6_K); everything
    but ``c`` is known at compile time, so the byte offsets and shifts below fold to constants.
    ``grids``: ``blocks.grid_table`` (the lattice types)."""
    kk = tl.arange(0, KS)[None, :]
    if QTYPE == 12:
        # block_q4_K (144 B): d @0, dmin @2, scales[12] @4, qs[128] @16; element 64i + 32h + l is
        # nibble h of qs[32i + l] (sub-block s = 2i + h)
        S: tl.constexpr = ST * KS // 32
        base = rows + c * 144
        b = _u8(base + 16 + (S // 2) * 32 + (ST * KS) % 32 + kk, nmask)
        code = (b >> (4 * (S % 2))) & 15
        sc, mn = _k_scale_min(base + 4, S, nmask)
        return code, _f16(base, nmask) * sc, _f16(base + 2, nmask) * mn
    elif QTYPE == 13:
        # block_q5_K (176 B): as Q4_K with qh[32] @16 and qs @48; the 5th bit of element 32s + l
        # is bit s of qh[l]
        S: tl.constexpr = ST * KS // 32
        L0: tl.constexpr = (ST * KS) % 32
        base = rows + c * 176
        b = _u8(base + 48 + (S // 2) * 32 + L0 + kk, nmask)
        qh = _u8(base + 16 + L0 + kk, nmask)
        code = ((b >> (4 * (S % 2))) & 15) | (((qh >> S) & 1) << 4)
        sc, mn = _k_scale_min(base + 4, S, nmask)
        return code, _f16(base, nmask) * sc, _f16(base + 2, nmask) * mn
    elif QTYPE == 14:
        # block_q6_K (210 B): ql[128] @0, qh[64] @128, int8 scales[16] @192, d @208; sub-blocks of
        # 16 (KS == 16, so ST is the sub-block). Element 128h + r: low 4 bits = nibble r // 64 of
        # ql[64h + r % 64], high 2 bits = bits 2 (r // 32) of qh[32h + r % 32]; value = code - 32.
        H: tl.constexpr = ST // 8
        R: tl.constexpr = (ST % 8) * 16
        base = rows + c * 210
        ql = _u8(base + 64 * H + R % 64 + kk, nmask)
        qh = _u8(base + 128 + 32 * H + R % 32 + kk, nmask)
        code = ((ql >> (4 * (R // 64))) & 15) | (((qh >> (2 * (R // 32))) & 3) << 4)
        sc = tl.load(base + 192 + ST, mask=nmask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        scale = _f16(base + 208, nmask) * sc
        return code, scale, 32.0 * scale
    elif QTYPE == 10 or QTYPE == 11:
        # block_q2_K (84 B) / block_q3_K (110 B), sub-blocks of 16 (KS == 16: ST is the sub-block):
        # element 16 ST + l is bits 2J of code byte 32H + M0 + l (H = ST // 8, J = (ST % 8) // 2,
        # M0 = 16 (ST % 2)); Q3_K's third bit is bit 4H + J of hmask[M0 + l] @0 (set: no -4).
        tl.static_assert(KS == 16, "Q2_K / Q3_K sub-steps are their 16-element sub-blocks")
        H: tl.constexpr = ST // 8
        J: tl.constexpr = (ST % 8) // 2
        M0: tl.constexpr = 16 * (ST % 2)
        if QTYPE == 10:  # scales[16] @0 (scale | min << 4), qs @16, d @80, dmin @82: d sc code - dmin mn
            base = rows + c * 84
            code = (_u8(base + 16 + 32 * H + M0 + kk, nmask) >> (2 * J)) & 3
            sc = _u8(base + ST, nmask)
            return code, _f16(base + 80, nmask) * (sc & 15).to(tl.float32), \
                _f16(base + 82, nmask) * (sc >> 4).to(tl.float32)
        else:  # hmask @0, qs @32, 6-bit scales @96 (minus 32), d @108: d (sc - 32) (code - 4)
            base = rows + c * 110
            code = ((_u8(base + 32 + 32 * H + M0 + kk, nmask) >> (2 * J)) & 3) | \
                (((_u8(base + M0 + kk, nmask) >> (4 * H + J)) & 1) << 2)
            sc = ((_u8(base + 96 + ST % 8, nmask) >> (4 * (ST // 8))) & 15) | \
                (((_u8(base + 104 + ST % 4, nmask) >> (2 * (ST // 4))) & 3) << 4)
            scale = _f16(base + 108, nmask) * (sc - 32).to(tl.float32)
            return code, scale, 4.0 * scale
    else:
        # the lattice types: weight = scale * v with v a signed integer (grid * sign; IQ1: 8 grid
        # +- 1, its delta times 8), |v| < 64: the code is v + 64 and the offset 64 * scale
        # (byte offsets: blocks.py's unpacking helpers of each type)
        e = ST * KS + kk  # elements of the chunk
        l = e % 32
        S: tl.constexpr = ST * KS // 32  # the 32-element sub-block (KS divides it)
        if QTYPE == 16:  # IQ2_XXS (66 B): sub-block S @2 + 8S: 4 index bytes, aux u32
            base = rows + c * 66
            aux = _u32(base + 6 + 8 * S, nmask)
            g = tl.load(grids + _IQ2XXS + _u8(base + 2 + 8 * S + l // 8, nmask) * 8 + l % 8).to(tl.int32)
            v = g * (1 - 2 * ((_ksign(aux >> (7 * (l // 8))) >> (l % 8)) & 1))
            scale = _f16(base, nmask) * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.25
        elif QTYPE == 17:  # IQ2_XS (74 B, KS == 16): u16 per group @2, scale nibbles @66
            tl.static_assert(KS == 16, "its scales are per 16: ST is the sub-block")
            base = rows + c * 74
            q16 = _u8(base + 2 + 2 * (e // 8), nmask) | (_u8(base + 3 + 2 * (e // 8), nmask) << 8)
            g = tl.load(grids + _IQ2XS + (q16 & 511) * 8 + e % 8).to(tl.int32)
            v = g * (1 - 2 * ((_ksign(q16 >> 9) >> (e % 8)) & 1))
            scale = iq2_scale(base, 66, ST, nmask)
        elif QTYPE == 22:  # IQ2_S (82 B, KS == 16): index bytes @2, signs @34, high bits @66, scales @74
            tl.static_assert(KS == 16, "its scales are per 16: ST is the sub-block")
            base = rows + c * 82
            grp = e // 8
            idx = _u8(base + 2 + grp, nmask) | (((_u8(base + 66 + grp // 4, nmask) >> (2 * (grp % 4))) & 3) << 8)
            g = tl.load(grids + _IQ2S + idx * 8 + e % 8).to(tl.int32)
            v = g * (1 - 2 * ((_u8(base + 34 + grp, nmask) >> (e % 8)) & 1))
            scale = iq2_scale(base, 74, ST, nmask)
        elif QTYPE == 18:  # IQ3_XXS (98 B): index byte per 4 @2, aux u32 per sub-block @66
            base = rows + c * 98
            aux = _u32(base + 66 + 4 * S, nmask)
            g = tl.load(grids + _IQ3XXS + _u8(base + 2 + e // 4, nmask) * 4 + e % 4).to(tl.int32)
            v = g * (1 - 2 * ((_ksign(aux >> (7 * (l // 8))) >> (l % 8)) & 1))
            scale = _f16(base, nmask) * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.5
        elif QTYPE == 21:  # IQ3_S (110 B): index bytes @2, bit 8 @66, signs @74, scale nibbles @106
            base = rows + c * 110
            idx = _u8(base + 2 + e // 4, nmask) | (((_u8(base + 66 + S, nmask) >> (l // 4)) & 1) << 8)
            g = tl.load(grids + _IQ3S + idx * 4 + e % 4).to(tl.int32)
            v = g * (1 - 2 * ((_u8(base + 74 + e // 8, nmask) >> (e % 8)) & 1))
            sc = (_u8(base + 106 + S // 2, nmask) >> (4 * (S % 2))) & 15
            scale = _f16(base, nmask) * (1 + 2 * sc).to(tl.float32)
        elif QTYPE == 19:  # IQ1_S (50 B): index bytes @2, u16 per sub-block @34 (high bits, scale, sign)
            base = rows + c * 50
            qh = _u8(base + 34 + 2 * S, nmask) | (_u8(base + 35 + 2 * S, nmask) << 8)
            idx = _u8(base + 2 + e // 8, nmask) | (((qh >> (3 * (l // 8))) & 7) << 8)
            g = tl.load(grids + _IQ1S + idx * 8 + e % 8).to(tl.int8, bitcast=True).to(tl.int32)
            v = 8 * g + 1 - 2 * ((qh >> 15) & 1)
            scale = _f16(base, nmask) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32) * 0.125
        else:  # IQ1_M (56 B, KS == 16): index bytes @0, a nibble per group @32, scales u16[4] @48
            tl.static_assert(QTYPE == 29, "moe_grouped has no sub-block branch for this quant type")
            tl.static_assert(KS == 16, "its scales are per 16: ST is the sub-block")
            base = rows + c * 56
            grp = e // 8
            qn = (_u8(base + 32 + grp // 2, nmask) >> (4 * (grp % 2))) & 15
            g = tl.load(grids + _IQ1S + (_u8(base + grp, nmask) | ((qn & 7) << 8)) * 8 + e % 8)
            v = 8 * g.to(tl.int8, bitcast=True).to(tl.int32) + 1 - 2 * (qn >> 3)
            u = _u8(base + 48 + 2 * (ST // 4), nmask) | (_u8(base + 49 + 2 * (ST // 4), nmask) << 8)
            scale = iq1_m_d(base, nmask) * (2 * ((u >> (3 * (ST % 4))) & 7) + 1).to(tl.float32) * 0.125
        return v + 64, scale, 64.0 * scale


@triton.jit
def _act_sub(a_rows, mmask, k0, KS: tl.constexpr, OPER: tl.constexpr):
    """Activations ``[KS, BM]`` (columns ``k0 ...`` of the rows ``a_rows [BM, 1]``; masked pairs
    read 0) as the dot's second operand, and their per-pair sums ``[1, BM]`` in fp32. Loaded
    row-major (contiguous along K: vector loads) and transposed on the way to the tensor cores."""
    k = k0 + tl.arange(0, KS)[None, :]
    a = tl.load(a_rows + k, mask=mmask, other=0.0)
    if OPER == 0:
        a = a.to(tl.float32)
    elif OPER == 1:
        a = a.to(tl.bfloat16)
    else:
        a = a.to(tl.float16)
    return tl.trans(a), tl.sum(a.to(tl.float32), axis=1)[None, :]


@triton.jit
def _mma_sub(acc, QTYPE: tl.constexpr, rows, nmask, c, ST: tl.constexpr, KS: tl.constexpr, a, asum,
             OPER: tl.constexpr, grids):
    """``acc [BN, BM] +=`` one sub-step of weights times activations: codes on the tensor cores,
    then the sub-block's scale, offset and the operand's bias on the fp32 product."""
    code, scale, off = _sub_block(QTYPE, rows, nmask, c, ST, KS, grids)
    w = _operand(code, OPER)
    if OPER == 0:
        d = tl.dot(w, a, input_precision="ieee")
    else:
        d = tl.dot(w, a)
    bias: tl.constexpr = 0.0 if OPER == 0 else (128.0 if OPER == 1 else 1024.0)
    return acc + scale * d - (scale * bias + off) * asum


@triton.jit
def sub_gate_up_kernel(x_ptr, grids_ptr, pairs_ptr, block_expert_ptr, slot_ptr, gate_ptr, up_ptr, gate_h_ptr, up_h_ptr, h_ptr,
                        TOPK, N_EXPERT, N_FF, K, gate_slot_bytes, up_slot_bytes, up_row0, gate_row_bytes,
                        up_row_bytes, stride_x, GATE_QTYPE: tl.constexpr, UP_QTYPE: tl.constexpr,
                        HAS_HOST: tl.constexpr, OPER: tl.constexpr, KS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """``BLOCK_N`` rows of gate and up of one block's expert times the block's activation rows;
    ``h = silu(gate) * up`` stored per pair in ``h_ptr``'s dtype."""
    wait_prior(PDL)
    blk = tl.program_id(0)
    expert = tl.load(block_expert_ptr + blk)
    if expert < N_EXPERT:  # blocks past the last expert's are padding of the worst-case grid
        slot = tl.load(slot_ptr + expert).to(tl.int64)
        pair = tl.load(pairs_ptr + blk * BLOCK_M + tl.arange(0, BLOCK_M))  # -1: padding
        mmask = (pair >= 0)[None, :]
        amask = (pair >= 0)[:, None]
        a_rows = x_ptr + (tl.maximum(pair, 0) // TOPK).to(tl.int64)[:, None] * stride_x
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = (n < tl.where((slot >= 0) | HAS_HOST, N_FF, 0))[:, None]
        g_rows = slot_base(slot, gate_ptr, gate_h_ptr, gate_slot_bytes, HAS_HOST) + n.to(tl.int64)[:, None] * gate_row_bytes
        u_rows = slot_base(slot, up_ptr, up_h_ptr, up_slot_bytes, HAS_HOST) + \
            (n + up_row0).to(tl.int64)[:, None] * up_row_bytes
        g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for c in range(0, K // 256):
            for st in tl.static_range(256 // KS):
                a, asum = _act_sub(a_rows, amask, c * 256 + st * KS, KS, OPER)
                g = _mma_sub(g, GATE_QTYPE, g_rows, nmask, c, st, KS, a, asum, OPER, grids_ptr)
                u = _mma_sub(u, UP_QTYPE, u_rows, nmask, c, st, KS, a, asum, OPER, grids_ptr)
        h = g / (1.0 + tl.exp(-g)) * u
        tl.store(h_ptr + pair.to(tl.int64)[None, :] * N_FF + n[:, None], h.to(h_ptr.dtype.element_ty),
                 mask=mmask & (n[:, None] < N_FF))


@triton.jit
def sub_down_kernel(h_ptr, grids_ptr, pairs_ptr, block_expert_ptr, wts_ptr, slot_ptr, down_ptr, down_h_ptr, part_ptr,
                     N_EXPERT, N_EMBD, N_FF, down_slot_bytes, down_row_bytes, DOWN_QTYPE: tl.constexpr,
                     HAS_HOST: tl.constexpr, OPER: tl.constexpr, KS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """``BLOCK_N`` rows of one block's expert's down times the block's ``h`` rows, times each
    pair's routing weight, stored per pair (fp32)."""
    wait_prior(PDL)
    blk = tl.program_id(0)
    expert = tl.load(block_expert_ptr + blk)
    if expert < N_EXPERT:
        slot = tl.load(slot_ptr + expert).to(tl.int64)
        pair = tl.load(pairs_ptr + blk * BLOCK_M + tl.arange(0, BLOCK_M))
        mmask = (pair >= 0)[None, :]
        amask = (pair >= 0)[:, None]
        pair64 = tl.maximum(pair, 0).to(tl.int64)
        a_rows = h_ptr + pair64[:, None] * N_FF
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = (n < tl.where((slot >= 0) | HAS_HOST, N_EMBD, 0))[:, None]
        rows = slot_base(slot, down_ptr, down_h_ptr, down_slot_bytes, HAS_HOST) + n.to(tl.int64)[:, None] * down_row_bytes
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for c in range(0, N_FF // 256):
            for st in tl.static_range(256 // KS):
                a, asum = _act_sub(a_rows, amask, c * 256 + st * KS, KS, OPER)
                acc = _mma_sub(acc, DOWN_QTYPE, rows, nmask, c, st, KS, a, asum, OPER, grids_ptr)
        weight = tl.load(wts_ptr + pair64, mask=pair >= 0, other=0.0).to(tl.float32)
        tl.store(part_ptr + pair64[None, :] * N_EMBD + n[:, None], acc * weight[None, :],
                 mask=mmask & (n[:, None] < N_EMBD))


# ----------------------------------------------------------------------------- expanded-tile kernels

@triton.jit
def tile_gate_up_kernel(x_ptr, grids_ptr, pairs_ptr, block_expert_ptr, slot_ptr, gate_ptr, up_ptr, gate_h_ptr,
                            up_h_ptr, h_ptr, TOPK, N_EXPERT, N_FF, K, gate_slot_bytes, up_slot_bytes, up_row0,
                            gate_row_bytes, up_row_bytes, stride_x,
                            GATE_QTYPE: tl.constexpr, UP_QTYPE: tl.constexpr, HAS_HOST: tl.constexpr,
                            DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """One block of ``BLOCK_M`` pairs routed to one expert x ``BLOCK_N`` rows of its gate and up."""
    wait_prior(PDL)
    blk = tl.program_id(0)
    expert = tl.load(block_expert_ptr + blk)
    if expert < N_EXPERT:  # blocks past the last expert's are padding of the worst-case grid
        slot = tl.load(slot_ptr + expert).to(tl.int64)
        m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pairs_ptr + m)  # -1: padding row
        amask = pair[:, None] >= 0
        a_rows = x_ptr + (tl.maximum(pair, 0) // TOPK).to(tl.int64)[:, None] * stride_x
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n3 = n[:, None, None]
        rmask = n3 < tl.where((slot >= 0) | HAS_HOST, N_FF, 0)
        g_rows = slot_base(slot, gate_ptr, gate_h_ptr, gate_slot_bytes, HAS_HOST) + n3.to(tl.int64) * gate_row_bytes
        u_rows = slot_base(slot, up_ptr, up_h_ptr, up_slot_bytes, HAS_HOST) + (n3 + up_row0).to(tl.int64) * up_row_bytes
        g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for c in range(0, tl.cdiv(K, 256)):
            g = _tile_dot(GATE_QTYPE, g_rows, rmask, a_rows, amask, c, K, g, DOT_FP32, BLOCK_N, grids_ptr)
            u = _tile_dot(UP_QTYPE, u_rows, rmask, a_rows, amask, c, K, u, DOT_FP32, BLOCK_N, grids_ptr)
        h = g / (1.0 + tl.exp(-g)) * u
        tl.store(h_ptr + pair.to(tl.int64)[:, None] * N_FF + n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=amask & (n[None, :] < N_FF))


@triton.jit
def tile_down_kernel(h_ptr, grids_ptr, pairs_ptr, block_expert_ptr, wts_ptr, slot_ptr, down_ptr, down_h_ptr,
                         part_ptr, N_EXPERT, N_EMBD, N_FF, down_slot_bytes, down_row_bytes,
                         DOWN_QTYPE: tl.constexpr, HAS_HOST: tl.constexpr, DOT_FP32: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """One block of pairs x ``BLOCK_N`` rows of the expert's down, times each pair's weight."""
    wait_prior(PDL)
    blk = tl.program_id(0)
    expert = tl.load(block_expert_ptr + blk)
    if expert < N_EXPERT:
        slot = tl.load(slot_ptr + expert).to(tl.int64)
        m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pairs_ptr + m)
        amask = pair[:, None] >= 0
        pair64 = tl.maximum(pair, 0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n3 = n[:, None, None]
        rmask = n3 < tl.where((slot >= 0) | HAS_HOST, N_EMBD, 0)
        rows = slot_base(slot, down_ptr, down_h_ptr, down_slot_bytes, HAS_HOST) + n3.to(tl.int64) * down_row_bytes
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for c in range(0, tl.cdiv(N_FF, 256)):
            acc = _tile_dot(DOWN_QTYPE, rows, rmask, h_ptr + pair64[:, None] * N_FF, amask, c, N_FF, acc,
                            DOT_FP32, BLOCK_N, grids_ptr)
        weight = tl.load(wts_ptr + pair64, mask=pair >= 0, other=0.0).to(tl.float32)
        tl.store(part_ptr + pair64[:, None] * N_EMBD + n[None, :], acc * weight[:, None],
                 mask=amask & (n[None, :] < N_EMBD))


# ----------------------------------------------------------------------------- grouping

@triton.jit(do_not_specialize=["P", "N_BLOCKS"])
def group_pairs_kernel(ids_ptr, pairs_ptr, block_expert_ptr, counts_ptr, limit_ptr, P, TOPK, N_EXPERT, N_BLOCKS,
                        HAS_COUNT: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_P: tl.constexpr, BINS: tl.constexpr, PDL: tl.constexpr):
    """Program ``e < N_EXPERT`` places expert e's pairs; program ``N_EXPERT`` pads the unused tail.
    Every program counts all experts itself (a histogram of the ids, P small): no program waits
    for another, and every output element is written by exactly one program. ``HAS_LIMIT``: only
    the pairs of the first ``*limit_ptr`` tokens are counted (all are placed)."""
    wait_prior(PDL)
    if HAS_LIMIT:
        counted = tl.load(limit_ptr).to(tl.int32) * TOPK
    else:
        counted = P
    e = tl.program_id(0)
    hist = tl.zeros([BINS], dtype=tl.int32)
    for p0 in range(0, P, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        ids = tl.load(ids_ptr + offs, mask=offs < P, other=N_EXPERT).to(tl.int32)  # masked: a spare bin
        hist += tl.histogram(ids, BINS)
    bins = tl.arange(0, BINS)
    padded = tl.where(bins < N_EXPERT, (hist + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    if e == N_EXPERT:
        used = tl.sum(padded, axis=0)
        for r0 in range(used, N_BLOCKS * BLOCK_M, BLOCK_P):
            r = r0 + tl.arange(0, BLOCK_P)
            tl.store(pairs_ptr + r, tl.full([BLOCK_P], -1, tl.int32), mask=r < N_BLOCKS * BLOCK_M)
        for b0 in range(used // BLOCK_M, N_BLOCKS, BLOCK_P):
            b = b0 + tl.arange(0, BLOCK_P)
            tl.store(block_expert_ptr + b, tl.full([BLOCK_P], 0, tl.int64) + N_EXPERT, mask=b < N_BLOCKS)
    else:
        mine = bins == e
        pad = tl.sum(tl.where(mine, padded, 0), axis=0)
        count = tl.sum(tl.where(mine, hist, 0), axis=0)
        start = tl.sum(tl.where(bins < e, padded, 0), axis=0)
        seen = 0
        real = 0
        for p0 in range(0, P, BLOCK_P):  # in pair order: a stable sort by expert
            offs = p0 + tl.arange(0, BLOCK_P)
            hit = (tl.load(ids_ptr + offs, mask=offs < P, other=N_EXPERT) == e).to(tl.int32)
            rank = seen + tl.cumsum(hit, axis=0) - 1
            tl.store(pairs_ptr + start + rank, offs, mask=hit > 0)
            seen += tl.sum(hit, axis=0)
            real += tl.sum(tl.where(offs < counted, hit, 0), axis=0)
        r = tl.arange(0, BLOCK_M)
        tl.store(pairs_ptr + start + count + r, tl.full([BLOCK_M], -1, tl.int32), mask=r < pad - count)
        for b0 in range(0, pad // BLOCK_M, BLOCK_P):
            b = b0 + tl.arange(0, BLOCK_P)
            tl.store(block_expert_ptr + start // BLOCK_M + b, tl.full([BLOCK_P], 0, tl.int64) + e,
                     mask=b < pad // BLOCK_M)
        if HAS_COUNT:
            tl.store(counts_ptr + e, tl.load(counts_ptr + e) + real)


def group_pairs(ids: torch.Tensor, n_expert: int, block_m: int, counts: torch.Tensor | None = None,
                count_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the (token, choice) pairs of ``ids [T, k]`` by expert into blocks of ``block_m`` rows.

    Returns ``pairs`` (int32, ``n_blocks * block_m``: flat pair index ``t * k + j``, in pair order
    within an expert, or -1 for padding) and ``block_expert`` (int64 ``[n_blocks]``: the block's
    expert, ``n_expert`` for unused blocks); ``counts`` (int32 ``[n_expert]``), when given, is
    incremented by the routings per expert. ``n_blocks`` is the worst case ``ceil(P / block_m) +
    min(n_expert, P)`` so that nothing here waits for the device. One launch (the torch form was
    ~18 kernels, each a few microseconds of host time in a host-bound prefill). ``count_tokens``: a
    one-element integer device tensor, the number of leading tokens that are real (a padded
    prefill call, ``runtime.graph``): only their routings are counted."""
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    P = flat.numel()
    n_blocks = triton.cdiv(P, block_m) + min(n_expert, P)
    pairs = torch.empty(n_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(n_blocks, dtype=torch.int64, device=ids.device)
    if counts is not None and (counts.dtype != torch.int32 or counts.numel() != n_expert or not counts.is_contiguous()):
        raise ValueError(f"counts must be a contiguous int32 [{n_expert}]")
    if n_blocks:
        group_pairs_kernel[(n_expert + 1,)](flat, pairs, block_expert, counts if counts is not None else pairs,
                                             count_tokens if count_tokens is not None else pairs, P, ids.shape[-1], n_expert,
                                             n_blocks, HAS_COUNT=counts is not None,
                                             HAS_LIMIT=count_tokens is not None and counts is not None, BLOCK_M=block_m,
                                             BLOCK_P=1024, BINS=triton.next_power_of_2(n_expert + 1), num_warps=4,
                                             **pdl.flags(flat))
    return pairs, block_expert


def tile_tiles(pairs_per_expert: float) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps) of the ``_tile_*`` kernels, by the average pairs per expert (padding
    rows cost a weight-tile unpack too): the fastest shape at each call length of the qwen3.6
    shape, 256 experts top-8 (``bench/kernels_bench.py --only prefill --moe-tiles ...``)."""
    if pairs_per_expert < 4:
        return 16, 64, 4
    return (32, 32, 4) if pairs_per_expert < 32 else (64, 64, 8)


def sub_tiles(pairs_per_expert: float) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps) of the sub-block kernels, by the average pairs per expert.
    The fastest shapes at each call length of the Qwen3-30B (128 x 768) and qwen3.6 (256 x 512)
    shapes, top-8 (``bench/kernels_bench.py --only prefill --moe-tiles ...``)."""
    if pairs_per_expert < 8:
        return 16, 64, 4
    if pairs_per_expert < 24:
        return 32, 64, 4
    return (64, 128, 8) if pairs_per_expert >= 96 else (64, 64, 4)


def tile_calls(n_expert: int, topk: int, max_tokens: int) -> list[int]:
    """The fewest tokens of a call that picks each tile shape (``sub_tiles``, ``tile_tiles``),
    for calls of up to ``max_tokens``: each shape is a kernel compiled on its first call, which
    a session's warm-up makes rather than a user's prompt (a calibration window whose last call
    picked a new shape took many times longer)."""
    first: dict[tuple, int] = {}
    for t in range(2, max_tokens + 1):
        per = t * topk / n_expert
        first.setdefault((sub_tiles(per), tile_tiles(per)), t)
    return sorted(first.values())


def _sub_step(*qtypes: int) -> int:
    """Elements per sub-step of the sub-block kernels reading these types: the smallest sub-block."""
    return min(KERNEL_QUANTS[q].sub for q in qtypes)


def grouped_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, slot_table: torch.Tensor,
                    pools: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                    qtypes: tuple[int, int, int], n_ff: int, up_row0: int, part: torch.Tensor,
                    counts: torch.Tensor | None = None, tiles: tuple[int, int, int] | None = None,
                    sub: bool = True, count_tokens: torch.Tensor | None = None) -> None:
    """Weighted expert outputs of every (token, choice) pair into ``part [T*k, n_embd]`` (fp32),
    in two launches after ``group_pairs``. Arguments as ``moe.moe_experts`` has checked them:
    ``pools`` = (gate, up, down) device views (up may be gate's view with ``up_row0 = n_ff``),
    ``host`` the same over the host pool or None. ``sub``: the sub-block kernels where the types
    have them; False the expanded-tile kernels for every type (comparisons). ``tiles`` =
    (BLOCK_M, BLOCK_N, warps) overrides the tile shape, for tuning. ``count_tokens``: see ``group_pairs``."""
    (gate, up, down), (gq, uq, dq) = pools, (int(q) for q in qtypes)
    gate_h, up_h, down_h = host if host is not None else pools
    T_, n_embd = x.shape
    topk = topk_ids.shape[1]
    n_expert = slot_table.numel()
    half = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
    sub_gu = sub and gq in SUB_TYPES and uq in SUB_TYPES
    sub_down = sub and dq in SUB_TYPES
    per_expert = T_ * topk / n_expert
    bm, bn, warps = tiles or (sub_tiles if sub_gu or sub_down else tile_tiles)(per_expert)
    if min(bm, bn) < 16 or (bm & (bm - 1)) or (bn & (bn - 1)):
        raise ValueError(f"grouped tiles must be powers of two >= 16 (tl.dot), got {bm}x{bn}")
    pairs, block_expert = group_pairs(topk_ids, n_expert, bm, counts, count_tokens)
    nb, flags = block_expert.numel(), pdl.flags(x)
    # h between the launches: in the activations' half dtype where the products take it in that
    # dtype anyway (the same rounding, half the bytes), else fp32
    h = torch.empty((T_ * topk, n_ff), dtype=x.dtype if half else torch.float32, device=x.device)
    # fp32 operands off the GPU (Triton's interpreter gets half tl.dot wrong) and for fp32 activations
    oper = (OPER_BF16 if x.dtype == torch.bfloat16 else OPER_F16) if half else OPER_F32
    if sub_gu:
        sub_gate_up_kernel[(nb, triton.cdiv(n_ff, bn))](
            x, grid_table(x.device), pairs, block_expert, slot_table, gate, up, gate_h, up_h, h, topk, n_expert, n_ff, n_embd,
            gate.stride(0), up.stride(0), up_row0, gate.shape[2], up.shape[2], x.stride(0),
            GATE_QTYPE=gq, UP_QTYPE=uq, HAS_HOST=host is not None, OPER=oper, KS=_sub_step(gq, uq),
            BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, **flags)
    else:
        tile_gate_up_kernel[(nb, triton.cdiv(n_ff, bn))](
            x, grid_table(x.device), pairs, block_expert, slot_table, gate, up, gate_h, up_h, h, topk, n_expert, n_ff, n_embd,
            gate.stride(0), up.stride(0), up_row0, gate.shape[2], up.shape[2], x.stride(0),
            GATE_QTYPE=gq, UP_QTYPE=uq, HAS_HOST=host is not None, DOT_FP32=not half,
            BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, **flags)
    if sub_down:
        sub_down_kernel[(nb, triton.cdiv(n_embd, bn))](
            h, grid_table(x.device), pairs, block_expert, topk_weights, slot_table, down, down_h, part, n_expert, n_embd, n_ff,
            down.stride(0), down.shape[2], DOWN_QTYPE=dq, HAS_HOST=host is not None, OPER=oper,
            KS=_sub_step(dq), BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, **flags)
    else:
        tile_down_kernel[(nb, triton.cdiv(n_embd, bn))](
            h, grid_table(x.device), pairs, block_expert, topk_weights, slot_table, down, down_h, part, n_expert, n_embd, n_ff,
            down.stride(0), down.shape[2], DOWN_QTYPE=dq, HAS_HOST=host is not None, DOT_FP32=not half,
            BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, **flags)
