"""Staged prefill: a long call's cold experts copied to the device in bulk, one copy per layer.

Why: in zero-copy mode (``runtime.expert_store``) the fused kernel reads a cold expert from pinned
host memory once per tile of tokens that routes to it, over PCIe. A decode step
routes a few experts a layer and that is the cheapest way to serve them; a call of many tokens
routes nearly every expert of every layer, many tiles each, and re-reads the same bytes again
and again (a long prompt at partial residency streams many times the cold experts' bytes and
prefills far slower than all-GPU; BENCHMARKS.md). A bulk DMA copy runs at full PCIe
speed instead, and the host pool keeps each layer's cold experts in one contiguous range
(``expert_pools.layout_pool``), so a layer takes ONE copy into a device staging buffer. Two
buffers take turns: while layer k computes from one, layer k+1's copy fills the other on the
copy stream, so the copies hide behind compute when a call is long enough.

The kernels are unchanged: the staging buffer is handed to them as the "host" pool (same unit
spacing), and a per-call table row sends each host entry ``-(h + 1)`` to ``h - first`` in the
buffer (``staged_row``), so the arithmetic, and the bits, are those of every other residency.

Only experts in the pinned host pool are staged. Cold experts in the disk tier (host RAM cannot
hold them all) are served as before (async mode: copied into cache slots, or read through a
pinned staging buffer filled from the file); a store without a host pool has nothing to stage.
A call captured alone in a CUDA graph (``runtime.graph``) never stages: the choreography below is
host code between launches. A group of calls run layer by layer (``MoEModel.forward_calls``: a
prompt's calls, padded ones included) stages each layer once: every call of the group reads the
layer's buffer before the next layer is served; a whole group is also captured, copies included
(``begin``/``end``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .expert_pools import PoolLayout
from .expert_slots import NOT_RESIDENT
from .expert_tables import ExpertLayer

if TYPE_CHECKING:
    from .kernels.moe import ExpertPools


@dataclass(frozen=True)
class Span:
    """One layer's cold experts in the host pool: ``units`` units from unit offset ``first``."""

    first: int
    units: int


def cold_spans(layout: PoolLayout) -> dict[int, Span]:
    """Each layer's range in the host pool ``layout`` (layers with no expert there are left out).
    ``layout_pool`` keeps a layer's experts together, so a range holds that layer's experts and
    nothing else; a layout that did not would be staged wrong, hence the check."""
    spans = {}
    for il, u in layout.units.items():
        at = layout.offset[il][layout.offset[il] >= 0]
        if not len(at):
            continue
        first, end = int(at.min()), int(at.max()) + u
        if end - first != u * len(at):
            raise ValueError(f"layer {il}'s experts are not contiguous in the host pool")
        spans[il] = Span(first, end - first)
    return spans


def staging_units(spans: dict[int, Span]) -> int:
    """Units of one staging buffer: the largest layer's span (``formats.placement`` counts two)."""
    return max((s.units for s in spans.values()), default=0)


def staged_row(row: torch.Tensor, first: int) -> torch.Tensor:
    """A slot table row whose host pool entries ``-(h + 1)`` point into a staging buffer holding
    the host pool from unit ``first`` on: ``-(h - first + 1) = entry + first``. Device entries
    (hot and cached experts) and ``NOT_RESIDENT`` are kept."""
    return torch.where((row < 0) & (row != NOT_RESIDENT), row + first, row)


