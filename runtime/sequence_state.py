"""One sequence's state as a value: what each kind of layer keeps of a sequence at a position,
copied out of a ``Cache`` (``snapshot``) and put back into one (``restore``).

Why a value: a server keeps many conversations (``runtime.conversation_cache``) but computes
in one ``Cache``; a conversation switched out is a ``SequenceState`` in host memory or in a
file, and switching back in is one bulk copy instead of its prefill.

The interface, one implementation per kind of layer (``LAYER_KINDS``; an architecture's cache is
a list of these layers, ``MoEModel.new_cache``), at a position ``pos`` where the sequence's rows
are exact (a fresh session's call ends there: ``Session.exact``):

- ``take(layer, pos, saved)`` -> the host tensors that are the layer's state at ``pos`` (``saved``:
  the layer's ``StateCheckpoints`` copy at ``pos``, for the states the cache itself has moved
  past), or None when the layer holds nothing yet;
- ``put(layer, tensors, pos, device)`` writes them back into the layer's own buffers (a captured
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


class LayerKind(Protocol):
    def take(self, layer, pos: int, saved: HostTensors | None) -> HostTensors | None: ...

    def put(self, layer, tensors: HostTensors, pos: int, device: torch.device) -> None: ...


def _host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t`` (pinned for a device tensor), queued behind the current stream's work."""
    out = pinned_like(t, pin=t.is_cuda)
    out.copy_(t, non_blocking=True)
    return out


class AttentionRows:
    """A full-attention layer: rows ``[0, pos)`` of each of its buffers."""

    def take(self, layer: KVCache, pos: int, saved: HostTensors | None) -> HostTensors | None:
        if layer.k is None or pos == 0:
            return None
        return tuple(_host(t[:, :pos]) for t in layer.state()) + (_dtype_tag(layer.dtype),)

    def put(self, layer: KVCache, tensors: HostTensors, pos: int, device: torch.device) -> None:
        *rows, tag = tensors
        layer.reserve(pos, _like(rows[0], tag, layer, device))
        for t, host in zip(layer.state(), rows):
            t[:, :pos].copy_(host, non_blocking=True)


class WindowRows:
    """A sliding-window layer's ring: the rows of positions ``[pos - window + 1, pos)``, in order."""

    def take(self, layer: KVCache, pos: int, saved: HostTensors | None) -> HostTensors | None:
        if layer.k is None or pos == 0:
            return None
        first = max(0, pos - layer.window + 1)
        if saved is not None:  # (StateCheckpoints keeps the window's rows first)
            rows = [h[:, : pos - first].clone() for h in saved]
        else:
            at = torch.arange(first, pos, device=layer.k.device) % layer.rows
            rows = [_host(t[:, at]) for t in layer.state()]
        return tuple(rows) + (_dtype_tag(layer.dtype),)

    def put(self, layer: KVCache, tensors: HostTensors, pos: int, device: torch.device) -> None:
        *rows, tag = tensors
        layer.reserve(pos, _like(rows[0], tag, layer, device))
        first = max(0, pos - layer.window + 1)
        at = torch.arange(first, pos, device=layer.k.device) % layer.rows
        for t, host in zip(layer.state(), rows):
            t[:, at] = host.to(t.device, non_blocking=True)
        layer.since = first  # the ring's other rows hold another sequence's positions


class RecurrentRows:
    """A Gated DeltaNet layer: its conv window and recurrent matrix after ``pos`` tokens (only a
    checkpoint has them: the cache's own are overwritten token after token)."""

    def take(self, layer: RecurrentState, pos: int, saved: HostTensors | None) -> HostTensors | None:
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

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}


def _dtype_tag(dtype: torch.dtype | None) -> torch.Tensor:
    """The activations' dtype of a KV layer as a one-value tensor (a q8_0 buffer holds codes, so its
    own dtype does not say which dtype attention reads), kept among the state's tensors so that a
    file holds tensors only."""
    return torch.tensor([_DTYPES[dtype or torch.float32]], dtype=torch.int8)


def _like(rows: torch.Tensor, tag: torch.Tensor, layer: KVCache, device: torch.device) -> torch.Tensor:
    """What ``KVCache.reserve`` sizes new buffers after: ``[1, H_kv, head_dim]`` in the activations' dtype."""
    dtype = next(d for d, i in _DTYPES.items() if i == int(tag[0]))
    return torch.empty((1, rows.shape[0], rows.shape[2]), dtype=dtype, device=device)


def truncatable(cache: Cache) -> bool:
    """Whether a state at ``pos`` also gives the state at any earlier exact position (full
    attention only: its rows are a prefix; a ring's window or a recurrent state is not)."""
    return all(isinstance(la, KVCache) and not la.ring for la in cache.layers)


@dataclass
class SequenceState:
    """The state of one sequence after ``tokens`` (the position is their number), one entry of
    host tensors per cache layer (None: nothing there yet). ``cuts``: where a fresh session's
    calls end within ``tokens`` (``Session.cuts``), the positions a truncatable state can be
    cut back to. ``ready``: the copies were queued on a side stream; restoring waits for it."""

    tokens: tuple[int, ...]
    cuts: tuple[int, ...]
    layers: list[HostTensors | None]
    ready: object | None = field(default=None, repr=False)  # a torch.cuda.Event

    @property
    def pos(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.layers if layer is not None for t in layer)

    def wait(self) -> None:
        """Block until the copies out of the device are done (before reading the host tensors)."""
        if self.ready is not None:
            self.ready.synchronize()


def snapshot(cache: Cache, tokens: list[int], cuts: list[int], saved: list | None) -> SequenceState:
    """The state of ``cache`` at ``len(tokens)`` (an exact position whose rows the cache still
    holds; ``saved``: the ``StateCheckpoints`` copy there, for recurrent states and rings that
    moved past it). On a GPU the copies run on a side stream, ordered after the work queued so
    far and off the next request's path (``SequenceState.ready``)."""
    pos = len(tokens)
    device = next((t.device for la in cache.layers for t in _tensors(la)), torch.device("cpu"))
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    ready = None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        layers = [kind_of(la).take(la, pos, saved[il] if saved is not None else None)
                  for il, la in enumerate(cache.layers)]
        if stream is not None:
            ready = torch.cuda.Event()
            ready.record(stream)
    return SequenceState(tuple(tokens), tuple(c for c in cuts if c <= pos), layers, ready)


def restore(state: SequenceState, cache: Cache, device: torch.device) -> None:
    """Put ``state`` into ``cache``'s own buffers and set its position: the cache then holds what
    it held when ``state`` was taken (rows past it are masked, and a ring vouches only for the
    restored window)."""
    state.wait()
    cache.reset()
    pos = state.pos
    for la, tensors in zip(cache.layers, state.layers):
        if tensors is not None:
            kind_of(la).put(la, tensors, pos, device)
    cache.pos = cache.high = pos
    for la in cache.layers:
        if isinstance(la, KVCache) and la.ring:
            la.since = max(0, pos - la.window + 1)


def _tensors(layer: KVCache | RecurrentState) -> list[torch.Tensor]:
    if isinstance(layer, RecurrentState):
        return [t for t in (layer.conv, layer.ssm) if t is not None]
    return layer.state()
