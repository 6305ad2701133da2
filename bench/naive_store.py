"""The naive offload the expert store is measured against: misses read from the file on demand.

Uniform placement, then for every miss the expert's bytes are read from the mmapped file into a
pageable buffer and copied into a cache slot with a blocking copy on the compute stream, before
the layer runs: no pinned memory, no host pool, no copy stream, no zero-copy reads. It is the
product store (``runtime.expert_store.ExpertStore``) in async mode with those pieces taken out,
so it computes exactly the same bits; ``bench/store_bench.py`` runs it as its "naive" rows and
the tests check its outputs equal the all-GPU ones.
"""
from __future__ import annotations

from sparkpack.runtime.expert_pools import ColdTier, DiskTier, PoolLayout
from sparkpack.runtime.expert_store import ExpertStore


class NaiveStore(ExpertStore):
    """``ExpertStore`` without pinned memory or a host pool; arguments as it takes them (``mode``
    is always async: misses are copied before the layer runs)."""

    PINNED = False

    def __init__(self, *args, **kwargs):
        kwargs.pop("mode", None)
        super().__init__(*args, mode="async", **kwargs)

    def _cold_tier(self, layout: PoolLayout, nbytes: dict[int, int], host_bytes: int | None) -> ColdTier:
        """The file itself: a fresh pageable buffer per miss (the bounded cache of the disk tier
        only when even the store would not hold every cold expert)."""
        cap = 0 if self.host_all else max(1, int(host_bytes or 0) // max(self.slot_bytes, 1))
        return DiskTier(self.source, nbytes, self.slot_bytes, cap, pin=False)

