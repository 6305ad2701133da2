"""The greedy planner: honours the budget, prefers frequent experts, ranks across layers; and the
one VRAM plan split and the runtime share."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sparkpack.formats.archs import LINEAR, model_spec
from sparkpack.formats.decayed_routing import DecayedRouting
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.memory import (PREFILL_CHUNK, PREFILL_GRAPH_TOKENS, MemoryTarget, group_bytes, kv_cache_bytes,
                                      runtime_bytes)
from sparkpack.formats.placement import (SWAP_MARGIN, Budget, Swaps, cold_hit_rates, default_cache_slots, expert_scores,
                                         make_plan, plan_residency, plan_swaps, plan_uniform)
from sparkpack.formats.profile import Profile, model_identity
from sparkpack.formats.sparkpack import Pack


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


# --- re-placement while running ------------------------------------------------------------------

def apply(hot: np.ndarray, swaps: Swaps) -> np.ndarray:
    hot = hot.copy()
    for il, e in swaps.demote:
        assert hot[il, e]
        hot[il, e] = False
    for il, e in swaps.promote:
        assert not hot[il, e]
        hot[il, e] = True
    return hot


def test_swaps_reach_the_greedy_plan_within_the_budget():
    rng = np.random.default_rng(3)
    scores = rng.random((3, 16))
    scores[0] = 0  # a dense layer
    nbytes = {1: 100, 2: 100}
    plan = make_plan(3, 16, nbytes, 1500, {"prompt": scores * 0, "generated": scores}, {"generated": 1.0})
    hot = np.zeros((3, 16), dtype=bool)
    hot[1:, :7] = True  # a uniform start, 1400 bytes
    swaps = plan_swaps(hot, scores, nbytes, 1500, margin=0.0)
    after = apply(hot, swaps)
    assert np.array_equal(after, plan.hot)
    assert swaps.gain == pytest.approx(scores[plan.hot].sum() - scores[hot].sum())
    assert not plan_swaps(after, scores, nbytes, 1500, margin=0.0)  # nothing left to do


def test_a_shrunk_budget_drops_the_weakest_and_a_grown_one_fills():
    scores = np.array([[5.0, 4.0, 3.0, 2.0, 1.0, 0.5]])
    hot = np.array([[True, True, True, True, False, False]])
    s = plan_swaps(hot, scores, {0: 10}, 25)
    assert s.demote == [(0, 3), (0, 2)] and s.promote == []
    s = plan_swaps(hot, scores, {0: 10}, 60)
    assert s.demote == [] and s.promote == [(0, 4), (0, 5)]


def test_hysteresis_margin_and_unequal_sizes():
    hot = np.array([[False, False], [True, True]])
    nbytes = {0: 200, 1: 100}  # layer 0's expert takes the bytes of both of layer 1's
    scores = np.array([[0.0, 2.4], [1.0, 1.0]])
    assert not plan_swaps(hot, scores, nbytes, 200, margin=0.25)  # 2.4 does not beat 1.25 x (1 + 1)
    scores[0, 1] = 2.6
    s = plan_swaps(hot, scores, nbytes, 200, margin=0.25)
    assert s.promote == [(0, 1)] and sorted(s.demote) == [(1, 0), (1, 1)] and s.gain == pytest.approx(0.6)
    scores = np.array([[0.0, 0.0], [1.0, 1.0]])
    hot = np.array([[True, False], [False, False]])
    assert plan_swaps(hot, scores, nbytes, 200, max_promote=1).promote == [(1, 0)]  # the strongest move first
    assert not plan_swaps(hot, scores, nbytes, 200, max_promote=0)


def test_the_hot_set_does_not_flap_on_stationary_traffic(synth_model):
    """Noisy counts of one fixed routing distribution, re-placed after every request. At the
    edge of each layer's hot half sit two experts of exactly equal use: with the margin the set
    settles and stays; without it they keep trading places. The half-life gives an edge
    expert about as many routings of memory as the default gives a full-size model's."""
    g = GGUFModel(synth_model("qwen3moe"))
    spec = model_spec(g)
    rng = np.random.default_rng(0)
    p = -np.sort(-rng.dirichlet(np.full(spec.n_expert, 1.0), size=spec.n_layer), axis=1)
    half = spec.n_expert // 2
    p[:, half - 1: half + 1] = p[:, half - 1: half + 1].mean(axis=1, keepdims=True)
    p = p[:, rng.permutation(spec.n_expert)]
    nbytes = {il: 100 for il in spec.moe_layers}
    budget = 100 * len(spec.moe_layers) * half

    def run(margin: float) -> list[int]:
        learner = DecayedRouting(Profile.new(model_identity(g), spec), half_life_tokens=10_000)
        hot = plan_uniform((spec.n_layer, spec.n_expert), nbytes, budget)
        moves = []
        for _ in range(400):  # requests of 200 generated tokens, top-4 routings each
            c = np.stack([rng.multinomial(200 * 4, p[il]) for il in range(spec.n_layer)]).astype(float)
            learner.observe(c, 200, "generated")
            s = plan_swaps(hot, learner.scores(), nbytes, budget, margin=margin)
            hot = apply(hot, s)
            moves.append(len(s.promote))
        return moves

    settled = run(SWAP_MARGIN)
    assert sum(settled[:100]) > 0 and sum(settled[100:]) == 0
    assert sum(run(0.0)[100:]) > 10  # what the margin prevents


@pytest.mark.parametrize("arch, quant", [("qwen35moe", "Q4_K_M"), ("qwen3moe", "Q4_K_M"), ("laguna", "Q5_K_M"),
                                         ("qwen3moe", "Q8_0")])
