"""The expert store: where every routed expert's bytes live, and how a miss reaches the GPU.

Tiers, fastest first:
  hot      experts placed on the device at load (the pack's placement, or a profile's choice
           under a VRAM budget); never evicted.
  cache    a bounded set of spare device slots holding cold experts: the most recently used
           (LRU) when misses are copied in, the most often routed lately when they are read
           zero-copy (there a copy is an extra PCIe transfer, worth it only for repeat traffic).
  host     every cold expert in pinned host memory, when host RAM allows; the GPU can read it
           directly (zero-copy) or copy it into a cache slot.
  disk     otherwise a bounded pinned host cache over the mmapped GGUF / cold shards.

Hot and cached experts sit in one device pool ``[n_slots, slot_bytes]`` (one expert = one
contiguous row, so a miss is one copy) and every MoE layer has a row of one table ``expert ->
slot`` that the fused kernel reads, so a cached expert costs exactly what a hot one does. The
quantized bytes are never expanded in the pool; the kernels unpack them in registers.

How a miss is served (``mode``):
  sync      the router's choice is read on the host (one sync per layer) and missing experts are
            copied from the mmapped file into cache slots with blocking copies: the naive
            offload, kept as the baseline the benchmarks compare against.
  async     the same host read, but copies come from pinned host memory on a side stream and the
            compute stream waits only on their event.
  zerocopy  no host read inside the token: a cold expert's table entry points into the pinned
            host pool (``-(h + 1)``) and the kernel reads it over PCIe. After the token the store
            looks at what was routed (one small copy per token) and promotes missed experts
            that keep being routed into cache slots with async copies overlapping the next
            token, so repeat traffic is served from VRAM.
The arithmetic never depends on where bytes were read from, so every mode and every residency
gives bit-identical outputs (tests check it at 100/60/10% residency).

On a CPU device the same bookkeeping runs over CPU tensors (CI exercises the store that way) and
experts are computed by the plain torch path: dequantize the expert's bytes, SwiGLU, exactly what
``runtime.experts.GGUFExperts`` computes.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from sparkpack.formats.archs import ModelSpec
from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.experts import ROLE_ORDER, expert_slices
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.quants import quant_name

from .experts import ExpertProvider, routed_sum
from .layers import swiglu
from .weights import dequantize_bytes

if TYPE_CHECKING:
    from .kernels.q8dot import Int8Rows

MODES = ("auto", "zerocopy", "async", "sync")
NOT_RESIDENT = -(2**31)  # table entry of an expert in neither pool (disk tier, sync/async modes)
SLOT_ALIGN = 256
# Zero-copy cache admission: routing counts decay by this factor per token (a memory of ~20
# tokens), and a missed expert must reach ADMIT_MIN (routed three times lately) to be copied in:
# a copy costs the PCIe bytes of a zero-copy read, so it must be read from the slot again to pay.
# Measured on the full-size model (BENCHMARKS.md): admitting at 1.5 cost 3% of decode speed at
# 60% residency against no cache slots at all.
FREQ_DECAY = 0.95
ADMIT_MIN = 3.0


@dataclass(frozen=True)
class Part:
    """One tensor's block inside an expert's contiguous byte range."""

    role: str  # gate | up | gate_up | down
    tensor: str
    qtype: int
    shape: tuple[int, int]  # GGUF order (n_in, n_out) of one expert's matrix
    offset: int
    nbytes: int


class ExpertSource(Protocol):
    """Where experts' bytes come from: a GGUF's expert tensors or a pack's shards."""

    path: object

    def layout(self, layer: int) -> list[Part]: ...

    def read(self, layer: int, expert: int, out: np.ndarray) -> None:
        """Fill ``out`` (uint8, the expert's byte count) with the expert's bytes; errors name the file."""
        ...


