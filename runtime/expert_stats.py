"""What the expert store counts: routings by where they were served, bytes streamed, host time,
and the device-side routing counts they are learned from.

The fused kernels count every (token, choice) on the device (``RoutingCounts.step``); the host
learns from those counts between tokens. Reading them waits for the device, so a replayed step's
counts are copied into pinned memory behind it and read at the next ``end_step`` (a deferred
snapshot), and a store whose experts are all hot (nothing can move) leaves them on the device
until the caller asks (``ExpertStore.flush``). Reading ``stats`` never triggers either.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class StoreStats:
    """Counts over the run; ``tokens`` are decode + prefill tokens seen by the MoE layers."""

    tokens: int = 0
    hot_hits: int = 0  # routings served by a hot expert
    cache_hits: int = 0  # routings served by a cache slot
    misses: int = 0  # routings whose expert was neither hot nor cached when the layer ran
    loads: int = 0  # experts streamed into a cache slot
    zero_copy_reads: int = 0  # (layer, expert) reads served from host memory inside the kernel
    staged_layers: int = 0  # layers of long calls whose cold experts were copied in bulk (expert_staging)
    staged_bytes: int = 0  # the bytes of those copies
    bytes_streamed: int = 0  # host->device bytes: copies, staged copies and zero-copy reads together
    copy_seconds: float = 0.0  # wall time the host spent issuing/waiting for copies (async)
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


class RoutingCounts:
    """The device routing counts (int32 ``[n_layer, n_expert]``, which the MoE launches add to) and
    the three ways they reach the host: ``read`` now (a wait), ``snapshot`` behind the step into
    pinned memory for ``take_pending`` later, or ``unread`` tokens left on the device."""

    def __init__(self, shape: tuple[int, int], device: torch.device, pin: bool):
        self.step = torch.zeros(shape, dtype=torch.int32, device=device)
        self._host = torch.empty(shape, dtype=torch.int32, pin_memory=pin)
        self.pin = pin
        self.pending: tuple[int, torch.cuda.Event | None] | None = None  # (tokens, copy done)
        self.unread = 0  # tokens whose counts are still on the device only (all-hot stores)

    def read(self) -> np.ndarray:
        """The counts so far (waits for the device; a copy, also on the CPU), then zero them."""
        counts = self.step.to("cpu", copy=True).numpy()
        self.step.zero_()
        return counts

    def snapshot(self, n_tokens: int) -> None:
        """Queue this step's counts into pinned memory behind it, then zero them."""
        self._host.copy_(self.step, non_blocking=self.pin)
        self.step.zero_()
        done = None
        if self.pin:
            done = torch.cuda.Event()
            done.record()
        self.pending = (n_tokens, done)

    def take_pending(self) -> tuple[np.ndarray, int] | None:
        """A deferred step's counts and tokens (its copy has long landed: the caller read the
        step's logits). The next snapshot is queued only after the caller is done with them, so
        the pinned buffer is never rewritten while read."""
        if self.pending is None:
            return None
        n_tokens, done = self.pending
        self.pending = None
        if done is not None:
            done.synchronize()
        return self._host.numpy(), n_tokens

    def drop(self) -> None:
        """Forget counts not learned yet (they belong to statistics being replaced)."""
        if self.unread:
            self.unread = 0
            self.step.zero_()
        self.pending = None
