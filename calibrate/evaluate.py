"""How often a placement misses: cold-hit rates of uniform vs profile placement on a routing trace.

This is the number the product lives by. A routing is *cold* when its expert is neither resident
(hot) nor, with a cache, in the layer's spare slots: an LRU ring, or the LFU and
frequency-aware policies of ``calibrate.cache_policies`` (profile placement only). Placements are built the way
``repack split`` builds them (``formats.placement``: one greedy ranking across layers by expected
hits per byte) under the same byte budget as the uniform placement they are compared with, so the
comparison is between choices, not between budgets. Everything is numpy on the trace: no model.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from sparkpack.formats.placement import expert_scores, plan_greedy

from .cache_policies import simulate

FRACTIONS = (0.2, 0.4, 0.6, 0.8)
UNIFORM_SEED = 0


@dataclass
class EvalRow:
    fraction: float
    hot_per_layer: int  # uniform placement's experts per layer (the profile's budget in bytes)
    uniform: float  # cold-hit rate, expectation over arbitrary sets of that size
    profile: float
    uniform_lru: float | None  # uniform set drawn with UNIFORM_SEED, plus the cache
    profile_lru: float | None
    profile_generated: float | None  # profile placement, generated-side routings only
    profile_lfu: float | None = None  # profile placement with the LFU policy's slots
    profile_freq: float | None = None  # ... with the store's frequency-aware admission


# Fewest routings per expert, on average, for a count to say which experts are busy. Counts are
# close to Poisson: at 10 an expert's count is 10 +- 3, so one used twice as often as the average
# stands about 2 standard deviations clear; below that, which experts come out on top is mostly
# chance and a placement learned from it is little better than an arbitrary one.
MIN_ROUTINGS_PER_EXPERT = 10


def min_calibration_tokens(n_expert: int, n_expert_used: int) -> int:
    """Tokens that route each expert ``MIN_ROUTINGS_PER_EXPERT`` times on average: every token
    routes ``n_expert_used`` of the ``n_expert`` experts of each MoE layer."""
    return -(-MIN_ROUTINGS_PER_EXPERT * n_expert // n_expert_used)


def too_few_tokens(tokens: float, n_expert: int, n_expert_used: int) -> str | None:
    """One line saying why ``tokens`` cannot place experts, or None when they are enough."""
    need = min_calibration_tokens(n_expert, n_expert_used)
    if tokens >= need:
        return None
    per_expert = tokens * n_expert_used / n_expert
    return (f"only {tokens:.0f} tokens: each of the {n_expert} experts per layer is routed {per_expert:.1f} times "
            f"on average, too few to tell busy experts from idle ones (this model needs at least {need} tokens)")


def top_share(counts: np.ndarray, moe_layers: list[int], fraction: float = 0.6) -> float:
    """Share of routings taken by the most-used ``fraction`` of experts, per layer, pooled."""
    c = counts[moe_layers]
    total = c.sum()
    if total == 0:
        return 0.0
    n_top = max(1, int(round(fraction * c.shape[1])))
    return float(np.sort(c, axis=1)[:, ::-1][:, :n_top].sum() / total)


def uniform_mask(n_moe: int, n_expert: int, n_hot: int, seed: int = UNIFORM_SEED) -> np.ndarray:
    """``n_hot`` arbitrary experts per layer, reproducible: bool ``[n_moe, n_expert]``."""
    rng = np.random.default_rng(seed)
    hot = np.zeros((n_moe, n_expert), dtype=bool)
    for i in range(n_moe):
        hot[i, rng.choice(n_expert, size=n_hot, replace=False)] = True
    return hot


def profile_mask(counts: dict[str, np.ndarray], tokens: dict[str, float], moe_layers: list[int],
                 expert_nbytes: dict[int, int], budget: int) -> np.ndarray:
    """The hot set ``repack split`` would choose for ``budget`` bytes, rows in ``moe_layers`` order."""
    scores = expert_scores(counts["prompt"], counts["generated"], tokens.get("prompt", 0.0),
                           tokens.get("generated", 0.0))
    hot = plan_greedy(scores, {il: expert_nbytes[il] for il in moe_layers}, budget)
    return hot[moe_layers]


def cold_rate(ids: np.ndarray, hot: np.ndarray) -> float:
    """Share of routings in ``ids [N, n_moe, k]`` whose expert is not in ``hot [n_moe, n_expert]``."""
    if ids.size == 0:
        return 0.0
    layer = np.arange(hot.shape[0])[None, :, None]
    return float(1.0 - hot[layer, ids].mean())


def cold_rate_lru(ids: np.ndarray, hot: np.ndarray, slots: int) -> np.ndarray:
    """Cold-hit rate per mask with an LRU ring of ``slots`` experts per layer in front of the cold tier.

    ``hot [M, n_moe, n_expert]`` holds M placements evaluated together (one pass over the trace).
    The cache state is kept as each expert's last-use token (-1 = not cached): a non-hot routing
    whose expert is cached is a cache hit; a miss loads it, and when a layer's ring overflows the
    least recently used entries leave (within a token, in routing order). The loop is over tokens,
    vectorised over (mask, layer) rows.
    """
    m, n_moe, n_expert = hot.shape
    n = ids.shape[0]
    if n == 0:
        return np.zeros(m)
    if slots <= 0:
        return np.array([cold_rate(ids, h) for h in hot])
    rows = m * n_moe
    hot2 = hot.reshape(rows, n_expert)
    last = np.full((rows, n_expert), -1, dtype=np.int64)
    count = np.zeros(rows, dtype=np.int64)
    cold = np.zeros(rows, dtype=np.int64)
    r = np.arange(rows)[:, None]
    ids = np.asarray(ids, dtype=np.int64)
    k = ids.shape[2]
    slot = np.arange(k)[None, :]  # within a token, later routings count as more recent
    for t in range(n):
        e = np.tile(ids[t], (m, 1))  # [rows, k]
        need = ~hot2[r, e]
        seen = last[r, e]
        miss = need & (seen < 0)
        cold += miss.sum(1)
        count += miss.sum(1)
        last[r, e] = np.where(need, t * k + slot, seen)
        over = np.nonzero(count > slots)[0]
        if over.size:
            excess = count[over] - slots
            sub = last[over]
            sub = np.where(sub < 0, np.iinfo(np.int64).max, sub)
            kk = int(excess.max())
            part = np.argpartition(sub, kk - 1, axis=1)[:, :kk] if kk < n_expert else \
                np.tile(np.arange(n_expert), (over.size, 1))
            order = np.argsort(np.take_along_axis(sub, part, 1), axis=1, kind="stable")
            victims = np.take_along_axis(part, order, 1)
            take = np.arange(victims.shape[1])[None, :] < excess[:, None]
            last[np.repeat(over, take.sum(1)), victims[take]] = -1
            count[over] = slots
    per_mask = cold.reshape(m, n_moe).sum(1)
    return per_mask / float(ids[:, :, :].size)


def evaluate(ids: np.ndarray, generated: np.ndarray, n_expert: int, moe_layers: list[int],
             counts: dict[str, np.ndarray], tokens: dict[str, float], expert_nbytes: dict[int, int],
             slots: int = 0, fractions: tuple[float, ...] = FRACTIONS) -> list[EvalRow]:
    """One row per hot fraction: uniform vs profile placement, with and without an LRU ring."""
    ids = np.asarray(ids)
    n_moe = len(moe_layers)
    gen = ids[np.asarray(generated, dtype=bool)]
    n_hots = [int(round(f * n_expert)) for f in fractions]
    masks = []  # (uniform, profile) per fraction, simulated together in one pass over the trace
    for n_hot in n_hots:
        budget = sum(n_hot * expert_nbytes[il] for il in moe_layers)
        masks += [uniform_mask(n_moe, n_expert, n_hot), profile_mask(counts, tokens, moe_layers, expert_nbytes, budget)]
    lru = cold_rate_lru(ids, np.stack(masks), slots) if slots > 0 else None
    out = []
    for i, (f, n_hot) in enumerate(zip(fractions, n_hots)):
        prof = masks[2 * i + 1]
        other = {p: simulate(ids, prof, slots, p, shared=False).cold_rate for p in ("lfu", "freq")} if slots > 0 \
            else {"lfu": None, "freq": None}
        out.append(EvalRow(
            fraction=f, hot_per_layer=n_hot,
            uniform=1.0 - n_hot / n_expert,
            profile=cold_rate(ids, prof),
            uniform_lru=None if lru is None else float(lru[2 * i]),
            profile_lru=None if lru is None else float(lru[2 * i + 1]),
            profile_generated=cold_rate(gen, prof) if len(gen) else None,
            profile_lfu=other["lfu"], profile_freq=other["freq"],
        ))
    return out


def format_table(rows: list[EvalRow], slots: int, n_tokens: int) -> str:
    """A plain-text table of cold-hit rates (share of routings that need a cold expert)."""
    head = ["hot", "uniform", "profile"]
    if slots > 0:
        head += [f"uniform+LRU{slots}", f"profile+LRU{slots}", f"profile+LFU{slots}", f"profile+freq{slots}"]
    lines = [f"cold-hit rate over {n_tokens} tokens (share of routings whose expert is not resident)",
             "  ".join(f"{h:>16}" for h in head)]
    for r in rows:
        cells = [f"{r.fraction:.0%}", f"{r.uniform:.1%}", f"{r.profile:.1%}"]
        if slots > 0:
            cells += [f"{r.uniform_lru:.1%}", f"{r.profile_lru:.1%}", f"{r.profile_lfu:.1%}", f"{r.profile_freq:.1%}"]
        lines.append("  ".join(f"{c:>16}" for c in cells))
    return "\n".join(lines)


def rows_json(rows: list[EvalRow]) -> list[dict]:
    return [asdict(r) for r in rows]
