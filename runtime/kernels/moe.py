"""Fused mixture-of-experts decode: experts read through a slot table from per-layer weight pools.

Why a slot table (``slots.py``): hot and cached experts live in the same pools and the kernels
find expert ``e`` at ``slot_table[e]``, so every expert takes one code path whatever its residency,
and a cold expert in the host pool is read over PCIe inside the kernel (zero-copy), with no host
round trip to find out which experts the router chose. Residency must never change results, so
the arithmetic never depends on the slot: the same bytes give the same bits in any slot, and the
sum over the k chosen experts runs in a fixed order (k ascending) in its own pass rather than
with atomics.

Three launches:
1. ``gate_up_kernel``: one program per (token, choice) pair and block of ``n_ff`` rows computes
   gate and up dots from the same activation row and writes ``silu(gate) * up`` (fp32) to a small
   ``[T*k, n_ff]`` scratch; optionally the first block's program also counts the routing (an
   integer atomic add per pair: the expert store's statistics without a launch of their own).
2. ``down_kernel``: one program per pair and block of ``n_embd`` rows writes the down product
   times the routing weight to a ``[T*k, n_embd]`` fp32 scratch. Splitting over the k experts
   (instead of one program looping over them) gives k times more programs, which batch-1 decode
   needs to keep enough bytes in flight.
3. ``sum_topk_kernel``: the per-token sum over the k choices, in a fixed order (deterministic,
   unlike atomics; the scratch is only T*k*n_embd*4 bytes). The runtime's MoE blocks skip it
   (``reduce=False``): their residual epilogue (``kernels/ffn.py``) makes the same sum.

The first two reuse the per-family unpacking of ``blocks`` (one compiled variant per quant type),
or, with ``act_q8`` (the runtime's choice), ``q8dot``'s int8 dot products for the experts of ``q8dot.Q8_TYPES``:
x's int8 form comes from the norm that wrote it (``x_q8``; else one small launch) and h is
quantized once per pair (one small launch).

Prefill (many tokens) takes the grouped kernels of ``moe_grouped.py`` instead of launches 1 and
2: pairs sorted by expert, each expert's weights unpacked once per block of its pairs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparkpack.runtime import decode_rows
from sparkpack.runtime.kernels import pdl
from sparkpack.runtime.kernels.pdl import prefetch_l2, wait_prior
from sparkpack.runtime.kernels.q8dot import (Int8Rows, check_codes, chunks_per_iteration, quantize, readable, row_dot_q8,
                                             use_asm)
from sparkpack.runtime.kernels.moe_grouped import GROUPED_MIN_PAIRS, group_pairs, grouped_experts
from sparkpack.runtime.kernels.blocks import _output, _row_dot, grid_table, rows_per_program
from sparkpack.runtime.kernels.slots import check_pool, slot_base

__all__ = ["GROUPED_MIN_PAIRS", "ExpertPools", "MoELaunch", "group_pairs", "moe_experts"]


@triton.jit
def gate_up_kernel(x_ptr, xq, xd, xs, grids_ptr, ids_ptr, slot_ptr, gate_ptr, up_ptr, gate_h_ptr, up_h_ptr, h_ptr,
                    count_ptr, down_ptr, TOPK, N_FF, K, gate_slot_bytes, up_slot_bytes, up_row0, gate_row_bytes,
                    up_row_bytes, stride_x, stride_ids, down_slot_bytes, down_bytes,
                    GATE_QTYPE: tl.constexpr, UP_QTYPE: tl.constexpr, HAS_HOST: tl.constexpr,
                    HAS_COUNT: tl.constexpr, BLOCK_N: tl.constexpr, ACT_Q8: tl.constexpr, ASM: tl.constexpr,
                    CPI: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    pair = tl.program_id(0)
    t = pair // TOPK
    j = pair % TOPK
    expert = tl.load(ids_ptr + t * stride_ids + j)
    if HAS_COUNT:
        if tl.program_id(1) == 0:  # one count per (token, choice): the store's routing statistics
            tl.atomic_add(count_ptr + expert, 1)
    slot = tl.load(slot_ptr + expert).to(tl.int64)
    if PDL:  # this program's share of the expert's down matrix into L2, for the down launch
        if slot >= 0:
            share = tl.cdiv(tl.cdiv(down_bytes, tl.num_programs(1)), 16) * 16
            a = tl.program_id(1).to(tl.int64) * share
            base = down_ptr + slot * down_slot_bytes
            prefetch_l2(base + a, base + tl.minimum(a + share, down_bytes), True)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n3 = n[:, None, None]
    # Without a host pool a non-resident expert (slot < 0) reads nothing (zero valid rows) and
    # yields zeros; the caller guarantees residency before launch (validate=True checks it).
    rmask = n3 < tl.where((slot >= 0) | HAS_HOST, N_FF, 0)
    g_base = slot_base(slot, gate_ptr, gate_h_ptr, gate_slot_bytes, HAS_HOST)
    u_base = slot_base(slot, up_ptr, up_h_ptr, up_slot_bytes, HAS_HOST)
    if ACT_Q8:  # x quantized per token (q8dot): int8 dot products
        n4 = n[:, None, None, None]
        m4 = n4 < tl.where((slot >= 0) | HAS_HOST, N_FF, 0)
        q, d, s = xq + t * (K // 4), xd + t * (K // 32), xs + t * (K // 16)
        g = row_dot_q8(GATE_QTYPE, g_base, n4, m4, gate_row_bytes, q, d, s, K, BLOCK_N, CPI, ASM, grids_ptr)
        u = row_dot_q8(UP_QTYPE, u_base, n4 + up_row0, m4, up_row_bytes, q, d, s, K, BLOCK_N, CPI, ASM,
                       grids_ptr)
    else:
        x_row = x_ptr + t * stride_x
        g = _row_dot(GATE_QTYPE, g_base + n3.to(tl.int64) * gate_row_bytes, rmask, x_row, K, BLOCK_N, grids_ptr)
        u = _row_dot(UP_QTYPE, u_base + (n3 + up_row0).to(tl.int64) * up_row_bytes, rmask, x_row, K, BLOCK_N,
                     grids_ptr)
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(h_ptr + pair.to(tl.int64) * N_FF + n, h, mask=n < N_FF)


@triton.jit
def down_kernel(h_ptr, hq, hd, hs, grids_ptr, ids_ptr, wts_ptr, slot_ptr, down_ptr, down_h_ptr, part_ptr,
                 TOPK, N_EMBD, N_FF, down_slot_bytes, down_row_bytes, stride_ids, stride_wts,
                 DOWN_QTYPE: tl.constexpr, HAS_HOST: tl.constexpr, BLOCK_N: tl.constexpr,
                 ACT_Q8: tl.constexpr, ASM: tl.constexpr, CPI: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    pair = tl.program_id(0)
    t = pair // TOPK
    j = pair % TOPK
    expert = tl.load(ids_ptr + t * stride_ids + j)
    weight = tl.load(wts_ptr + t * stride_wts + j).to(tl.float32)
    slot = tl.load(slot_ptr + expert).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n3 = n[:, None, None]
    rmask = n3 < tl.where((slot >= 0) | HAS_HOST, N_EMBD, 0)
    base = slot_base(slot, down_ptr, down_h_ptr, down_slot_bytes, HAS_HOST)
    if ACT_Q8:  # h quantized per pair (q8dot)
        n4 = n[:, None, None, None]
        m4 = n4 < tl.where((slot >= 0) | HAS_HOST, N_EMBD, 0)
        p64 = pair.to(tl.int64)
        dot = row_dot_q8(DOWN_QTYPE, base, n4, m4, down_row_bytes, hq + p64 * (N_FF // 4), hd + p64 * (N_FF // 32),
                         hs + p64 * (N_FF // 16), N_FF, BLOCK_N, CPI, ASM, grids_ptr)
    else:
        dot = _row_dot(DOWN_QTYPE, base + n3.to(tl.int64) * down_row_bytes, rmask, h_ptr + pair.to(tl.int64) * N_FF,
                       N_FF, BLOCK_N, grids_ptr)
    part = weight * dot
    tl.store(part_ptr + pair.to(tl.int64) * N_EMBD + n, part, mask=n < N_EMBD)


@triton.jit
def sum_topk_kernel(part_ptr, y_ptr, TOPK, N_EMBD, stride_y, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """y[t] = sum over j = 0..k-1, in that order, of the weighted expert outputs."""
    wait_prior(PDL)
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(0, TOPK):
        acc += tl.load(part_ptr + (t * TOPK + j).to(tl.int64) * N_EMBD + n, mask=n < N_EMBD, other=0.0)
    tl.store(y_ptr + t * stride_y + n, acc, mask=n < N_EMBD)


def _launch(pairs: int) -> tuple[int, int]:
    """(rows, warps) per program. Few (token, expert) pairs (decode) want many small programs to
    keep enough loads in flight: one token top-8 at the qwen3.6 shape ran fastest with 2 rows on
    1 warp (``bench/kernels_bench.py --block-n 2 4 8 16 --warps 1 2 4 8``)."""
    return (2, 1) if pairs < 64 else (8, 4)


@dataclass(frozen=True)
class ExpertPools:
    """One layer's experts as the kernels read them: uint8 views ``[n_slots, rows, row_bytes]`` of
    the device pool, one per role (gate/up ``n_ff`` rows of n_embd elements, down ``n_embd`` rows
    of n_ff; ``up`` None means one merged gate_up pool of ``2*n_ff`` rows, gate rows first, as
    in ``ffn_gate_up_exps``), their GGML types, and ``host``: the same three views over a host
    pool the GPU can address (pinned memory, same slot spacing) when slot table entries may
    point there."""

    gate: torch.Tensor
    up: torch.Tensor | None
    down: torch.Tensor
    gate_qtype: int
    up_qtype: int | None
    down_qtype: int
    n_ff: int
    host: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None


@dataclass(frozen=True)
class MoELaunch:
    """Launch shapes, for tuning and comparisons (the defaults are the runtime's): ``block_n``
    (a power of two) rows and ``num_warps`` warps per program of the per-pair kernels, ``cpi``
    chunks of 256 each of their int8 programs loads at once; ``grouped`` the prefill kernels
    (``moe_grouped``: pairs sorted by expert, tensor-core tiles; by default from
    ``GROUPED_MIN_PAIRS`` pairs up), their tile shape ``tiles`` = (BLOCK_M, BLOCK_N, warps), and
    ``sub=False`` their expanded-tile kernels over the sub-block ones. Both paths are exact up to
    fp32 round-off except that the grouped one multiplies half-precision activations in half
    precision, as cuBLAS does for the dense layers."""

    block_n: int | None = None
    num_warps: int | None = None
    cpi: int = 8
    grouped: bool | None = None
    tiles: tuple[int, int, int] | None = None
    sub: bool = True


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, slot_table: torch.Tensor,
                pools: ExpertPools, *, act_q8: bool = False, x_q8: Int8Rows | None = None,
                counts: torch.Tensor | None = None, count_tokens: torch.Tensor | None = None, reduce: bool = True,
                out: torch.Tensor | None = None, validate: bool = False, launch: MoELaunch = MoELaunch()
                ) -> torch.Tensor:
    """Routed-expert output ``sum_j w[t,j] * down_e(silu(gate_e x_t) * up_e x_t)`` -> [T, n_embd] fp32.

    x: [T, n_embd] (f32/f16/bf16); topk_ids/topk_weights: [T, k]; slot_table: int32 [n_expert]
    (expert id -> slot in ``pools``; negative: in the host pool at ``-(slot+1)`` when the pools
    have one, else not resident). ``act_q8``: the per-pair (decode) kernels quantize their
    inputs to int8 and multiply experts of ``q8dot.Q8_TYPES`` with int8 dot products (``q8dot``; a kernel
    whose types are others keeps the float input); ``x_q8`` is x's int8 form when the kernel
    that wrote x made it (else it is made here). ``counts``: int32 ``[n_expert]`` incremented
    once per (token, choice) routed to each expert (integer atomics: exact in any order);
    ``count_tokens`` (a padded prefill call: a one-element integer device tensor) counts the
    routings of only that many leading tokens; such a call always takes the grouped kernels,
    whose grouping launch is where the limit is applied (the per-pair kernels count every pair
    they compute). ``reduce=False`` returns the weighted expert outputs unsummed,
    ``[T, k, n_embd]`` fp32, for a consumer that sums them in choice order itself
    (``layers.ffn_residual``: one launch fewer); ``out``: a float32 ``[T, n_embd]`` to write the
    sum into. ``validate=True`` checks residency on the host (a device sync: for tests and
    debugging, not the decode loop).
    """
    gate_raw, up_raw, down_raw = pools.gate, pools.up, pools.down
    gate_qtype, up_qtype, down_qtype, n_ff = pools.gate_qtype, pools.up_qtype, pools.down_qtype, pools.n_ff
    host = pools.host
    T_, n_embd = x.shape
    topk = topk_ids.shape[1]
    merged = up_raw is None
    if merged:
        up_raw, up_qtype, up_row0 = gate_raw, gate_qtype, n_ff
    else:
        up_row0 = 0
    check_pool(gate_raw, gate_qtype, n_embd, 2 * n_ff if merged else n_ff, "gate")
    if not merged:
        check_pool(up_raw, up_qtype, n_embd, n_ff, "up")
    check_pool(down_raw, down_qtype, n_ff, n_embd, "down")
    if host is not None:
        gate_h, up_h, down_h = host
        up_h = gate_h if merged else up_h
        for h, d, what in ((gate_h, gate_raw, "gate"), (up_h, up_raw, "up"), (down_h, down_raw, "down")):
            if h is None or h.shape[1:] != d.shape[1:] or h.stride() != d.stride() or h.dtype != torch.uint8:
                raise ValueError(f"host {what} pool must match the device pool's row layout and slot spacing")
    else:
        gate_h, up_h, down_h = gate_raw, up_raw, down_raw
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != T_:
        raise ValueError("topk_ids and topk_weights must both be [T, k]")
    if slot_table.dtype != torch.int32:
        raise ValueError("slot_table must be int32")
    if counts is not None and (counts.dtype != torch.int32 or not counts.is_contiguous()):
        raise ValueError("counts must be a contiguous int32 vector")
    if validate:
        slots = slot_table[topk_ids.long()]
        n_host = gate_h.shape[0] if host is not None else 0
        if bool((slots < -n_host).any()) or bool((slots >= gate_raw.shape[0]).any()):
            raise ValueError("a selected expert is not resident (slot out of range)")
    x = x.contiguous()
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.contiguous()
    part = torch.empty((T_ * topk, n_embd), dtype=torch.float32, device=x.device)
    y = _output(out, (T_, n_embd), x.device) if reduce else part.view(T_, topk, n_embd)
    if T_ == 0 or topk == 0:
        return y.zero_()
    has_host = host is not None
    # A batched decode step's tokens (``runtime.decode_rows``) take the per-pair kernels with
    # one token's launch, whatever their number: each pair's program is then the one it runs
    # when its token decodes alone.
    one_token = decode_rows.active()
    pairs = topk if one_token else T_ * topk
    grouped = launch.grouped if launch.grouped is not None else pairs >= GROUPED_MIN_PAIRS
    if count_tokens is not None or grouped:
        grouped_experts(x, topk_ids, topk_weights, slot_table, (gate_raw, up_raw, down_raw),
                        (gate_h, up_h, down_h) if has_host else None, (gate_qtype, up_qtype, down_qtype), n_ff,
                        up_row0, part, counts, launch.tiles, launch.sub, count_tokens)
    else:
        rows, warps = _launch(pairs)
        h = torch.empty((T_ * topk, n_ff), dtype=torch.float32, device=x.device)
        bn = launch.block_n or rows_per_program(x.device, rows)
        num_warps = launch.num_warps or warps
        cpi = launch.cpi
        q8_gu = act_q8 and readable(gate_qtype, gate_raw, gate_h) and readable(up_qtype, up_raw, up_h)
        q8_down = act_q8 and readable(down_qtype, down_raw, down_h)
        xq, xd, xs = (x_q8 if x_q8 is not None else quantize(x)) if q8_gu else (x, x, x)
        if q8_gu:
            check_codes(xq)
        grids = grid_table(x.device)
        gate_up_kernel[(T_ * topk, triton.cdiv(n_ff, bn))](
            x, xq, xd, xs, grids, topk_ids, slot_table, gate_raw, up_raw, gate_h, up_h, h,
            counts if counts is not None else slot_table, down_raw, topk, n_ff, n_embd, gate_raw.stride(0),
            up_raw.stride(0), up_row0, gate_raw.shape[2], up_raw.shape[2], x.stride(0), topk_ids.stride(0),
            down_raw.stride(0), down_raw.shape[1] * down_raw.shape[2],
            GATE_QTYPE=int(gate_qtype), UP_QTYPE=int(up_qtype), HAS_HOST=has_host, HAS_COUNT=counts is not None,
            BLOCK_N=bn, ACT_Q8=q8_gu, ASM=use_asm(x), CPI=chunks_per_iteration(n_embd, cpi), num_warps=num_warps,
            **pdl.flags(x))
        hq, hd, hs = quantize(h) if q8_down else (h, h, h)
        down_kernel[(T_ * topk, triton.cdiv(n_embd, bn))](
            h, hq, hd, hs, grids, topk_ids, topk_weights, slot_table, down_raw, down_h, part,
            topk, n_embd, n_ff, down_raw.stride(0), down_raw.shape[2], topk_ids.stride(0),
            topk_weights.stride(0), DOWN_QTYPE=int(down_qtype), HAS_HOST=has_host, BLOCK_N=bn, ACT_Q8=q8_down,
            ASM=use_asm(x), CPI=chunks_per_iteration(n_ff, cpi), num_warps=num_warps, **pdl.flags(h))
    if reduce:
        sum_topk_kernel[(T_, triton.cdiv(n_embd, 1024))](part, y, topk, n_embd, y.stride(0), BLOCK=1024,
                                                          num_warps=4, **pdl.flags(part))
    return y
