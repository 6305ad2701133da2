"""Per-sequence state carried between forward calls: KV caches and DeltaNet recurrent state.

One ``Cache`` per conversation. Attention layers append keys/values; linear-attention layers
replace their conv window and recurrent matrix. ``pos`` is the number of tokens already seen, so a
forward call knows the positions of its new tokens without being told.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


class KVCache:
    """Keys and values of one attention layer in preallocated buffers ``[H_kv, capacity, head_dim]``
    whose row ``i`` (of each head) holds position ``i``. Head-major, so each head's keys are one
    contiguous matrix that attention multiplies in place (position-major buffers had to be
    permuted into a copy of the whole buffer, twice per layer and token).

    Attention always runs over the whole buffer with a position mask (rows past the sequence are
    masked out), so a decode step has the same shapes at every position: that is what lets the
    CUDA graph of a step be replayed, and eager and replayed steps run the very same kernels. The
    buffer doubles when a sequence outgrows it (eager calls only; a captured step is given a
    buffer of its full context up front). Sliding-window layers keep every key too; the window
    is part of the mask.
    """

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def reserve(self, n: int, like: torch.Tensor) -> None:
        """Make room for ``n`` positions (buffers shaped and typed after ``like [T, H_kv, d]``)."""
        if self.k is not None and self.k.shape[1] >= n:
            return
        cap = max(self.capacity, 1)
        while cap < n:
            cap *= 2
        k = like.new_zeros((like.shape[1], cap, like.shape[2]))
        v = like.new_zeros((like.shape[1], cap, like.shape[2]))
        if self.k is not None:
            k[:, : self.k.shape[1]] = self.k
            v[:, : self.v.shape[1]] = self.v
        self.k, self.v, self.capacity = k, v, cap

    def append(self, k: torch.Tensor, v: torch.Tensor, pos0: "int | torch.Tensor") -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys/values ``[T, H_kv, d]`` at positions ``pos0..pos0+T-1`` (``pos0`` an
        int, or a device scalar inside a captured step) and return the whole buffers ``[H_kv, S, d]``."""
        T = k.shape[0]
        if isinstance(pos0, torch.Tensor):
            idx = pos0 + torch.arange(T, device=k.device)
            self.k.index_copy_(1, idx, k.transpose(0, 1))
            self.v.index_copy_(1, idx, v.transpose(0, 1))
        else:
            self.reserve(pos0 + T, k)
            self.k[:, pos0: pos0 + T] = k.transpose(0, 1)
            self.v[:, pos0: pos0 + T] = v.transpose(0, 1)
        return self.k, self.v


@dataclass
class RecurrentState:
    """Gated DeltaNet state of one layer: the last ``kernel-1`` conv inputs ``[K-1, C]`` and the
    per-head key->value memory ``[H_v, d_k, d_v]`` (None until the first token; afterwards
    updated in place, so a captured decode step keeps reading the same memory)."""

    conv: torch.Tensor | None = None
    ssm: torch.Tensor | None = None


@dataclass
class Cache:
    layers: list[KVCache | RecurrentState] = field(default_factory=list)
    pos: int = 0

    def reset(self) -> None:
        """Start a new sequence in the same buffers (a captured decode step stays valid): KV rows
        past ``pos`` are masked anyway; recurrent state is zeroed in place."""
        self.pos = 0
        for layer in self.layers:
            if isinstance(layer, RecurrentState):
                for t in (layer.conv, layer.ssm):
                    if t is not None:
                        t.zero_()
