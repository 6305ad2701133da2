"""The expert store: the expert provider (``runtime.experts.ExpertProvider``) that keeps a model's
experts quantized in tiers and serves every MoE layer from wherever they are.

Tiers, fastest first:
  hot      experts placed on the device at load (the pack's placement, or a profile's choice
           under a VRAM budget); never evicted.
  cache    a bounded set of spare device slots holding cold experts: the most recently used
           (LRU) when misses are copied in, the most often routed lately when they are read
           zero-copy (there a copy is an extra PCIe transfer, worth it only for repeat traffic).
  host     every cold expert in pinned host memory, when host RAM allows; the GPU can read it
           directly (zero-copy) or copy it into a cache slot.
  disk     otherwise a bounded pinned host cache over the mmapped GGUF / cold shards.

The store is put together from parts with one job each: where the bytes live
(``expert_pools``: device pool, host pool, disk tier), which expert sits in which slot and why
(``expert_slots``), what the kernels read (``expert_tables``: the slot table on the device and
each layer's views of the pools) and what is counted (``expert_stats``). Hot and cached experts
sit in one device pool (one expert = one contiguous range, so a miss is one copy) and every MoE
layer has a row of one table ``expert -> slot`` that the fused kernel reads, so a cached expert
costs exactly what a hot one does. The quantized bytes are never expanded in the pool; the
kernels unpack them in registers.

How a miss is served is a strategy (``runtime.expert_misses``: ``async`` copies misses into cache
slots before the layer runs, ``zerocopy`` lets the kernel read them from the pinned host pool and
promotes repeat traffic after the token), and which cold experts the cache slots keep is the
cache policy's (``formats.cache_policy``, the one the trace simulator replays). The arithmetic
never depends on where bytes were read from, so every mode and every residency gives bit-identical
outputs (tests check it at 100/60/10% residency).

Re-placement (``apply_swaps``, between requests: ``runtime.expert_replacement``) moves the hot set
toward what a live learner (``runtime.learning``) says the traffic uses. Each call's routing counts
reach the learner as the store reads them (``observer``), tagged with the side the session set
(``routing_side``). The naive offload the benchmarks compare against (blocking copies from the
file) is ``bench/naive_store.py``.

On a CPU device the same bookkeeping runs over CPU tensors (CI exercises the store that way) and
experts are computed by the plain torch path: dequantize the expert's bytes, SwiGLU, exactly what
``runtime.experts.GGUFExperts`` computes.
"""
from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING

import numpy as np
import torch

from sparkpack.formats.archs import ModelSpec
from sparkpack.formats.memory import SLOT_ALIGN
from sparkpack.formats.placement import Swaps
from sparkpack.formats.profile import SIDES

from .expert_misses import STRATEGIES, MissStrategy
from .expert_layout import store_layout
from .expert_pools import ColdTier, PoolLayout, cold_tier, fill_device_pool
from .expert_replacement import HotSetMover
from .expert_slots import ExpertSlots
from .expert_source import ExpertSource
from .expert_staging import StagedPrefill
from .expert_stats import RoutingCounts, RoutingObserver, RoutingRecorder, StoreStats
from .expert_tables import KernelTables
from .experts import ExpertProvider, expert_weights, routed_sum
from .layers import swiglu

if TYPE_CHECKING:
    from .kernels.q8dot import Int8Rows

__all__ = ["ExpertStore", "StoreStats"]


