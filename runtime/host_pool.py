"""Host memory for conversation states: slots of one fixed layout in pinned slabs, reused.

Why: each snapshot used to take pinned buffers of its own (``runtime.pinned.pinned_empty``: an
mmap whose pages are faulted in and locked by ``cudaHostRegister``), and a long conversation's
state is most of a gigabyte: faulting in fresh pages costs several times a copy into buffers
touched before, and the turn after a new conversation's first paid the registration too
(BENCHMARKS.md, issue 42). Here the registration is paid once per slab,
freed slots go back to a free list, and ``grow`` can be called from a thread of its own, so the
pool is ready before the engine asks.

A slot is one item of each tensor of the layout (``tensor(slot, j)``); the slots of a slab lie
one after the other in each tensor's region, so a run of consecutive slots of one slab is one
tensor ``[n, *shape]`` (``run``): a conversation's blocks cross PCIe in a few bulk copies.
Every pool of a cache draws on one ``HostBudget``: what ``--cache-ram`` allows.
"""
from __future__ import annotations

import bisect
import math
import threading

import torch

from .pinned import REGISTERING, pinned_empty

Layout = list[tuple[tuple[int, ...], torch.dtype]]
SLAB_BYTES = 256 << 20  # one registration per slab; slots of at least this size get a slab each
_ALIGN = 64


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class HostBudget:
    """The bytes all pools of a cache may allocate together (a slab's stay claimed: slabs are
    reused; only a claim whose allocation failed is given back)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.allocated = 0
        self.lock = threading.Lock()

    def claim(self, nbytes: int) -> bool:
        with self.lock:
            if self.allocated + nbytes > self.limit:
                return False
            self.allocated += nbytes
            return True

    def release(self, nbytes: int) -> None:
        """Give back a claim whose allocation failed."""
        with self.lock:
            self.allocated -= nbytes


class SlotPool:
    """Slots of ``layout`` in slabs of ``per_slab`` slots drawn from ``budget``; ``pin``: page-locked
    (on a GPU, so copies to and from it run without the host waiting). Thread-safe: ``grow`` may run
    in another thread than ``take`` and ``give``."""

    def __init__(self, layout: Layout, budget: HostBudget, pin: bool):
        self.layout = layout
        self.budget = budget
        self.pin = pin
        self.sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in layout]
        self.slot_bytes = sum(self.sizes)
        self.per_slab = 0  # fixed by the first ``grow``, from the budget then
        self.slabs: list[list[torch.Tensor]] = []  # per slab: one [per_slab, *shape] tensor per layout item
        self.free: list[int] = []  # ascending: the lowest first, so that new blocks tend to form runs
        self.lock = threading.Lock()

    @property
    def slots(self) -> int:
        return len(self.slabs) * self.per_slab

    @property
    def used(self) -> int:
        return self.slots - len(self.free)

    def grow(self) -> bool:
        """One more slab, if the budget allows (False otherwise). Registers it outside the lock.
        A slab is ``SLAB_BYTES``, or a sixteenth of a smaller budget (whole slots)."""
        if not self.per_slab:
            self.per_slab = max(1, min(SLAB_BYTES, self.budget.limit // 16) // max(1, self.slot_bytes))
        regions = [_padded(self.per_slab * size) for size in self.sizes]  # each aligned for its dtype
        if not self.budget.claim(sum(regions)):
            return False
        try:
            with REGISTERING:  # (may run in the reserve's thread, never during a capture)
                raw = pinned_empty(sum(regions), self.pin, tidy=False)
        except (OSError, RuntimeError):  # (the host is out of memory it can pin): as if over budget
            self.budget.release(sum(regions))
            return False
        tensors, at = [], 0
        for (shape, dtype), size, region in zip(self.layout, self.sizes, regions):
            tensors.append(raw[at: at + self.per_slab * size].view(dtype).view(self.per_slab, *shape))
            at += region
        with self.lock:
            first = len(self.slabs) * self.per_slab
            self.slabs.append(tensors)
            for s in range(first, first + self.per_slab):
                bisect.insort(self.free, s)
        return True

    def take(self, n: int) -> list[int] | None:
        """``n`` free slots (growing the pool as far as the budget allows), or None and nothing taken."""
        while True:
            with self.lock:
                if len(self.free) >= n:
                    out, self.free = self.free[:n], self.free[n:]
                    return out
            if not self.grow():
                return None

    def give(self, slots: list[int]) -> None:
        with self.lock:
            for s in slots:
                bisect.insort(self.free, s)

    def tensor(self, slot: int, j: int) -> torch.Tensor:
        """Layout item ``j`` of ``slot``."""
        return self.slabs[slot // self.per_slab][j][slot % self.per_slab]

    def run(self, slot: int, n: int, j: int) -> torch.Tensor:
        """Layout item ``j`` of slots ``slot .. slot + n - 1`` (one slab: ``runs``) as ``[n, *shape]``."""
        i = slot % self.per_slab
        return self.slabs[slot // self.per_slab][j][i: i + n]

    def runs(self, slots: list[int], longest: int) -> list[tuple[int, int, int]]:
        """``slots`` cut into runs of consecutive slots of one slab, at most ``longest`` long:
        (index in ``slots``, first slot, length)."""
        out: list[tuple[int, int, int]] = []
        for i, s in enumerate(slots):
            if out and out[-1][1] + out[-1][2] == s and s % self.per_slab and out[-1][2] < longest:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
            else:
                out.append((i, s, 1))
        return out
