"""How fast a decayed placement follows a change of traffic, and what a short memory costs.

    python bench/decay_half_life.py M.gguf A.trace B.trace [--half-lives 5000 20000 50000] \
        [--fraction 0.6] [--chunk 256] [--json]

Traces come from ``repack calibrate M.gguf --corpus C --trace T.trace`` on two different corpora.
Each trace is split in halves: the first is traffic to learn from (replayed in ``--chunk``-token
calls, cycled when more is needed), the second is held out to judge placements on.

Switch: a learner (``formats.decayed_routing``) whose memory is A and that then learns B for
``t`` tokens holds ``2**(-t/H) A + (1 - 2**(-t/H)) B`` (rates; exactly, up to sampling noise,
which the noise part measures on its own). So the switch is measured on mixtures: for weights
``w`` of B from 0 to 1, the hot set ``repack split`` would choose from the mixed rates at
``--fraction`` of expert bytes is scored on B's held-out half; the gap is ``cold(w=0) -
cold(w=1)``, and the weights that close 50% and 90% of it become times ``t = -H log2(1 - w)``,
in half-lives: properties of the two corpora and the model, whatever the half-life.

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
    ra, rb = bench.counts(np.asarray(a.ids[:na])) / na, bench.counts(np.asarray(b.ids[:nb])) / nb
    weights = np.linspace(0, 1, 201)
    cold = [cold_rate(b_held, bench.hot(expert_scores(w * rb + (1 - w) * ra, ra * 0, 1.0, 0.0))) for w in weights]
    switch = {}
    for share in (0.5, 0.9):
        target = cold[0] - share * (cold[0] - cold[-1])
        w = next((float(x) for x, c in zip(weights, cold) if c <= target), 1.0)
        switch[share] = {"weight": w, "half_lives": float(-np.log2(1 - w)) if w < 1 else None}
    rows = []
    for h in args.half_lives:
        learner = DecayedRouting(bench.empty, h)
        feed = calls(a, na, args.chunk)
        for _ in range(int(6 * h / args.chunk) + 1):
            bench.learn(learner, *next(feed))
        stationary = cold_rate(a_held, bench.hot(learner.scores()))
        full = cold_rate(a_held, a_own)
        rows.append({"half_life": h, "stationary_cold": stationary, "undecayed_cold": full,
                     "stationary_excess": stationary / full - 1 if full else None})
    out = {"model": str(args.model), "a": str(args.a), "b": str(args.b), "fraction": args.fraction,
           "a_tokens": a.n_tokens, "b_tokens": b.n_tokens,
           "cold_on_b": {"a_rates": cold[0], "b_rates": cold[-1], "b_own_placement": cold_bb},
           "switch": {str(k): v for k, v in switch.items()}, "noise": rows}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{args.model.name} at {args.fraction:.0%} hot, on {args.b.name}'s held-out half: placement from "
          f"{args.a.name} misses {cold[0]:.2%}, from {args.b.name} {cold[-1]:.2%}")
    for share, v in switch.items():
        t = f"{v['half_lives']:.2f} half-lives" if v["half_lives"] is not None else "never"
        print(f"  {share:.0%} of the gap closed at B weight {v['weight']:.3f}: {t} after the switch")
    print(f"stationary {args.a.name}: cold-hit rate of the decayed placement on its held-out half (undecayed "
          f"{rows[0]['undecayed_cold']:.2%})")
    for r in rows:
        print(f"  half-life {r['half_life']:>8.0f}: {r['stationary_cold']:.2%} ({r['stationary_excess']:+.1%})")


if __name__ == "__main__":
    main()
