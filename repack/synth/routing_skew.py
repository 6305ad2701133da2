"""Skewed, input-dependent routing for synthetic models, and how skewed a given setting is.

Random router weights give near-uniform expert use, so every expert is equally hot and a
placement policy has nothing to learn. Real traffic is skewed: on the published reference system
the most-used 60% of experts take ~93% of routings. Scaling router row e (``ffn_gate_inp``) by
``exp(S * g_e)``, ``g_e ~ N(0, 1)`` per layer, makes experts with large rows win top-k more often,
yet which ones win still depends on the hidden state, as in a trained router. Top-k choice is
invariant under the softmax/sigmoid that follows and nearly so under laguna's small
``exp_probs_b`` bias, so one estimate serves every arch.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

REFERENCE_TOP_SHARE = 0.93  # share of routings taken by the most-used 60% of experts
REFERENCE_EXPERT_FRACTION = 0.6


def expert_factors(skew: float, n_expert: int, rng: np.random.Generator) -> np.ndarray:
    """Per-expert router-row scale factors ``exp(skew * g)`` (float32, one per expert)."""
    g = rng.standard_normal(n_expert)
    return np.exp(skew * g).astype(np.float32)


def top_share(skew: float, n_expert: int, top_k: int, *, fraction: float = REFERENCE_EXPERT_FRACTION,
              n_tokens: int = 4096, n_layers: int = 4, dim: int = 64, seed: int = 0) -> float:
    """Monte Carlo share of routings taken by the most-used ``fraction`` of experts.

    Hidden states are standard Gaussian, router rows random unit vectors scaled by
    ``expert_factors`` (a wide real model's random rows have near-equal norms); the
    random draws are the same for every ``skew`` (common random numbers), so the estimate is a
    smooth, monotone function of ``skew`` that bisection can invert.
    """
    if not 0 < top_k <= n_expert:
        raise ValueError(f"top_k {top_k} must be in 1..{n_expert}")
    rng = np.random.default_rng(seed)
    n_top = max(1, int(round(fraction * n_expert)))
    shares = []
    for _ in range(n_layers):
        g = rng.standard_normal(n_expert)
        w = rng.standard_normal((n_expert, dim))
        w *= (np.exp(skew * g) / np.linalg.norm(w, axis=1))[:, None]  # unit rows, then the skew
        x = rng.standard_normal((n_tokens, dim))
        logits = x @ w.T
        chosen = np.argpartition(-logits, top_k - 1, axis=1)[:, :top_k]
        counts = np.bincount(chosen.reshape(-1), minlength=n_expert)
        shares.append(np.sort(counts)[::-1][:n_top].sum() / counts.sum())
    return float(np.mean(shares))


@lru_cache(maxsize=32)
def reference_skew(n_expert: int, top_k: int, target: float = REFERENCE_TOP_SHARE) -> float:
    """The ``skew`` at which ``top_share`` is ``target`` (bisection on [0, 8])."""
    lo, hi = 0.0, 8.0
    if top_share(lo, n_expert, top_k) >= target:
        return 0.0
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        if top_share(mid, n_expert, top_k) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-3:
            break
    return round(0.5 * (lo + hi), 3)
