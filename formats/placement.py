"""Which experts go to the GPU (hot) under a byte budget. Pure: numbers in, a plan out.

With a profile the choice is one greedy ranking across all layers by expected hits per byte, not a
fixed share per layer: a layer whose routing is concentrated needs few hot experts, a flat one
many. Hits are per-token routing rates, generated side weighted ``GEN_WEIGHT`` and prompt side
``1 - GEN_WEIGHT``: during decode every cold miss stalls a token, while prompt processing copies an
expert once for a whole batch, so decode traffic is what placement must serve first.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .archs import ModelSpec

GEN_WEIGHT = 0.8


@dataclass
class Plan:
    hot: np.ndarray  # bool [n_layer, n_expert]; rows of non-MoE layers are all False
    expert_budget: int  # bytes allowed for hot experts
    hot_bytes: int
    uniform: bool  # True when chosen without a profile
    cold_hit_rate: dict[str, float]  # side -> share of routings that land on cold experts (profile only)

    @property
    def n_hot(self) -> int:
        return int(self.hot.sum())


def expert_scores(prompt: np.ndarray, generated: np.ndarray, prompt_tokens: float, generated_tokens: float,
                  gen_weight: float = GEN_WEIGHT) -> np.ndarray:
    """Expected hits per token of each expert, decode-weighted (see module docstring)."""
    def rate(c: np.ndarray, t: float) -> np.ndarray:
        return c / t if t > 0 else (c / c.sum() if c.sum() > 0 else np.zeros_like(c))

    return gen_weight * rate(generated, generated_tokens) + (1 - gen_weight) * rate(prompt, prompt_tokens)


def plan_greedy(scores: np.ndarray, expert_nbytes: dict[int, int], budget: int) -> np.ndarray:
    """Hot mask taking experts in decreasing hits-per-byte order while they fit in ``budget``.

    Ties break by (layer, expert) so a plan is reproducible.
    """
    hot = np.zeros(scores.shape, dtype=bool)
    cand = [(-scores[il, e] / nb, il, e, nb) for il, nb in expert_nbytes.items() for e in range(scores.shape[1])]
    cand.sort()
    used = 0
    for _, il, e, nb in cand:
        if used + nb <= budget:
            hot[il, e] = True
            used += nb
    return hot


def plan_uniform(shape: tuple[int, int], expert_nbytes: dict[int, int], budget: int) -> np.ndarray:
    """Without routing data: the same number of experts in every MoE layer (the first k)."""
    hot = np.zeros(shape, dtype=bool)
    per_k = sum(expert_nbytes.values())
    k = min(shape[1], budget // per_k) if per_k else 0
    for il in expert_nbytes:
        hot[il, :k] = True
    return hot


def cold_hit_rates(hot: np.ndarray, counts: dict[str, np.ndarray]) -> dict[str, float]:
    """Share of each side's routings that would need a cold expert."""
    out = {}
    for side, c in counts.items():
        total = float(c.sum())
        out[side] = float(c[~hot].sum()) / total if total > 0 else 0.0
    return out


def make_plan(n_layer: int, n_expert: int, expert_nbytes: dict[int, int], budget: int,
              profile_counts: dict[str, np.ndarray] | None = None,
              profile_tokens: dict[str, float] | None = None) -> Plan:
    """The plan for ``budget`` bytes of hot experts; greedy when counts are given, else uniform."""
    shape = (n_layer, n_expert)
    budget = max(0, int(budget))
    if profile_counts is None:
        hot = plan_uniform(shape, expert_nbytes, budget)
        rates: dict[str, float] = {}
    else:
        tokens = profile_tokens or {}
        scores = expert_scores(profile_counts["prompt"], profile_counts["generated"],
                               tokens.get("prompt", 0.0), tokens.get("generated", 0.0))
        hot = plan_greedy(scores, expert_nbytes, budget)
        rates = cold_hit_rates(hot, profile_counts)
    hot_bytes = sum(int(hot[il].sum()) * nb for il, nb in expert_nbytes.items())
    return Plan(hot, budget, hot_bytes, profile_counts is None, rates)


def default_cache_slots(spec: ModelSpec) -> int:
    """Half of one token's routings over all MoE layers (shared by all layers): on held-out
    traffic a calibrated hot set still misses a few experts per layer per token, and those
    repeat across tokens, so the cache must hold several tokens' misses (BENCHMARKS.md)."""
    return max(4 * spec.n_expert_used, len(spec.moe_layers) * spec.n_expert_used // 2)
