"""Re-placement (between requests): the store's hot set moves toward what a live learner
(``runtime.learning``) says the traffic uses.

A promoted expert is copied into the device slot of a demoted one of the same size, and the
demoted expert's bytes go to the host-pool range the promoted one leaves, so both pools keep
their size and layout; then the table rows change (the same table tensor: captured CUDA graphs
stay valid). Results never change: the kernels read the same bytes wherever they are.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sparkpack.formats.placement import Swaps

from .pinned import pinned_empty

if TYPE_CHECKING:
    from .expert_store import ExpertStore

# Pinned host memory re-placement stages demoted experts through (kept between re-placements):
# ~18 experts of the Qwen3.6 shape a batch, one host sync each, all of it in idle time.
SWAP_STAGING_BYTES = 32 << 20


class HotSetMover:
    """Applies ``Swaps`` to one store, keeping the pinned buffer the demoted bytes go through."""

    def __init__(self, store: ExpertStore):
        self.store = store
        self._staging: torch.Tensor | None = None

    def check(self, swaps: Swaps) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """The (promoted, demoted) pairs, each promoted cold expert fitting its demoted hot one's slot."""
        store = self.store
        pairs = list(zip(swaps.promote, swaps.demote))
        if len(swaps.promote) != len(swaps.demote):
            raise ValueError("each promoted expert needs the slot of one demoted expert")
        if store.staging is not None and any(p[0] != d[0] for p, d in pairs):
            # staged calls copy each layer's cold experts as one host-pool range (expert_staging)
            raise ValueError("a store that stages long calls swaps experts within a layer only")
        units = store.device_layout.units
        for (pl, pe), (dl, de) in pairs:
            if pl not in units or dl not in units or units[pl] != units[dl]:
                raise ValueError(f"expert {pe} of layer {pl} does not fit the slot of expert {de} of layer {dl}")
            if store.hot[pl, pe] or not store.hot[dl, de]:
                raise ValueError(f"cannot promote expert {pe} of layer {pl} (hot: {bool(store.hot[pl, pe])}) over "
                                 f"expert {de} of layer {dl} (hot: {bool(store.hot[dl, de])})")
        if len({p for p, _ in pairs}) != len(pairs) or len({d for _, d in pairs}) != len(pairs):
            raise ValueError("an expert appears twice in one set of swaps")
        return pairs

    def apply(self, swaps: Swaps) -> int:
        """``ExpertStore.apply_swaps``: whatever the device still runs is waited for on the copy
        stream, the copies run there and are waited for, then the table rows change and are
        uploaded behind them. The demoted experts' bytes go through a pinned staging buffer to
        the host ranges the promoted experts leave (the two ranges swap contents) where the cold
        tier keeps every cold expert, so each stays readable from host memory; with the disk tier
        they are read from the file again when needed. Returns the bytes copied."""
        pairs = self.check(swaps)
        if not pairs:
            return 0
        store = self.store
        store.flush()  # counts read so far were served by the hot set as it was
        store.tables.wait_sent()  # (the flush may have queued an upload of the table settle rewrites)
        store.misses.settle()
        slots, U, pool, cold = store.slots, store.unit, store.pool, store.cold
        for p, _ in pairs:  # a promoted expert held in a cache slot leaves it
            if slots.slot_of[p] >= 0:
                slots.evict(int(slots.slot_of[p]))
        at_dev = [int(store.device_layout.offset[d]) * U for _, d in pairs]
        homes = [cold.demoted_home(*p) for p, _ in pairs]  # where each demoted expert's bytes go, if kept
        sizes = [(store.layers[p[0]].nbytes, store.layers[d[0]].nbytes) for p, d in pairs]
        moved, first = 0, 0
        while first < len(pairs):  # batches of at most SWAP_STAGING_BYTES staged (at least one expert)
            last, staged = first + 1, sizes[first][1]
            while last < len(pairs) and staged + sizes[last][1] <= SWAP_STAGING_BYTES:
                staged += sizes[last][1]
                last += 1
            batch = range(first, last)
            staging = self._buffer(staged) if homes[first] is not None else None
            with store.on_copy_stream():
                k = 0
                for i in batch:
                    n_p, n_d = sizes[i]
                    home = homes[i]
                    if staging is not None and home is not None:  # the demoted bytes out first: overwritten next
                        staging[k: k + n_d].copy_(pool[at_dev[i]: at_dev[i] + n_d], non_blocking=store.pin)
                        src = home
                        k += n_d
                    else:
                        src, read = cold.bytes(*pairs[i][0])
                        store.stats.disk_reads += read
                    pool[at_dev[i]: at_dev[i] + n_p].copy_(src[:n_p], non_blocking=cold.pinned)
                    moved += n_p + (n_d if staging is not None else 0)
            if store.copy_stream is not None:
                store.copy_stream.synchronize()
            if staging is not None:
                k = 0
                for i in batch:
                    n_d = sizes[i][1]
                    homes[i][:n_d].copy_(staging[k: k + n_d])
                    k += n_d
            first = last
        for i, (p, d) in enumerate(pairs):
            cold.swapped(p, d)
            store.device_layout.offset[p], store.device_layout.offset[d] = store.device_layout.offset[d], -1
            store.hot[p], store.hot[d] = True, False
            slots.hot[p], slots.hot[d] = True, False
            slots.table[p] = at_dev[i] // U
            slots.table[d] = slots.cold_entry(*d)
        store.tables.upload(track=True)
        return moved

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A (pinned) host buffer of at least ``nbytes`` for the demoted experts' bytes, kept for the
        next re-placement (pinning memory costs milliseconds)."""
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = pinned_empty(nbytes, self.store.pin)
        return self._staging
