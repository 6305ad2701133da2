"""The expert cache's policies: which cold experts the spare device slots hold, and which gives way.

The hot set is the long-term choice (the profile, ``formats.placement``); the cache slots do the
short-term part. This module is the one place their policy lives: the expert store
(``runtime.expert_slots``, ``runtime.expert_misses``) and the trace simulator that ``repack
calibrate --eval`` runs (``calibrate.cache_policies``) both keep their slots in a ``SlotCache``
run by one of the policies below, so what the simulator reports is what the store does.

A policy is one scoring method, as SGLang's eviction strategies are: ``priority`` gives each slot a
number, the lowest gives way first, ties going to the least recently used slot. Policies:

  lru   the least recently used slot gives way; every miss is copied in (the store's async misses).
  lfu   the slot whose expert was routed least often so far gives way; every miss is copied in.
  freq  frequency-aware admission (the store's zero-copy misses): routing counts decay by
        ``FREQ_DECAY`` a token, and a missed expert is copied in only once its decayed count
        reaches ``ADMIT_MIN`` and exceeds that of the cached expert with the lowest count, which
        it replaces. One-off misses never evict anything: a copy costs the PCIe bytes of a
        zero-copy read, so it must be read from the slot again to pay.

Pure numpy bookkeeping over integer keys (one per (layer, expert)); whoever owns the slots moves
the bytes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

# Zero-copy admission: counts decay by FREQ_DECAY per token (a memory of ~20 tokens), and a missed
# expert must reach ADMIT_MIN (routed three times lately) to be copied into a slot: a copy costs
# the PCIe bytes of a zero-copy read, so it pays only if the slot is read again; a lower threshold
# copies experts that are not, and decodes slower than no cache slots at all (BENCHMARKS.md).
FREQ_DECAY = 0.95
ADMIT_MIN = 3.0


class SlotPolicy(ABC):
    """How a slot cache learns from routings and which of its entries gives way."""

    name: ClassVar[str]
    copies_every_miss: ClassVar[bool] = True  # False: a miss is copied in only when ``admit`` takes it
    decay: ClassVar[float] = 1.0  # routing counts are multiplied by this before each step's are added
    admit_min: ClassVar[float] = 0.0  # the count a missed expert needs before ``admit`` takes it

    @abstractmethod
    def priority(self, owner: np.ndarray, used: np.ndarray, count: np.ndarray) -> np.ndarray:
        """Per entry (float) from its key ``owner`` (-1: an empty slot), the order of its last use
        ``used`` and the routing counts per key ``count`` (flat): the lowest gives way first."""


class LRU(SlotPolicy):
    name = "lru"

    def priority(self, owner, used, count):
        return used.astype(np.float64)


class LFU(SlotPolicy):
    name = "lfu"

    def priority(self, owner, used, count):
        return np.where(owner >= 0, count[np.maximum(owner, 0)], -1.0)


class FrequentAdmission(SlotPolicy):
    name = "freq"
    copies_every_miss = False
    decay = FREQ_DECAY
    admit_min = ADMIT_MIN

    def priority(self, owner, used, count):
        return np.where(owner >= 0, count[np.maximum(owner, 0)], -1.0)


POLICIES: dict[str, type[SlotPolicy]] = {p.name: p for p in (LRU, LFU, FrequentAdmission)}


class SlotCache:
    """``n_slots`` slots, each holding one key (``owner``, -1 empty) with the order of its last use
    (``used``: slots start in slot order), and the routing counts ``count`` per key (shape
    ``shape``: a key is a flat index into it)."""

    def __init__(self, n_slots: int, shape: tuple[int, ...], policy: SlotPolicy):
        self.policy = policy
        self.owner = np.full(n_slots, -1, dtype=np.int64)
        self.used = np.arange(n_slots, dtype=np.int64)
        self.clock = n_slots
        self.count = np.zeros(shape)
        self._flat = self.count.reshape(-1)  # a view: one index per key

    @property
    def n_slots(self) -> int:
        return len(self.owner)

    def priority(self) -> np.ndarray:
        return self.policy.priority(self.owner, self.used, self._flat)

    def learn(self, keys: np.ndarray, counts: np.ndarray) -> None:
        """A step routed ``keys`` (distinct flat keys) ``counts`` times each."""
        if self.policy.decay != 1.0:
            self.count *= self.policy.decay
        self._flat[keys] += counts

    def forget(self) -> None:
        self.count[...] = 0

    def use(self, slot: int, at: int | None = None) -> None:
        """The slot was read (or filled) now, or at the order ``at`` a caller stamps."""
        if at is None:
            at, self.clock = self.clock, self.clock + 1
        self.used[slot] = at

    def victim(self, protect: np.ndarray | None = None, incoming: tuple[int, int] | None = None) -> int:
        """The slot that gives way: the lowest priority, then the least recently used, among the
        slots ``protect`` (bool per slot) leaves; among all when it leaves none. ``incoming``
        (key, use order): a key about to come in, scored with them; -1 when it is the lowest."""
        score = self.priority()
        if protect is not None and not protect.all():
            score = np.where(protect, np.inf, score)
        used = self.used
        if incoming is not None:
            key, at = incoming
            score = np.append(score, self.policy.priority(np.array([key]), np.array([at]), self._flat))
            used = np.append(used, at)
        lowest = np.flatnonzero(score == score.min())
        v = int(lowest[np.argmin(used[lowest])])
        return -1 if v == self.n_slots else v

    def admit(self, candidates: np.ndarray) -> list[tuple[int, int]]:
        """Frequency-aware admission of missed keys ``candidates`` (ascending): those counted at
        least ``admit_min``, strongest first (ties: in key order), each replacing the slot of the
        lowest priority only if routed more often; a slot filled in this call is not given up
        again in it. Returns ``(key, slot)`` for the caller to evict and fill."""
        cand = candidates[self._flat[candidates] >= self.policy.admit_min]
        if not len(cand) or not self.n_slots:
            return []
        score = self.priority()
        cand_score = self._flat[cand]
        moves = []
        for k in np.argsort(-cand_score, kind="stable"):
            lowest = np.flatnonzero(score == score.min())
            v = int(lowest[np.argmin(self.used[lowest])])
            if cand_score[k] <= score[v]:
                break  # the rest are weaker still, and the weakest slot only gets stronger
            score[v] = np.inf  # filled now: not given up again in this step
            moves.append((int(cand[k]), v))
        return moves
