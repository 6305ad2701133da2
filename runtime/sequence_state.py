"""One sequence's state as a value: what each kind of layer keeps of a sequence at a position,
copied out of a ``Cache`` (``snapshot``) and put back into one (``restore``).

Why a value: a server keeps many conversations (``runtime.conversation_cache``) but computes
in one ``Cache``; a conversation switched out is a ``SequenceState`` in host memory or in a
file, and switching back in is one bulk copy instead of its prefill.

The interface, one implementation per kind of layer (``LAYER_KINDS``; an architecture's cache is
a list of these layers, ``MoEModel.new_cache``), at a position ``pos`` where the sequence's rows
are exact (a fresh session's call ends there: ``Session.exact``):

- ``take(layer, pos, saved, parent)`` -> the layer's state at ``pos`` in host memory (``saved``:
  the layer's ``StateCheckpoints`` copy at ``pos``, for the states the cache itself has moved
  past; ``parent``: the same layer's part of a state of a prefix, whose attention rows are
  shared instead of copied again), or None when the layer holds nothing yet;
- ``put(layer, part, pos, device)`` writes it back into the layer's own buffers (a captured
  decode step keeps reading them), allocating them if the layer has none yet.

| layer | state at ``pos`` |
| --- | --- |
| full attention ``KVCache`` | keys and values (q8_0: codes and scales) of positions ``[0, pos)`` |
| sliding-window ring ``KVCache`` | the ``window - 1`` rows before ``pos`` (all a later token reads) |
| Gated DeltaNet ``RecurrentState`` | the conv window and the recurrent matrix after ``pos`` tokens |

A restored state gives the bits the cache had at ``pos``: the rows and states are copied, never
recomputed. No global state: each ``SequenceState`` is one sequence, so several can be held (and
later decoded together).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .cache import Cache, KVCache, RecurrentState
from .pinned import pinned_like

HostTensors = tuple[torch.Tensor, ...]
# A state shares its attention rows with the state it extends (its parent: the same
# conversation's previous turn) and copies only the rows after it; past this many pieces a
# snapshot copies all rows again, so a restore stays a few bulk copies.
MAX_CHUNKS = 16


@dataclass
class Rows:
    """A full-attention layer's rows ``[0, pos)``: consecutive chunks, each the layer's buffers'
    rows of some positions (``KVCache.state()``: keys, values, and with q8_0 their scales), in the
    dtype attention reads (``dtype``; q8_0 buffers hold codes). Chunks are shared between the
    states of one conversation, never written after they are taken."""

    chunks: list[HostTensors]
    dtype: torch.dtype

    @property
    def rows(self) -> int:
        return sum(c[0].shape[1] for c in self.chunks)

    def tensors(self) -> list[torch.Tensor]:
        return [t for c in self.chunks for t in c]

    def cut(self, pos: int) -> "Rows":
        """The rows of positions before ``pos``."""
        out, at = [], 0
        for c in self.chunks:
            n = c[0].shape[1]
            if at >= pos:
                break
            out.append(c if at + n <= pos else tuple(t[:, : pos - at] for t in c))
            at += n
        return Rows(out, self.dtype)


LayerPart = HostTensors | Rows


class LayerKind(Protocol):
    def take(self, layer, pos: int, saved: HostTensors | None, parent: LayerPart | None) -> LayerPart | None: ...

    def put(self, layer, part: LayerPart, pos: int, device: torch.device) -> None: ...


def _host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t`` (pinned for a device tensor), queued behind the current stream's work."""
    out = pinned_like(t, pin=t.is_cuda)
    out.copy_(t, non_blocking=True)
    return out


class AttentionRows:
    """A full-attention layer: rows ``[0, pos)`` of each of its buffers, those after ``parent``'s
    rows copied, the parent's shared."""

    def take(self, layer: KVCache, pos: int, saved: HostTensors | None, parent: LayerPart | None) -> Rows | None:
        if layer.k is None or pos == 0:
            return None
        old = parent if isinstance(parent, Rows) and len(parent.chunks) < MAX_CHUNKS else Rows([], layer.dtype)
        first = old.rows
        new = [tuple(_host(t[:, first:pos]) for t in layer.state())] if pos > first else []
        return Rows(old.chunks + new, layer.dtype)

    def put(self, layer: KVCache, part: Rows, pos: int, device: torch.device) -> None:
        d = part.chunks[0][0].shape
        layer.reserve(pos, torch.empty((1, d[0], d[2]), dtype=part.dtype, device=device))
        at = 0
        for chunk in part.chunks:
            n = chunk[0].shape[1]
            for t, host in zip(layer.state(), chunk):
                t[:, at:at + n].copy_(host, non_blocking=True)
            at += n


class WindowRows:
    """A sliding-window layer's ring: the rows of positions ``[pos - window + 1, pos)``, in order."""

    def take(self, layer: KVCache, pos: int, saved: HostTensors | None, parent: LayerPart | None) -> Rows | None:
        if layer.k is None or pos == 0:
            return None
        first = max(0, pos - layer.window + 1)
        if saved is not None:  # (StateCheckpoints keeps the window's rows first)
            rows = [h[:, : pos - first].clone() for h in saved]
        else:
            at = torch.arange(first, pos, device=layer.k.device) % layer.rows
            rows = [_host(t[:, at]) for t in layer.state()]
        return Rows([tuple(rows)], layer.dtype)

    def put(self, layer: KVCache, part: Rows, pos: int, device: torch.device) -> None:
        [rows] = part.chunks
        d = rows[0].shape
        layer.reserve(pos, torch.empty((1, d[0], d[2]), dtype=part.dtype, device=device))
        first = max(0, pos - layer.window + 1)
        at = torch.arange(first, pos, device=layer.k.device) % layer.rows
        for t, host in zip(layer.state(), rows):
            t[:, at] = host.to(t.device, non_blocking=True)
        layer.since = first  # the ring's other rows hold another sequence's positions