class ExpertStore(ExpertProvider):
    """Tiered expert storage implementing the expert-provider contract of ``runtime.experts``.

    ``hot``: bool ``[n_layer, n_expert]`` of experts resident from the start. ``cache_slots``:
    spare device slots shared by all layers. ``mode``: the miss strategy (``runtime.expert_misses``;
    "auto": zero-copy where it can run). ``host_bytes``: pinned host memory allowed for cold
    experts (None: all of them); when they do not fit, misses are read from the file through a
    bounded host cache (the disk tier) and a warning says so. ``stage_tokens``: eager calls of at
    least that many tokens stage the host pool's cold experts (zero-copy mode; None: never).
    """

    PINNED = True  # host buffers in pinned memory on a GPU (copies overlap compute)

    def __init__(self, source: ExpertSource, spec: ModelSpec, device: torch.device | str, dtype: torch.dtype,
                 hot: np.ndarray, cache_slots: int = 0, mode: str = "auto", host_bytes: int | None = None,
                 fused: bool | None = None, warn=None, stage_tokens: int | None = None):
        self.source, self.spec = source, spec
        self.device, self.dtype = torch.device(device), dtype
        self.warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
        on_cuda = self.device.type == "cuda"
        self.pin = on_cuda and self.PINNED
        lay = store_layout(source, spec, on_cuda, hot, cache_slots, mode, host_bytes, fused, self.warn)
        self.moe_layers, self.n_expert, self.hot = lay.moe_layers, spec.n_expert, lay.hot
        self.layers, self.fused_all, self.layer_nbytes = lay.layers, lay.fused_all, lay.layer_nbytes
        self.unit = SLOT_ALIGN
        self.n_hot = int(lay.hot.sum())
        self.device_layout, self.n_cache = lay.device, len(lay.device.slots)
        self.slot_bytes = lay.device.slot_units * self.unit  # a cache slot: any layer's expert fits
        self.host_all = lay.host_all
        cold_layout, nbytes = lay.cold, lay.nbytes
        # Where the bytes live: the device pool and the cold tier; how a miss is served.
        self.misses: MissStrategy = STRATEGIES[lay.mode](self)
        self.copy_stream = torch.cuda.Stream(self.device) if self.pin else None
        self.pool = torch.empty(self.device_layout.nbytes, dtype=torch.uint8, device=self.device)
        fill_device_pool(source, self.device_layout, self.pool, nbytes, self.pin)
        self.cold = self._cold_tier(cold_layout, nbytes, host_bytes)
        host_pool = self.cold.kernel_pool()

        # Which expert sits where, as the host writes it and as the kernels read it.
        self.tables = KernelTables((spec.n_layer, self.n_expert), self.device, self.pin)
        zero_copy = self.misses.zero_copy
        self.slots = ExpertSlots(self.tables.host, self.device_layout.offset, self.device_layout.slots,
                                 cold_layout.offset if zero_copy else None, self.misses.policy())
        self.tables.to_device()
        for la in self.layers.values():
            if la.fused:
                la.bind(self.pool, host_pool, self.unit)
        self.staging = None  # long calls' bulk copies (runtime.expert_staging)
        if stage_tokens is not None and zero_copy and self.fused_all and host_pool is not None:
            self.staging = StagedPrefill(host_pool, cold_layout, self.layers, stage_tokens, self.device,
                                         self.copy_stream)

        # What is counted. Every expert on the device: nothing can move, so the per-token count
        # read (a wait on the device, then ~20 small numpy passes with the GPU idle) is put off;
        # the counts add up on the device until ``flush``.
        self.all_hot = lay.n_cold == 0
        self.counts = RoutingCounts((spec.n_layer, self.n_expert), self.device, self.pin)
        self._stats = StoreStats()
        # A padded prefill call (``count_real_tokens``): the device scalar of its real tokens,
        # whose routings alone the fused kernels count (padding must not teach placement).
        self.real_tokens: torch.Tensor | None = None
        self._step_routed = False

        # Who else learns from the traffic (``runtime.learning``, ``runtime.routing_trace``) and
        # the side of the tokens being run.
        self.observer: RoutingObserver | None = None
        self.recorder: RoutingRecorder | None = None
        self.side = SIDES[0]
        self.mover = HotSetMover(self)

    def _cold_tier(self, layout: PoolLayout, nbytes: dict[int, int], host_bytes: int | None) -> ColdTier:
        """``expert_pools.cold_tier`` (a seam: bench's naive store reads the file instead)."""
        return cold_tier(self.source, layout, nbytes, host_bytes, self.host_all, self.slot_bytes, self.pin,
                         self._copies_done)

    def _copies_done(self) -> None:
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    @property
    def mode(self) -> str:
        """The miss strategy's name: "async" or "zerocopy"."""
        return self.misses.name

    # --- the expert-provider contract ---------------------------------------------------------

    @property
    def capturable(self) -> bool:
        """A decode step through this store can be captured in a CUDA graph (``runtime.graph``):
        zero-copy mode with every layer on the fused kernel needs no host round trip inside the step."""
        return self.misses.capturable

    def count_real_tokens(self, real: torch.Tensor | None) -> None:
        self.real_tokens = real

    def staged_prefill(self, n_tokens: int) -> bool:
        """Whether an eager call of ``n_tokens`` tokens stages the cold experts (one bulk copy per
        layer: ``runtime.expert_staging``) instead of reading them zero-copy."""
        return self.staging is not None and self.staging.wants(n_tokens)

    def stage_calls(self, n_tokens: int | None) -> None:
        self.misses.stage_calls(n_tokens)

    def routing_side(self, side: str) -> None:
        """The calls from now on run tokens of ``side``. An all-hot store's counts of the other
        side, still on the device, are read first (only when a learner needs them apart; the read
        waits for a decode step launched ahead, one step at most: a prompt joining a ``--parallel``
        server's running sequences)."""
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        if side != self.side and self.counts.unread and self.observer is not None:
            self.flush()
        self.side = side

    def moe(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            q8: "Int8Rows | None" = None, parts: bool = True) -> torch.Tensor:
        """The contract's ``moe`` (``runtime.experts.ExpertProvider``): where the fused kernel runs,
        the k weighted outputs ``[T, k, n_embd]`` float32 unsummed (``parts=False``: summed, in
        float32); elsewhere their sum in x's dtype.

        A layer whose quant types have a fused kernel always runs it, whatever the token count and
        wherever the experts are: experts that could not be brought into device slots (more misses
        than slots, as in a long prefill) are read from host memory inside the kernel through a
        one-off table row. So the arithmetic, and the result, never depend on residency."""
        self._step_routed = True
        if self.recorder is not None:
            self.recorder.record(layer, ids, self.real_tokens)
        y = self.misses.serve(layer, x, weights, ids, parts, q8)
        if y is not None:
            return y
        return routed_sum(x, weights, ids, lambda e, rows: self._expert_forward(layer, e, rows))

    def _expert_forward(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        """The plain path: expand the expert's bytes (wherever they are) and run SwiGLU."""
        return swiglu(x, *expert_weights(self.layers[layer].parts, self._bytes_of(layer, expert), x.device, self.dtype))

    def device_bytes(self, layer: int, expert: int) -> torch.Tensor:
        """The expert's bytes in the device pool (hot or cached)."""
        at = int(self.slots.table[layer, expert])
        if at < 0:
            raise KeyError(f"expert {expert} of layer {layer} is not on the device")
        return self.pool[at * self.unit: at * self.unit + self.layers[layer].nbytes]

    def _bytes_of(self, layer: int, expert: int) -> torch.Tensor:
        if int(self.slots.table[layer, expert]) >= 0:
            return self.device_bytes(layer, expert)
        buf, read = self.cold.bytes(layer, expert)
        self._stats.disk_reads += read
        return buf

    # --- moving bytes (the miss strategies and re-placement) ----------------------------------

    def capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    @contextlib.contextmanager
    def on_copy_stream(self):
        """Copies issued inside run on the side stream, after what the compute stream has queued
        (nothing to do without one: CPU, pageable copies). The caller waits for them as it needs."""
        stream = self.copy_stream
        if stream is None:
            yield
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield

    def copy_in(self, layer: int, expert: int, slot: int, publish: bool = True) -> None:
        """Copy an expert into a cache slot on the current stream (the caller picks the copy
        stream once for a batch: entering a stream context per copy cost more than the copy's
        launch). ``publish`` False leaves its table entry for the caller to set once the copy
        is known to be complete."""
        nbytes = self.layers[layer].nbytes
        at = int(self.slots.cache[slot]) * self.unit
        src, read = self.cold.bytes(layer, expert)
        self._stats.disk_reads += read
        self.pool[at: at + nbytes].copy_(src[:nbytes], non_blocking=self.cold.pinned)  # pageable: blocking
        self.slots.fill(slot, layer, expert, publish)
        self._stats.loads += 1
        self._stats.bytes_streamed += nbytes

    # --- between tokens -----------------------------------------------------------------------

    def end_step(self, n_tokens: int, routed: bool | None = None, defer: bool = False) -> None:
        """After a forward call: count what was routed and let the miss strategy learn from it
        (zero-copy: promote missed experts into cache slots so that repeats are served from
        VRAM). ``routed`` says whether MoE layers ran (a replayed graph cannot tell the store).

        ``defer`` (a replayed decode step, called right after its launch): the step's counts are
        copied into pinned memory behind it and learned from at the next ``end_step``, which
        then runs while the GPU computes that next step, not between steps with the GPU idle.
        Its table changes reach the step after (the upload is stream-ordered behind the step
        running): residency moves a token later, results never change.

        Promotions overlap the next step instead of delaying it: a victim slot leaves the table
        at once (its expert is read from host memory again), the copy runs on the side stream
        while the next token computes, and the new entry is published at the following
        ``end_step``, when the copy has had a whole step to land."""
        if self.staging is not None:
            self.staging.finish()
        if not (self._step_routed if routed is None else routed):
            return
        self._step_routed = False
        if self.recorder is not None:
            self.recorder.end_step(n_tokens, self.side, defer)
        self.misses.end_step(n_tokens, defer)

    def forget_traffic(self) -> None:
        """Drop what the store learned from the tokens so far (statistics, routing counts for
        the cache policy): a session's warm-up runs dummy tokens that must teach nothing."""
        self.reset_stats()  # counts not learned yet (on the device, or a deferred step's) go too
        self.slots.policy.forget()
        self.misses.forget()
        if self.recorder is not None:
            self.recorder.drop()

    @property
    def stats(self) -> StoreStats:
        """The run's counts as learned so far: up to the last token after ``flush``."""
        return self._stats

    def flush(self) -> None:
        """Learn everything counted so far: a deferred step's counts, and the counts an all-hot
        store leaves on the device. Waits for the device."""
        self.misses.flush()
        if self.recorder is not None:
            self.recorder.flush()

    def reset_stats(self) -> None:
        """Start counting afresh; counts not learned yet belong to the statistics replaced."""
        self.counts.drop()
        self._stats = StoreStats()

    def apply_swaps(self, swaps: Swaps) -> int:
        """Move the hot set between requests: ``swaps.promote[i]`` (a cold expert) takes the device
        slot of ``swaps.demote[i]`` (a hot one whose layer's experts take as many pool units:
        ``formats.placement.plan_swaps_in_place``). Returns the bytes copied
        (``runtime.expert_replacement``)."""
        return self.mover.apply(swaps)

    def describe(self) -> dict:
        n_total = len(self.moe_layers) * self.n_expert
        nothing_cold = not self.n_cache and self.n_hot == n_total
        return {"mode": self.mode, "hot_experts": self.n_hot, "experts": n_total,
                "hot_fraction": self.n_hot / max(n_total, 1), "cache_slots": self.n_cache,
                "slot_bytes": self.slot_bytes, "device_pool_bytes": self.pool.numel(),
                "host_pool_bytes": self.cold.host_bytes if not nothing_cold else 0,
                "staging_bytes": self.staging.nbytes if self.staging is not None else 0,
                "stage_tokens": self.staging.min_tokens if self.staging is not None else None,
                "host_tier": self.cold.kind if self.cold.kind == "pinned" or not nothing_cold else "none",
                "host_pinned": self.cold.pinned}
