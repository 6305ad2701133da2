"""Where an expert's bytes are: the per-layer slot table and the weight pools it points into.

Hot (pinned) and cached experts live in the same uint8 pools ``[n_slots, rows, row_bytes]``, and
every MoE kernel finds expert ``e`` at ``slot_table[e]``, so every expert takes one code path
whatever its residency. With a host pool (pinned host memory the GPU can address, same layout) a
negative entry ``-(h + 1)`` sends the kernel to host slot ``h``: a cold expert is then read over
PCIe inside the kernel (zero-copy). Shared by the one-token kernels (``moe.py``) and the grouped
prefill kernels (``moe_grouped.py``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .blocks import SUPPORTED_QTYPES, row_bytes_of


@triton.jit
def slot_base(slot, dev_ptr, host_ptr, slot_bytes, HAS_HOST: tl.constexpr):
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
