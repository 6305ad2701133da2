"""What the MoE kernels read: the slot table on the device and each layer's views of the pools.

The table lives in pinned host memory (``host``, written by ``runtime.expert_slots``) and on the
device (``device``, read by the kernels); ``upload`` sends the host copy without a host sync.
Each MoE layer's experts are seen through views of the device pool (and the host pool) in the
kernels' ``[n_slots, rows, row_bytes]`` form, one per role, with the pool's unit as the slot
stride: the kernel finds expert ``e`` at ``table[e] * unit`` bytes, whatever its residency.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from sparkpack.formats.experts import ROLE_ORDER, ExpertPart
from sparkpack.formats.quants import KERNEL_QTYPES, quant_name

from .expert_slots import NOT_RESIDENT
from .expert_source import ExpertSource

if TYPE_CHECKING:
    from .kernels.moe import ExpertPools


@dataclass
class ExpertLayer:
    """One MoE layer's experts as the store serves them."""

    parts: list[ExpertPart]
    nbytes: int  # one expert's bytes
    fused: bool  # every part has a fused-kernel quant type
    pools: "ExpertPools | None" = None  # the device pool as the fused kernel reads it
    host_pools: "ExpertPools | None" = None  # the same, with the host pool beside it when there is one

    def bind(self, pool: torch.Tensor, host: torch.Tensor | None, unit: int) -> None:
        """Views of the pools for the fused kernel (its quant types and width too)."""
        from .kernels.moe import ExpertPools  # noqa: PLC0415 - triton import only when used

        q = {p.role: int(p.qtype) for p in self.parts}
        n_ff = (self.parts[0].shape[1] // 2) if "gate_up" in q else self.parts[0].shape[1]
        self.pools = ExpertPools(*kernel_views(pool, self.parts, unit), q.get("gate", q.get("gate_up")), q.get("up"),
                                 q["down"], n_ff)
        self.host_pools = self.with_host(host, unit) if host is not None else self.pools

    def with_host(self, host: torch.Tensor, unit: int) -> "ExpertPools":
        """The device pools with ``host`` (a flat host buffer laid out in ``unit`` slots) beside them."""
        return replace(self.pools, host=kernel_views(host, self.parts, unit))


def expert_layers(source: ExpertSource, moe_layers: list[int], want_fused: bool
                  ) -> tuple[dict[int, ExpertLayer], set[str]]:
    """Each MoE layer's parts and whether the fused kernel reads them (where ``want_fused``), and
    the names of the expert types it has no kernel for."""
    layers, slow = {}, set()
    for il in moe_layers:
        parts = source.layout(il)
        slow |= {quant_name(int(p.qtype)) for p in parts if int(p.qtype) not in KERNEL_QTYPES}
        ok = all(int(p.qtype) in KERNEL_QTYPES for p in parts)
        layers[il] = ExpertLayer(parts, sum(p.nbytes for p in parts), ok and want_fused)
    return layers, slow


def kernel_views(pool: torch.Tensor, parts: list[ExpertPart], unit: int) -> tuple:
    """``(gate, up, down)`` views of a flat pool as ``moe_experts`` takes them (``up`` None when
    the layer has one merged gate_up tensor), with slot stride ``unit``."""
    by = {p.role: p for p in parts}
    views = tuple(_role_view(pool, by[r], unit) for r in ROLE_ORDER if r in by)
    return views if len(views) == 3 else (views[0], None, views[1])


def _role_view(pool: torch.Tensor, p: ExpertPart, unit: int) -> torch.Tensor:
    """``[n, rows, row_bytes]`` view of one role's block at every unit offset ``0 .. n-1`` of a
    flat pool at which a whole expert fits."""
    n_in, n_out = p.shape
    row_bytes = p.nbytes // n_out
    n = max(0, (pool.numel() - p.offset - p.nbytes) // unit + 1)
    return pool.as_strided((n, n_out, row_bytes), (unit, row_bytes, 1), p.offset if n else 0)


class KernelTables:
    """The slot table in pinned host memory (``host``: the numpy array the slots write) and on the
    device (``device``)."""

    def __init__(self, shape: tuple[int, int], device: torch.device, pin: bool):
        self.pin = pin
        self.pinned = torch.full(shape, NOT_RESIDENT, dtype=torch.int32, pin_memory=pin)
        self.host = self.pinned.numpy()
        self.device: torch.Tensor | None = None
        self._on = device
        self._sent: torch.cuda.Event | None = None  # the last tracked upload from the pinned table

    def to_device(self) -> None:
        """The first copy on the device, once the slots have filled the host table."""
        self.device = self.pinned.to(self._on, copy=True)

    def upload(self, layer: int | None = None, track: bool = False) -> None:
        """Send the host table (or one layer's row) to the device without a host sync. ``track``:
        remember the copy, so that ``wait_sent`` can hold the host off the pinned table until it
        has been read (zero-copy bookkeeping rewrites the table while the device runs; the async
        mode's per-layer uploads are ordered by its host reads anyway)."""
        src = self.pinned if layer is None else self.pinned[layer]
        dst = self.device if layer is None else self.device[layer]
        dst.copy_(src, non_blocking=self.pin)
        if self.pin and track:
            self._sent = torch.cuda.Event()
            self._sent.record()

    def wait_sent(self) -> None:
        """Before the host rewrites the table: the last tracked upload has read it."""
        if self._sent is not None:
            self._sent.synchronize()
            self._sent = None

