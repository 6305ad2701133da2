"""Fused mixture-of-experts decode: experts read through a slot table from per-layer weight pools.

Why a slot table: hot (pinned) experts and cached experts live in the same uint8 pools
``[n_slots, rows, row_bytes]`` and the kernels find expert ``e`` at ``slot_table[e]``, so every
expert takes one code path whatever its residency. With a host pool (pinned host memory the GPU
can address, same layout) a negative entry ``-(h + 1)`` sends the kernel to host slot ``h``: a
cold expert is then read over PCIe inside the kernel (zero-copy), with no host round trip to
find out which experts the router chose. Residency must never change results, so the
arithmetic never depends on the slot: the same bytes give the same bits in any slot, and the sum
over the k chosen experts runs in a fixed order (k ascending) in its own pass rather than with
atomics.

Three launches:
1. ``_gate_up_kernel``: one program per (token, choice) pair and block of ``n_ff`` rows computes
   gate and up dots from the same activation row and writes ``silu(gate) * up`` (fp32) to a small
   ``[T*k, n_ff]`` scratch; optionally the first block's program also counts the routing (an
   integer atomic add per pair: the expert store's statistics without a launch of their own).
2. ``_down_kernel``: one program per pair and block of ``n_embd`` rows writes the down product
   times the routing weight to a ``[T*k, n_embd]`` fp32 scratch. Splitting over the k experts
   (instead of one program looping over them) gives k times more programs, which batch-1 decode
   needs to keep enough bytes in flight.
3. ``_sum_topk_kernel``: the per-token sum over the k choices, in a fixed order (deterministic,
   unlike atomics; the scratch is only T*k*n_embd*4 bytes). The runtime's MoE blocks skip it
   (``reduce=False``): their residual epilogue (``kernels/ffn.py``) makes the same sum.

The first two reuse the per-family unpacking of ``qmatvec`` (one compiled variant per quant type),
or, with ``act_q8`` (the runtime's default), ``q8dot``'s int8 dot products for Q4_K/Q6_K experts:
x's int8 form comes from the norm that wrote it (``q8dot.attach``; else one small launch) and h
is quantized once per pair (one small launch).

Prefill (many tokens) takes a grouped variant of launches 1 and 2: the (token, choice) pairs are
sorted by expert into blocks of ``BLOCK_M`` rows of one expert (padded; built on the device with
no host sync, in one launch: ``_group_pairs_kernel``), and each program multiplies one block's activations by a tile of that expert's
weights with ``tl.dot``, unpacking the quant blocks once per tile instead of once per pair. The
per-pair kernels above unpack an expert's weights for every token routed to it: at 512 tokens
that is ~16 unpacks of every expert per layer, and the unpacking, not the bytes, is the cost.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels import pdl
from runtime.kernels.pdl import prefetch_l2, wait_prior
from runtime.kernels.q8dot import chunks_per_iteration, quantize, quantized, readable, row_dot_q8, use_asm
from runtime.kernels.qmatvec import SUPPORTED_QTYPES, _output, _row_dot, _tile_dot, row_bytes_of, rows_per_program


@triton.jit
def _slot_base(slot, dev_ptr, host_ptr, slot_bytes, HAS_HOST: tl.constexpr):
    """Address of a slot's bytes: device pool for slot >= 0, host pool slot -(slot+1) otherwise
    (without a host pool a negative slot is clamped to 0 and the caller masks every row)."""
    if HAS_HOST:
        if slot >= 0:
            base = dev_ptr + slot * slot_bytes
        else:
            base = host_ptr + (-slot - 1) * slot_bytes
    else:
        base = dev_ptr + tl.maximum(slot, 0) * slot_bytes
    return base


@triton.jit
def _gate_up_kernel(x_ptr, xq, xd, xs, ids_ptr, slot_ptr, gate_ptr, up_ptr, gate_h_ptr, up_h_ptr, h_ptr, count_ptr,
                    down_ptr, TOPK, N_FF, K, gate_slot_bytes, up_slot_bytes, up_row0, gate_row_bytes, up_row_bytes,
                    stride_x, stride_ids, down_slot_bytes, down_bytes,
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
    g_base = _slot_base(slot, gate_ptr, gate_h_ptr, gate_slot_bytes, HAS_HOST)
    u_base = _slot_base(slot, up_ptr, up_h_ptr, up_slot_bytes, HAS_HOST)
    if ACT_Q8:  # x quantized per token (q8dot): int8 dot products
        n4 = n[:, None, None, None]
        m4 = n4 < tl.where((slot >= 0) | HAS_HOST, N_FF, 0)
        q, d, s = xq + t * (K // 4), xd + t * (K // 32), xs + t * (K // 16)
        g = row_dot_q8(GATE_QTYPE, g_base, n4, m4, gate_row_bytes, q, d, s, K, BLOCK_N, CPI, ASM)
        u = row_dot_q8(UP_QTYPE, u_base, n4 + up_row0, m4, up_row_bytes, q, d, s, K, BLOCK_N, CPI, ASM)
    else:
        x_row = x_ptr + t * stride_x
        g = _row_dot(GATE_QTYPE, g_base + n3.to(tl.int64) * gate_row_bytes, rmask, x_row, K, BLOCK_N)
        u = _row_dot(UP_QTYPE, u_base + (n3 + up_row0).to(tl.int64) * up_row_bytes, rmask, x_row, K, BLOCK_N)
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(h_ptr + pair.to(tl.int64) * N_FF + n, h, mask=n < N_FF)


@triton.jit
def _down_kernel(h_ptr, hq, hd, hs, ids_ptr, wts_ptr, slot_ptr, down_ptr, down_h_ptr, part_ptr,
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
    base = _slot_base(slot, down_ptr, down_h_ptr, down_slot_bytes, HAS_HOST)
    if ACT_Q8:  # h quantized per pair (q8dot)
        n4 = n[:, None, None, None]
        m4 = n4 < tl.where((slot >= 0) | HAS_HOST, N_EMBD, 0)
        p64 = pair.to(tl.int64)
        dot = row_dot_q8(DOWN_QTYPE, base, n4, m4, down_row_bytes, hq + p64 * (N_FF // 4), hd + p64 * (N_FF // 32),
                         hs + p64 * (N_FF // 16), N_FF, BLOCK_N, CPI, ASM)
    else:
        dot = _row_dot(DOWN_QTYPE, base + n3.to(tl.int64) * down_row_bytes, rmask, h_ptr + pair.to(tl.int64) * N_FF,
                       N_FF, BLOCK_N)
    part = weight * dot
    tl.store(part_ptr + pair.to(tl.int64) * N_EMBD + n, part, mask=n < N_EMBD)


@triton.jit
def _sum_topk_kernel(part_ptr, y_ptr, TOPK, N_EMBD, stride_y, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """y[t] = sum over j = 0..k-1, in that order, of the weighted expert outputs."""
    wait_prior(PDL)
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(0, TOPK):
        acc += tl.load(part_ptr + (t * TOPK + j).to(tl.int64) * N_EMBD + n, mask=n < N_EMBD, other=0.0)
    tl.store(y_ptr + t * stride_y + n, acc, mask=n < N_EMBD)


@triton.jit
def _grouped_gate_up_kernel(x_ptr, pairs_ptr, block_expert_ptr, slot_ptr, gate_ptr, up_ptr, gate_h_ptr, up_h_ptr,
                            h_ptr, TOPK, N_EXPERT, N_FF, K, gate_slot_bytes, up_slot_bytes, up_row0,
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
        g_rows = _slot_base(slot, gate_ptr, gate_h_ptr, gate_slot_bytes, HAS_HOST) + n3.to(tl.int64) * gate_row_bytes
        u_rows = _slot_base(slot, up_ptr, up_h_ptr, up_slot_bytes, HAS_HOST) + (n3 + up_row0).to(tl.int64) * up_row_bytes
        g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for c in range(0, tl.cdiv(K, 256)):
            g = _tile_dot(GATE_QTYPE, g_rows, rmask, a_rows, amask, c, K, g, DOT_FP32, BLOCK_N)
            u = _tile_dot(UP_QTYPE, u_rows, rmask, a_rows, amask, c, K, u, DOT_FP32, BLOCK_N)
        h = g / (1.0 + tl.exp(-g)) * u
        tl.store(h_ptr + pair.to(tl.int64)[:, None] * N_FF + n[None, :], h, mask=amask & (n[None, :] < N_FF))


@triton.jit
def _grouped_down_kernel(h_ptr, pairs_ptr, block_expert_ptr, wts_ptr, slot_ptr, down_ptr, down_h_ptr, part_ptr,
                         N_EXPERT, N_EMBD, N_FF, down_slot_bytes, down_row_bytes,
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
        rows = _slot_base(slot, down_ptr, down_h_ptr, down_slot_bytes, HAS_HOST) + n3.to(tl.int64) * down_row_bytes
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for c in range(0, tl.cdiv(N_FF, 256)):
            acc = _tile_dot(DOWN_QTYPE, rows, rmask, h_ptr + pair64[:, None] * N_FF, amask, c, N_FF, acc,
                            DOT_FP32, BLOCK_N)
        weight = tl.load(wts_ptr + pair64, mask=pair >= 0, other=0.0).to(tl.float32)
        tl.store(part_ptr + pair64[:, None] * N_EMBD + n[None, :], acc * weight[:, None],
                 mask=amask & (n[None, :] < N_EMBD))


@triton.jit
def _group_pairs_kernel(ids_ptr, pairs_ptr, block_expert_ptr, counts_ptr, P, N_EXPERT, N_BLOCKS,
                        HAS_COUNT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                        BINS: tl.constexpr, PDL: tl.constexpr):
    """Program ``e < N_EXPERT`` places expert e's pairs; program ``N_EXPERT`` pads the unused tail.
    Every program counts all experts itself (a histogram of the ids, P small): no program waits
    for another, and every output element is written by exactly one program."""
    wait_prior(PDL)
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
        for p0 in range(0, P, BLOCK_P):  # in pair order: a stable sort by expert
            offs = p0 + tl.arange(0, BLOCK_P)
            hit = (tl.load(ids_ptr + offs, mask=offs < P, other=N_EXPERT) == e).to(tl.int32)
            rank = seen + tl.cumsum(hit, axis=0) - 1
            tl.store(pairs_ptr + start + rank, offs, mask=hit > 0)
            seen += tl.sum(hit, axis=0)
        r = tl.arange(0, BLOCK_M)
        tl.store(pairs_ptr + start + count + r, tl.full([BLOCK_M], -1, tl.int32), mask=r < pad - count)
        for b0 in range(0, pad // BLOCK_M, BLOCK_P):
            b = b0 + tl.arange(0, BLOCK_P)
            tl.store(block_expert_ptr + start // BLOCK_M + b, tl.full([BLOCK_P], 0, tl.int64) + e,
                     mask=b < pad // BLOCK_M)
        if HAS_COUNT:
            tl.store(counts_ptr + e, tl.load(counts_ptr + e) + count)


def group_pairs(ids: torch.Tensor, n_expert: int, block_m: int,
                counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the (token, choice) pairs of ``ids [T, k]`` by expert into blocks of ``block_m`` rows.

    Returns ``pairs`` (int32, ``n_blocks * block_m``: flat pair index ``t * k + j``, in pair order
    within an expert, or -1 for padding) and ``block_expert`` (int64 ``[n_blocks]``: the block's
    expert, ``n_expert`` for unused blocks); ``counts`` (int32 ``[n_expert]``), when given, is
    incremented by the routings per expert. ``n_blocks`` is the worst case ``ceil(P / block_m) +
    min(n_expert, P)`` so that nothing here waits for the device. One launch (the torch form was
    ~18 kernels, each a few microseconds of host time in a host-bound prefill)."""
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
        _group_pairs_kernel[(n_expert + 1,)](flat, pairs, block_expert, counts if counts is not None else pairs,
                                             P, n_expert, n_blocks, HAS_COUNT=counts is not None, BLOCK_M=block_m,
                                             BLOCK_P=1024, BINS=triton.next_power_of_2(n_expert + 1), num_warps=4,
                                             **pdl.flags(flat))
    return pairs, block_expert


