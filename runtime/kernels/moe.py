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
   unlike atomics; the scratch is only T*k*n_embd*4 bytes).

The first two reuse the per-family unpacking of ``qmatvec`` (one compiled variant per quant type).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.qmatvec import SUPPORTED_QTYPES, _output, _row_dot, row_bytes_of, rows_per_program


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
def _gate_up_kernel(x_ptr, ids_ptr, slot_ptr, gate_ptr, up_ptr, gate_h_ptr, up_h_ptr, h_ptr, count_ptr,
                    TOPK, N_FF, K, gate_slot_bytes, up_slot_bytes, up_row0, gate_row_bytes, up_row_bytes,
                    stride_x, stride_ids,
                    GATE_QTYPE: tl.constexpr, UP_QTYPE: tl.constexpr, HAS_HOST: tl.constexpr,
                    HAS_COUNT: tl.constexpr, BLOCK_N: tl.constexpr):
    pair = tl.program_id(0)
    t = pair // TOPK
    j = pair % TOPK
    expert = tl.load(ids_ptr + t * stride_ids + j)
    if HAS_COUNT:
        if tl.program_id(1) == 0:  # one count per (token, choice): the store's routing statistics
            tl.atomic_add(count_ptr + expert, 1)
    slot = tl.load(slot_ptr + expert).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n3 = n[:, None, None]
    # Without a host pool a non-resident expert (slot < 0) reads nothing (zero valid rows) and
    # yields zeros; the caller guarantees residency before launch (validate=True checks it).
    rmask = n3 < tl.where((slot >= 0) | HAS_HOST, N_FF, 0)
    g_rows = _slot_base(slot, gate_ptr, gate_h_ptr, gate_slot_bytes, HAS_HOST) + n3.to(tl.int64) * gate_row_bytes
    u_rows = _slot_base(slot, up_ptr, up_h_ptr, up_slot_bytes, HAS_HOST) + (n3 + up_row0).to(tl.int64) * up_row_bytes
    x_row = x_ptr + t * stride_x
    g = _row_dot(GATE_QTYPE, g_rows, rmask, x_row, K, BLOCK_N)
    u = _row_dot(UP_QTYPE, u_rows, rmask, x_row, K, BLOCK_N)
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(h_ptr + pair.to(tl.int64) * N_FF + n, h, mask=n < N_FF)


@triton.jit
def _down_kernel(h_ptr, ids_ptr, wts_ptr, slot_ptr, down_ptr, down_h_ptr, part_ptr,
                 TOPK, N_EMBD, N_FF, down_slot_bytes, down_row_bytes, stride_ids, stride_wts,
                 DOWN_QTYPE: tl.constexpr, HAS_HOST: tl.constexpr, BLOCK_N: tl.constexpr):
    pair = tl.program_id(0)
    t = pair // TOPK
    j = pair % TOPK
    expert = tl.load(ids_ptr + t * stride_ids + j)
    weight = tl.load(wts_ptr + t * stride_wts + j).to(tl.float32)
    slot = tl.load(slot_ptr + expert).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n3 = n[:, None, None]
    rmask = n3 < tl.where((slot >= 0) | HAS_HOST, N_EMBD, 0)
    rows = _slot_base(slot, down_ptr, down_h_ptr, down_slot_bytes, HAS_HOST) + n3.to(tl.int64) * down_row_bytes
    h_row = h_ptr + pair.to(tl.int64) * N_FF
    part = weight * _row_dot(DOWN_QTYPE, rows, rmask, h_row, N_FF, BLOCK_N)
    tl.store(part_ptr + pair.to(tl.int64) * N_EMBD + n, part, mask=n < N_EMBD)


@triton.jit
def _sum_topk_kernel(part_ptr, y_ptr, TOPK, N_EMBD, stride_y, BLOCK: tl.constexpr):
    """y[t] = sum over j = 0..k-1, in that order, of the weighted expert outputs."""
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(0, TOPK):
        acc += tl.load(part_ptr + (t * TOPK + j).to(tl.int64) * N_EMBD + n, mask=n < N_EMBD, other=0.0)
    tl.store(y_ptr + t * stride_y + n, acc, mask=n < N_EMBD)


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
                counts: torch.Tensor | None = None, num_warps: int | None = None) -> torch.Tensor:
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
    y = _output(out, (T_, n_embd), x.device)
    if T_ == 0 or topk == 0:
        return y.zero_()
    h = torch.empty((T_ * topk, n_ff), dtype=torch.float32, device=x.device)
    rows, warps = _launch(T_ * topk)
    bn = block_n or rows_per_program(x.device, rows)
    num_warps = num_warps or warps
    has_host = host is not None
    _gate_up_kernel[(T_ * topk, triton.cdiv(n_ff, bn))](
        x, topk_ids, slot_table, gate_raw, up_raw, gate_h, up_h, h, counts if counts is not None else slot_table,
        topk, n_ff, n_embd, gate_raw.stride(0), up_raw.stride(0), up_row0,
        gate_raw.shape[2], up_raw.shape[2], x.stride(0), topk_ids.stride(0),
        GATE_QTYPE=int(gate_qtype), UP_QTYPE=int(up_qtype), HAS_HOST=has_host, HAS_COUNT=counts is not None,
        BLOCK_N=bn, num_warps=num_warps)
    part = torch.empty((T_ * topk, n_embd), dtype=torch.float32, device=x.device)
    _down_kernel[(T_ * topk, triton.cdiv(n_embd, bn))](
        h, topk_ids, topk_weights, slot_table, down_raw, down_h, part,
        topk, n_embd, n_ff, down_raw.stride(0), down_raw.shape[2], topk_ids.stride(0),
        topk_weights.stride(0), DOWN_QTYPE=int(down_qtype), HAS_HOST=has_host, BLOCK_N=bn, num_warps=num_warps)
    _sum_topk_kernel[(T_, triton.cdiv(n_embd, 1024))](part, y, topk, n_embd, y.stride(0), BLOCK=1024, num_warps=4)
    return y
