"""Copy a layer's predicted cold experts into reserved device slots, choosing them on the device.

Why a kernel and not ``copy_``: which experts to copy is known only on the GPU (a router guess
computed inside a captured decode step), and a CUDA graph replays fixed copy addresses. So one
launch reads the guessed ids and the layer's slot table, and for every guessed expert that lives
in the pinned host pool (table entry ``-(h + 1)``) its programs copy host slot ``h`` into device
slot ``first_slot + j`` (j = the guess's rank) and point an effective copy of the table row at it.
The MoE kernel then reads that row: a good guess is served from VRAM, a wrong one changes nothing
(the routed expert is still read from host memory), and the bytes, hence the results, are the same.

Programs: ``(guess j, chunk c)``; each chunk copies every ``n_chunks``-th block of the slot, so
a few dozen programs keep enough PCIe reads in flight while leaving most SMs to the main stream.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import wait_prior


@triton.jit
def _prefetch_kernel(ids_ptr, table_ptr, eff_ptr, host_ptr, dev_ptr, first_slot, slot_words, N_CHUNKS,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    j = tl.program_id(0)
    c = tl.program_id(1)
    expert = tl.load(ids_ptr + j)
    slot = tl.load(table_ptr + expert)
    if slot < 0:
        dst_slot = first_slot + j
        if c == 0:
            tl.store(eff_ptr + expert, dst_slot)
        src = host_ptr + (-slot - 1).to(tl.int64) * slot_words
        dst = dev_ptr + dst_slot.to(tl.int64) * slot_words
        for start in range(c * BLOCK, slot_words, N_CHUNKS * BLOCK):
            o = start + tl.arange(0, BLOCK)
            m = o < slot_words
            tl.store(dst + o, tl.load(src + o, mask=m), mask=m)


def prefetch_experts(ids: torch.Tensor, table_row: torch.Tensor, eff_row: torch.Tensor, host_pool: torch.Tensor,
                     pool: torch.Tensor, first_slot: int, n_chunks: int | None = None) -> None:
    """Copy the host-resident experts among ``ids`` into ``pool[first_slot + j]`` and write
    ``eff_row`` = ``table_row`` with those experts pointed at their new slots.

    ids: int [k] distinct expert ids (a router's top-k); table_row: int32 [n_expert] (slot >= 0
    on the device, ``-(h + 1)`` in ``host_pool`` row h); host_pool and pool: uint8 ``[n, slot_bytes]``
    (host_pool pinned when pool is on a GPU), ``slot_bytes`` a multiple of 16; ``pool`` has room
    for ``first_slot + k`` rows. Enqueued on the current stream; no host sync.
    """
    k = ids.numel()
    slot_bytes = pool.shape[1]
    if host_pool.shape[1] != slot_bytes or slot_bytes % 16:
        raise ValueError("host and device pools need the same slot size, a multiple of 16 bytes")
    if first_slot + k > pool.shape[0]:
        raise ValueError(f"pool has {pool.shape[0]} slots; prefetch needs {first_slot + k}")
    if table_row.dtype != torch.int32 or eff_row.dtype != torch.int32:
        raise ValueError("slot tables must be int32")
    eff_row.copy_(table_row)
    if k == 0:
        return
    words = slot_bytes // 4  # 4-byte words: contiguous, so the loads vectorise to 16 bytes
    # On the CPU (Triton's interpreter, CI) each program costs a Python re-entry: one per guess.
    chunks = n_chunks or (1 if pool.device.type == "cpu" else 16)
    _prefetch_kernel[(k, chunks)](ids.reshape(-1), table_row, eff_row, host_pool.view(torch.int32),
                                  pool.view(torch.int32), first_slot, words, chunks, BLOCK=1024, num_warps=4,
                                  **pdl.flags(ids))
