"""One generated token for each of several sessions in one batched forward (``MoEModel.decode_batch``):
what a server decoding several sequences at once (``runtime.server.parallel``) steps them with.

Each session keeps its own sequence (its cache, its fed tokens); a row of the step's logits is bit
for bit what that session's ``feed(fed + [token])`` gives alone, so a session can go on alone, or
take its next prompt, as after its own steps.

On a GPU the batched forward is not captured yet, and an eager step costs far more launches than
a captured one saves by batching (BENCHMARKS.md, issue 46): there each session takes its own
captured decode step in turn (``captured_in_turn``), the same bits by the same invariant, until the
batched step is captured per batch size.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .generate import GENERATED, Session


def decode_together(sessions: Sequence[Session], tokens: Sequence[int]) -> torch.Tensor:
    """The logits ``[B, n_vocab]`` of ``tokens[b]`` fed to ``sessions[b]`` (distinct sessions of
    one model), each appended to its session's fed tokens."""
    model = sessions[0].model
    if any(s.model is not model for s in sessions):
        raise ValueError("decode_together: sessions of one model")
    if model.device.type == "cuda":
        return captured_in_turn(sessions, tokens)
    model.experts.routing_side(GENERATED)
    t0 = time.perf_counter()
    logits = model.decode_batch([int(t) for t in tokens], [s.cache for s in sessions])
    dt = time.perf_counter() - t0
    for s, t in zip(sessions, tokens):
        s.fed = s.fed + [int(t)]
        s.timing.decode_tokens += 1
        s.timing.decode_seconds += dt  # (each sequence waited for the whole step)
    return logits


def captured_in_turn(sessions: Sequence[Session], tokens: Sequence[int]) -> torch.Tensor:
    """``decode_together`` as each session's own (captured) decode step, one after the other."""
    return torch.stack([s.feed(s.fed + [int(t)], GENERATED) for s, t in zip(sessions, tokens)])
