"""Sequences decoding alone and together, for the batched-step tests (``test_decode_batch``,
``test_batch_attention``): three conversations of different lengths, the tokens each is fed after
its prompt (teacher-forced: the same ids alone and batched), and which decode together at each step."""
from __future__ import annotations

import torch

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
