"""The routing a live run has learned: per-(layer, expert) counts that fade as traffic moves on.

A server counts which experts its user's traffic routes to and keeps the profile beside the model.
Plain sums would make a month of one repository outweigh a week of another forever, so every
token processed ages everything learned before it by ``d = 2 ** (-1 / half_life_tokens)``: a
routing ``half_life_tokens`` tokens ago counts half as much as one now. Token totals fade alike,
so ``counts / tokens`` stays a per-token rate (``formats.placement.expert_scores``) and the hot set
chosen from it follows the recent mix. Steady state holds ``1 / (1 - d)`` (about
``1.44 x half_life_tokens``) tokens' worth of traffic.

Why ``HALF_LIFE_TOKENS`` = 200k (chosen with ``bench/decay_half_life.py`` on recorded traces of
tiny synthetic models over the real corpora; docs/FORMAT.md, "Decay", has the tables): the
placement's sampling noise stays under 1% of the cold-hit rate once every expert has a few
thousand routings of memory, which a 256-expert top-8 model (Qwen3.5/3.6) reaches at a half-life
of 50-100k tokens; 200k gives it ~9000 (``1.44 x 200k x 8 / 256``), margin for flatter layers. After
a switch of corpus, 90% of the gap between the old and the new traffic's placement closed
within 0.2-4.5 half-lives (about one typically). A coding agent feeding a local server processes
~150-600k tokens an active hour (the new suffix of each turn after prefix reuse, 1-5k tokens,
plus a few hundred generated, every 10-30 s), so a change of work moves the placement within
about an hour, two or three at worst, and a ten-minute detour (~50k tokens) weighs only ~16%.
"""
from __future__ import annotations

import math

import numpy as np

from .placement import GEN_WEIGHT, expert_scores
from .profile import SIDES, Decay, Profile

HALF_LIFE_TOKENS = 200_000.0


class DecayedRouting:
    """Decayed routing counts per side and (layer, expert), starting from ``profile`` (which is
    copied): a profile learned earlier, a ``repack calibrate`` sum, or ``Profile.new`` (nothing
    learned yet). A starting profile holding more tokens than the memory keeps in steady state
    (a long offline calibration, or one made with a longer half-life) is scaled down to that:
    it describes the user's traffic as of now, and new traffic must be able to move it at the
    designed speed."""

    def __init__(self, profile: Profile, half_life_tokens: float = HALF_LIFE_TOKENS):
        if not (math.isfinite(half_life_tokens) and half_life_tokens > 0):
            raise ValueError(f"half_life_tokens must be finite and > 0, got {half_life_tokens}")
        self.half_life_tokens = float(half_life_tokens)
        self.per_token = 2.0 ** (-1.0 / self.half_life_tokens)
        self._p = profile.copy()
        self.tokens_seen = profile.decay.tokens_seen if profile.decay is not None else sum(profile.tokens.values())
        total = sum(self._p.tokens.values())
        if total > self.memory_tokens:
            scale = self.memory_tokens / total
            for s in SIDES:
                self._p.counts[s] *= scale
                self._p.tokens[s] *= scale

    @property
    def memory_tokens(self) -> float:
        """Tokens' worth of traffic held in steady state: ``sum_t d**t = 1 / (1 - d)``."""
        return 1.0 / (1.0 - self.per_token)

    @property
    def shape(self) -> tuple[int, int]:
        return (self._p.n_layer, self._p.n_expert)

    def observe(self, counts: np.ndarray, tokens: int, side: str) -> None:
        """Learn one forward call: ``counts [n_layer, n_expert]`` routings of its ``tokens``
        tokens, all of ``side`` ("prompt" or "generated").

        Everything learned before ages by ``d ** tokens``. The call's own routings get the mean
        weight its tokens would have had if learned one at a time, ``(1 - d**T) / (T (1 - d))``,
        so a prompt learned in one call or token by token gives the same counts when its
        tokens route alike, and the token total grows by exactly ``sum_{i<T} d**i``."""
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        a = np.asarray(counts, dtype=np.float64)
        if a.shape != self.shape:
            raise ValueError(f"counts have shape {a.shape}, expected {self.shape}")
        if not np.isfinite(a).all() or (a < 0).any():
            raise ValueError("counts must be finite and >= 0")
        if tokens < 0 or (tokens == 0 and a.any()):
            raise ValueError(f"{tokens} tokens cannot have produced routings")
        if tokens == 0:
            return
        age = self.per_token ** tokens
        added = (1.0 - age) / (1.0 - self.per_token)  # sum_{i<T} d**i
        for s in SIDES:
            self._p.counts[s] *= age
            self._p.tokens[s] *= age
        self._p.counts[side] += a * (added / tokens)
        self._p.tokens[side] += added
        self.tokens_seen += tokens

    def scores(self, gen_weight: float = GEN_WEIGHT) -> np.ndarray:
        """Expected hits per token of each expert now (``formats.placement.expert_scores``)."""
        c, t = self._p.counts, self._p.tokens
        return expert_scores(c["prompt"], c["generated"], t["prompt"], t["generated"], gen_weight)

    def profile(self) -> Profile:
        """A snapshot to save or plan from; learning may go on meanwhile."""
        p = self._p.copy()
        p.decay = Decay(self.half_life_tokens, float(self.tokens_seen))
        return p
