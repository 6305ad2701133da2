"""The numbers of ``repack report``: what a profile says about the traffic and what a hot set
makes of it. Pure numpy: the page (``report_page``) draws them and ``--json`` prints them.

Use of an expert is its expected hits per token (``formats.placement.expert_scores``: decode
weighted), per side its routing rate. The coverage curve orders all experts the way
``repack split`` does (hits per byte, across layers) and reads off, for every share of expert
bytes kept on the GPU, the share of routings those experts serve (per layer: by count within
the layer).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparkpack.formats.placement import expert_scores
from sparkpack.formats.profile import SIDES, Profile

FRACTIONS = np.linspace(0.0, 1.0, 101)
TOP_FRACTION = 0.6  # "the most-used 60% of experts take X% of routings", as calibrate prints it


@dataclass
class HitTimeline:
    """Share of a trace's routings served by the hot set, in windows of ``window`` tokens."""

    window: int
    start: list[int]  # first token of each window
    hit_rate: list[float]
    generated_share: list[float]  # of each window's tokens, the generated-side share
    overall: float


@dataclass
class Report:
    title: str
    profile: Profile
    moe_layers: list[int]
    nbytes: dict[int, int]  # one expert's bytes per MoE layer (equal when unknown)
    bytes_known: bool
    hot: np.ndarray | None  # bool [n_layer, n_expert]
    hot_source: str | None
    timeline: HitTimeline | None = None

    # --- what the profile says ----------------------------------------------------------------

    @property
    def scores(self) -> np.ndarray:
        c, t = self.profile.counts, self.profile.tokens
        return expert_scores(c["prompt"], c["generated"], t["prompt"], t["generated"])

    def rates(self, side: str) -> np.ndarray | None:
        """Routings per token of ``side`` ([n_layer, n_expert]), None when it saw no tokens."""
        t = self.profile.tokens[side]
        return self.profile.counts[side] / t if t > 0 else None

    def top_share(self, use: np.ndarray, fraction: float = TOP_FRACTION) -> list[float]:
        """Per MoE layer: share of its use taken by its most-used ``fraction`` of experts."""
        n_top = max(1, int(round(fraction * use.shape[1])))
        out = []
        for il in self.moe_layers:
            row = np.sort(use[il])[::-1]
            out.append(float(row[:n_top].sum() / row.sum()) if row.sum() > 0 else 0.0)
        return out

    def layer_coverage(self, use: np.ndarray) -> np.ndarray:
        """[n_moe, len(FRACTIONS)]: share of a layer's use served by its top experts."""
        n_expert = use.shape[1]
        out = np.zeros((len(self.moe_layers), len(FRACTIONS)))
        for j, il in enumerate(self.moe_layers):
            row = np.sort(use[il])[::-1]
            total = row.sum()
            cum = np.concatenate([[0.0], np.cumsum(row) / total]) if total > 0 else np.linspace(0, 1, n_expert + 1)
            out[j] = np.interp(FRACTIONS * n_expert, np.arange(n_expert + 1), cum)
        return out

    def overall_coverage(self) -> dict[str, list[float]]:
        """Share of each side's routings served at each share of expert bytes, experts taken in
        the planner's order (hits per byte across layers)."""
        n_expert = self.profile.n_expert
        layer = np.repeat(self.moe_layers, n_expert)
        expert = np.tile(np.arange(n_expert), len(self.moe_layers))
        size = np.array([self.nbytes[il] for il in layer], dtype=float)
        order = np.lexsort((expert, layer, -self.scores[layer, expert] / size))
        x = np.concatenate([[0.0], np.cumsum(size[order]) / size.sum()])
        out = {}
        for side in SIDES:
            c = self.profile.counts[side][layer, expert][order]
            if c.sum() > 0:
                out[side] = np.interp(FRACTIONS, x, np.concatenate([[0.0], np.cumsum(c) / c.sum()])).tolist()
        return out

    # --- what the hot set makes of it -----------------------------------------------------------

    def hot_fraction(self) -> float | None:
        if self.hot is None:
            return None
        total = sum(self.nbytes[il] * self.profile.n_expert for il in self.moe_layers)
        return sum(self.nbytes[il] * int(self.hot[il].sum()) for il in self.moe_layers) / total

    def hot_hit_rate(self) -> dict[str, float]:
        """Per side: the share of its routings the hot set serves (expected from the profile)."""
        if self.hot is None:
            return {}
        out = {}
        for side in SIDES:
            c = self.profile.counts[side][self.moe_layers]
            if c.sum() > 0:
                out[side] = float(c[self.hot[self.moe_layers]].sum() / c.sum())
        return out

    def to_json(self) -> dict:
        scores = self.scores
        p = self.profile
        skew = {side: (self.top_share(r) if (r := self.rates(side)) is not None else None) for side in SIDES}
        gen, prompt = self.rates("generated"), self.rates("prompt")
        corr = None
        if gen is not None and prompt is not None:
            a, b = gen[self.moe_layers].ravel(), prompt[self.moe_layers].ravel()
            if a.std() > 0 and b.std() > 0:
                corr = float(np.corrcoef(a, b)[0, 1])
        d = {
            "title": self.title,
            "arch": p.arch,
            "identity": p.identity.to_json(),
            "tokens": dict(p.tokens),
            "decay": p.decay.to_json() if p.decay else None,
            "moe_layers": self.moe_layers,
            "n_expert": p.n_expert,
            "expert_bytes": {str(il): nb for il, nb in self.nbytes.items()} if self.bytes_known else None,
            "top_share": {"fraction": TOP_FRACTION, "use": self.top_share(scores), **skew},
            "prompt_generated_correlation": corr,
            "coverage": {"fractions": FRACTIONS.tolist(), "overall": self.overall_coverage(),
                         "per_layer": {str(il): row.tolist() for il, row in
                                       zip(self.moe_layers, self.layer_coverage(scores))}},
            "hot_set": None,
            "timeline": None,
        }
        if self.hot is not None:
            d["hot_set"] = {"source": self.hot_source, "experts": int(self.hot[self.moe_layers].sum()),
                            "of": len(self.moe_layers) * p.n_expert, "byte_fraction": self.hot_fraction(),
                            "per_layer": {str(il): int(self.hot[il].sum()) for il in self.moe_layers},
                            "expected_hit_rate": self.hot_hit_rate()}
        if self.timeline is not None:
            d["timeline"] = self.timeline.__dict__
        return d


def hit_timeline(ids: np.ndarray, generated: np.ndarray, hot: np.ndarray, windows: int = 60) -> HitTimeline:
    """Hit rate of ``hot`` (rows in trace order) over a trace ``ids [N, n_moe, k]``."""
    ids = np.asarray(ids)
    n = len(ids)
    per_token = hot[np.arange(hot.shape[0])[None, :, None], ids].mean(axis=(1, 2))
    window = max(1, -(-n // windows))
    starts = list(range(0, n, window))
    gen = np.asarray(generated, dtype=float)
    return HitTimeline(window, starts, [float(per_token[s: s + window].mean()) for s in starts],
                       [float(gen[s: s + window].mean()) for s in starts], float(per_token.mean()) if n else 0.0)
