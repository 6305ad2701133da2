"""What the expert store counts: routings by where they were served, bytes streamed, host time,
and the device-side routing counts they are learned from.

The fused kernels count every (token, choice) on the device (``RoutingCounts.step``); the host
learns from those counts between tokens. Reading them waits for the device, so a replayed step's
counts are copied into pinned memory behind it and read at the next ``end_step`` (a deferred
snapshot), and a store whose experts are all hot (nothing can move) leaves them on the device
until the caller asks (``ExpertStore.flush``). Reading ``stats`` never triggers either.

Each call's counts also reach the store's ``observer`` (a live learner, ``runtime.learning``) as
the store reads them, tagged with the side of the call's tokens (prompt or generated, which the
session says through ``routing_side``): learning costs no device sync of its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


class RoutingObserver(Protocol):
    """Learns each forward call's routings as the store reads them."""

    def observe(self, counts: np.ndarray, tokens: int, side: str) -> None:
        """``counts [n_layer, n_expert]`` routings of ``tokens`` tokens of ``side`` ("prompt" or
        "generated"). The array is the store's buffer: read it now, keep no reference."""
        ...


class RoutingRecorder(Protocol):
    """Records which experts every token was routed to (``runtime.routing_trace``)."""

    def record(self, layer: int, ids: torch.Tensor, real: torch.Tensor | None = None) -> None:
        """A MoE layer's routing ``ids [T, k]`` (inside a captured graph too); ``real`` (a device
        scalar): a padded call's count of real rows."""
        ...

    def end_step(self, n_tokens: int, side: str, defer: bool) -> None:
        """The call ended (or a group of calls, ``MoEModel.forward_calls``, each layer recorded
        once per call, in call order): its first ``n_tokens`` real rows are tokens of ``side``;
        ``defer``: a replayed call whose ids are read at the next ``end_step`` or ``flush``."""
        ...

    def flush(self) -> None:
        """Write what a deferred call left."""
        ...

    def drop(self) -> None:
        """Forget what is not written yet (a session's warm-up)."""
        ...


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
        self.pending: tuple[int, str, bool, torch.cuda.Event | None] | None = None  # (tokens, side, staged, copy done)
        self.unread = 0  # tokens whose counts are still on the device only (all-hot stores)

    def read(self) -> np.ndarray:
        """The counts so far (waits for the device; a copy, also on the CPU), then zero them."""
        counts = self.step.to("cpu", copy=True).numpy()
        self.step.zero_()
        return counts

    def snapshot(self, n_tokens: int, side: str, staged: bool = False) -> None:
        """Queue this step's counts (its tokens of ``side``; ``staged``: a staged call's, whose
        cold experts were copied in bulk, not read zero-copy) into pinned memory behind it, then
        zero them."""
        self._host.copy_(self.step, non_blocking=self.pin)
        self.step.zero_()
        done = None
        if self.pin:
            done = torch.cuda.Event()
            done.record()
        self.pending = (n_tokens, side, staged, done)

    def take_pending(self) -> tuple[np.ndarray, int, str, bool] | None:
        """A deferred step's counts, tokens, side and whether it staged (its copy has long landed: the caller read the
        step's logits). The next snapshot is queued only after the caller is done with them, so
        the pinned buffer is never rewritten while read."""
        if self.pending is None:
            return None
        n_tokens, side, staged, done = self.pending
        self.pending = None
        if done is not None:
            done.synchronize()
        return self._host.numpy(), n_tokens, side, staged

    def drop(self) -> None:
        """Forget counts not learned yet (they belong to statistics being replaced)."""
        if self.unread:
            self.unread = 0
            self.step.zero_()
        self.pending = None
