"""A drafter for tests and benchmarks only (not product code): it proposes the main model's own
greedy tokens with a set probability, so a benchmark on random weights (where no real drafter's
acceptance means anything) measures decode speed at the acceptance it chooses, and tests reach
every acceptance length."""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch


class ForcedDrafter:
    """A drafter for tests and benchmarks only: it knows the target's own continuation (``oracle``:
    the tokens a greedy run produces after ``tokens``) and proposes each of its next tokens with
    probability ``p``, a wrong token otherwise (which ends the useful part of the draft), so the
    acceptance is what the benchmark sets, whatever the weights. Not a product drafter: the
    oracle is a previous run's output."""

    name = "forced"
    needs_hidden = False

    def __init__(self, oracle: Callable[[Sequence[int], int], list[int]], p: float, n_vocab: int, seed: int = 0):
        self.oracle, self.p, self.n_vocab = oracle, p, n_vocab
        self.rng = random.Random(seed)

    def propose(self, tokens: Sequence[int], k: int, hidden: torch.Tensor | None = None) -> list[int]:
        out = []
        for t in self.oracle(tokens, k):
            out.append(t if self.rng.random() < self.p else (t + 1) % self.n_vocab)
        return out

    def rewind(self, n_tokens: int) -> None:
        pass


def known_continuation(prompt: Sequence[int], reply: Sequence[int]) -> Callable[[Sequence[int], int], list[int]]:
    """``ForcedDrafter``'s oracle from a recorded greedy reply to ``prompt``: the next ``k`` reply
    tokens after ``tokens`` (which must be the prompt and a prefix of the reply)."""
    full = list(prompt) + list(reply)

    def oracle(tokens: Sequence[int], k: int) -> list[int]:
        n = len(tokens)
        return full[n:n + k] if list(tokens) == full[:n] else []

    return oracle
