"""One generated token for each of several sessions in one batched forward (``MoEModel.decode_batch``):
what a server decoding several sequences at once (``runtime.server.running``) steps them with.

Each session keeps its own sequence (its cache, its fed tokens); a row of the step's logits is bit
for bit what that session's ``feed(fed + [token])`` gives alone, so a session can go on alone, or
take its next prompt, as after its own steps.

On a GPU an eager batched step costs far more launches than batching saves (BENCHMARKS.md, issue
46): there the step is replayed from a CUDA graph per set of sessions (``runtime.graph.BatchGraphs``,
given as ``graphs``); a lone session takes its own captured step, and without ``graphs`` (a store
that cannot be captured) each session takes its own step in turn (``captured_in_turn``), the same
bits by the same invariant.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .generate import GENERATED, Session
from .graph import BatchGraphs


def decode_together(sessions: Sequence[Session], tokens: Sequence[int], graphs: BatchGraphs | None = None
                    ) -> torch.Tensor:
    """The logits ``[B, n_vocab]`` of ``tokens[b]`` fed to ``sessions[b]`` (distinct sessions of
    one model), each appended to its session's fed tokens. ``graphs``: the batched steps of these
    sessions' caches (``BatchGraphs`` of their model)."""
    model = sessions[0].model
    if any(s.model is not model for s in sessions) or (graphs is not None and graphs.model is not model):
        raise ValueError("decode_together: sessions of one model")
    batched = graphs is not None and len(sessions) > 1
    if model.device.type == "cuda" and not batched:
        return captured_in_turn(sessions, tokens)
    model.experts.routing_side(GENERATED)
    t0 = time.perf_counter()
    ids = [int(t) for t in tokens]
    caches = [s.cache for s in sessions]
    captures = graphs.captures if graphs is not None else 0
    logits = graphs.step(ids, caches) if batched else model.decode_batch(ids, caches)
    if logits.is_cuda:
        torch.cuda.synchronize(logits.device)
    dt = time.perf_counter() - t0
    capturing = graphs is not None and graphs.captures != captures
    for s, t in zip(sessions, ids):
        s.fed.append(t)
        if capturing:  # kept out of the decode rate, as ``Session`` keeps its own captures
            s.timing.capture_seconds += dt
        else:
            s.timing.decode_tokens += 1
            s.timing.decode_seconds += dt  # (each sequence waited for the whole step)
    return logits


def launch_together(sessions: Sequence[Session], tokens: torch.Tensor, graphs: BatchGraphs) -> torch.Tensor:
    """``decode_together`` for token ids still on the device (``tokens [B]``, distinct sessions of
    ``graphs``' model): the captured batched step launched and not waited for, its logits
    ``[B, n_vocab]``. The caller appends each token to its session's ``fed`` once it has read it,
    and times the step (from one token read to the next: ``server.running``'s step ahead)."""
    sessions[0].model.experts.routing_side(GENERATED)
    return graphs.step(tokens, [s.cache for s in sessions])


def captured_in_turn(sessions: Sequence[Session], tokens: Sequence[int]) -> torch.Tensor:
    """``decode_together`` as each session's own (captured) decode step, one after the other."""
    return torch.stack([s.feed(s.fed + [int(t)], GENERATED) for s, t in zip(sessions, tokens)])
