"""Cache-slot policies on routing traces: LRU against the vectorised simulation, LFU and the
store's frequency-aware admission on hand-made traces, and all three on a recorded real trace."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sparkpack.calibrate.cache_policies import POLICIES, simulate
from sparkpack.calibrate.evaluate import cold_rate, cold_rate_lru
from sparkpack.calibrate.trace import read_trace
from sparkpack.formats.cache_policy import ADMIT_MIN

from tests.commands import calibrate_in_process

REPO = Path(__file__).resolve().parents[1]


def skewed_trace(n: int, layers: int, n_expert: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = np.exp(rng.standard_normal(n_expert) * 1.5)
    return np.stack([[rng.choice(n_expert, size=k, replace=False, p=p / p.sum()) for _ in range(layers)]
                     for _ in range(n)])


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_lru_per_layer_equals_the_vectorised_simulation(slots):
    ids = skewed_trace(300, 3, 12, 2, slots)
    hot = np.random.default_rng(slots).random((3, 12)) < 0.3
    r = simulate(ids, hot, slots, "lru", shared=False)
    assert r.cold_rate == pytest.approx(cold_rate_lru(ids, hot[None], slots)[0])
    assert r.copies == r.cold  # LRU copies every miss in


def test_no_slots_is_the_placement_alone():
    ids = skewed_trace(100, 2, 8, 2, 0)
    hot = np.zeros((2, 8), bool)
    hot[:, :3] = True
    for p in POLICIES:
        r = simulate(ids, hot, 0, p)
        assert r.cold_rate == pytest.approx(cold_rate(ids, hot)) and r.copies == 0


def test_lfu_keeps_the_most_routed_expert():
    # one layer, two slots: expert 1 is routed four times, then 2, then 3 (which must evict one), then 1
    ids = np.array([1, 1, 1, 1, 2, 3, 1])[:, None, None]
    hot = np.zeros((1, 4), bool)
    lfu, lru = simulate(ids, hot, 2, "lfu"), simulate(ids, hot, 2, "lru")
    assert (lfu.cold, lfu.copies) == (3, 3)  # 3 evicts 2 (routed once), so 1 is still there at the end
    assert (lru.cold, lru.copies) == (4, 4)  # 3 evicts 1 (least recent), which then misses


def test_frequency_aware_admission_ignores_one_off_misses():
    hot = np.zeros((1, 64), bool)
    once = np.arange(40)[:, None, None]  # 40 different experts, each routed once
    r = simulate(once, hot, 4, "freq")
    assert r.copies == 0 and r.cold == 40
    assert simulate(once, hot, 4, "lru").copies == 40
    again = np.array([5, 5, 5, 5, 5, 5])[:, None, None]  # admitted once its decayed count reaches ADMIT_MIN
    r = simulate(again, hot, 1, "freq")
    assert ADMIT_MIN == 3.0 and r.copies == 1 and r.cold == 4  # counts 1, 1.95, 2.85, 3.71: in after the 4th


def test_shared_pool_serves_all_layers():
    ids = np.array([[[0], [0]]] * 5)  # two layers routing their expert 0 every token
    hot = np.zeros((2, 4), bool)
    assert simulate(ids, hot, 1, "lru", shared=True).cold == 6  # one slot, two layers: they take turns
    assert simulate(ids, hot, 1, "lru", shared=False).cold == 2
    assert simulate(ids, hot, 2, "lru", shared=True).cold == 2


@pytest.mark.slow
def test_policies_on_a_recorded_trace(synth_model, tmp_path):
    """A trace recorded by `repack calibrate --trace` on the bundled corpus: every policy's
    slots only ever help, and frequency-aware admission copies fewer experts than LRU."""
    model = synth_model("qwen3moe", skew="reference")
    calibrate_in_process(model, "--corpus", REPO / "corpora", "-o", tmp_path / "p.json", "--trace", tmp_path / "t.trace",
           "--max-tokens", "3000")
    tr = read_trace(tmp_path / "t.trace")
    hot = np.zeros((len(tr.moe_layers), tr.n_expert), bool)
    hot[:, : tr.n_expert // 2] = True
    base = cold_rate(tr.ids, hot)
    res = {p: simulate(tr.ids, hot, 8, p) for p in POLICIES}
    assert all(r.cold_rate < base for r in res.values()), res
    assert res["freq"].copies < res["lru"].copies
