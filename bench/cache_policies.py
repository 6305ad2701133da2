"""Which cache-slot policy serves the cold routings best: LRU, LFU or frequency-aware admission.

    python bench/cache_policies.py M.gguf TRAIN.trace TEST.trace [TEST2.trace ...] \
        [--fractions 0.4 0.6] [--slots N] [--json]

Traces come from ``repack calibrate M.gguf --corpus C --trace T.trace``. The hot set is the one
``repack split`` would choose from the routing counts of TRAIN (``calibrate.evaluate.profile_mask``,
all tokens of both sides) at each hot fraction; every TEST trace is then replayed against it with
no slots and with each policy (``calibrate.cache_policies``) in the store's layout: one pool of
``--slots`` (default: the runtime's default for the model) shared by all MoE layers, and, for
comparison, that many slots per layer divided evenly. A TEST that is TRAIN itself is split in
halves (profile from the first, replay of the second).

Cold routings are what a policy fails to serve from VRAM (a stall, or a PCIe read in zero-copy
mode); copies are what it pays for what it serves (one PCIe transfer each). In zero-copy mode a
cold routing and a copy cost the same link bytes, so ``transfers = cold + copies`` per token is
the link load, and an LRU copy made for a routing that is never seen again doubles a miss's cost.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from sparkpack.calibrate.cache_policies import POLICIES, simulate
from sparkpack.calibrate.evaluate import cold_rate, profile_mask
from sparkpack.calibrate.trace import read_trace
from sparkpack.formats.archs import model_spec
from sparkpack.formats.experts import expert_nbytes
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.placement import default_cache_slots


def counts_of(ids: np.ndarray, n_layer: int, n_expert: int, moe_layers: list[int]) -> np.ndarray:
    c = np.zeros((n_layer, n_expert))
    for j, il in enumerate(moe_layers):
        c[il] = np.bincount(ids[:, j].ravel(), minlength=n_expert)
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("train", type=Path)
    ap.add_argument("tests", type=Path, nargs="+")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.4, 0.6])
    ap.add_argument("--slots", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    gguf = GGUFModel(a.model)
    spec = model_spec(gguf)
    slots = default_cache_slots(spec) if a.slots is None else a.slots
    nbytes = {il: expert_nbytes(gguf, spec, il) for il in spec.moe_layers}
    train = read_trace(a.train)
    rows = []
    for test_path in a.tests:
        test = read_trace(test_path)
        if test_path.resolve() == a.train.resolve():
            half = train.n_tokens // 2
            fit, ids, name = np.asarray(train.ids[:half]), np.asarray(train.ids[half:]), f"{test_path.name} (2nd half)"
        else:
            fit, ids, name = np.asarray(train.ids), np.asarray(test.ids), test_path.name
        counts = counts_of(fit, spec.n_layer, spec.n_expert, spec.moe_layers)
        for frac in a.fractions:
            budget = int(round(frac * spec.n_expert)) * sum(nbytes.values())
            hot = profile_mask({"prompt": counts, "generated": counts * 0}, {"prompt": 1.0}, spec.moe_layers,
                               nbytes, budget)
            row = {"test": name, "tokens": int(len(ids)), "fraction": frac, "slots": slots,
                   "no_cache": cold_rate(ids, hot)}
            per_layer = max(1, slots // len(spec.moe_layers))
            for p in POLICIES:
                for shared, n_slots in ((True, slots), (False, per_layer)):
                    r = simulate(ids, hot, n_slots, p, shared=shared)
                    key = p if shared else f"{p}_per_layer"
                    row[key] = {"cold": r.cold_rate, "copies_per_token": r.copies_per_token,
                                "transfers_per_token": (r.cold + r.copies) / r.tokens}
            rows.append(row)
    if a.json:
        print(json.dumps({"model": str(a.model), "train": str(a.train), "rows": rows}, indent=1))
        return
    k = spec.n_expert_used * len(spec.moe_layers)
    print(f"{a.model.name}: profile from {a.train.name}; {slots} slots shared (or {max(1, slots // len(spec.moe_layers))}"
          f" per layer); cold = share of routings, copies and transfers per token ({k} routings a token)")
    print(f"{'test':>28} {'hot':>4} {'none':>6} " + " ".join(f"{p + ' cold/copy/xfer':>24}" for p in POLICIES))
    for r in rows:
        cells = [f"{r[p]['cold']:6.1%} {r[p]['copies_per_token']:6.2f} {r[p]['transfers_per_token']:6.2f}"
                 for p in POLICIES]
        print(f"{r['test']:>28} {r['fraction']:4.0%} {r['no_cache']:6.1%} " + " ".join(f"{c:>24}" for c in cells))
        cells = [f"{r[p + '_per_layer']['cold']:6.1%} {r[p + '_per_layer']['copies_per_token']:6.2f} "
                 f"{r[p + '_per_layer']['transfers_per_token']:6.2f}" for p in POLICIES]
        print(f"{'(per layer)':>28} {'':>4} {'':>6} " + " ".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
