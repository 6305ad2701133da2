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

How a miss is served (``mode``):
  async     the router's choice is read on the host (one sync per layer) and missing experts are
            copied from host memory into cache slots on a side stream; the compute stream waits
            only on their event.
  zerocopy  no host read inside the token: a cold expert's table entry points into the pinned
            host pool (``-(h + 1)``) and the kernel reads it over PCIe. After the token the store
            looks at what was routed (one small copy per token) and promotes missed experts
            that keep being routed into cache slots with async copies overlapping the next
            token, so repeat traffic is served from VRAM.
A long eager call in zero-copy mode (``stage_tokens`` tokens or more: a prompt) stages instead:
each layer's cold experts are copied from the host pool to a device buffer in one bulk copy that
overlaps the previous layer's compute, and the kernel reads them there (``runtime.expert_staging``).
The arithmetic never depends on where bytes were read from, so every mode and every residency
gives bit-identical outputs (tests check it at 100/60/10% residency).

Re-placement (``apply_swaps``, between requests): the hot set moves toward what a live learner
(``runtime.learning``) says the traffic uses. A promoted expert is copied into the device slot of
a demoted one of the same size, and the demoted expert's bytes go to the host-pool range the
promoted one leaves, so both pools keep their size and layout; then the table rows change (the
same table tensor: captured CUDA graphs stay valid). Each call's routing counts reach the learner
as the store reads them (``observer``), tagged with the side the session set (``routing_side``). The naive offload the
benchmarks compare against (blocking copies from the file) is ``bench/naive_store.py``.

On a CPU device the same bookkeeping runs over CPU tensors (CI exercises the store that way) and
experts are computed by the plain torch path: dequantize the expert's bytes, SwiGLU, exactly what
``runtime.experts.GGUFExperts`` computes.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from sparkpack.formats.archs import ModelSpec
from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.memory import SLOT_ALIGN
from sparkpack.formats.placement import ADMIT_MIN, FREQ_DECAY, Swaps
from sparkpack.formats.profile import SIDES
from sparkpack.formats.quants import KERNEL_QTYPES, quant_name

from .expert_pools import ColdTier, DiskTier, HostPool, PoolLayout, fill_device_pool, layout_pool
from .expert_slots import ExpertSlots
from .expert_source import ExpertSource, GGUFSource, PackSourceExperts, Part
from .expert_staging import StagedPrefill
from .expert_stats import RoutingCounts, RoutingObserver, RoutingRecorder, StoreStats
from .expert_tables import ExpertLayer, KernelTables
from .experts import ExpertProvider, routed_sum
from .layers import swiglu
from .pinned import pinned_empty
from .weights import dequantize_bytes

if TYPE_CHECKING:
    from .kernels.moe import ExpertPools
    from .kernels.q8dot import Int8Rows

__all__ = ["ExpertStore", "ExpertSource", "GGUFSource", "PackSourceExperts", "Part", "StoreStats"]