class StagedPrefill:
    """Two device staging buffers over the pinned host pool ``host`` (laid out as ``layout``) and
    the order of their copies. A call stages when it has at least ``min_tokens`` tokens
    (``wants``; benchmarks move ``min_tokens`` to compare both paths in one process).

    Per staged layer the store calls ``serve`` before the kernel and ``done`` after it is
    launched. ``serve`` makes sure this layer's copy was issued (the first staged layer of a call
    issues its own), issues the next staged layer's copy into the other buffer once the kernel
    that last read that buffer is done (``free``), and has the compute stream wait for this
    layer's copy (``ready``). On the CPU the copies are plain copies and nothing waits.

    The spans are the host pool's layout at load. They stay right because re-placement swaps a
    staging store's experts within a layer only (``ExpertStore.apply_swaps``): a demoted expert
    takes the host range its layer's promoted expert leaves, so each layer keeps its range."""

    def __init__(self, host: torch.Tensor, layout: PoolLayout, layers: dict[int, ExpertLayer], min_tokens: int,
                 device: torch.device, copy_stream: "torch.cuda.Stream | None"):
        self.host, self.unit, self.min_tokens = host, layout.unit, min_tokens
        self.spans = cold_spans(layout)
        self.order = sorted(self.spans)  # the order a forward call runs its layers in
        self.index = {il: i for i, il in enumerate(self.order)}
        size = staging_units(self.spans) * self.unit
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]
        self.layers = layers  # their device pool views are taken at each call (re-placement may rebind them)
        self.stream = copy_stream
        self.ready: list[torch.cuda.Event | None] = [None, None]  # buffer's last copy landed
        self.free: list[torch.cuda.Event | None] = [None, None]  # buffer's last reader finished
        self.ahead: int | None = None  # index of the layer whose copy was issued ahead
        self.current: int | None = None  # index of the layer being served (its buffer is ready)

    @property
    def nbytes(self) -> int:
        """Device bytes of both buffers (what the VRAM plan reserves)."""
        return sum(b.numel() for b in self.buffers)

    def wants(self, n_tokens: int) -> bool:
        return n_tokens >= self.min_tokens

    def span_bytes(self, layer: int) -> int:
        return self.spans[layer].units * self.unit

    def serve(self, layer: int, row: torch.Tensor) -> tuple["ExpertPools", torch.Tensor, bool]:
        """The kernel's pools and table row for ``layer`` (one with cold experts) in a staged call,
        and whether the layer's copy is new: the layer served last is served again from its
        buffer (the next call of a group)."""
        i, b = self.index[layer], self.index[layer] % 2
        new = self.current != i
        if new:
            if self.ahead != i:  # the call's first staged layer (or one after an interrupted call)
                self._issue(i)
            self.ahead = None
            if i + 1 < len(self.order):
                self._issue(i + 1)
                self.ahead = i + 1
            self.current = i
            if self.ready[b] is not None:
                torch.cuda.current_stream(self.buffers[b].device).wait_event(self.ready[b])
        return self.layers[layer].with_host(self.buffers[b], self.unit), staged_row(row, self.spans[layer].first), new

    def finish(self) -> None:
        """The call (or group) is over: the next one copies its layers again (re-placement may
        change the host pool between calls)."""
        self.current = None

    def begin(self) -> None:
        """A group begins (run, or captured in a CUDA graph: ``runtime.graph.PrefillGraphs``):
        its first copy into each buffer waits for all work queued before it, not for events of
        an earlier call, which a capture cannot wait on (and which a capture's own events must
        not outlive). Within a capture that wait forks the copy stream into the graph."""
        self.ready, self.free = [None, None], [None, None]
        self.ahead = self.current = None

    def end(self) -> None:
        """A group ends: in a capture, the copy stream joins the compute stream (a graph must end
        on the stream it began on) and the capture's events are dropped."""
        if self.stream is not None and torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(self.buffers[0].device).wait_stream(self.stream)
            self.begin()

    def done(self, layer: int) -> None:
        """The layer's kernel is launched: its buffer may be refilled once the kernel finishes."""
        if self.stream is not None:
            b = self.index[layer] % 2
            self.free[b] = torch.cuda.Event()
            self.free[b].record()

    def _issue(self, i: int) -> None:
        b, span = i % 2, self.spans[self.order[i]]
        src = self.host[span.first * self.unit: (span.first + span.units) * self.unit]
        dst = self.buffers[b][: src.numel()]
        if self.stream is None:
            dst.copy_(src)
            return
        if self.free[b] is None:  # the buffer's first copy since ``begin``: after all work queued
            self.stream.wait_stream(torch.cuda.current_stream(dst.device))
        with torch.cuda.stream(self.stream):
            if self.free[b] is not None:
                self.stream.wait_event(self.free[b])
            dst.copy_(src, non_blocking=True)
            self.ready[b] = torch.cuda.Event()
            self.ready[b].record(self.stream)

