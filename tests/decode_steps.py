"""Sequences decoding alone and together, for the batched-step tests (``test_decode_batch``,
``test_batch_attention``): three conversations of different lengths, the tokens each is fed after
its prompt (teacher-forced: the same ids alone and batched), and which decode together at each step.
``EagerStep``: a captured decode step's stand-in on the CPU, for the decode-ahead tests
(``test_generate``, ``test_server_parallel``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sparkpack.runtime.generate import Session

ARCHS = ("qwen35moe", "laguna", "qwen3moe")
PROMPTS = ([3, 14, 15, 92, 65, 35, 89], [7, 1], [46, 26, 43, 38, 32, 79, 50, 28, 84, 19, 71])
FED = ([5, 9, 2, 6], [53, 58, 97, 93], [23, 84, 62, 64])
# Which sequences decode together at each step: all, a sequence leaving, joining, another order.
STEPS = ((0, 1, 2), (2, 0), (1, 2, 0), (1,))


def alone(model, prompts=PROMPTS, fed=FED) -> list[list[torch.Tensor]]:
    """Each sequence's logits per fed token, decoding alone (one token per ``forward``)."""
    out = []
    for prompt, tokens in zip(prompts, fed):
        cache = model.new_cache()
        model.forward(prompt, cache, last_only=True)
        out.append([model.forward([t], cache)[0] for t in tokens])
    return out


def batched(model, prompts=PROMPTS, fed=FED, steps=STEPS) -> list[list[torch.Tensor]]:
    """The same, the sequences decoding together in the batches of ``steps`` (a sequence's later
    tokens alone once it has no batch left)."""
    caches = [model.new_cache() for _ in prompts]
    for prompt, cache in zip(prompts, caches):
        model.forward(prompt, cache, last_only=True)
    out: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in steps:
        logits = model.decode_batch([fed[b][len(out[b])] for b in step], [caches[b] for b in step])
        for row, b in enumerate(step):
            out[b].append(logits[row])
    for b, tokens in enumerate(fed):
        for t in tokens[len(out[b]):]:
            out[b].append(model.decode_batch([t], [caches[b]])[0])
    return out


def assert_same(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> None:
    for b, (g, w) in enumerate(zip(got, want)):
        assert len(g) == len(w) > 0
        for i, (x, y) in enumerate(zip(g, w)):
            assert torch.equal(x, y), f"sequence {b}, fed token {i}: {(x - y).abs().max().item()}"


class EagerStep:
    """Stands in for a captured decode step on the CPU (no CUDA graphs there): feeds a token id
    tensor without reading it, so ``Session.decode`` takes its step-ahead branch in CI too."""

    graph = True  # "captured"

    def __init__(self, session: Session, room: int, capture_at: int = -1):
        self.session, self.room, self.capture_at, self.steps, self.captures = session, room, capture_at, 0, 0
        self.positions: list[int] = []  # where each step fed its token

    def step(self, token: torch.Tensor) -> torch.Tensor | None:
        s = self.session
        if s.cache.pos + 1 > self.room:
            return None  # past the graph's room: Session.decode falls back to feed
        self.steps += 1
        self.positions.append(s.cache.pos)
        self.captures += s.cache.pos == self.capture_at  # as DecodeGraph captures again after KV growth
        return s.model.forward(token.as_subclass(torch.Tensor).reshape(1), s.cache, last_only=True)[-1]