MODES = ("auto", "zerocopy", "async")
# Pinned host memory re-placement stages demoted experts through (kept between re-placements):
# ~18 experts of the Qwen3.6 shape a batch, one host sync each, all of it in idle time.
SWAP_STAGING_BYTES = 32 << 20


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class ExpertStore(ExpertProvider):
    """Tiered expert storage implementing the expert-provider contract of ``runtime.experts``.

    ``hot``: bool ``[n_layer, n_expert]`` of experts resident from the start. ``cache_slots``:
    spare device slots shared by all layers. ``host_bytes``: pinned host memory allowed for cold
    experts (None: all of them); when they do not fit, misses are read from the file through a
    bounded host cache (the disk tier) and a warning says so. ``stage_tokens``: eager calls of at
    least that many tokens stage the host pool's cold experts (zero-copy mode; None: never).
    """

    PINNED = True  # host buffers in pinned memory on a GPU (copies overlap compute)

    def __init__(self, source: ExpertSource, spec: ModelSpec, device: torch.device | str, dtype: torch.dtype,
                 hot: np.ndarray, cache_slots: int = 0, mode: str = "auto", host_bytes: int | None = None,
                 fused: bool | None = None, warn=None, stage_tokens: int | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.source, self.spec = source, spec
        self.device, self.dtype = torch.device(device), dtype
        self.warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
        self.moe_layers = list(spec.moe_layers)
        self.n_expert = spec.n_expert
        hot = np.asarray(hot, dtype=bool).copy()
        moe = np.zeros_like(hot)
        moe[self.moe_layers] = True
        hot &= moe
        self.hot = hot
        on_cuda = self.device.type == "cuda"
        self.pin = on_cuda and self.PINNED
        self.layers = self._expert_layers(fused if fused is not None else on_cuda)
        self.fused_all = all(la.fused for la in self.layers.values())  # every layer on the fused kernel
        nbytes = {il: la.nbytes for il, la in self.layers.items()}
        self.layer_nbytes = np.zeros(spec.n_layer, dtype=np.int64)  # one expert's bytes per layer
        self.layer_nbytes[list(nbytes)] = list(nbytes.values())

        # Where the bytes live: the device pool (hot experts, each at its layer's size, then the
        # cache slots at the largest) and the cold tier. Slots start at multiples of SLOT_ALIGN,
        # the pools' unit: the plan (formats.placement) counts exactly these bytes.
        self.unit = SLOT_ALIGN
        units = {il: -(-nb // SLOT_ALIGN) for il, nb in nbytes.items()}
        n_cold = int((moe & ~hot).sum())
        self.n_hot = int(hot.sum())
        self.device_layout = layout_pool(hot, units, self.unit, max(0, min(int(cache_slots), n_cold)))
        self.n_cache = len(self.device_layout.slots)
        self.slot_bytes = self.device_layout.slot_units * self.unit  # a cache slot: any layer's expert fits
        cold_layout = layout_pool(moe & ~hot, units, self.unit)
        self.host_all = host_bytes is None or cold_layout.nbytes <= host_bytes
        if not self.host_all:
            self.warn(f"host RAM budget {_gib(host_bytes)} is too small for {_gib(cold_layout.nbytes)} of cold experts: "
                      f"misses are read from {_name(source.path)} through a {_gib(host_bytes)} host cache (disk tier, slower)")
        if mode == "auto":
            mode = "zerocopy" if (on_cuda and self.host_all and self.fused_all) else "async"
        if mode == "zerocopy" and not self.host_all:
            raise SparkpackError(source.path, "zero-copy streaming needs every cold expert in host memory; "
                                              "raise the host RAM budget or use --stream async")
        self.mode = mode
        self.copy_stream = torch.cuda.Stream(self.device) if self.pin else None
        self.pool = torch.empty(self.device_layout.nbytes, dtype=torch.uint8, device=self.device)
        fill_device_pool(source, self.device_layout, self.pool, nbytes, self.pin)
        self.cold = self._cold_tier(cold_layout, nbytes, host_bytes)
        host_pool = self.cold.tensor if isinstance(self.cold, HostPool) and cold_layout.n_units else None

        # Which expert sits where, as the host writes it and as the kernels read it.
        self.tables = KernelTables((spec.n_layer, self.n_expert), self.device, self.pin)
        zero_copy = mode == "zerocopy"
        self.slots = ExpertSlots(self.tables.host, self.device_layout.offset, self.device_layout.slots,
                                 cold_layout.offset if zero_copy else None)
        self.tables.to_device()
        for la in self.layers.values():
            if la.fused:
                la.bind(self.pool, host_pool, self.unit)
        self.staging = None  # long calls' bulk copies (runtime.expert_staging)
        if stage_tokens is not None and zero_copy and self.fused_all and host_pool is not None:
            self.staging = StagedPrefill(host_pool, cold_layout, self.layers, stage_tokens, self.device,
                                         self.copy_stream)
        self._staged_call = False  # the call being run stages (its counts are no zero-copy reads)
        self._group: int | None = None  # tokens of the group of calls being run (stage_calls)

        # What is counted. Every expert on the device: nothing can move, so the per-token count
        # read (a wait on the device, then ~20 small numpy passes with the GPU idle) is put off; the counts add up on the device until ``flush``.
        self.all_hot = n_cold == 0
        self.counts = RoutingCounts((spec.n_layer, self.n_expert), self.device, self.pin)
        self._stats = StoreStats()
        # A padded prefill call (``count_real_tokens``): the device scalar of its real tokens,
        # whose routings alone the fused kernels count (padding must not teach placement).
        self.real_tokens: torch.Tensor | None = None
        self._step_routed = False
        self._promoting: tuple[list[tuple[int, int, int]], torch.cuda.Event] | None = None

        # Who else learns from the traffic (``runtime.learning``, ``runtime.routing_trace``),
        # the side of the tokens being run, and the async mode's counts (read on the host there).
        self.observer: RoutingObserver | None = None
        self.recorder: RoutingRecorder | None = None
        self.side = SIDES[0]
        self._routed = np.zeros((spec.n_layer, self.n_expert), dtype=np.int64)
        self._swap_staging: torch.Tensor | None = None

    def _expert_layers(self, want_fused: bool) -> dict[int, ExpertLayer]:
        """Each MoE layer's parts and whether the fused kernel reads them; one warning names the
        expert types it does not read."""
        layers, slow = {}, set()
        for il in self.moe_layers:
            parts = self.source.layout(il)
            slow |= {quant_name(int(p.qtype)) for p in parts if int(p.qtype) not in KERNEL_QTYPES}
            ok = all(int(p.qtype) in KERNEL_QTYPES for p in parts)
            layers[il] = ExpertLayer(parts, sum(p.nbytes for p in parts), ok and want_fused)
        if want_fused and slow:
            self.warn(f"{_name(self.source.path)}: experts in {', '.join(sorted(slow))} have no Triton kernel; their "
                      f"layers dequantize each expert on use (slower, and decode steps are not captured in CUDA graphs)")
        return layers

    def _cold_tier(self, layout: PoolLayout, nbytes: dict[int, int], host_bytes: int | None) -> ColdTier:
        """Every cold expert in (pinned) host memory when host RAM allows, else the disk tier."""
        if self.host_all:
            return HostPool(self.source, layout, nbytes, self.pin)
        cap = max(1, int(host_bytes or 0) // max(self.slot_bytes, 1))
        return DiskTier(self.source, nbytes, self.slot_bytes, cap, self.pin, self._copies_done)

    def _copies_done(self) -> None:
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    # --- the expert-provider contract ---------------------------------------------------------

    @property
    def capturable(self) -> bool:
        """A decode step through this store can be captured in a CUDA graph (``runtime.graph``):
        zero-copy mode with every layer on the fused kernel needs no host round trip inside the step."""
        return self.mode == "zerocopy" and self.fused_all

    def count_real_tokens(self, real: torch.Tensor | None) -> None:
        self.real_tokens = real

    def staged_prefill(self, n_tokens: int) -> bool:
        """Whether an eager call of ``n_tokens`` tokens stages the cold experts (one bulk copy per
        layer: ``runtime.expert_staging``) instead of reading them zero-copy."""
        return self.staging is not None and self.staging.wants(n_tokens)

    def stage_calls(self, n_tokens: int | None) -> None:
        """A group stages all at once: its copies are counted here, once (not while a graph of
        it is captured: its replays are counted, each bracketed by ``stage_calls``)."""
        staging = self.staging
        if staging is None:
            self._group = n_tokens
            return
        if n_tokens is None:
            if self._group is not None and self.staged_prefill(self._group):
                staging.end()
            self._group = None
            staging.finish()
            return
        self._group = n_tokens
        if self.staged_prefill(n_tokens):
            staging.begin()
            self._staged_call = True
            if not _capturing(self.device):
                nbytes = sum(staging.span_bytes(il) for il in staging.order)
                self._stats.staged_layers += len(staging.order)
                self._stats.staged_bytes += nbytes
                self._stats.bytes_streamed += nbytes

    def _stages(self, n_tokens: int) -> bool:
        """This call stages: a call of a group that stages (eager, or captured whole: the group's
        copies are captured with it), or a call alone, long enough, eager (not padded: alone it is
        one of a captured session's calls; not being captured)."""
        if self._group is not None:
            return self.staged_prefill(self._group)
        if self.real_tokens is not None or not self.staged_prefill(n_tokens):
            return False
        return not _capturing(self.device)

    def routing_side(self, side: str) -> None:
        """The calls from now on run tokens of ``side``. An all-hot store's counts of the other
        side, still on the device, are read first (only when a learner needs them apart: the
        session has just read a result of theirs, so the device is idle)."""
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
        la = self.layers[layer]
        self._step_routed = True
        if self.recorder is not None:
            self.recorder.record(layer, ids, self.real_tokens)
        if self.mode == "zerocopy":
            if la.fused:  # the kernel counts the routings itself
                if self.staging is not None and layer in self.staging.spans and self._stages(x.shape[0]):
                    return self._fused_staged(layer, x, weights, ids, parts, q8)
                return self._fused(la.host_pools, x, weights, ids, self.tables.device[layer],
                                   self.counts.step[layer], parts, q8)
            flat = ids.reshape(-1)
            one = torch.ones_like(flat, dtype=torch.int32)
            if self.real_tokens is not None:  # a padded call run eagerly off the GPU (tests): real tokens only
                one = (torch.arange(ids.shape[0], device=ids.device) < self.real_tokens).to(torch.int32)
                one = one.repeat_interleave(ids.shape[1])
            self.counts.step[layer].index_add_(0, flat, one)
        else:
            left = self._make_resident(layer, ids)
            if la.fused:
                if len(left):
                    return self._fused_overflow(layer, la, x, weights, ids, left, parts, q8)
                return self._fused(la.pools, x, weights, ids, self.tables.device[layer], parts=parts, q8=q8)
        return routed_sum(x, weights, ids, lambda e, rows: self._expert_forward(layer, e, rows))

    def _fused(self, pools: "ExpertPools", x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
               table_row: torch.Tensor, counts: torch.Tensor | None = None, parts: bool = False,
               q8: "Int8Rows | None" = None) -> torch.Tensor:
        from .kernels.moe import moe_experts

        # router ids (int64) and weights (float32) go in as they are: the kernels read either
        # float32 out: the block's residual epilogue (layers.ffn_residual) rounds it, no launch of its own
        return moe_experts(x, ids, weights.float(), table_row, pools, act_q8=True, x_q8=q8, counts=counts,
                           count_tokens=self.real_tokens if counts is not None else None, reduce=not parts)

    def _fused_staged(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      parts: bool, q8: "Int8Rows | None") -> torch.Tensor:
        """The fused kernel over the layer's cold experts staged in a device buffer."""
        staging = self.staging
        assert staging is not None
        pools, row, new = staging.serve(layer, self.tables.device[layer])
        y = self._fused(pools, x, weights, ids, row, self.counts.step[layer], parts, q8)
        staging.done(layer)
        if new and self._group is None:  # (a group's copies are counted by stage_calls)
            nbytes = staging.span_bytes(layer)
            self._stats.staged_layers += 1
            self._stats.staged_bytes += nbytes
            self._stats.bytes_streamed += nbytes
        self._staged_call = True
        return y

    def _fused_overflow(self, layer: int, la: ExpertLayer, x: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor, left: np.ndarray, parts: bool = False,
                        q8: "Int8Rows | None" = None) -> torch.Tensor:
        """The fused kernel with experts ``left`` read from host memory: the pinned host pool when
        it holds every cold expert, else a pinned staging buffer filled from the file."""
        row = self.slots.table[layer].copy()  # a one-off row
        staging = None
        if isinstance(self.cold, HostPool):
            row[left] = -(self.cold.layout.offset[layer, left] + 1)
            pools = la.host_pools
        else:
            slot_units = self.device_layout.slot_units
            staging = torch.empty(len(left) * self.slot_bytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            for i, e in enumerate(left.tolist()):
                buf, read = self.cold.bytes(layer, e)
                self._stats.disk_reads += read
                staging[i * self.slot_bytes: (i + 1) * self.slot_bytes].copy_(buf[: self.slot_bytes])
            row[left] = -(slot_units * np.arange(len(left)) + 1)
            pools = la.with_host(staging, self.unit)
        self._stats.zero_copy_reads += len(left)
        y = self._fused(pools, x, weights, ids, torch.from_numpy(row).to(self.device), parts=parts, q8=q8)
        if staging is not None and staging.is_pinned():
            torch.cuda.current_stream(self.device).synchronize()  # the kernel reads staging: keep it alive
        return y

    def _expert_forward(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        """The plain path: expand the expert's bytes (wherever they are) and run SwiGLU."""
        la = self.layers[layer]
        raw = self._bytes_of(layer, expert)
        w: dict[str, torch.Tensor] = {}
        for p in la.parts:
            w[p.role] = dequantize_bytes(raw[p.offset: p.offset + p.nbytes], p.qtype, p.shape, x.device, self.dtype)
        if "gate_up" in w:
            gate, up = w["gate_up"].chunk(2, dim=0)
        else:
            gate, up = w["gate"], w["up"]
        return swiglu(x, gate, up, w["down"])

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

    # --- residency (async mode) -------------------------------------------------------------

    def _make_resident(self, layer: int, ids: torch.Tensor) -> np.ndarray:
        """Count the layer's routings and bring every expert ``ids`` names onto the device
        before the layer computes. Returns the experts left in host memory (more misses
        than cache slots): the caller reads those from there."""
        chosen, counts = np.unique(ids.reshape(-1).cpu().numpy(), return_counts=True)  # the one sync
        self._routed[layer, chosen] += counts
        st, slots = self._stats, self.slots
        st.tokens += ids.shape[0] if layer == self.moe_layers[0] else 0
        resident = slots.table[layer, chosen] >= 0
        is_hot = self.hot[layer, chosen]
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
            st.bytes_streamed += len(missing) * self.layers[layer].nbytes
            return missing
        t0 = time.perf_counter()
        protect = set(int(s) for s in cached_now)
        stream = self.copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with _on(stream):
            for e in missing.tolist():
                slot = slots.lru_victim(protect)
                protect.add(slot)
                self._copy_in(layer, e, slot)
        self.tables.upload(layer)
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        st.copy_seconds += time.perf_counter() - t0
        return missing[:0]

    def _copy_in(self, layer: int, expert: int, slot: int, publish: bool = True) -> None:
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
        """After a forward call: count what was routed and (zero-copy mode) promote missed experts
        into cache slots so that repeats are served from VRAM. One small device->host copy.
        ``routed`` says whether MoE layers ran (a replayed graph cannot tell the store).

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
        if self.mode != "zerocopy":
            if self.observer is not None:
                self.observer.observe(self._routed, n_tokens, self.side)
            self._routed[:] = 0
            return
        if self.all_hot:
            self.counts.unread += n_tokens
            return
        self._learn_pending()
        staged, self._staged_call = self._staged_call, False
        if defer:
            self.counts.snapshot(n_tokens, self.side, staged)
        else:
            self._timed_learn(self.counts.read(), n_tokens, self.side, staged)

    def forget_traffic(self) -> None:
        """Drop what the store learned from the tokens so far (statistics, decayed routing counts
        for cache admission): a session's warm-up runs dummy tokens that must teach nothing."""
        self.reset_stats()  # counts not learned yet (on the device, or a deferred step's) go too
        self.slots.freq[:] = 0
        self._routed[:] = 0
        if self.recorder is not None:
            self.recorder.drop()

    @property
    def stats(self) -> StoreStats:
        """The run's counts as learned so far: up to the last token after ``flush``."""
        return self._stats

    def flush(self) -> None:
        """Learn everything counted so far: a deferred step's counts, and the counts an all-hot
        store leaves on the device. Waits for the device."""
        if self.counts.unread:
            n, self.counts.unread = self.counts.unread, 0
            self._timed_learn(self.counts.read(), n, self.side)
        self._learn_pending()
        if self.recorder is not None:
            self.recorder.flush()

    def reset_stats(self) -> None:
        """Start counting afresh; counts not learned yet belong to the statistics replaced."""
        self.counts.drop()
        self._stats = StoreStats()

    def _learn_pending(self) -> None:
        pending = self.counts.take_pending()
        if pending is not None:
            self._timed_learn(*pending)

    def _timed_learn(self, counts: np.ndarray, n_tokens: int, side: str, staged: bool = False) -> None:
        if self.observer is not None:
            self.observer.observe(counts, n_tokens, side)
        t0 = time.perf_counter()
        self._learn_step(counts, n_tokens, staged)
        self._stats.step_seconds += time.perf_counter() - t0

    def _learn_step(self, counts: np.ndarray, n_tokens: int, staged: bool = False) -> None:
        """``staged``: the counts are a staged call's, whose cold experts were copied in bulk
        (counted when staged), not read zero-copy."""
        # On the few (layer, expert) pairs routed this step (8 a layer a token), not the whole
        # [n_layer, n_expert] table: whole-table masks cost several times more host time a token.
        self.tables.wait_sent()  # the pinned table is rewritten below
        st, slots = self._stats, self.slots
        st.tokens += n_tokens
        n_expert = counts.shape[1]
        table, freq = slots.table.reshape(-1), slots.freq.reshape(-1)  # flat views: one index per (layer, expert)
        f = np.flatnonzero(counts.reshape(-1) != 0)  # in (layer, expert) order, as candidates keep it below
        il = f // n_expert
        c = counts.reshape(-1)[f].astype(np.int64)
        resident = table[f] >= 0
        hot = self.hot.reshape(-1)[f]
        st.hot_hits += int(c[hot].sum())
        st.cache_hits += int(c[resident & ~hot].sum())
        missed = ~resident
        st.misses += int(c[missed].sum())
        if not staged:
            st.zero_copy_reads += int(missed.sum())
            st.bytes_streamed += int(self.layer_nbytes[il[missed]].sum())
        slots.freq *= FREQ_DECAY
        freq[f] += c
        published = self._publish_promotions()
        # routed and not resident (published just now are resident)
        keep = f[(table[f] < 0) & (freq[f] >= ADMIT_MIN)]
        moves = slots.admit(np.stack((keep // n_expert, keep % n_expert), axis=1)) if slots.n_cache and len(keep) else []
        if not moves:
            if published:
                self.tables.upload(track=True)
            return
        self.tables.upload(track=True)  # victims point back to host memory before any copy overwrites them
        stream = self.copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with _on(stream):
            for il, e, slot in moves:
                self._copy_in(il, e, slot, publish=stream is None)  # streamed a second time: counted again
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            self._promoting = (moves, event)

    def _publish_promotions(self) -> bool:
        """Point the table at the cache slots filled since the last step (host table only)."""
        if self._promoting is None:
            return False
        moves, event = self._promoting
        self._promoting = None
        event.synchronize()  # long done: the copies had a whole decode step
        for il, e, slot in moves:
            self.slots.publish(il, e, slot)
        return True

    # --- re-placement (between requests) ---------------------------------------------------

    def apply_swaps(self, swaps: Swaps) -> int:
        """Move the hot set: ``swaps.promote[i]`` (a cold expert) takes the device slot of
        ``swaps.demote[i]`` (a hot one whose layer's experts take as many pool units:
        ``formats.placement.plan_swaps_in_place``). Returns the bytes copied.

        For between requests: whatever the device still runs is waited for on the copy stream,
        the copies run there and are waited for, then the table rows change and are uploaded
        behind them. The demoted experts' bytes go from the device to the host-pool ranges the
        promoted experts leave (through a pinned staging buffer: the two ranges swap contents),
        so every cold expert stays readable from host memory (zero-copy reads, cache copies)
        and no pool changes size; with the disk tier they are read from the file again when
        needed. Results never change: the kernels read the same bytes wherever they are."""
        pairs = list(zip(swaps.promote, swaps.demote))
        if len(swaps.promote) != len(swaps.demote):
            raise ValueError("each promoted expert needs the slot of one demoted expert")
        if self.staging is not None and any(p[0] != d[0] for p, d in pairs):
            # staged calls copy each layer's cold experts as one host-pool range (expert_staging)
            raise ValueError("a store that stages long calls swaps experts within a layer only")
        units = self.device_layout.units
        for (pl, pe), (dl, de) in pairs:
            if pl not in units or dl not in units or units[pl] != units[dl]:
                raise ValueError(f"expert {pe} of layer {pl} does not fit the slot of expert {de} of layer {dl}")
            if self.hot[pl, pe] or not self.hot[dl, de]:
                raise ValueError(f"cannot promote expert {pe} of layer {pl} (hot: {bool(self.hot[pl, pe])}) over "
                                 f"expert {de} of layer {dl} (hot: {bool(self.hot[dl, de])})")
        if len({p for p, _ in pairs}) != len(pairs) or len({d for _, d in pairs}) != len(pairs):
            raise ValueError("an expert appears twice in one set of swaps")
        if not pairs:
            return 0
        self.flush()  # counts read so far were served by the hot set as it was
        self._publish_promotions()
        self.tables.wait_sent()
        slots, U = self.slots, self.unit
        for p, _ in pairs:  # a promoted expert held in a cache slot leaves it
            if slots.slot_of[p] >= 0:
                slots.evict(int(slots.slot_of[p]))
        host = self.cold if isinstance(self.cold, HostPool) else None
        at_dev = [int(self.device_layout.offset[d]) * U for _, d in pairs]
        at_host = [int(host.layout.offset[p]) * U for p, _ in pairs] if host is not None else []
        sizes = [(self.layers[p[0]].nbytes, self.layers[d[0]].nbytes) for p, d in pairs]
        stream = self.copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        moved, first = 0, 0
        while first < len(pairs):  # batches of at most SWAP_STAGING_BYTES staged (at least one expert)
            last, staged = first + 1, sizes[first][1]
            while last < len(pairs) and staged + sizes[last][1] <= SWAP_STAGING_BYTES:
                staged += sizes[last][1]
                last += 1
            batch = range(first, last)
            staging = self._staging(staged) if host is not None else None
            with _on(stream):
                k = 0
                for i in batch:
                    n_p, n_d = sizes[i]
                    if staging is not None:  # the demoted expert's bytes out first: its slot is overwritten next
                        staging[k: k + n_d].copy_(self.pool[at_dev[i]: at_dev[i] + n_d], non_blocking=self.pin)
                        src = host.tensor[at_host[i]: at_host[i] + n_p]
                        k += n_d
                    else:
                        src, read = self.cold.bytes(*pairs[i][0])
                        self._stats.disk_reads += read
                    self.pool[at_dev[i]: at_dev[i] + n_p].copy_(src[:n_p], non_blocking=self.cold.pinned)
                    moved += n_p + (n_d if staging is not None else 0)
            if stream is not None:
                stream.synchronize()
            if staging is not None:
                k = 0
                for i in batch:
                    n_d = sizes[i][1]
                    host.tensor[at_host[i]: at_host[i] + n_d].copy_(staging[k: k + n_d])
                    k += n_d
            first = last
        for i, (p, d) in enumerate(pairs):
            if host is not None:
                host.layout.offset[d], host.layout.offset[p] = host.layout.offset[p], -1
            self.device_layout.offset[p], self.device_layout.offset[d] = self.device_layout.offset[d], -1
            self.hot[p], self.hot[d] = True, False
            slots.hot[p], slots.hot[d] = True, False
            slots.table[p] = at_dev[i] // U
            slots.table[d] = slots.cold_entry(*d)
        self.tables.upload(track=True)
        return moved

    def _staging(self, nbytes: int) -> torch.Tensor:
        """A (pinned) host buffer of at least ``nbytes`` for the demoted experts' bytes, kept for the
        next re-placement (pinning memory costs milliseconds)."""
        if self._swap_staging is None or self._swap_staging.numel() < nbytes:
            self._swap_staging = pinned_empty(nbytes, self.pin)
        return self._swap_staging

    # --- reporting ----------------------------------------------------------------------------

    def describe(self) -> dict:
        n_total = len(self.moe_layers) * self.n_expert
        return {"mode": self.mode, "hot_experts": self.n_hot, "experts": n_total,
                "hot_fraction": self.n_hot / max(n_total, 1), "cache_slots": self.n_cache,
                "slot_bytes": self.slot_bytes, "device_pool_bytes": self.pool.numel(),
                "staging_bytes": self.staging.nbytes if self.staging is not None else 0,
                "stage_tokens": self.staging.min_tokens if self.staging is not None else None,
                "host_tier": ("pinned" if isinstance(self.cold, HostPool) and self.cold.layout.n_units
                              else "none" if not self.n_cache and self.n_hot == n_total
                              else "file" if self.host_all else "disk")}


def _on(stream: "torch.cuda.Stream | None"):
    """``torch.cuda.stream(stream)``, or nothing to do without one (CPU, pageable copies)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _gib(n: int | None) -> str:
    n = n or 0
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 else f"{n / 1024**2:.1f} MiB"


def _name(path) -> str:
    return os.path.basename(str(path))