class GGUFSource:
    """Experts of a plain GGUF: each expert's parts are gathered from the 3-D expert tensors."""

    def __init__(self, gguf: GGUFModel, spec: ModelSpec):
        self.gguf, self.spec, self.path = gguf, spec, gguf.path

    def layout(self, layer: int) -> list[Part]:
        parts, off = [], 0
        for s in expert_slices(self.gguf, self.spec, layer, 0):
            t = self.gguf.tensors[s.tensor]
            parts.append(Part(s.role, s.tensor, t.qtype, (t.shape[0], t.shape[1]), off, s.nbytes))
            off += s.nbytes
        return parts

    def read(self, layer: int, expert: int, out: np.ndarray) -> None:
        off = 0
        for s in expert_slices(self.gguf, self.spec, layer, expert):
            out[off: off + s.nbytes] = self.gguf.bytes_at(s.offset, s.nbytes)
            off += s.nbytes


class PackSourceExperts:
    """Experts of a ``.sparkpack``: one contiguous range of the hot shard or of a cold shard,
    checked against its manifest checksum on load (a corrupt shard is named when first needed)."""

    def __init__(self, pack, spec: ModelSpec):
        self.pack, self.spec, self.path = pack, spec, pack.path

    def layout(self, layer: int) -> list[Part]:
        out = []
        for p in sorted(self.pack.parts[layer], key=lambda p: p.offset):
            t = self.pack.tensors[p.tensor]
            out.append(Part(p.role, p.tensor, int(t["qtype"]), (int(t["shape"][0]), int(t["shape"][1])),
                            p.offset, p.nbytes))
        return out

    def read(self, layer: int, expert: int, out: np.ndarray) -> None:
        try:
            data = self.pack.expert_bytes(layer, expert, verify=True)
        except OSError as e:
            rec = self.pack.expert_record(layer, expert)
            raise SparkpackError(self.pack.path, f"shard {rec.shard} cannot be read ({e.strerror or e})") from None
        out[: data.size] = data


@dataclass
class StoreStats:
    """Counts over the run; ``tokens`` are decode + prefill tokens seen by the MoE layers."""

    tokens: int = 0
    hot_hits: int = 0  # routings served by a hot expert
    cache_hits: int = 0  # routings served by a cache slot
    misses: int = 0  # routings whose expert was not on the device when the layer ran
    loads: int = 0  # experts streamed into a cache slot
    zero_copy_reads: int = 0  # (layer, expert) reads served from host memory inside the kernel
    bytes_streamed: int = 0  # host->device bytes, copies and zero-copy reads together
    copy_seconds: float = 0.0  # wall time the host spent issuing/waiting for copies (sync, async)
    step_seconds: float = 0.0  # host time of the per-token bookkeeping (overlaps the next replayed step)
    disk_reads: int = 0

    def as_json(self) -> dict:
        routed = self.hot_hits + self.cache_hits + self.misses
        per_tok = max(self.tokens, 1)
        return {**self.__dict__,
                "routings": routed,
                "hot_hits_per_token": self.hot_hits / per_tok,
                "cache_hits_per_token": self.cache_hits / per_tok,
                "misses_per_token": self.misses / per_tok,
                "miss_rate": self.misses / routed if routed else 0.0}


@dataclass
class _Layer:
    parts: list[Part]
    nbytes: int
    fused: bool  # every part has a fused-kernel quant type
    views: tuple = field(default=())  # (gate or gate_up, up or None, down) device pool views for the kernel
    host_views: tuple | None = None  # the same over the pinned host pool
    qtypes: tuple = field(default=())  # (gate or gate_up, up or None, down) quant types
    n_ff: int = 0


