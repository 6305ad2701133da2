"""Where experts' bytes live: the device pool, the host pool of cold experts, the disk tier.

A pool is one flat uint8 tensor addressed in units of ``unit`` bytes: an expert of layer ``l``
takes ``units[l]`` units at a unit offset, and ``PoolLayout`` says which. The device pool holds
the hot experts, packed by size, then ``n_slots`` spare slots of the largest size (the cache
slots: any layer's expert fits one). The host pool holds every cold expert in pinned memory the
GPU reads directly. When host memory cannot hold them, cold experts are read from the file
through a bounded pinned cache instead (the disk tier). The slot table the kernels read holds
these unit offsets (``runtime.expert_slots``), and the kernels address an expert at ``offset *
unit`` bytes into a pool (``runtime.expert_tables``).

Where later work fits: re-placing the hot set between requests is new hot offsets under the same
layout rules and copies into the device pool; staging a layer's cold experts before its MoE runs
is more spare slots after the cache slots.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from .expert_source import ExpertSource
from .pinned import pinned_empty

if TYPE_CHECKING:
    from .expert_tables import ExpertLayer
    from .kernels.moe import ExpertPools


@dataclass(frozen=True)
class PoolLayout:
    """Where experts sit in one pool, in units of ``unit`` bytes."""

    unit: int
    units: dict[int, int]  # MoE layer -> units one of its experts takes
    offset: np.ndarray  # int64 [n_layer, n_expert]: unit offset of each expert placed here, -1 elsewhere
    slots: np.ndarray  # int64 [n_slots]: unit offsets of the spare slots (the largest size each)
    n_units: int

    @property
    def nbytes(self) -> int:
        return self.n_units * self.unit

    @property
    def slot_units(self) -> int:
        """Units of one spare slot: the largest expert's."""
        return max(self.units.values(), default=0)

    def placed(self) -> list[tuple[int, int]]:
        """The experts placed here, ``(layer, expert)``, in pool order."""
        il, e = np.nonzero(self.offset >= 0)
        order = np.argsort(self.offset[il, e], kind="stable")
        return list(zip(il[order].tolist(), e[order].tolist()))


def layout_pool(place: np.ndarray, units: dict[int, int], unit: int, n_slots: int = 0) -> PoolLayout:
    """The experts ``place`` marks (bool ``[n_layer, n_expert]``, MoE layers only), packed: the
    largest first, each size in (layer, expert) order, so the experts of one size stay together;
    then ``n_slots`` spare slots of the largest size."""
    offset = np.full(place.shape, -1, dtype=np.int64)
    at = 0
    for size in sorted(set(units.values()), reverse=True):
        for il in sorted(il for il, u in units.items() if u == size):
            experts = np.flatnonzero(place[il])
            offset[il, experts] = at + size * np.arange(len(experts))
            at += size * len(experts)
    slot = max(units.values(), default=0)
    slots = at + slot * np.arange(n_slots, dtype=np.int64)
    return PoolLayout(unit, dict(units), offset, slots, at + slot * n_slots)


def read_experts(source: ExpertSource, jobs: list[tuple[int, int, np.ndarray]]) -> None:
    """Read experts into their buffers, ``(layer, expert, out)``, several at a time (a pack
    verifies each shard's checksum as it is read)."""
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as ex:
        list(ex.map(lambda job: source.read(*job), jobs))


def fill_device_pool(source: ExpertSource, layout: PoolLayout, pool: torch.Tensor, nbytes: dict[int, int],
                     pin: bool, chunk: int = 64) -> None:
    """Read the experts ``layout`` places into the device ``pool``, ``chunk`` at a time through a
    (pinned) host staging buffer: experts adjacent in the layout are adjacent in the pool, so a
    chunk is one copy."""
    placed = layout.placed()
    if not placed:
        return
    U = layout.unit
    staging = pinned_empty(min(len(placed), chunk) * layout.slot_units * U, pin)
    stage_np = staging.numpy()
    for i in range(0, len(placed), chunk):
        part = placed[i: i + chunk]
        first = int(layout.offset[part[0]])
        end = int(layout.offset[part[-1]]) + layout.units[part[-1][0]]
        jobs = []
        for il, e in part:
            at = (int(layout.offset[il, e]) - first) * U
            jobs.append((il, e, stage_np[at: at + nbytes[il]]))
        read_experts(source, jobs)
        pool[first * U: end * U].copy_(staging[: (end - first) * U])


class ColdTier(Protocol):
    """Where the store finds cold experts' bytes: to copy into a device slot, for the kernel to
    read in place, and where re-placement puts a demoted expert's bytes."""

    pinned: bool  # the bytes are in pinned memory: copies may be asynchronous
    kind: str  # what ``ExpertStore.describe`` calls it: "pinned", "file" (no cold experts), "disk"

    @property
    def host_bytes(self) -> int:
        """The host memory the tier holds at most (what a user's RAM must have room for)."""
        ...

    def bytes(self, layer: int, expert: int) -> tuple[torch.Tensor, bool]:
        """The expert's bytes (a buffer at least that long), and whether the file was read for them."""
        ...

    def kernel_pool(self) -> torch.Tensor | None:
        """The host pool the kernels read every cold expert from in place (zero-copy), or None."""
        ...

    def kernel_view(self, layer: int, experts: np.ndarray, row: np.ndarray, la: ExpertLayer, slot_units: int,
                    pin: bool) -> tuple[ExpertPools, torch.Tensor | None, int]:
        """The pools a fused kernel reads ``experts`` of ``layer`` from host memory with, their
        entries written into the one-off table ``row``; the host buffer the kernel reads (to keep
        alive until it ran) or None; the file reads it took."""
        ...

    def demoted_home(self, layer: int, expert: int) -> torch.Tensor | None:
        """Re-placement: the host range cold expert (layer, expert) leaves when promoted, which the
        demoted expert's bytes then take; None where the tier keeps no copy (read from the file)."""
        ...

    def swapped(self, promoted: tuple[int, int], demoted: tuple[int, int]) -> None:
        """Re-placement done: the demoted expert now lives at the promoted one's ``demoted_home``."""
        ...


