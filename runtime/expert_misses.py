"""How the expert store serves routed experts that are not on the device: two miss strategies
behind one interface.

  async     (``CopyMisses``) the router's choice is read on the host (one sync per layer) and
            missing experts are copied from host memory into cache slots on a side stream before
            the layer computes; the compute stream waits only on their event. The slots are run
            least recently used first (``formats.cache_policy.LRU``).
  zerocopy  (``ZeroCopyMisses``) no host read inside the token: a cold expert's table entry points
            into the pinned host pool (``-(h + 1)``) and the kernel reads it over PCIe. After the
            token the store looks at what was routed (one small copy per token) and promotes
            missed experts that keep being routed into cache slots with async copies overlapping
            the next token (``formats.cache_policy.FrequentAdmission``). A long eager call stages
            instead: each layer's cold experts are copied to a device buffer in one bulk copy
            (``runtime.expert_staging``).

``serve`` takes one call's token rows (``x [T, n_embd]``, ``ids [T, k]``) and never assumes they
are one sequence's: the async strategy copies in the union of the rows' routed experts per layer,
the zero-copy kernel counts every row's routings, so a batch of sequences' rows is one call.
The arithmetic never depends on where bytes were read from: every strategy gives the same bits.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from sparkpack.formats.cache_policy import LRU, FrequentAdmission, SlotPolicy

if TYPE_CHECKING:
    from .expert_store import ExpertStore
    from .expert_tables import ExpertLayer
    from .kernels.moe import ExpertPools
    from .kernels.q8dot import Int8Rows


def fused(store: ExpertStore, pools: ExpertPools, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
          table_row: torch.Tensor, counts: torch.Tensor | None = None, parts: bool = False,
          q8: Int8Rows | None = None) -> torch.Tensor:
    """The fused kernel over ``pools`` through ``table_row`` (``counts``: the row it counts into,
    only a padded call's real tokens when the store holds their number: ``count_real_tokens``)."""
    from .kernels.moe import moe_experts

    # router ids (int64) and weights (float32) go in as they are: the kernels read either
    # float32 out: the block's residual epilogue (layers.ffn_residual) rounds it, no launch of its own
    return moe_experts(x, ids, weights.float(), table_row, pools, act_q8=True, x_q8=q8, counts=counts,
                       count_tokens=store.real_tokens if counts is not None else None, reduce=not parts)


class MissStrategy(ABC):
    """What the store does about experts that are not on the device, inside a call and after it."""

    name: ClassVar[str]
    policy: ClassVar[type[SlotPolicy]]  # how its cache slots are run
    zero_copy: ClassVar[bool]  # cold experts' table entries point into the host pool

    def __init__(self, store: ExpertStore):
        self.store = store

    @property
    def capturable(self) -> bool:
        """A decode step needs no host round trip (``ExpertProvider.capturable``)."""
        return False

    @abstractmethod
    def serve(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, parts: bool,
              q8: Int8Rows | None) -> torch.Tensor | None:
        """Count the call's routings at ``layer`` and return the fused kernel's result, or None
        where the store computes the layer expert by expert (no fused kernel for its types)."""

    @abstractmethod
    def end_step(self, n_tokens: int, defer: bool) -> None:
        """After a call that ran MoE layers: learn from its routings."""

    def stage_calls(self, n_tokens: int | None) -> None:
        """``ExpertProvider.stage_calls``: only zero-copy stages."""

    def flush(self) -> None:
        """Learn everything counted so far."""

    def settle(self) -> None:
        """Finish in-flight slot changes before the table is rewritten (re-placement)."""

    def forget(self) -> None:
        """Drop routings counted but not learned from yet."""


class CopyMisses(MissStrategy):
    name, policy, zero_copy = "async", LRU, False

    def __init__(self, store: ExpertStore):
        super().__init__(store)
        self.routed = np.zeros((store.spec.n_layer, store.n_expert), dtype=np.int64)  # for the observer

    def serve(self, layer, x, weights, ids, parts, q8):
        store = self.store
        la = store.layers[layer]
        left = self._make_resident(layer, ids)
        if not la.fused:
            return None
        if len(left):
            return self._fused_overflow(layer, la, x, weights, ids, left, parts, q8)
        return fused(store, la.pools, x, weights, ids, store.tables.device[layer], parts=parts, q8=q8)

    def end_step(self, n_tokens: int, defer: bool) -> None:
        store = self.store
        if store.observer is not None:
            store.observer.observe(self.routed, n_tokens, store.side)
        self.routed[:] = 0

    def forget(self) -> None:
        self.routed[:] = 0

    def _make_resident(self, layer: int, ids: torch.Tensor) -> np.ndarray:
        """Count the layer's routings and bring every expert ``ids`` names onto the device
        before the layer computes. Returns the experts left in host memory (more misses
        than cache slots): the caller reads those from there."""
        store = self.store
        chosen, counts = np.unique(ids.reshape(-1).cpu().numpy(), return_counts=True)  # the one sync
        self.routed[layer, chosen] += counts
        st, slots = store.stats, store.slots
        st.tokens += ids.shape[0] if layer == store.moe_layers[0] else 0
        resident = slots.table[layer, chosen] >= 0
        is_hot = store.hot[layer, chosen]
        st.hot_hits += int(counts[is_hot].sum())
        st.cache_hits += int(counts[resident & ~is_hot].sum())
        missing = chosen[~resident]
        st.misses += int(counts[~resident].sum())
        cached_now = slots.cached(layer, chosen)
        for s in cached_now:
            slots.touch(int(s))
        if not len(missing):
            return missing
        if len(missing) + len(cached_now) > slots.n_cache:
            # Read from host memory where they are (a prefill touches most experts at once).
            st.bytes_streamed += len(missing) * store.layers[layer].nbytes
            return missing
        t0 = time.perf_counter()
        protect = set(int(s) for s in cached_now)
        with store.on_copy_stream():
            for e in missing.tolist():
                slot = slots.victim(protect)
                protect.add(slot)
                store.copy_in(layer, e, slot)
        store.tables.upload(layer)
        if store.copy_stream is not None:
            torch.cuda.current_stream(store.device).wait_stream(store.copy_stream)
        st.copy_seconds += time.perf_counter() - t0
        return missing[:0]

    def _fused_overflow(self, layer: int, la: ExpertLayer, x: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor, left: np.ndarray, parts: bool, q8: Int8Rows | None) -> torch.Tensor:
        """The fused kernel with experts ``left`` read from host memory, through a one-off table
        row (the cold tier says where: ``ColdTier.kernel_view``)."""
        store = self.store
        row = store.slots.table[layer].copy()
        pools, keep, reads = store.cold.kernel_view(layer, left, row, la, store.device_layout.slot_units,
                                                    store.device.type == "cuda")
        store.stats.disk_reads += reads
        store.stats.zero_copy_reads += len(left)
        y = fused(store, pools, x, weights, ids, torch.from_numpy(row).to(store.device), parts=parts, q8=q8)
        if keep is not None and keep.is_pinned():
            torch.cuda.current_stream(store.device).synchronize()  # the kernel reads it: keep it alive
        return y


class ZeroCopyMisses(MissStrategy):
    name, policy, zero_copy = "zerocopy", FrequentAdmission, True

    def __init__(self, store: ExpertStore):
        super().__init__(store)
        self.staged_call = False  # the call being run stages (its counts are no zero-copy reads)
        self.group: int | None = None  # tokens of the group of calls being run (stage_calls)
        self.promoting: tuple[list[tuple[int, int, int]], torch.cuda.Event] | None = None

    @property
    def capturable(self) -> bool:
        return self.store.fused_all

    def serve(self, layer, x, weights, ids, parts, q8):
        store = self.store
        if store.layers[layer].fused:  # the kernel counts the routings itself
            staging = store.staging
            if staging is not None and layer in staging.spans and self._stages(x.shape[0]):
                return self._fused_staged(layer, x, weights, ids, parts, q8)
            return fused(store, store.layers[layer].host_pools, x, weights, ids, store.tables.device[layer],
                         store.counts.step[layer], parts, q8)
        flat = ids.reshape(-1)
        one = torch.ones_like(flat, dtype=torch.int32)
        if store.real_tokens is not None:  # a padded call run eagerly off the GPU (tests): real tokens only
            one = (torch.arange(ids.shape[0], device=ids.device) < store.real_tokens).to(torch.int32)
            one = one.repeat_interleave(ids.shape[1])
        store.counts.step[layer].index_add_(0, flat, one)
        return None

    # --- staged calls ---------------------------------------------------------------------------

    def stage_calls(self, n_tokens: int | None) -> None:
        """A group stages all at once: its copies are counted here, once (not while a graph of
        it is captured: its replays are counted, each bracketed by ``stage_calls``)."""
        store = self.store
        staging = store.staging
        if staging is None:
            self.group = n_tokens
            return
        if n_tokens is None:
            if self.group is not None and store.staged_prefill(self.group):
                staging.end()
            self.group = None
            staging.finish()
            return
        self.group = n_tokens
        if store.staged_prefill(n_tokens):
            staging.begin()
            self.staged_call = True
            if not store.capturing():
                self._count_staged(sum(staging.span_bytes(il) for il in staging.order), len(staging.order))

    def _count_staged(self, nbytes: int, layers: int) -> None:
        st = self.store.stats
        st.staged_layers += layers
        st.staged_bytes += nbytes
        st.bytes_streamed += nbytes

    def _stages(self, n_tokens: int) -> bool:
        """This call stages: a call of a group that stages (eager, or captured whole: the group's
        copies are captured with it), or a call alone, long enough, eager (not padded: alone it is
        one of a captured session's calls; not being captured)."""
        store = self.store
        if self.group is not None:
            return store.staged_prefill(self.group)
        if store.real_tokens is not None or not store.staged_prefill(n_tokens):
            return False
        return not store.capturing()

    def _fused_staged(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      parts: bool, q8: Int8Rows | None) -> torch.Tensor:
        """The fused kernel over the layer's cold experts staged in a device buffer."""
        store = self.store
        staging = store.staging
        assert staging is not None
        pools, row, new = staging.serve(layer, store.tables.device[layer])
        y = fused(store, pools, x, weights, ids, row, store.counts.step[layer], parts, q8)
        staging.done(layer)
        if new and self.group is None:  # (a group's copies are counted by stage_calls)
            self._count_staged(staging.span_bytes(layer), 1)
        self.staged_call = True
        return y

    # --- between calls --------------------------------------------------------------------------

    def end_step(self, n_tokens: int, defer: bool) -> None:
        store = self.store
        if store.all_hot:
            store.counts.unread += n_tokens
            return
        self._learn_pending()
        staged, self.staged_call = self.staged_call, False
        if defer:
            store.counts.snapshot(n_tokens, store.side, staged)
        else:
            self._timed_learn(store.counts.read(), n_tokens, store.side, staged)

    def flush(self) -> None:
        counts = self.store.counts
        if counts.unread:
            n, counts.unread = counts.unread, 0
            self._timed_learn(counts.read(), n, self.store.side)
        self._learn_pending()

    def _learn_pending(self) -> None:
        pending = self.store.counts.take_pending()
        if pending is not None:
            self._timed_learn(*pending)

    def _timed_learn(self, counts: np.ndarray, n_tokens: int, side: str, staged: bool = False) -> None:
        store = self.store
        if store.observer is not None:
            store.observer.observe(counts, n_tokens, side)
        t0 = time.perf_counter()
        self._learn_step(counts, n_tokens, staged)
        store.stats.step_seconds += time.perf_counter() - t0

    def _learn_step(self, counts: np.ndarray, n_tokens: int, staged: bool = False) -> None:
        """Count where a call's routings were served and admit missed experts into cache slots.
        ``staged``: the counts are a staged call's, whose cold experts were copied in bulk
        (counted when staged), not read zero-copy."""
        # On the few (layer, expert) pairs routed this step (8 a layer a token), not the whole
        # [n_layer, n_expert] table: whole-table masks cost several times more a token.
        store = self.store
        store.tables.wait_sent()  # the pinned table is rewritten below
        st, slots = store.stats, store.slots
        st.tokens += n_tokens
        n_expert = counts.shape[1]
        table = slots.table.reshape(-1)  # a flat view: one index per (layer, expert)
        f = np.flatnonzero(counts.reshape(-1) != 0)  # in (layer, expert) order: admission's tie order
        il = f // n_expert
        c = counts.reshape(-1)[f].astype(np.int64)
        resident = table[f] >= 0
        hot = store.hot.reshape(-1)[f]
        st.hot_hits += int(c[hot].sum())
        st.cache_hits += int(c[resident & ~hot].sum())
        missed = ~resident
        st.misses += int(c[missed].sum())
        if not staged:
            st.zero_copy_reads += int(missed.sum())
            st.bytes_streamed += int(store.layer_nbytes[il[missed]].sum())
        slots.policy.learn(f, c)
        published = self._publish_promotions()
        keep = f[table[f] < 0]  # routed and not resident (published just now are resident)
        moves = slots.admit(keep) if slots.n_cache and len(keep) else []
        if not moves:
            if published:
                store.tables.upload(track=True)
            return
        store.tables.upload(track=True)  # victims point back to host memory before any copy overwrites them
        stream = store.copy_stream
        with store.on_copy_stream():
            for layer, e, slot in moves:
                store.copy_in(layer, e, slot, publish=stream is None)  # streamed a second time: counted again
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            self.promoting = (moves, event)

    def _publish_promotions(self) -> bool:
        """Point the table at the cache slots filled since the last step (host table only)."""
        if self.promoting is None:
            return False
        moves, event = self.promoting
        self.promoting = None
        event.synchronize()  # long done: the copies had a whole decode step
        for layer, e, slot in moves:
            self.store.slots.publish(layer, e, slot)
        return True

    def settle(self) -> None:
        self._publish_promotions()


STRATEGIES: dict[str, type[MissStrategy]] = {s.name: s for s in (CopyMisses, ZeroCopyMisses)}
