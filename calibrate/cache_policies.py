"""Cache-slot policies replayed on a routing trace: which cold experts the spare GPU slots hold.

The policies themselves are ``formats.cache_policy``'s, the ones the expert store runs: this module
only replays a trace through them, one token a step (the store learns from a step once it ran):

  lru   every missed expert is copied in; the least recently routed cached expert leaves.
  lfu   every missed expert is copied in; the cached expert routed least often so far leaves
        (ties: the least recent).
  freq  the store's zero-copy admission (``FrequentAdmission``: ``SlotCache.admit``, the very
        code the store runs): one-off misses never evict anything.

Slots are one pool shared by all MoE layers (the store's layout, ``shared=True``) or ``slots``
per layer. What it costs: *cold* routings (served from host memory: a stall in sync/async mode,
a PCIe read inside the kernel in zero-copy mode) and *copies* (experts copied into slots, each
one more PCIe transfer). Pure Python over the cold routings only, so a full-size model's trace
stays quick to replay.

Compared with ``bench/cache_policies.py`` (traces of tiny synthetic models with ``--skew
reference`` over the real corpora, hot set from SWE-bench problem statements, the runtime's
default slot count shared by all layers): on a 256-expert top-8 model (Qwen3.5/3.6's routing
shape) ``freq`` leaves about as many routings cold as LRU and LFU with far fewer copies, about
half the PCIe transfers. On a 128-expert top-8 model, whose routing is more concentrated, LRU
serves slightly more when the cold working set fits the slots, while ``freq`` still needs fewer
transfers where it does not. LFU never wins. So ``freq`` stays the store's policy. The synthetic router draws each token's experts independently, so
these traces underestimate the reuse between neighbouring tokens that real routers show, which
every policy would serve better.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparkpack.formats.cache_policy import POLICIES as POLICY_CLASSES
from sparkpack.formats.cache_policy import LRU, SlotCache

POLICIES = tuple(POLICY_CLASSES)


@dataclass(frozen=True)
class CacheResult:
    tokens: int
    routings: int
    cold: int  # routings whose expert was neither hot nor cached
    copies: int  # experts copied into a slot

    @property
    def cold_rate(self) -> float:
        return self.cold / self.routings if self.routings else 0.0

    @property
    def copies_per_token(self) -> float:
        return self.copies / self.tokens if self.tokens else 0.0


def simulate(ids: np.ndarray, hot: np.ndarray, slots: int, policy: str, shared: bool = True) -> CacheResult:
    """Replay ``ids [N, n_moe, k]`` (expert ids per token and MoE layer, a trace's ``ids``) against
    the hot mask ``hot [n_moe, n_expert]`` and ``slots`` cache slots run by ``policy``, one pool
    shared by all layers (``shared``, the store's layout) or ``slots`` per layer."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    ids = np.asarray(ids, dtype=np.int64)
    n, n_moe, k = ids.shape
    n_expert = hot.shape[1]
    keys = ids + (np.arange(n_moe) * n_expert)[None, :, None]  # one key per (layer, expert)
    cold_keys = np.where(hot.reshape(-1)[keys], -1, keys).reshape(n, n_moe * k)
    shape = (n_moe * n_expert,)
    pools = [SlotCache(slots, shape, POLICY_CLASSES[policy]()) for _ in range(1 if shared else n_moe)]
    pool_of = np.zeros(n_moe * n_expert, dtype=np.int64) if shared else np.arange(n_moe * n_expert) // n_expert
    slot_of = np.full(n_moe * n_expert, -1, dtype=np.int64)  # key -> its slot in its pool
    width = n_moe * k
    cold = copies = 0
    for t in range(n):
        row = [int(x) for x in cold_keys[t] if x >= 0]
        missed = [x for x in row if slot_of[x] < 0]
        cold += len(missed)
        for i, pool in enumerate(pools):
            routed = keys[t].reshape(-1) if shared else keys[t, i]
            pool.learn(routed, np.ones(len(routed)))
        if not slots:
            continue
        if pools[0].policy.copies_every_miss:
            copies += _copy_misses(pools, pool_of, slot_of, row, slots + t * width)
        else:
            for i, pool in enumerate(pools):
                mine = np.unique([x for x in missed if pool_of[x] == i]).astype(np.int64)
                for key, slot in pool.admit(mine):
                    _place(pool, slot_of, key, slot)
                    copies += 1
    return CacheResult(n, n * n_moe * k, cold, copies)


def _copy_misses(pools: list[SlotCache], pool_of: np.ndarray, slot_of: np.ndarray, row: list[int], at: int) -> int:
    """One token of a policy that copies every miss in: its routings are used in routing order
    (stamped ``at``, ``at + 1``, ...); each missed expert takes a free slot, else the slot the
    policy gives up, and stays out when it scores below all of them. LFU never gives up a slot
    filled for this token while another can go (a fresh copy's count is low: it would leave
    first); LRU needs no such rule (a fresh copy is the newest). Returns the copies made."""
    copies = 0
    keeps_fresh = not isinstance(pools[0].policy, LRU)
    fresh = {id(p): np.zeros(p.n_slots, dtype=bool) for p in pools}
    missed = [(i, x) for i, x in enumerate(row) if slot_of[x] < 0]
    for i, x in enumerate(row):
        if slot_of[x] >= 0:
            pools[pool_of[x]].use(int(slot_of[x]), at + i)
    for i, x in missed:
        pool = pools[pool_of[x]]
        copies += 1
        free = np.flatnonzero(pool.owner < 0)
        if len(free):
            slot = int(free[0])
        else:
            protect = fresh[id(pool)] if keeps_fresh else np.ones(pool.n_slots, dtype=bool)
            slot = pool.victim(protect, (x, at + i) if protect.all() else None)
            if slot < 0:
                continue
        _place(pool, slot_of, x, slot)
        pool.use(slot, at + i)
        fresh[id(pool)][slot] = True
    return copies


def _place(pool: SlotCache, slot_of: np.ndarray, key: int, slot: int) -> None:
    old = int(pool.owner[slot])
    if old >= 0:
        slot_of[old] = -1
    pool.owner[slot] = key
    slot_of[key] = slot
