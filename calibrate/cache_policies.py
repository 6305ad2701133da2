"""Cache-slot policies replayed on a routing trace: which cold experts the spare GPU slots hold.

The hot set is the long-term choice (the profile); the slots do the short-term part. Three
policies, each deciding after a token what the slots hold for the next one (the store learns from
a step once it ran):

  lru   every missed expert is copied in; the least recently routed cached expert leaves.
  lfu   every missed expert is copied in; the cached expert routed least often so far leaves
        (ties: the least recent).
  freq  the store's zero-copy admission (``formats.placement.FREQ_DECAY`` / ``ADMIT_MIN``):
        routing counts decay by FREQ_DECAY a token; a missed expert is copied in only once its
        decayed count reaches ADMIT_MIN and exceeds that of the cached expert with the lowest
        count, which it replaces. One-off misses never evict anything.

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

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from sparkpack.formats.placement import ADMIT_MIN, FREQ_DECAY

POLICIES = ("lru", "lfu", "freq")


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


def simulate(ids: np.ndarray, hot: np.ndarray, slots: int, policy: str, shared: bool = True,
             decay: float = FREQ_DECAY, admit_min: float = ADMIT_MIN) -> CacheResult:
    """Replay ``ids [N, n_moe, k]`` (expert ids per token and MoE layer, a trace's ``ids``) against
    the hot mask ``hot [n_moe, n_expert]`` and ``slots`` cache slots run by ``policy``."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    ids = np.asarray(ids, dtype=np.int64)
    n, n_moe, k = ids.shape
    n_expert = hot.shape[1]
    keys = ids + (np.arange(n_moe) * n_expert)[None, :, None]  # one key per (layer, expert)
    cold_keys = np.where(hot.reshape(-1)[keys], -1, keys).reshape(n, n_moe * k)
    pools = [_Pool(slots)] if shared else [_Pool(slots) for _ in range(n_moe)]
    pool_of = (lambda key: pools[0]) if shared else (lambda key: pools[key // n_expert])
    count = np.zeros(n_moe * n_expert)  # lfu: routings so far; freq: decayed routings
    cold = copies = 0
    for t in range(n):
        row = [int(x) for x in cold_keys[t] if x >= 0]
        missed = [x for x in row if x not in pool_of(x).cached]
        cold += len(missed)
        if policy == "freq":
            count *= decay
        if policy != "lru":
            np.add.at(count, keys[t].reshape(-1), 1.0)
        if not slots:
            continue
        if policy == "freq":
            for x in row:
                if x in pool_of(x).cached:
                    pool_of(x).touch(x, t)
            copies += _admit_frequent(missed, count, pool_of, admit_min, t)
            continue
        # lru / lfu: every routed expert is (or now becomes) cached, in routing order; then each
        # pool that overflows drops its least recent (lru) or least routed (lfu) experts,
        # never one just copied in while an older one can go instead
        for x in row:
            pool_of(x).touch(x, t)
        copies += len(missed)
        fresh = set(missed)
        for pool in {id(p): p for p in map(pool_of, missed)}.values():
            while len(pool.cached) > pool.cap:
                if policy == "lru":
                    victim = next(iter(pool.cached))
                else:
                    old = [v for v in pool.cached if v not in fresh] or list(pool.cached)
                    victim = min(old, key=lambda v: (count[v], pool.cached[v]))
                del pool.cached[victim]
    return CacheResult(n, n * n_moe * k, cold, copies)


def _admit_frequent(missed: list[int], count: np.ndarray, pool_of, admit_min: float, t: int) -> int:
    """The store's admission: strongest candidates first, each replacing its pool's weakest
    cached expert only if routed more often lately (an expert copied in for this token is not
    replaced again by it). Returns the copies made."""
    copies = 0
    filled: set[int] = set()
    for x in sorted((x for x in missed if count[x] >= admit_min), key=lambda x: -count[x]):
        pool = pool_of(x)
        if len(pool.cached) >= pool.cap:
            left = [v for v in pool.cached if v not in filled]
            if not left:
                continue
            victim = min(left, key=lambda v: (count[v], pool.cached[v]))
            if count[x] <= count[victim]:
                continue
            del pool.cached[victim]
        pool.touch(x, t)
        filled.add(x)
        copies += 1
    return copies


class _Pool:
    """Cached keys in least-recently-used-first order, each with its last use."""

    def __init__(self, cap: int):
        self.cap = cap
        self.cached: OrderedDict[int, int] = OrderedDict()

    def touch(self, key: int, t: int) -> None:
        self.cached[key] = t
        self.cached.move_to_end(key)
