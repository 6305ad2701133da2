"""Which expert sits in which device slot: the hot set, the cache slots and the table the kernels read.

The slot table (int32 ``[n_layer, n_expert]``) says where each expert is when a MoE layer runs:
its unit offset in the device pool (``>= 0``: hot, or cached in a spare slot), ``-(h + 1)`` for
unit offset ``h`` in the pinned host pool when cold experts are read there by the kernel
(zero-copy), or ``NOT_RESIDENT``. Hot experts never move. Which cold experts the cache slots take,
and which gives way, is the policy's (``formats.cache_policy``: the one home of the cache policy,
shared with the trace simulator of ``repack calibrate --eval``); the miss strategy picks it
(``runtime.expert_misses``). Pure bookkeeping on numpy arrays; the store (``runtime.expert_store``)
moves the bytes and uploads the table (``runtime.expert_tables``).
"""
from __future__ import annotations

import numpy as np

from sparkpack.formats.cache_policy import SlotCache, SlotPolicy

NOT_RESIDENT = -(2**31)  # table entry of an expert in neither pool (disk tier, async mode)


class ExpertSlots:
    """The table ``table`` (written in place: a view of the pinned memory the kernels' copy is
    uploaded from) for hot experts at ``hot_offset`` (unit offsets, -1 for the rest), cache slots
    at ``cache_offset`` run by ``policy`` and, where cold experts are read zero-copy, their host
    pool offsets ``host_offset`` (else None: a cold expert is ``NOT_RESIDENT``)."""

    def __init__(self, table: np.ndarray, hot_offset: np.ndarray, cache_offset: np.ndarray,
                 host_offset: np.ndarray | None, policy: SlotPolicy):
        self.table = table
        self.hot = hot_offset >= 0
        self.cache = cache_offset
        self.host = host_offset
        self.policy = SlotCache(len(cache_offset), table.shape, policy)  # keys: flat (layer, expert)
        self.slot_of = np.full(table.shape, -1, dtype=np.int64)  # expert -> its cache slot
        table[...] = NOT_RESIDENT
        table[self.hot] = hot_offset[self.hot]
        if host_offset is not None:
            cold = host_offset >= 0
            table[cold] = -(host_offset[cold] + 1)

    @property
    def n_cache(self) -> int:
        return len(self.cache)

    def owner(self, slot: int) -> tuple[int, int] | None:
        key = int(self.policy.owner[slot])
        return None if key < 0 else divmod(key, self.table.shape[1])

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
        old = self.owner(slot)
        if old is not None:
            self.table[old] = self.cold_entry(*old)
            self.slot_of[old] = -1
            self.policy.owner[slot] = -1

    def touch(self, slot: int) -> None:
        self.policy.use(slot)

    def victim(self, protect: set[int]) -> int:
        """The slot the policy gives up, not one in ``protect`` (the slots the layer being served
        reads), emptied and marked used."""
        mask = np.zeros(self.n_cache, dtype=bool)
        mask[list(protect)] = True
        if mask.all():  # pragma: no cover - guarded by the slot count check
            raise RuntimeError("no free cache slot")
        slot = self.policy.victim(mask)
        self.evict(slot)
        self.policy.use(slot)
        return slot

    def fill(self, slot: int, layer: int, expert: int, publish: bool = True) -> None:
        """``slot`` now holds the expert; ``publish`` False leaves its table entry for ``publish``
        once the copy is known to be complete."""
        self.policy.owner[slot] = layer * self.table.shape[1] + expert
        self.slot_of[layer, expert] = slot
        if publish:
            self.publish(layer, expert, slot)

    def publish(self, layer: int, expert: int, slot: int) -> None:
        self.table[layer, expert] = self.cache[slot]

    def admit(self, missed: np.ndarray) -> list[tuple[int, int, int]]:
        """The policy's admission of missed experts ``missed`` (ascending flat (layer, expert)
        keys); the slots given up are evicted. Returns the moves ``(layer, expert, slot)`` for the
        caller to copy."""
        moves = []
        for key, slot in self.policy.admit(missed):
            self.evict(slot)
            moves.append((*divmod(key, self.table.shape[1]), slot))
        return moves