class HostPool:
    """Every cold expert in host memory (pinned on a GPU: the kernels read it over PCIe)."""

    def __init__(self, source: ExpertSource, layout: PoolLayout, nbytes: dict[int, int], pin: bool):
        self.layout, self.nbytes, self.pinned = layout, nbytes, pin
        self.tensor = pinned_empty(layout.nbytes, pin)  # exactly its size (runtime.pinned)
        self.kind = "pinned" if layout.n_units else "file"
        flat = self.tensor.numpy()
        U = layout.unit
        read_experts(source, [(il, e, flat[int(layout.offset[il, e]) * U:][: nbytes[il]])
                              for il, e in layout.placed()])

    @property
    def host_bytes(self) -> int:
        return self.tensor.numel()

    def bytes(self, layer: int, expert: int) -> tuple[torch.Tensor, bool]:
        at = int(self.layout.offset[layer, expert]) * self.layout.unit
        return self.tensor[at: at + self.nbytes[layer]], False

    def kernel_pool(self) -> torch.Tensor | None:
        return self.tensor if self.layout.n_units else None

    def kernel_view(self, layer, experts, row, la, slot_units, pin):
        row[experts] = -(self.layout.offset[layer, experts] + 1)
        return la.host_pools, None, 0

    def demoted_home(self, layer: int, expert: int) -> torch.Tensor | None:
        at = int(self.layout.offset[layer, expert]) * self.layout.unit
        return self.tensor[at: at + self.layout.units[layer] * self.layout.unit]

    def swapped(self, promoted: tuple[int, int], demoted: tuple[int, int]) -> None:
        off = self.layout.offset
        off[demoted], off[promoted] = off[promoted], -1


class DiskTier:
    """Cold experts read from the file on demand, the last ``cap`` kept in (pinned) host buffers
    of ``slot_bytes`` each; ``cap`` 0 keeps none (every read is a fresh buffer)."""

    kind = "disk"

    def __init__(self, source: ExpertSource, nbytes: dict[int, int], slot_bytes: int, cap: int, pin: bool,
                 before_reuse: Callable[[], None] = lambda: None):
        self.source, self.nbytes, self.slot_bytes = source, nbytes, slot_bytes
        self.cap, self.pinned = cap, pin
        self.before_reuse = before_reuse  # a buffer about to be rewritten may still feed a copy
        self.cache: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()

    @property
    def host_bytes(self) -> int:
        return self.cap * self.slot_bytes

    def bytes(self, layer: int, expert: int) -> tuple[torch.Tensor, bool]:
        key = (layer, expert)
        buf = self.cache.get(key)
        if buf is not None:
            self.cache.move_to_end(key)
            return buf, False
        if not self.cap:
            buf = torch.empty(self.slot_bytes, dtype=torch.uint8)
        elif len(self.cache) >= self.cap:
            _, buf = self.cache.popitem(last=False)
            self.before_reuse()
        else:
            buf = pinned_empty(self.slot_bytes, self.pinned)
        self.source.read(layer, expert, buf.numpy()[: self.nbytes[layer]])
        if self.cap:
            self.cache[key] = buf
        return buf, True

    def kernel_pool(self) -> torch.Tensor | None:
        return None

    def kernel_view(self, layer, experts, row, la, slot_units, pin):
        """The experts read (through this tier's buffers) into a staging buffer of slots."""
        staging = torch.empty(len(experts) * self.slot_bytes, dtype=torch.uint8, pin_memory=pin)
        reads = 0
        for i, e in enumerate(experts.tolist()):
            buf, read = self.bytes(layer, e)
            reads += read
            staging[i * self.slot_bytes: (i + 1) * self.slot_bytes].copy_(buf[: self.slot_bytes])
        row[experts] = -(slot_units * np.arange(len(experts)) + 1)
        return la.with_host(staging, self.slot_bytes // slot_units), staging, reads

    def demoted_home(self, layer: int, expert: int) -> torch.Tensor | None:
        return None

    def swapped(self, promoted: tuple[int, int], demoted: tuple[int, int]) -> None:
        pass


def cold_tier(source: ExpertSource, layout: PoolLayout, nbytes: dict[int, int], host_bytes: int | None,
              host_all: bool, slot_bytes: int, pin: bool, copies_done: Callable[[], None]) -> ColdTier:
    """Every cold expert in (pinned) host memory when host RAM allows (``host_all``), else the disk
    tier: a host cache of ``host_bytes`` in slots of ``slot_bytes`` over the file, whose reused
    buffers wait for ``copies_done`` (the copies still reading them)."""
    if host_all:
        return HostPool(source, layout, nbytes, pin)
    cap = max(1, int(host_bytes or 0) // max(slot_bytes, 1))
    return DiskTier(source, nbytes, slot_bytes, cap, pin, copies_done)
