"""One decode step captured in a CUDA graph and replayed for every following token.

An eager decode step of these models launches a few thousand small kernels; on the GPU machine
the host needs ~90 ms to issue them while the GPU works ~12 ms. Replaying a captured graph
issues the whole step at once. What makes the step capturable:
  - the token id and its position are read from device memory (``ids``, ``pos``), so nothing
    of the step is a Python value that changes between tokens;
  - KV caches are preallocated buffers attended with a position mask, and recurrent states are
    updated in place (``runtime.cache``), so every step reads and writes the same addresses;
  - the expert store serves misses in zero-copy mode: cold experts are read from pinned host
    memory inside the kernel (routings are counted there too), guessed ones are copied on a
    side stream that forks and joins inside the graph (prefetch), and the store's per-token
    bookkeeping (reading the counts, promoting missed experts into cache slots, rewriting the
    slot table in place) runs on the host while the next replay computes. Stores that copy
    misses on demand (async, sync) need the router's choice on the host mid-step and run eagerly.
A replayed step runs exactly the kernels of an eager step with the same shapes, so outputs are
the same bits either way.
"""
from __future__ import annotations

import os

import torch

from .cache import Cache
from .models.base import MoEModel


def capturable(model: MoEModel) -> bool:
    """Whether a decode step of ``model`` can be captured: CUDA, and experts that need no host
    round trip inside the step. ``SPARKPACK_CUDA_GRAPHS=0`` turns capture off (debugging)."""
    if os.environ.get("SPARKPACK_CUDA_GRAPHS", "1") == "0":
        return False
    return model.device.type == "cuda" and bool(getattr(model.experts, "capturable", False))


class DecodeGraph:
    """Decode steps of one ``Cache``: the first runs eagerly (warm-up: lazy weights, kernel
    compilation, allocator) and is captured; later ones replay. Positions up to the KV buffers'
    capacity are covered; ``step`` returns None past it and the caller decodes eagerly, which
    grows the buffers; the next step then captures again on the new ones."""

    def __init__(self, model: MoEModel, cache: Cache):
        self.model, self.cache = model, cache
        self.ids = torch.zeros(1, dtype=torch.long, device=model.device)
        self.pos = torch.zeros((), dtype=torch.long, device=model.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.replays = 0
        self.captures = 0
        self.captured_on: tuple[int, ...] = ()

    def _kv(self) -> list[torch.Tensor]:
        return [la.k for la in self.cache.layers if getattr(la, "k", None) is not None]

    def room(self) -> int:
        return min((k.shape[1] for k in self._kv()), default=0)

    def _buffers(self) -> tuple[int, ...]:
        return tuple(k.data_ptr() for k in self._kv())

    def step(self, token: int | torch.Tensor) -> torch.Tensor | None:
        """Logits ``[n_vocab]`` after feeding ``token`` at position ``cache.pos``: an int, or a
        one-element id tensor on the device (``Session.decode``: nothing waits for its value)."""
        if self.cache.pos + 1 > self.room():
            return None
        if self.graph is not None and self._buffers() != self.captured_on:
            self.graph = None  # eager steps past the room grew the KV buffers: capture again on them
        if isinstance(token, torch.Tensor):
            self.ids.copy_(token.reshape(1), non_blocking=True)
        else:
            self.ids.fill_(token)
        self.pos.fill_(self.cache.pos)
        if self.graph is None:
            logits = self._capture()
        else:
            self.graph.replay()
            self.replays += 1
            logits = self.logits
        self.cache.pos += 1
        end_step = getattr(self.model.experts, "end_step", None)
        if end_step is not None:  # the store learns from the previous step while this one runs
            end_step(1, routed=True, defer=True)
        return logits[-1].clone()  # the graph's output buffer is rewritten by the next replay

    def _capture(self) -> torch.Tensor:
        stream = torch.cuda.Stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream):  # the real step, eagerly, on a side stream as capture wants
            logits = self.model.forward(self.ids, self.cache, last_only=True, pos=self.pos).clone()
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        self.captures += 1
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # records the same step; nothing runs now
            self.logits = self.model.forward(self.ids, self.cache, last_only=True, pos=self.pos)
        self.graph = graph
        self.captured_on = self._buffers()
        return logits