class ExpertStore(ExpertProvider):
    """Tiered expert storage implementing the expert-provider contract of ``runtime.experts``.

    ``hot``: bool ``[n_layer, n_expert]`` of experts resident from the start. ``cache_slots``:
    spare device slots shared by all layers. ``host_bytes``: pinned host memory allowed for cold
    experts (None: all of them); when they do not fit, misses are read from the file through a
    bounded host cache (the disk tier) and a warning says so.
    """

    def __init__(self, source: ExpertSource, spec: ModelSpec, device: torch.device | str, dtype: torch.dtype,
                 hot: np.ndarray, cache_slots: int = 0, mode: str = "auto", host_bytes: int | None = None,
                 fused: bool | None = None, warn=None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.source, self.spec = source, spec
        self.device, self.dtype = torch.device(device), dtype
        self.warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
        self.moe_layers = list(spec.moe_layers)
        self.n_expert = spec.n_expert
        hot = np.asarray(hot, dtype=bool).copy()
        mask = np.zeros_like(hot)
        mask[self.moe_layers] = True
        hot &= mask
        self.hot = hot
        on_cuda = self.device.type == "cuda"
        self.layers: dict[int, _Layer] = {}
        want_fused = fused if fused is not None else on_cuda
        slow: set[str] = set()  # expert quant types without a kernel
        for il in self.moe_layers:
            parts = source.layout(il)
            slow |= {quant_name(int(p.qtype)) for p in parts if int(p.qtype) not in _fused_qtypes()}
            ok = all(int(p.qtype) in _fused_qtypes() for p in parts)
            self.layers[il] = _Layer(parts, sum(p.nbytes for p in parts) if parts else 0, ok and want_fused)
        self.fused_all = all(la.fused for la in self.layers.values())  # every layer on the fused kernel
        if want_fused and slow:
            self.warn(f"{_name(source.path)}: experts in {', '.join(sorted(slow))} have no Triton kernel; their "
                      f"layers dequantize each expert on use (slower, and decode steps are not captured in CUDA graphs)")
        self.layer_nbytes = np.zeros(spec.n_layer, dtype=np.int64)  # one expert's bytes per layer
        for il, la in self.layers.items():
            self.layer_nbytes[il] = la.nbytes
        self.slot_bytes = _round_up(max((la.nbytes for la in self.layers.values()), default=0), SLOT_ALIGN)
        n_cold = int((~hot[self.moe_layers]).sum())
        self.n_hot = int(hot.sum())
        self.n_cache = max(0, min(int(cache_slots), n_cold))
        cold_bytes = n_cold * self.slot_bytes
        self.host_all = host_bytes is None or cold_bytes <= host_bytes
        if not self.host_all:
            self.warn(f"host RAM budget {_gib(host_bytes)} is too small for {_gib(cold_bytes)} of cold experts: "
                      f"misses are read from {_name(source.path)} through a {_gib(host_bytes)} host cache (disk tier, slower)")
        if mode == "auto":
            mode = "zerocopy" if (on_cuda and self.host_all and self.fused_all) else "async"
        if mode == "zerocopy" and not self.host_all:
            raise SparkpackError(source.path, "zero-copy streaming needs every cold expert in host memory; "
                                              "raise the host RAM budget or use --stream async")
        self.mode = mode
        self.pin = on_cuda and mode != "sync"
        # Every expert on the device: nothing can move, so the per-token count read (a wait on
        # the device, then ~20 small numpy passes with the GPU idle: ~0.2 ms a token on the H100)
        # is put off; the counts add up on the device until the stats are read (``stats``).
        self.all_hot = n_cold == 0
        self._unread_tokens = 0
        self._stats = StoreStats()
        self.copy_stream = torch.cuda.Stream(self.device) if on_cuda and mode != "sync" else None

        # Device pool and tables.
        self.pool = torch.empty((self.n_hot + self.n_cache, self.slot_bytes), dtype=torch.uint8,
                                device=self.device)
        self.table = np.full((spec.n_layer, self.n_expert), NOT_RESIDENT, dtype=np.int32)
        self.owner: list[tuple[int, int] | None] = [None] * (self.n_hot + self.n_cache)  # cache slot -> expert
        self.lru: OrderedDict[int, None] = OrderedDict((self.n_hot + i, None) for i in range(self.n_cache))
        self.host_index = np.full((spec.n_layer, self.n_expert), -1, dtype=np.int64)
        self.host_pool: torch.Tensor | None = None
        self.host_cache: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()
        self.host_cache_cap = 0 if self.host_all else max(1, int(host_bytes or 0) // max(self.slot_bytes, 1))
        self._load(hot, n_cold)
        self.table_pinned = torch.from_numpy(self.table).pin_memory() if self.pin else torch.from_numpy(self.table)
        self.table = self.table_pinned.numpy()
        self.table_dev = self.table_pinned.to(self.device, copy=True)
        self.step_counts = torch.zeros((spec.n_layer, self.n_expert), dtype=torch.int32, device=self.device)
        # A padded prefill call (``MoEModel.forward(real=...)``): the device scalar of its real
        # tokens, whose routings alone the fused kernels count (padding must not teach placement).
        self.real_tokens: torch.Tensor | None = None
        self._step_routed = False
        # A replayed step's counts are copied into pinned memory behind it and
        # learned from while the next step runs (``end_step(defer=True)``): (tokens, copy done).
        self._pending: tuple[int, torch.cuda.Event | None] | None = None
        self._table_sent: torch.cuda.Event | None = None  # the last upload from the pinned table
        self.freq = np.zeros((spec.n_layer, self.n_expert))  # decayed routing counts (zero-copy admission)
        self._promoting: tuple[list[tuple[int, int, int]], torch.cuda.Event] | None = None
        self._counts_host = torch.empty(self.step_counts.shape, dtype=torch.int32, pin_memory=self.pin)
        self._bind_views()

    # --- loading ------------------------------------------------------------------------------

    def _load(self, hot: np.ndarray, n_cold: int) -> None:
        """Read hot experts into the device pool and (host tier) cold experts into pinned memory,
        checksums verified as they are read, several experts at a time."""
        jobs_hot = [(il, e) for il in self.moe_layers for e in range(self.n_expert) if hot[il, e]]
        jobs_cold = [(il, e) for il in self.moe_layers for e in range(self.n_expert) if not hot[il, e]]
        for slot, (il, e) in enumerate(jobs_hot):
            self.table[il, e] = slot
        if self.host_all and self.mode != "sync" and jobs_cold:
            self.host_pool = torch.empty((n_cold, self.slot_bytes), dtype=torch.uint8, pin_memory=self.pin)
            for h, (il, e) in enumerate(jobs_cold):
                self.host_index[il, e] = h
                if self.mode == "zerocopy":
                    self.table[il, e] = -(h + 1)
        host_np = self.host_pool.numpy() if self.host_pool is not None else None
        staging = torch.empty((max(1, min(len(jobs_hot), 64)), self.slot_bytes), dtype=torch.uint8, pin_memory=self.pin)
        stage_np = staging.numpy()

        def read(job: tuple[int, int], out: np.ndarray) -> None:
            il, e = job
            self.source.read(il, e, out[: self.layers[il].nbytes])

        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as ex:
            for i in range(0, len(jobs_hot), len(staging)):
                chunk = jobs_hot[i: i + len(staging)]
                list(ex.map(read, chunk, [stage_np[j] for j in range(len(chunk))]))
                self.pool[i: i + len(chunk)].copy_(staging[: len(chunk)])
            if host_np is not None:
                list(ex.map(read, jobs_cold, [host_np[self.host_index[il, e]] for il, e in jobs_cold]))

    def _bind_views(self) -> None:
        """Per-layer views of the pools in the kernel's ``[n_slots, rows, row_bytes]`` form."""
        for la in self.layers.values():
            if not la.fused:
                continue
            q = {p.role: int(p.qtype) for p in la.parts}
            la.qtypes = (q.get("gate", q.get("gate_up")), q.get("up"), q["down"])
            la.n_ff = (la.parts[0].shape[1] // 2) if "gate_up" in q else la.parts[0].shape[1]
            la.views = _kernel_views(self.pool, la.parts)
            if self.host_pool is not None:
                la.host_views = _kernel_views(self.host_pool, la.parts)

    # --- the MoE-layer interface --------------------------------------------------------------

    def count_real_tokens(self, real: torch.Tensor | None) -> None:
        self.real_tokens = real

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
        if self.mode == "zerocopy":
            if la.fused:  # the kernel counts the routings itself
                return self._fused(la, x, weights, ids, self.table_dev[layer], la.host_views, self.step_counts[layer],
                                   parts, q8)
            flat = ids.reshape(-1)
            one = torch.ones_like(flat, dtype=torch.int32)
            if self.real_tokens is not None:  # a padded call run eagerly off the GPU (tests): real tokens only
                one = (torch.arange(ids.shape[0], device=ids.device) < self.real_tokens).to(torch.int32)
                one = one.repeat_interleave(ids.shape[1])
            self.step_counts[layer].index_add_(0, flat, one)
        else:
            left = self._make_resident(layer, ids)
            if la.fused:
                if len(left):
                    return self._fused_overflow(layer, la, x, weights, ids, left, parts, q8)
                return self._fused(la, x, weights, ids, self.table_dev[layer], None, parts=parts, q8=q8)
        return routed_sum(x, weights, ids, lambda e, rows: self._expert_forward(layer, e, rows))

    def _fused(self, la: "_Layer", x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
               table_row: torch.Tensor, host_views: tuple | None, counts: torch.Tensor | None = None,
               parts: bool = False, q8: "Int8Rows | None" = None) -> torch.Tensor:
        from .kernels.moe import moe_experts

        # router ids (int64) and weights (float32) go in as they are: the kernels read either
        # float32 out: the block's residual epilogue (layers.ffn_residual) rounds it, no launch of its own
        return moe_experts(x, ids, weights.float(), table_row, *la.views, *la.qtypes, la.n_ff,
                           host=host_views, counts=counts, act_q8=True, x_q8=q8, reduce=not parts,
                           count_tokens=self.real_tokens if counts is not None else None)

    def _fused_overflow(self, layer: int, la: "_Layer", x: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor, left: np.ndarray, parts: bool = False,
                        q8: "Int8Rows | None" = None) -> torch.Tensor:
        """The fused kernel with experts ``left`` read from host memory: the pinned host pool when
        it holds every cold expert, else a pinned staging buffer filled from the file."""
        row = self.table[layer].copy()
        staging = None
        if self.host_pool is not None:
            row[left] = -(self.host_index[layer, left] + 1)
            host_views = la.host_views
        else:
            on_cuda = self.device.type == "cuda"
            staging = torch.empty((len(left), self.slot_bytes), dtype=torch.uint8, pin_memory=on_cuda)
            for i, e in enumerate(left.tolist()):
                staging[i].copy_(self._host_copy(layer, e))
            row[left] = -(np.arange(len(left)) + 1)
            host_views = _kernel_views(staging, la.parts)
        self.stats.zero_copy_reads += len(left)
        y = self._fused(la, x, weights, ids, torch.from_numpy(row).to(self.device), host_views, parts=parts, q8=q8)
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

    def _bytes_of(self, layer: int, expert: int) -> torch.Tensor:
        s = int(self.table[layer, expert])
        if s >= 0:
            return self.pool[s]
        h = int(self.host_index[layer, expert])
        if h >= 0 and self.host_pool is not None:
            return self.host_pool[h]
        return self._host_copy(layer, expert)

    # --- residency (sync / async modes) -------------------------------------------------------

    def _make_resident(self, layer: int, ids: torch.Tensor) -> np.ndarray:
        """Count the layer's routings and bring every expert ``ids`` names onto the device
        before the layer computes. Returns the experts left in host memory (more misses
        than cache slots): the caller reads those from there."""
        chosen, counts = np.unique(ids.reshape(-1).cpu().numpy(), return_counts=True)  # the one sync
        row = self.table[layer]
        self.stats.tokens += ids.shape[0] if layer == self.moe_layers[0] else 0
        slots_now = row[chosen]
        is_hot = self.hot[layer, chosen]
        self.stats.hot_hits += int(counts[is_hot].sum())
        self.stats.cache_hits += int(counts[(slots_now >= 0) & ~is_hot].sum())
        missing = chosen[slots_now < 0]
        self.stats.misses += int(counts[slots_now < 0].sum())
        for s in slots_now[slots_now >= self.n_hot]:
            self.lru.move_to_end(int(s))
        if not len(missing):
            return missing
        cached_now = slots_now[slots_now >= self.n_hot]
        if len(missing) + len(cached_now) > self.n_cache:
            # Read from host memory where they are (a prefill touches most experts at once).
            self.stats.bytes_streamed += len(missing) * self.layers[layer].nbytes
            return missing
        t0 = time.perf_counter()
        protect = set(int(s) for s in cached_now)
        stream = self.copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with _on(stream):
            for e in missing.tolist():
                slot = self._victim(protect)
                protect.add(slot)
                self._copy_in(layer, e, slot)
        self._upload_table(layer)
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        self.stats.copy_seconds += time.perf_counter() - t0
        return missing[:0]

    def _upload_table(self, layer: int | None = None) -> None:
        """Send the host table (or one layer's row) to the device without a host sync.

        ``self.table`` is a view of pinned memory; the host writes it only after the last copy
        from it is done (the router read of async mode syncs anyway; zero-copy mode's bookkeeping
        waits for ``_table_sent``), so a pending copy never sees a half-written table."""
        src = self.table_pinned if layer is None else self.table_pinned[layer]
        dst = self.table_dev if layer is None else self.table_dev[layer]
        dst.copy_(src, non_blocking=self.pin)
        if self.pin and self.mode == "zerocopy":  # async mode's per-layer uploads need no event
            self._table_sent = torch.cuda.Event()
            self._table_sent.record()

    def _victim(self, protect: set[int]) -> int:
        """Least recently used cache slot not needed by the layer being served."""
        for slot in self.lru:
            if slot not in protect:
                break
        else:  # pragma: no cover - guarded by the slot count check
            raise RuntimeError("no free cache slot")
        self._evict(slot)
        self.lru.move_to_end(slot)
        return slot

    def _evict(self, slot: int) -> None:
        """The slot's expert (if any) is read from host memory again (zero-copy) or not at all."""
        old = self.owner[slot]
        if old is not None:
            il, e = old
            h = int(self.host_index[il, e])
            self.table[il, e] = -(h + 1) if (self.mode == "zerocopy" and h >= 0) else NOT_RESIDENT
            self.owner[slot] = None

    def _copy_in(self, layer: int, expert: int, slot: int, publish: bool = True) -> None:
        """Copy an expert into a cache slot on the current stream (the caller picks the copy
        stream once for a batch: entering a stream context per copy cost more than the copy's
        launch). ``publish`` False leaves its table entry for the caller to set once the copy
        is known to be complete."""
        if self.mode == "sync":
            self.pool[slot].copy_(self._host_copy(layer, expert))  # pageable, blocking: the naive baseline
        else:
            self.pool[slot].copy_(self._bytes_of(layer, expert), non_blocking=self.pin)
        self.owner[slot] = (layer, expert)
        if publish:
            self.table[layer, expert] = slot
        self.stats.loads += 1
        self.stats.bytes_streamed += self.layers[layer].nbytes

    def _host_copy(self, layer: int, expert: int) -> torch.Tensor:
        """The expert's bytes read from the file: kept in a bounded pinned host cache (disk tier),
        or in a throwaway pageable buffer (sync mode, which reads the file on every miss)."""
        key = (layer, expert)
        buf = self.host_cache.get(key)
        if buf is not None:
            self.host_cache.move_to_end(key)
            return buf
        if not self.host_cache_cap:
            buf = torch.empty(self.slot_bytes, dtype=torch.uint8)
        elif len(self.host_cache) >= self.host_cache_cap:
            _, buf = self.host_cache.popitem(last=False)
            if self.copy_stream is not None:  # the buffer may still feed an in-flight copy
                self.copy_stream.synchronize()
        else:
            buf = torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=self.pin)
        self.source.read(layer, expert, buf.numpy()[: self.layers[layer].nbytes])
        self.stats.disk_reads += 1
        if self.host_cache_cap:
            self.host_cache[key] = buf
        return buf

    # --- between tokens -----------------------------------------------------------------------

    @property
    def capturable(self) -> bool:
        """A decode step through this store can be captured in a CUDA graph (``runtime.graph``):
        zero-copy mode with every layer on the fused kernel needs no host round trip inside the step."""
        return self.mode == "zerocopy" and self.fused_all

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
        if not (self._step_routed if routed is None else routed):
            return
        self._step_routed = False
        if self.mode != "zerocopy":
            return
        if self.all_hot:
            self._unread_tokens += n_tokens
            return
        self._learn_pending()
        if defer:
            self._snapshot(n_tokens)
        else:
            self._read_counts(n_tokens)

    def forget_traffic(self) -> None:
        """Drop what the store learned from the tokens so far (statistics, decayed routing counts
        for cache admission): a session's warm-up runs dummy tokens that must teach nothing."""
        _ = self.stats  # reads counts still on the device or pending, so none leak into later stats
        self.freq[:] = 0
        self.stats = StoreStats()

    @property
    def stats(self) -> StoreStats:
        """The run's counts, up to the last token (reading counts an all-hot store left on the
        device, and a deferred step's)."""
        if self._unread_tokens:
            n, self._unread_tokens = self._unread_tokens, 0
            self._read_counts(n)
        self._learn_pending()
        return self._stats

    @stats.setter
    def stats(self, value: StoreStats) -> None:
        if self._unread_tokens:  # counts not read yet belong to the stats being replaced
            self._unread_tokens = 0
            self.step_counts.zero_()
        self._pending = None  # so does a deferred step's snapshot (the device counts are reset)
        self._stats = value

    def _read_counts(self, n_tokens: int) -> None:
        counts = self.step_counts.to("cpu", copy=True).numpy()  # waits for the step; a copy on CPU too
        self.step_counts.zero_()
        self._timed_learn(counts, n_tokens)

    def _snapshot(self, n_tokens: int) -> None:
        """Queue this step's counts into pinned memory behind it, then reset them."""
        self._counts_host.copy_(self.step_counts, non_blocking=self.pin)
        self.step_counts.zero_()
        done = None
        if self.pin:
            done = torch.cuda.Event()
            done.record()
        self._pending = (n_tokens, done)

    def _learn_pending(self) -> None:
        """Learn from a deferred step's snapshot (its copy has long landed: the caller read the
        step's logits). The next snapshot is queued only after this returns, so the pinned
        buffers are never rewritten while read."""
        if self._pending is None:
            return
        n_tokens, done = self._pending
        self._pending = None
        if done is not None:
            done.synchronize()
        self._timed_learn(self._counts_host.numpy(), n_tokens)

    def _timed_learn(self, counts: np.ndarray, n_tokens: int) -> None:
        t0 = time.perf_counter()
        self._learn_step(counts, n_tokens)
        self._stats.step_seconds += time.perf_counter() - t0

    def _learn_step(self, counts: np.ndarray, n_tokens: int) -> None:
        # On the few (layer, expert) pairs routed this step (8 a layer a token), not the whole
        # [n_layer, n_expert] table: whole-table masks cost ~0.3 ms a token (40 x 256 experts)
        # against ~0.05 ms so.
        if self._table_sent is not None:  # the pinned table is rewritten below
            self._table_sent.synchronize()
            self._table_sent = None
        st = self._stats
        st.tokens += n_tokens
        n_expert = counts.shape[1]
        table, freq = self.table.reshape(-1), self.freq.reshape(-1)  # flat views: one index per (layer, expert)
        f = np.flatnonzero(counts.reshape(-1) != 0)  # in (layer, expert) order, as candidates keep it below
        il = f // n_expert
        c = counts.reshape(-1)[f].astype(np.int64)
        resident = table[f] >= 0
        hot = self.hot.reshape(-1)[f]
        st.hot_hits += int(c[hot].sum())
        st.cache_hits += int(c[resident & ~hot].sum())
        missed = ~resident
        st.misses += int(c[missed].sum())
        st.zero_copy_reads += int(missed.sum())
        st.bytes_streamed += int(self.layer_nbytes[il[missed]].sum())
        self.freq *= FREQ_DECAY
        freq[f] += c
        published = self._publish_promotions()
        # routed and not resident (published just now are resident)
        keep = f[(table[f] < 0) & (freq[f] >= ADMIT_MIN)]
        cand = np.stack((keep // n_expert, keep % n_expert), axis=1)
        if not self.n_cache or not len(cand):
            if published:
                self._upload_table()
            return
        # Frequency-aware admission: a missed expert replaces the cached one with the lowest
        # decayed routing count, and only if it is routed more often. One-off misses never
        # evict anything, so cache slots stop costing PCIe bandwidth on traffic they cannot serve.
        cached = range(self.n_hot, self.n_hot + self.n_cache)
        scores = np.array([-1.0 if self.owner[s] is None else self.freq[self.owner[s]] for s in cached])
        cand_score = self.freq[cand[:, 0], cand[:, 1]]
        moves = []
        for k in np.argsort(-cand_score, kind="stable"):
            v = int(np.argmin(scores))
            if cand_score[k] <= scores[v]:
                break
            slot = self.n_hot + v
            self._evict(slot)
            scores[v] = np.inf  # filled now: not evicted again in this step
            moves.append((int(cand[k, 0]), int(cand[k, 1]), slot))
        if not moves:
            if published:
                self._upload_table()
            return
        self._upload_table()  # victims point back to host memory before any copy overwrites them
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
            self.table[il, e] = slot
        return True

    # --- reporting ----------------------------------------------------------------------------

    def describe(self) -> dict:
        n_total = len(self.moe_layers) * self.n_expert
        return {"mode": self.mode, "hot_experts": self.n_hot, "experts": n_total,
                "hot_fraction": self.n_hot / max(n_total, 1), "cache_slots": self.n_cache,
                "slot_bytes": self.slot_bytes, "device_pool_bytes": self.pool.numel(),
                "host_tier": ("pinned" if self.host_pool is not None else "none" if not self.n_cache and self.n_hot == n_total
                              else "file" if self.host_all else "disk")}


def _on(stream: "torch.cuda.Stream | None"):
    """``torch.cuda.stream(stream)``, or nothing to do without one (CPU, sync mode)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def routed_experts_bytes(source: ExpertSource, spec: ModelSpec) -> dict[int, int]:
    """Device bytes one expert of each MoE layer costs in the store: every slot of the one pool
    has the largest layer's (aligned) size, so that is the cost whatever the layer. Planning
    with per-layer sizes undercounted a Q4_K_M model's pool by 7% and broke --vram budgets."""
    slot = _round_up(max((sum(p.nbytes for p in source.layout(il)) for il in spec.moe_layers), default=0), SLOT_ALIGN)
    return {il: slot for il in spec.moe_layers}


def _kernel_views(pool: torch.Tensor, parts: list[Part]) -> tuple:
    """``(gate, up, down)`` views of a pool as ``moe_experts`` takes them (``up`` None when the
    layer has one merged gate_up tensor)."""
    views = tuple(_role_view(pool, p) for p in _roles(parts))
    return views if len(views) == 3 else (views[0], None, views[1])


def _roles(parts: list[Part]) -> list[Part]:
    by = {p.role: p for p in parts}
    return [by[r] for r in ROLE_ORDER if r in by]


def _role_view(pool: torch.Tensor, p: Part) -> torch.Tensor:
    """``[n_slots, rows, row_bytes]`` view of one role's block in every slot of ``pool``."""
    n_in, n_out = p.shape
    row_bytes = p.nbytes // n_out
    return pool.as_strided((pool.shape[0], n_out, row_bytes), (pool.stride(0), row_bytes, 1), p.offset)


def _fused_qtypes() -> tuple[int, ...]:
    from .kernels.blocks import SUPPORTED_QTYPES  # noqa: PLC0415 - triton import only when used

    return SUPPORTED_QTYPES


def _round_up(v: int, a: int) -> int:
    return (v + a - 1) // a * a


def _gib(n: int | None) -> str:
    n = n or 0
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 else f"{n / 1024**2:.1f} MiB"


def _name(path) -> str:
    return os.path.basename(str(path))
