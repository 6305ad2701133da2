"""How fast a decayed placement follows a change of traffic, and what a short memory costs.

    python bench/decay_half_life.py M.gguf A.trace B.trace [--half-lives 5000 20000 50000] \
        [--fraction 0.6] [--chunk 256] [--json]

Traces come from ``repack calibrate M.gguf --corpus C --trace T.trace`` on two different corpora.
Each trace is split in halves: the first is traffic to learn from (replayed in ``--chunk``-token
calls, cycled when more is needed), the second is held out to judge placements on.

Switch: a learner (``formats.decayed_routing``) with each half-life learns A for four half-lives
(its memory is then A), then B. After every call the hot set ``repack split`` would choose from
the learned scores at ``--fraction`` of expert bytes is scored on B's held-out half. The gap is
``cold(A's own placement) - cold(B's own placement)`` on B; the script reports after how many
tokens of B (and how many half-lives) the learned placement has closed 50% and 90% of it.

Noise: a learner with each half-life learns A only, for six half-lives; its placement's cold rate
on A's held-out half is compared with the placement from all of A's first half (no decay). Too
short a memory estimates the ranking from too few routings; the excess says how short is too short.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from sparkpack.calibrate.evaluate import cold_rate
from sparkpack.calibrate.trace import Trace, read_trace
from sparkpack.formats.archs import model_spec
from sparkpack.formats.decayed_routing import DecayedRouting
from sparkpack.formats.experts import expert_nbytes
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.placement import expert_scores, plan_greedy
from sparkpack.formats.profile import Profile, model_identity


def calls(tr: Trace, n: int, chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless ``chunk``-token calls over the first ``n`` tokens of ``tr``: (ids, generated)."""
    while True:
        for t0 in range(0, n - chunk + 1, chunk):
            yield np.asarray(tr.ids[t0: t0 + chunk]), np.asarray(tr.generated[t0: t0 + chunk])


class Bench:
    def __init__(self, gguf: GGUFModel, fraction: float):
        self.spec = spec = model_spec(gguf)
        self.empty = Profile.new(model_identity(gguf), spec)
        self.nbytes = {il: expert_nbytes(gguf, spec, il) for il in spec.moe_layers}
        self.budget = int(round(fraction * spec.n_expert)) * sum(self.nbytes.values())

    def counts(self, ids: np.ndarray) -> np.ndarray:
        c = np.zeros((self.spec.n_layer, self.spec.n_expert))
        for j, il in enumerate(self.spec.moe_layers):
            c[il] = np.bincount(ids[:, j].ravel(), minlength=self.spec.n_expert)
        return c

    def learn(self, learner: DecayedRouting, ids: np.ndarray, generated: np.ndarray) -> None:
        for side, mask in (("prompt", ~generated), ("generated", generated)):
            if mask.any():
                learner.observe(self.counts(ids[mask]), int(mask.sum()), side)

    def hot(self, scores: np.ndarray) -> np.ndarray:
        return plan_greedy(scores, self.nbytes, self.budget)[self.spec.moe_layers]

    def own(self, ids: np.ndarray) -> np.ndarray:
        """The placement calibrated on ``ids`` (no decay)."""
        c = self.counts(ids)
        return self.hot(expert_scores(c, c * 0, len(ids), 0.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--half-lives", type=float, nargs="+", default=[5000, 20000, 50000])
    ap.add_argument("--fraction", type=float, default=0.6)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    bench = Bench(GGUFModel(args.model), args.fraction)
    a, b = read_trace(args.a), read_trace(args.b)
    na, nb = a.n_tokens // 2, b.n_tokens // 2
    a_held, b_held = np.asarray(a.ids[na:]), np.asarray(b.ids[nb:])
    a_own, b_own = bench.own(np.asarray(a.ids[:na])), bench.own(np.asarray(b.ids[:nb]))
    cold_ab, cold_bb = cold_rate(b_held, a_own), cold_rate(b_held, b_own)
    rows = []
    for h in args.half_lives:
        learner = DecayedRouting(bench.empty, h)
        feed = calls(a, na, args.chunk)
        for _ in range(int(4 * h / args.chunk) + 1):
            bench.learn(learner, *next(feed))
        start = cold_rate(b_held, bench.hot(learner.scores()))
        t50 = t90 = None
        seen = 0
        feed = calls(b, nb, args.chunk)
        curve = []
        while seen < 6 * h and t90 is None:
            bench.learn(learner, *next(feed))
            seen += args.chunk
            c = cold_rate(b_held, bench.hot(learner.scores()))
            closed = (start - c) / (start - cold_bb) if start > cold_bb else 1.0
            curve.append((seen, c))
            if t50 is None and closed >= 0.5:
                t50 = seen
            if t90 is None and closed >= 0.9:
                t90 = seen
        learner = DecayedRouting(bench.empty, h)
        feed = calls(a, na, args.chunk)
        for _ in range(int(6 * h / args.chunk) + 1):
            bench.learn(learner, *next(feed))
        stationary = cold_rate(a_held, bench.hot(learner.scores()))
        full = cold_rate(a_held, a_own)
        rows.append({"half_life": h, "cold_before_switch": start, "t50": t50, "t90": t90,
                     "t50_half_lives": t50 / h if t50 else None, "t90_half_lives": t90 / h if t90 else None,
                     "stationary_cold": stationary, "undecayed_cold": full,
                     "stationary_excess": stationary / full - 1 if full else None})
    out = {"model": str(args.model), "a": str(args.a), "b": str(args.b), "fraction": args.fraction,
           "a_tokens": a.n_tokens, "b_tokens": b.n_tokens, "cold_on_b": {"a_placement": cold_ab, "b_placement": cold_bb},
           "rows": rows}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{args.model.name} at {args.fraction:.0%} hot: on {args.b.name}'s held-out half, {args.a.name}'s placement "
          f"misses {cold_ab:.1%}, {args.b.name}'s own {cold_bb:.1%}")
    print(f"{'half-life':>10} {'50% closed':>18} {'90% closed':>18} {'stationary cold':>16} {'undecayed':>10} {'excess':>7}")
    for r in rows:
        def at(t, k):
            return f"{t:>8} ({r[k]:.2f} H)" if t else f"{'> 6 H':>18}"
        print(f"{r['half_life']:>10.0f} {at(r['t50'], 't50_half_lives'):>18} {at(r['t90'], 't90_half_lives'):>18} "
              f"{r['stationary_cold']:>16.2%} {r['undecayed_cold']:>10.2%} {r['stationary_excess']:>+7.1%}")


if __name__ == "__main__":
    main()
