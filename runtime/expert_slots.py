"""Which expert sits in which device slot, and why: the hot set, the cache slots and their policy.

The slot table (int32 ``[n_layer, n_expert]``) says where each expert is when a MoE layer runs:
its unit offset in the device pool (``>= 0``: hot, or cached in a spare slot), ``-(h + 1)`` for
unit offset ``h`` in the pinned host pool when cold experts are read there by the kernel
(zero-copy), or ``NOT_RESIDENT``. Hot experts never move. The cache slots take cold experts:
the least recently used slot gives way when a layer's misses are copied in before it runs
(``lru_victim``), and when misses are read zero-copy an expert is admitted only when it keeps
being routed (``admit``, with ``formats.placement``'s decayed counts: ``FREQ_DECAY``,
``ADMIT_MIN``): a copy costs the PCIe bytes of a zero-copy read, so it must be read from the
slot again to pay. Pure bookkeeping on numpy arrays; the store (``runtime.expert_store``)
moves the bytes and uploads the table (``runtime.expert_tables``).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

NOT_RESIDENT = -(2**31)  # table entry of an expert in neither pool (disk tier, async mode)


class ExpertSlots:
    """The table ``table`` (written in place: a view of the pinned memory the kernels' copy is
    uploaded from) for hot experts at ``hot_offset`` (unit offsets, -1 for the rest), cache slots
    at ``cache_offset`` and, where cold experts are read zero-copy, their host pool offsets
    ``host_offset`` (else None: a cold expert is ``NOT_RESIDENT``)."""

    def __init__(self, table: np.ndarray, hot_offset: np.ndarray, cache_offset: np.ndarray,
                 host_offset: np.ndarray | None):
        self.table = table
        self.hot = hot_offset >= 0
        self.cache = cache_offset
        self.host = host_offset
        self.owner: list[tuple[int, int] | None] = [None] * len(cache_offset)  # cache slot -> expert
        self.slot_of = np.full(table.shape, -1, dtype=np.int64)  # expert -> its cache slot
        self.lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(len(cache_offset)))
        self.freq = np.zeros(table.shape)  # decayed routing counts (zero-copy admission)
        table[...] = NOT_RESIDENT
        table[self.hot] = hot_offset[self.hot]
        if host_offset is not None:
            cold = host_offset >= 0
            table[cold] = -(host_offset[cold] + 1)

    @property
    def n_cache(self) -> int:
        return len(self.cache)

    def cold_entry(self, layer: int, expert: int) -> int:
        """The table entry of a cold expert: its host pool offset, or ``NOT_RESIDENT``."""
        h = -1 if self.host is None else int(self.host[layer, expert])
        return -(h + 1) if h >= 0 else NOT_RESIDENT

    def cached(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Cache slots of those of ``experts`` (of ``layer``) that are cached."""
        slots = self.slot_of[layer, experts]
        return slots[slots >= 0]

    def evict(self, slot: int) -> None:
        """The slot's expert (if any) is read from the host pool again, or not at all."""
        old = self.owner[slot]
        if old is not None:
            self.table[old] = self.cold_entry(*old)
            self.slot_of[old] = -1
            self.owner[slot] = None

    def touch(self, slot: int) -> None:
        self.lru.move_to_end(slot)

    def lru_victim(self, protect: set[int]) -> int:
        """The least recently used cache slot not in ``protect`` (the slots the layer being served
        reads), emptied and marked used."""
        for slot in self.lru:
            if slot not in protect:
                break
        else:  # pragma: no cover - guarded by the slot count check
            raise RuntimeError("no free cache slot")
        self.evict(slot)
        self.lru.move_to_end(slot)
        return slot

    def fill(self, slot: int, layer: int, expert: int, publish: bool = True) -> None:
        """``slot`` now holds the expert; ``publish`` False leaves its table entry for ``publish``
        once the copy is known to be complete."""
        self.owner[slot] = (layer, expert)
        self.slot_of[layer, expert] = slot
        if publish:
            self.publish(layer, expert, slot)

    def publish(self, layer: int, expert: int, slot: int) -> None:
        self.table[layer, expert] = self.cache[slot]

    def admit(self, candidates: np.ndarray) -> list[tuple[int, int, int]]:
        """Frequency-aware admission of missed experts ``candidates`` (``[n, 2]`` (layer, expert)
        rows): a candidate replaces the cached expert with the lowest decayed routing count, and
        only if it is routed more often, so one-off misses never evict anything. The victims are
        evicted; returns the moves ``(layer, expert, slot)`` for the caller to copy."""
        scores = np.array([-1.0 if o is None else self.freq[o] for o in self.owner])
        cand_score = self.freq[candidates[:, 0], candidates[:, 1]]
        moves = []
        for k in np.argsort(-cand_score, kind="stable"):
            v = int(np.argmin(scores))
            if cand_score[k] <= scores[v]:
                break
            self.evict(v)
            scores[v] = np.inf  # filled now: not evicted again in this step
            moves.append((int(candidates[k, 0]), int(candidates[k, 1]), v))
        return moves
