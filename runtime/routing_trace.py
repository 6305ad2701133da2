"""``--trace-out F``: every token's routed experts, recorded while the model runs, in the trace
format ``repack calibrate --trace`` writes (``calibrate.trace``), so that ``repack calibrate
--eval F`` judges placements and cache policies on the user's own traffic.

The ids come from the expert store's ``moe`` (``runtime.expert_stats.RoutingRecorder``). An
eager call hands over its ids tensors (kept by reference, read when the call ends). Inside a
captured CUDA graph nothing runs in Python at replay, so while a graph is captured each layer's
ids are copied into a buffer the recorder owns, at that layer's row (a captured group's calls one
after another); every replay then rewrites
the buffer, and the call's rows are copied into pinned memory behind it and written at the next
call (as the store defers its counts). Cost, only with the trace on: one small copy per MoE
layer in a captured step (~40 launches of a few microseconds a token on the Qwen3.6 shape) and
one device-to-host copy per call, ``n_moe * k`` bytes a token on disk (320 for Qwen3.6). The
recorder must exist before graphs are captured (the server attaches it before its warm-up);
a run without ``--trace-out`` captures no copies.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from sparkpack.calibrate.trace import TraceWriter, trace_header
from sparkpack.formats.archs import ModelSpec
from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.memory import GROUP_TOKENS
from sparkpack.formats.profile import SIDES, ModelIdentity

GENERATED = SIDES[1]


class TraceRecorder:
    """Records into ``path`` (sealed by ``close``; until then it is ``path.partial``).
    ``max_tokens``: the most rows captured in one graph (a group of whole calls,
    ``GROUP_TOKENS``; eager calls of any length hand over their own ids), the capture buffer's.
    Nothing is written until ``active``."""

    def __init__(self, path: str | os.PathLike[str], spec: ModelSpec, identity: ModelIdentity,
                 device: torch.device, max_tokens: int = GROUP_TOKENS):
        path = Path(path)
        if path.exists():
            raise SparkpackError(path, "already exists; give a new name for the trace (or remove the old one)")
        self.writer = TraceWriter(path, *trace_header(spec, identity))
        self.path = path
        self.index = {il: j for j, il in enumerate(spec.moe_layers)}
        self.k = spec.n_expert_used
        shape = (max_tokens, len(spec.moe_layers), self.k)
        self.buffer = torch.zeros(shape, dtype=torch.int32, device=device)
        pin = torch.device(device).type == "cuda"
        self.host = torch.zeros(shape, dtype=torch.int32, pin_memory=pin)
        self.pin = pin
        self.eager: dict[int, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}  # a layer's calls
        self.captured: dict[int, int] = {}  # rows each layer recorded in the capture being made
        self.pending: tuple[int, bool, torch.cuda.Event | None] | None = None  # (tokens, generated, copied)
        self.active = False
        self.tokens = 0

    def record(self, layer: int, ids: torch.Tensor, real: torch.Tensor | None = None) -> None:
        if ids.is_cuda and torch.cuda.is_current_stream_capturing():
            at = self.captured.get(layer, 0)  # a captured group's calls: one after another
            self.buffer[at: at + ids.shape[0], self.index[layer]].copy_(ids)
            self.captured[layer] = at + ids.shape[0]
        else:
            self.eager.setdefault(layer, []).append((ids, real))

    def end_step(self, n_tokens: int, side: str, defer: bool) -> None:
        self.flush()
        self.captured = {}
        if self.eager:  # eager calls (also the run a capture starts with): their own ids, real rows
            rows = torch.stack([torch.cat([ids if real is None else ids[: int(real)] for ids, real in self.eager[il]])
                                for il in sorted(self.eager, key=self.index.__getitem__)], dim=1)
            self.eager = {}
            self._write(rows[:n_tokens].cpu().numpy(), side == GENERATED)
            return
        self.host[:n_tokens].copy_(self.buffer[:n_tokens], non_blocking=self.pin)
        done = None
        if self.pin:
            done = torch.cuda.Event()
            done.record()
        self.pending = (n_tokens, side == GENERATED, done)
        if not defer:
            self.flush()

    def flush(self) -> None:
        if self.pending is None:
            return
        n, generated, done = self.pending
        self.pending = None
        if done is not None:
            done.synchronize()
        self._write(self.host[:n].numpy(), generated)

    def drop(self) -> None:
        self.eager, self.captured = {}, {}
        self.pending = None

    def _write(self, ids: np.ndarray, generated: bool) -> None:
        if self.active and len(ids):
            self.writer.append(ids, np.full(len(ids), generated))
            self.tokens += len(ids)

    def sync(self) -> None:
        """Make what is written so far durable (after a request)."""
        self.writer.flush()

    def close(self) -> Path:
        self.flush()
        return self.writer.close()


def attach_trace(model, path: str | os.PathLike[str]) -> TraceRecorder:
    """A recorder on ``model``'s expert store (before any CUDA graph is captured), inactive
    until the caller sets ``active`` (after a warm-up)."""
    from .residency import identity_of

    recorder = TraceRecorder(path, model.spec, identity_of(model.gguf), model.device)
    if model.store is not None:  # the plain path (no store) routes nothing through a recorder
        model.store.recorder = recorder
    return recorder
