"""Live learning: decay arithmetic, the steady state, starting profiles, and the saved decay state."""
from __future__ import annotations

import json

import numpy as np
import pytest

from sparkpack.formats.archs import model_spec
from sparkpack.formats.decayed_routing import DecayedRouting
from sparkpack.formats.errors import FormatError
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.profile import Profile, model_identity


@pytest.fixture(scope="module")
def empty(synth_model) -> Profile:
    g = GGUFModel(synth_model("qwen3moe"))
    return Profile.new(model_identity(g), model_spec(g))


def test_a_routing_counts_half_after_one_half_life(empty):
    h = 1000.0
    learner = DecayedRouting(empty, h)
    c = np.zeros(learner.shape)
    c[1, 3] = 1.0
    learner.observe(c, 1, "generated")
    learner.observe(np.zeros(learner.shape), 1000, "prompt")
    p = learner.profile()
    assert p.counts["generated"][1, 3] == pytest.approx(0.5, rel=1e-12)
    assert p.tokens["generated"] == pytest.approx(0.5, rel=1e-12)
    assert p.tokens["prompt"] == pytest.approx((1 - 0.5) / (1 - 2 ** (-1 / h)), rel=1e-12)
    assert p.decay.half_life_tokens == h and p.decay.tokens_seen == 1001


def test_one_call_or_token_by_token_learn_the_same(empty):
    rng = np.random.default_rng(0)
    per_token = rng.integers(0, 3, size=(empty.n_layer, empty.n_expert)).astype(float)
    whole, steps = DecayedRouting(empty, 50.0), DecayedRouting(empty, 50.0)
    whole.observe(per_token * 40, 40, "prompt")
    for _ in range(40):
        steps.observe(per_token, 1, "prompt")
    a, b = whole.profile(), steps.profile()
    assert np.allclose(a.counts["prompt"], b.counts["prompt"], rtol=1e-12)
    assert a.tokens["prompt"] == pytest.approx(b.tokens["prompt"], rel=1e-12)


def test_steady_state_rates_follow_the_traffic(empty):
    """Counts / tokens stay per-token rates, and the token mass levels off at 1 / (1 - d)."""
    learner = DecayedRouting(empty, 200.0)
    rate = np.zeros(learner.shape)
    rate[0, :4] = 1.0  # every token routes to experts 0-3 of layer 0
    for _ in range(300):
        learner.observe(rate * 7, 7, "generated")
    p = learner.profile()
    assert sum(p.tokens.values()) == pytest.approx(learner.memory_tokens, rel=1e-3)
    assert np.allclose(p.counts["generated"] / p.tokens["generated"], rate)
    assert np.allclose(learner.scores(gen_weight=1.0), rate)


def test_a_long_calibration_is_scaled_to_the_memory(empty):
    prof = empty.copy()
    c = np.arange(prof.n_layer * prof.n_expert, dtype=float).reshape(prof.n_layer, prof.n_expert)
    prof.add(prompt=c * 1e4, generated=c * 1e3, prompt_tokens=1e7, generated_tokens=1e6)
    learner = DecayedRouting(prof, 1000.0)
    p = learner.profile()
    assert sum(p.tokens.values()) == pytest.approx(learner.memory_tokens)
    assert np.allclose(p.counts["prompt"] / p.tokens["prompt"], c * 1e4 / 1e7)  # rates kept
    assert p.decay.tokens_seen == 1.1e7
    assert np.array_equal(prof.counts["prompt"], c * 1e4)  # the starting profile is not touched


def test_the_ranking_follows_a_switch_of_traffic(empty):
    """Stationary traffic A, then B: B's top experts lead after about two half-lives."""
    rng = np.random.default_rng(1)
    n_layer, n_expert = empty.n_layer, empty.n_expert
    pa, pb = rng.dirichlet(np.full(n_expert, 0.3)), rng.dirichlet(np.full(n_expert, 0.3))
    learner = DecayedRouting(empty, 2000.0)

    def feed(p: np.ndarray, tokens: int) -> None:
        for _ in range(tokens // 100):
            c = np.stack([rng.multinomial(100 * 4, p) for _ in range(n_layer)]).astype(float)
            learner.observe(c, 100, "generated")

    def top(v: np.ndarray) -> set[int]:
        return set(np.argsort(-v)[:6].tolist())

    feed(pa, 20_000)
    assert top(learner.scores()[0]) == top(pa)
    feed(pb, 500)
    assert top(learner.scores()[0]) != top(pb)  # a quarter half-life is not enough
    feed(pb, 5_500)
    assert top(learner.scores()[0]) == top(pb)


@pytest.mark.parametrize("bad, message", [
    (lambda L: L.observe(np.ones((1, 2)), 1, "prompt"), "shape"),
    (lambda L: L.observe(-np.ones(L.shape), 1, "prompt"), ">= 0"),
    (lambda L: L.observe(np.ones(L.shape), 0, "prompt"), "cannot have produced"),
    (lambda L: L.observe(np.ones(L.shape), 1, "decode"), "side"),
])
def test_bad_observations_are_refused(empty, bad, message):
    learner = DecayedRouting(empty, 100.0)
    with pytest.raises(ValueError, match=message):
        bad(learner)
    with pytest.raises(ValueError, match="half_life"):
        DecayedRouting(empty, 0.0)


def test_decay_state_round_trips_and_v1_files_still_load(empty, tmp_path):
    learner = DecayedRouting(empty, 300.0)
    learner.observe(np.ones(learner.shape), 3, "prompt")
    path = learner.profile().save(tmp_path / "p.json")
    d = json.loads(path.read_text())
    assert d["version"] == 1 and d["decay"] == {"half_life_tokens": 300, "tokens_seen": 3}
    back = Profile.load(path)
    assert back.decay == learner.profile().decay
    assert np.array_equal(back.counts["prompt"], learner.profile().counts["prompt"])
    resumed = DecayedRouting(back, 300.0)
    assert resumed.tokens_seen == 3
    del d["decay"]  # a profile written before decay existed (repack calibrate's)
    path.write_text(json.dumps(d))
    assert Profile.load(path).decay is None
    for bad in ({"half_life_tokens": 0, "tokens_seen": 1}, {"tokens_seen": 1}, {"half_life_tokens": 1, "tokens_seen": -1}):
        path.write_text(json.dumps(dict(d, decay=bad)))
        with pytest.raises(FormatError, match="decay"):
            Profile.load(path)