def _grouped_tiles(pairs_per_expert: float) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps) of the grouped kernels, by the average pairs per expert (padding
    rows cost a weight-tile unpack too). Measured on the H100 at the qwen3.6 shape, 256 experts
    top-8 (``bench/kernels_bench.py --only prefill --moe-tiles ...``, us per layer):
    T=16: 16x64x4 517, 16x32x4 671, 32x32x4 621; T=512: 32x32x4 1512, 32x64x4 1647, 16x64x4 1776,
    64x64x8 2120; T=2048: 64x64x8 3125, 64x64x4 3648, 32x32x4 3584; T=4096: 64x64x8 5273,
    64x64x4 6148, 32x32x4 6571."""
    if pairs_per_expert < 4:
        return 16, 64, 4
    return (32, 32, 4) if pairs_per_expert < 32 else (64, 64, 8)


GROUPED_MIN_PAIRS = 64  # (token, choice) pairs from which the grouped (prefill) kernels run


def _launch(pairs: int) -> tuple[int, int]:
    """(rows, warps) per program. Few (token, expert) pairs (decode) want many small programs to
    keep enough loads in flight: on the H100, one token top-8 at the qwen3.6 shape ran in 40 us
    with 2 rows on 1 warp against 67 us with 4 rows on 4 warps (``bench/kernels_bench.py
    --block-n 2 4 8 16 --warps 1 2 4 8``)."""
    return (2, 1) if pairs < 64 else (8, 4)


def check_pool(raw: torch.Tensor, qtype: int, K: int, rows: int, what: str) -> None:
    """A pool view ``[n_slots, rows, row_bytes]``: rows contiguous inside a slot; slots may be
    spaced wider than their bytes (views of one pool holding several roles per slot)."""
    qtype = int(qtype)
    if qtype not in SUPPORTED_QTYPES:
        raise ValueError(f"quant type {qtype} has no Triton kernel (supported: {SUPPORTED_QTYPES})")
    if raw.dtype != torch.uint8 or raw.dim() != 3:
        raise ValueError(f"{what} pool must be uint8 [n_slots, rows, row_bytes], got {raw.dtype} {tuple(raw.shape)}")
    rb = row_bytes_of(qtype, K)
    if raw.shape[1] != rows or raw.shape[2] != rb or raw.stride(2) != 1 or raw.stride(1) != rb:
        raise ValueError(f"{what} pool is {tuple(raw.shape)} with strides {raw.stride()}; expected "
                         f"[n_slots, {rows}, {rb}] with contiguous rows")


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                slot_table: torch.Tensor, gate_raw: torch.Tensor, up_raw: torch.Tensor | None,
                down_raw: torch.Tensor, gate_qtype: int, up_qtype: int | None, down_qtype: int,
                n_ff: int, validate: bool = False, out: torch.Tensor | None = None,
                block_n: int | None = None,
                host: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None,
                counts: torch.Tensor | None = None, num_warps: int | None = None,
                grouped: bool | None = None, tiles: tuple[int, int, int] | None = None,
                act_q8: bool = False, cpi: int = 8, reduce: bool = True) -> torch.Tensor:
    """Routed-expert output ``sum_j w[t,j] * down_e(silu(gate_e x_t) * up_e x_t)`` -> [T, n_embd] fp32.

    x: [T, n_embd] (f32/f16/bf16); topk_ids/topk_weights: [T, k]; slot_table: int32 [n_expert]
    (expert id -> slot in the pools; negative: in the host pool at ``-(slot+1)`` when ``host`` is
    given, else not resident). Pools are uint8 ``[n_slots, rows, row_bytes]``: gate/up have
    ``n_ff`` rows of n_embd elements, down ``n_embd`` rows of n_ff. ``up_raw=None`` means a merged
    gate_up pool of ``2*n_ff`` rows (gate rows first, then up), as in ``ffn_gate_up_exps``.
    ``host``: the same three views over a host pool the GPU can address (pinned memory), with the
    same slot spacing as the device pools. ``counts``: int32 ``[n_expert]`` incremented once per
    (token, choice) routed to each expert (integer atomics: exact in any order). ``validate=True`` checks residency on the host (a
    device sync: for tests and debugging, not the decode loop). ``block_n`` (a power of two)
    overrides the rows per program and ``num_warps`` the warps per program, for tuning.
    ``grouped``: the prefill kernels (pairs sorted by expert, ``tl.dot`` tiles); by default used
    from ``GROUPED_MIN_PAIRS`` pairs up. ``tiles`` = (BLOCK_M, BLOCK_N, warps) overrides their
    tile shape, for tuning. Both paths are exact up to fp32 round-off except that the grouped
    one multiplies in half precision when ``x`` is (``qmatvec._tile_dot``), as cuBLAS does for
    the dense layers. ``act_q8``: the per-pair (decode) kernels quantize their inputs to int8 and
    multiply Q4_K/Q6_K experts with int8 dot products (``q8dot``; a kernel whose types are
    others keeps the float input), loading up to ``cpi`` chunks of 256 per row at once.
    ``reduce=False`` returns the weighted expert outputs unsummed, ``[T, k, n_embd]`` fp32, for a
    consumer that sums them in choice order itself (``layers.ffn_residual``: one launch fewer).
    """
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
    h = torch.empty((T_ * topk, n_ff), dtype=torch.float32, device=x.device)
    has_host = host is not None
    if grouped if grouped is not None else T_ * topk >= GROUPED_MIN_PAIRS:
        n_expert = slot_table.numel()
        bm, bn, warps = tiles or _grouped_tiles(T_ * topk / n_expert)
        if min(bm, bn) < 16 or (bm & (bm - 1)) or (bn & (bn - 1)):
            raise ValueError(f"grouped tiles must be powers of two >= 16 (tl.dot), got {bm}x{bn}")
        pairs, block_expert = group_pairs(topk_ids, n_expert, bm, counts)
        # Triton's interpreter gets bf16 tl.dot wrong (see tests/test_kernels.py): off the GPU the
        # products run in fp32 whatever the activations' dtype.
        fp32 = x.dtype == torch.float32 or not x.is_cuda
        _grouped_gate_up_kernel[(block_expert.numel(), triton.cdiv(n_ff, bn))](
            x, pairs, block_expert, slot_table, gate_raw, up_raw, gate_h, up_h, h,
            topk, n_expert, n_ff, n_embd, gate_raw.stride(0), up_raw.stride(0), up_row0,
            gate_raw.shape[2], up_raw.shape[2], x.stride(0),
            GATE_QTYPE=int(gate_qtype), UP_QTYPE=int(up_qtype), HAS_HOST=has_host, DOT_FP32=fp32,
            BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, **pdl.flags(x))
        _grouped_down_kernel[(block_expert.numel(), triton.cdiv(n_embd, bn))](
            h, pairs, block_expert, topk_weights, slot_table, down_raw, down_h, part,
            n_expert, n_embd, n_ff, down_raw.stride(0), down_raw.shape[2],
            DOWN_QTYPE=int(down_qtype), HAS_HOST=has_host, DOT_FP32=fp32, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, **pdl.flags(h))
    else:
        rows, warps = _launch(T_ * topk)
        bn = block_n or rows_per_program(x.device, rows)
        num_warps = num_warps or warps
        q8_gu = act_q8 and readable(gate_qtype, gate_raw, gate_h) and readable(up_qtype, up_raw, up_h)
        q8_down = act_q8 and readable(down_qtype, down_raw, down_h)
        xq, xd, xs = quantized(x) if q8_gu else (x, x, x)  # the norm that wrote x may have attached it
        _gate_up_kernel[(T_ * topk, triton.cdiv(n_ff, bn))](
            x, xq, xd, xs, topk_ids, slot_table, gate_raw, up_raw, gate_h, up_h, h, counts if counts is not None else slot_table,
            down_raw, topk, n_ff, n_embd, gate_raw.stride(0), up_raw.stride(0), up_row0,
            gate_raw.shape[2], up_raw.shape[2], x.stride(0), topk_ids.stride(0), down_raw.stride(0),
            down_raw.shape[1] * down_raw.shape[2],
            GATE_QTYPE=int(gate_qtype), UP_QTYPE=int(up_qtype), HAS_HOST=has_host, HAS_COUNT=counts is not None,
            BLOCK_N=bn, ACT_Q8=q8_gu, ASM=use_asm(x), CPI=chunks_per_iteration(n_embd, cpi), num_warps=num_warps,
            **pdl.flags(x))
        hq, hd, hs = quantize(h) if q8_down else (h, h, h)
        _down_kernel[(T_ * topk, triton.cdiv(n_embd, bn))](
            h, hq, hd, hs, topk_ids, topk_weights, slot_table, down_raw, down_h, part,
            topk, n_embd, n_ff, down_raw.stride(0), down_raw.shape[2], topk_ids.stride(0),
            topk_weights.stride(0), DOWN_QTYPE=int(down_qtype), HAS_HOST=has_host, BLOCK_N=bn, ACT_Q8=q8_down,
            ASM=use_asm(x), CPI=chunks_per_iteration(n_ff, cpi), num_warps=num_warps, **pdl.flags(h))
    if reduce:
        _sum_topk_kernel[(T_, triton.cdiv(n_embd, 1024))](part, y, topk, n_embd, y.stride(0), BLOCK=1024,
                                                          num_warps=4, **pdl.flags(part))
    return y