class RecurrentRows:
    """A Gated DeltaNet layer: its conv window and recurrent matrix after ``pos`` tokens (only a
    checkpoint has them: the cache's own are overwritten token after token)."""

    def take(self, layer: RecurrentState, pos: int, saved: HostTensors | None,
             parent: LayerPart | None) -> HostTensors | None:
        if pos == 0 or saved is None:
            return None
        return tuple(h.clone() for h in saved)

    def put(self, layer: RecurrentState, tensors: HostTensors, pos: int, device: torch.device) -> None:
        if layer.conv is None:
            layer.conv, layer.ssm = (torch.empty(h.shape, dtype=h.dtype, device=device) for h in tensors)
        layer.conv.copy_(tensors[0], non_blocking=True)
        layer.ssm.copy_(tensors[1], non_blocking=True)


def kind_of(layer: KVCache | RecurrentState) -> LayerKind:
    """The one table from a cache layer to what its state is (``LAYER_KINDS``)."""
    if isinstance(layer, RecurrentState):
        return LAYER_KINDS["recurrent"]
    return LAYER_KINDS["window" if layer.ring else "attention"]


LAYER_KINDS: dict[str, LayerKind] = {"attention": AttentionRows(), "window": WindowRows(), "recurrent": RecurrentRows()}

def truncatable(cache: Cache) -> bool:
    """Whether a state at ``pos`` also gives the state at any earlier exact position (full
    attention only: its rows are a prefix; a ring's window or a recurrent state is not)."""
    return all(isinstance(la, KVCache) and not la.ring for la in cache.layers)


@dataclass
class SequenceState:
    """The state of one sequence after ``tokens`` (the position is their number), one part per
    cache layer (None: nothing there yet): ``Rows`` for attention layers, host tensors for
    recurrent ones. ``cuts``: where a fresh session's calls end within ``tokens``
    (``Session.cuts``), the positions a truncatable state can be cut back to. ``ready``: events of
    the copies queued on side streams (its own and the parent's it shares rows with)."""

    tokens: tuple[int, ...]
    cuts: tuple[int, ...]
    layers: list[LayerPart | None]
    ready: list = field(default_factory=list, repr=False)  # torch.cuda.Events

    @property
    def pos(self) -> int:
        return len(self.tokens)

    def tensors(self) -> list[torch.Tensor]:
        """Every host tensor the state holds (shared ones too)."""
        return [t for part in self.layers if part is not None
                for t in (part.tensors() if isinstance(part, Rows) else part)]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def wait(self) -> None:
        """Block until the copies out of the device are done (before reading the host tensors)."""
        for event in self.ready:
            event.synchronize()

    def cut(self, pos: int) -> "SequenceState":
        """A truncatable state (``truncatable``) cut back to ``pos``, one of its cuts."""
        layers = [part.cut(pos) if isinstance(part, Rows) else part for part in self.layers]
        return SequenceState(self.tokens[:pos], tuple(c for c in self.cuts if c <= pos), layers, self.ready)


def snapshot(cache: Cache, tokens: list[int], cuts: list[int], saved: list | None,
             parent: SequenceState | None = None) -> SequenceState:
    """The state of ``cache`` at ``len(tokens)`` (an exact position whose rows the cache still
    holds; ``saved``: the ``StateCheckpoints`` copy there, for recurrent states and rings that
    moved past it). ``parent``: a state of a prefix of ``tokens`` ending at one of ``cuts`` (the
    conversation's previous turn), whose attention rows the cache holds unchanged: they are
    shared, not copied. On a GPU the copies run on a side stream, ordered after the work queued
    so far and before any queued later; the host does not wait for them (``SequenceState.ready``
    says when they are done)."""
    pos = len(tokens)
    if parent is not None and (parent.pos not in cuts or tuple(tokens[:parent.pos]) != parent.tokens):
        raise ValueError("a parent state must be of a prefix of the tokens that ends a call")
    device = next((t.device for la in cache.layers for t in _tensors(la)), torch.device("cpu"))
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    ready = list(parent.ready) if parent is not None else []
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        layers = [kind_of(la).take(la, pos, saved[il] if saved is not None else None,
                                   parent.layers[il] if parent is not None else None)
                  for il, la in enumerate(cache.layers)]
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            ready.append(event)
    if stream is not None:  # whatever is queued next (a request, a bootstrap step) writes the cache after the copies
        torch.cuda.current_stream(device).wait_event(event)
    return SequenceState(tuple(tokens), tuple(c for c in cuts if c <= pos), layers, ready)


def restore(state: SequenceState, cache: Cache, device: torch.device) -> None:
    """Put ``state`` into ``cache``'s own buffers and set its position: the cache then holds what
    it held when ``state`` was taken (rows past it are masked, and a ring vouches only for the
    restored window)."""
    state.wait()
    cache.reset()
    pos = state.pos
    for la, part in zip(cache.layers, state.layers):
        if part is not None:
            kind_of(la).put(la, part, pos, device)
    cache.pos = cache.high = pos
    for la in cache.layers:
        if isinstance(la, KVCache) and la.ring:
            la.since = max(0, pos - la.window + 1)


def _tensors(layer: KVCache | RecurrentState) -> list[torch.Tensor]:
    if isinstance(layer, RecurrentState):
        return [t for t in (layer.conv, layer.ssm) if t is not None]
    return layer.state()
