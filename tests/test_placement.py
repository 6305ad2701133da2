"""The greedy planner: honours the budget, prefers frequent experts, ranks across layers."""
from __future__ import annotations

import numpy as np

from sparkpack.formats.placement import cold_hit_rates, expert_scores, make_plan


def counts(n_layer: int, n_expert: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.zipf(1.5, size=(n_layer, n_expert)).astype(float)


def test_budget_is_honoured_and_filled():
    nbytes = {0: 100, 1: 100, 2: 250}
    gen = counts(3, 8)
    for budget in (0, 99, 100, 333, 1000, 10_000):
        plan = make_plan(3, 8, nbytes, budget, {"prompt": gen * 0, "generated": gen}, {"generated": 1.0})
        assert plan.hot_bytes <= budget
        assert plan.hot_bytes == sum(int(plan.hot[il].sum()) * nb for il, nb in nbytes.items())
        cold_sizes = [nb for il, nb in nbytes.items() for e in range(8) if not plan.hot[il, e]]
        assert not cold_sizes or plan.hot_bytes + min(cold_sizes) > budget  # nothing else would fit


def test_prefers_frequent_experts_across_layers():
    gen = np.zeros((2, 4))
    gen[0] = [100, 1, 1, 1]  # layer 0 is concentrated
    gen[1] = [30, 30, 30, 10]  # layer 1 is flat
    plan = make_plan(2, 4, {0: 10, 1: 10}, 40, {"prompt": np.zeros((2, 4)), "generated": gen}, {"generated": 1.0})
    assert plan.hot.tolist() == [[True, False, False, False], [True, True, True, False]]
    assert not plan.uniform
    assert np.isclose(plan.cold_hit_rate["generated"], 13 / 203)


def test_generated_side_outweighs_prompt_side():
    prompt = np.array([[0.0, 50.0]])
    gen = np.array([[5.0, 0.0]])
    # per-token rates: expert 1 is busy in prompts, expert 0 while decoding
    plan = make_plan(1, 2, {0: 1}, 1, {"prompt": prompt, "generated": gen}, {"prompt": 100, "generated": 10})
    assert plan.hot.tolist() == [[True, False]]


def test_hits_per_byte_prefers_smaller_experts_at_equal_rate():
    gen = np.ones((2, 2))
    plan = make_plan(2, 2, {0: 300, 1: 100}, 200, {"prompt": gen * 0, "generated": gen}, {"generated": 1})
    assert plan.hot[1].all() and not plan.hot[0].any()


def test_uniform_without_profile_same_count_per_layer():
    plan = make_plan(4, 8, {1: 10, 2: 10, 3: 20}, 130, None)
    assert plan.uniform and plan.cold_hit_rate == {}
    assert [int(r.sum()) for r in plan.hot] == [0, 3, 3, 3]  # 3 x (10+10+20) = 120 <= 130 < 160
    assert plan.hot_bytes == 120


def test_scores_and_rates_helpers():
    s = expert_scores(np.array([[1.0, 3.0]]), np.array([[2.0, 0.0]]), 4, 2)
    assert np.allclose(s, [[0.8 * 1 + 0.2 * 0.25, 0.2 * 0.75]])
    r = cold_hit_rates(np.array([[True, False]]), {"generated": np.array([[3.0, 1.0]])})
    assert r == {"generated": 0.25}