def test_split_plans_what_the_runtime_allocates(synth_model, tmp_path, monkeypatch, capsys, arch, quant):
    """``repack split --vram`` and ``spark-run --vram`` on a GPU plan the same hot set and cache
    slots for the same budget, and the store's device pool is exactly what split planned for
    experts: each hot expert at its own layer's size (Q4_K_M mixes Q4_K and Q6_K down matrices
    across layers), each cache slot at the largest; a zero-copy store allocates the two staging
    buffers for long prompts the plan reserved. The runtime's plan for a GPU is computed here on
    the CPU; the stores are built on the CPU from it."""
    from sparkpack.repack.cli import main
    from sparkpack.runtime.expert_store import ExpertStore
    from sparkpack.runtime.models import SessionOptions, StoreOptions, plan_store
    from sparkpack.runtime.weights import PackAsGGUF

    path = synth_model(arch, quant)
    gguf = GGUFModel(path)
    spec = model_spec(gguf)
    full = plan_residency(spec, gguf.tensors, Budget(vram=2**40), MemoryTarget.gpu(spec, 512))
    assert full.hot[list(spec.moe_layers)].all() and len(set(full.slot_bytes.values())) == (1 if quant == "Q8_0" else 2)
    fixed = full.dense_bytes + full.kv_bytes + full.state_bytes + full.overhead_bytes
    # about half fits, with room for staging buffers
    vram = fixed + default_cache_slots(spec) * full.cache_slot_bytes + full.hot_bytes // 2 + full.hot_bytes // 4
    out = tmp_path / "m.sparkpack"
    monkeypatch.setattr(sys, "argv", ["repack", "split", str(path), "--vram", str(vram), "--ctx", "512", "-o", str(out)])
    try:
        main()
    except SystemExit as e:  # (only on errors)
        pytest.fail(f"repack split exited {e.code}: {capsys.readouterr().err}")
    placement = json.loads((out / "manifest.json").read_text())["placement"]
    split = placement["budget"]
    pack = Pack.open(out)
    opts, session = StoreOptions(vram=vram), SessionOptions(ctx=512)
    src, plan = plan_store(PackAsGGUF(pack), pack, spec, "cuda", torch.bfloat16, opts, session=session)
    assert np.array_equal(plan.hot, pack.hot) and 0 < plan.hot.sum() < len(spec.moe_layers) * spec.n_expert
    assert (plan.hot_bytes, plan.cache_slots, plan.cache_slot_bytes, plan.dense_bytes, plan.expert_budget,
            plan.overhead_bytes, plan.staging_bytes) == \
        (placement["hot_bytes"], split["cache_slots"], split["cache_slot_bytes"], split["non_expert"], split["experts"],
         split["runtime"], split["staging"])
    # every arch stages (the all-attention models in their 512-token calls, in groups)
    chunk = PREFILL_CHUNK if any(k.attention == LINEAR for k in spec.layers) else PREFILL_GRAPH_TOKENS
    assert plan.staging_bytes > 0 and "prompt staging" in capsys.readouterr().err
    assert plan.overhead_bytes == runtime_bytes(spec, 512, chunk) + group_bytes(spec, 512, chunk)
    assert plan.hot_bytes + plan.staging_bytes + plan.overhead_bytes + plan.dense_bytes + plan.kv_bytes + \
        plan.state_bytes + plan.cache_bytes <= vram
    assert np.array_equal(plan_store(gguf, None, spec, "cuda", torch.bfloat16, opts, session=session)[1].hot, pack.hot)  # from the GGUF too
    store = ExpertStore(src, spec, "cpu", torch.float32, plan.hot, plan.cache_slots, "async")
    assert store.pool.numel() == plan.pool_bytes == placement["hot_bytes"] + split["cache_slots"] * split["cache_slot_bytes"]
    assert (store.n_hot, store.n_cache) == (int(pack.hot.sum()), split["cache_slots"])
    assert store.staging is None  # (async: nothing staged)
    staged = ExpertStore(src, spec, "cpu", torch.float32, plan.hot, plan.cache_slots, "zerocopy", fused=True,
                         stage_tokens=opts.stage_tokens if plan.staging_bytes else None)  # (as open_store passes it)
    assert staged.describe()["staging_bytes"] == plan.staging_bytes


def test_vram_plan_prints_the_plan_split_and_spark_run_share(synth_model, capsys):
    """bench/vram_plan.py: per context the KV cache a session allocates (Laguna's rings counted)
    and the hot experts the shared plan leaves, or the plan's own refusal as one line."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import vram_plan

    path = synth_model("laguna", "Q4_K_M")
    spec = model_spec(GGUFModel(path))
    rows = vram_plan.main([str(path), "--vram", "4GiB", "--ctx", "512", "40000", "--kv", "auto"])
    for r in rows:
        target = MemoryTarget.gpu(spec, r["ctx"])
        assert r["kv_bytes"] == kv_cache_bytes(spec, r["ctx"], 2.0, target.prefill_chunk)
        assert r["hot_bytes"] == plan_residency(spec, GGUFModel(path).tensors, Budget(vram=4 * 2**30), target).hot_bytes
    assert rows[1]["kv_bytes"] < 2 * 40000 * spec.head_dim * sum(spec.n_head_kv) * 2  # the rings hold less
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[1].startswith("--ctx 40000 --kv-type auto: KV cache")
    refused = vram_plan.main([str(path), "--vram", "1MiB", "--ctx", "512", "--kv", "q8_0"])
    assert "too small" in refused[0]["refused"] and "refused: " in capsys.readouterr().out
