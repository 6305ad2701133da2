"""Per-sequence state carried between forward calls: KV caches and DeltaNet recurrent state.

One ``Cache`` per conversation. Attention layers append keys/values; linear-attention layers
replace their conv window and recurrent matrix. ``pos`` is the number of tokens already seen, so a
forward call knows the positions of its new tokens without being told.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


class KVCache:
    """Keys and values of one attention layer, ``[S, H_kv, head_dim]``, grown by concatenation.

    All keys are kept (also for sliding-window layers, where the window is a mask): simple and
    exact; a bounded ring buffer is a later optimisation for long contexts.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat((self.k, k), dim=0)
        self.v = v if self.v is None else torch.cat((self.v, v), dim=0)
        return self.k, self.v


@dataclass
class RecurrentState:
    """Gated DeltaNet state of one layer: the last ``kernel-1`` conv inputs ``[K-1, C]`` and the
    per-head key->value memory ``[H_v, d_k, d_v]`` (None until the first token)."""

    conv: torch.Tensor | None = None
    ssm: torch.Tensor | None = None


@dataclass
class Cache:
    layers: list[KVCache | RecurrentState] = field(default_factory=list)
    pos: int = 0
