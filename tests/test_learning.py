"""Placement learning inside a run: the store hands every call's routing counts to the learner
with the right side, re-placement between requests keeps every result bit-identical while the
hot set moves toward the learned counts, the engine never re-places inside a request, and a
run starts from the profile beside the model (refusing another model's in one line).

On the CPU the store's whole bookkeeping runs over CPU tensors (CI); with
SPARKPACK_TEST_DEVICE=cuda the same tests run on the GPU, decode steps replayed from CUDA graphs
captured before the swaps (the table is the same tensor: the graphs stay valid)."""
from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest
import torch

from sparkpack.calibrate.replay import GENERATED, PROMPT
from sparkpack.formats.placement import GEN_WEIGHT, plan_swaps_in_place
from sparkpack.formats.profile import Profile
from sparkpack.runtime.expert_pools import HostPool
from sparkpack.runtime.calibration import RoutingTap
from sparkpack.runtime.generate import Session, generate
from sparkpack.runtime.learning import LearnOptions, start_learning
from sparkpack.runtime.models import StoreOptions, load_model
from tests.commands import run_cli

DEVICE = os.environ.get("SPARKPACK_TEST_DEVICE", "cpu")
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
IDS = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]
FOREVER = LearnOptions(half_life_tokens=1e15)  # no decay to speak of: learned counts are plain sums


@pytest.fixture(scope="module")
def model_path(synth_model):
    # Q4_K_M: two expert sizes (layers whose ffn_down is Q6_K and the rest), skewed routing
    return synth_model("qwen35moe", "Q4_K_M", skew=1.0)


def load(model_path, tmp_path, hot_fraction: float, mode: str = "auto", learn: LearnOptions | None = None,
         cache_slots: int = 4):
    """The model with its store, placed uniformly; learning into ``tmp_path/p.profile.json`` when
    ``learn`` (a profile path that does not exist yet: uniform placement)."""
    return load_model(model_path, device=DEVICE, dtype=DTYPE,
                      store=StoreOptions(hot_fraction=hot_fraction, cache_slots=cache_slots, miss_mode=mode,
                                         profile=tmp_path / "p.profile.json", learn=learn or LearnOptions()))


def greedy(session: Session, n: int = 3) -> tuple[list[int], torch.Tensor]:
    """A fresh request's greedy tokens and every logits row it produced."""
    session.reset()
    ids = list(IDS)
    logits = session.prompt(ids)
    rows = [logits]
    for _ in range(n):
        ids.append(int(torch.argmax(logits)))
        logits = session.feed(ids, "generated")
        rows.append(logits)
    return ids[len(IDS):], torch.stack(rows)


def source_bytes(store, layer: int, expert: int) -> torch.Tensor:
    out = np.zeros(store.layers[layer].nbytes, dtype=np.uint8)
    store.source.read(layer, expert, out)
    return torch.from_numpy(out)


@pytest.mark.parametrize("hot_fraction,mode", [(1.0, "zerocopy"), (0.6, "async"), (0.6, "zerocopy"), (0.1, "async"),
                                               (0.1, "zerocopy")])
def test_swaps_keep_results_bit_identical(model_path, tmp_path, monkeypatch, mode, hot_fraction):
    """Re-placement toward scores that favour the cold experts: the hot set moves as asked,
    every expert's bytes are where the table says (device pool, or the host pool range the
    promoted expert left), and the same requests give the same bits and tokens. (The staging
    buffer is made to hold one expert: every swap is its own batch.)"""
    from sparkpack.runtime import expert_replacement

    monkeypatch.setattr(expert_replacement, "SWAP_STAGING_BYTES", 1)
    model = load(model_path, tmp_path, hot_fraction, mode)
    store = model.experts
    session = Session(model, ctx=64)
    tokens, before = greedy(session)
    # cached experts too: a promoted one may sit in a cache slot, which it must leave
    assert store.n_cache == 0 or store.stats.cache_hits + store.stats.loads > 0 or hot_fraction == 1.0
    hot0 = store.hot.copy()
    rng = np.random.default_rng(0)
    scores = rng.random(hot0.shape)
    scores[~hot0] += 1.0  # traffic that moved on to the experts now cold
    # as the learner plans them: a store that stages long calls (on a GPU) swaps within a layer
    across = store.staging is None
    swaps = plan_swaps_in_place(store.hot, scores, store.device_layout.units, across_layers=across)
    if hot_fraction == 1.0:
        assert not swaps  # nothing is cold
    else:
        assert swaps and len(swaps.promote) == len(swaps.demote)
        moved = store.apply_swaps(swaps)
        assert moved >= sum(store.layers[il].nbytes for il, _ in swaps.promote)
        assert all(store.hot[p] for p in swaps.promote) and not any(store.hot[d] for d in swaps.demote)
        assert store.hot.sum() == hot0.sum() and scores[store.hot].sum() > scores[hot0].sum()
        for p in swaps.promote:
            assert torch.equal(store.device_bytes(*p).cpu(), source_bytes(store, *p))
        if isinstance(store.cold, HostPool):
            for d in swaps.demote:
                assert torch.equal(store.cold.bytes(*d)[0].cpu(), source_bytes(store, *d))
        if mode == "zerocopy":  # a demoted expert is read from where the host pool now holds it
            for d in swaps.demote:
                assert store.slots.table[d] == -(store.cold.layout.offset[d] + 1)
        assert not plan_swaps_in_place(store.hot, scores, store.device_layout.units,
                                       across_layers=across)  # where the scores say
    replays = session.graph.replays if session.graph is not None else 0
    tokens2, after = greedy(session)
    assert tokens2 == tokens and torch.equal(after, before)
    if DEVICE == "cuda" and session.graph is not None:
        assert session.graph.replays > replays  # the graph captured before the swaps, replayed after


@pytest.mark.parametrize("mode,hot_fraction", [("async", 0.5), ("zerocopy", 0.5), ("zerocopy", 1.0)])
def test_learner_gets_each_sides_routings(model_path, tmp_path, mode, hot_fraction):
    """A request's prompt is learned as prompt-side and its decode steps as generated-side,
    with the very counts the calibration counter finds for the same tokens (an all-hot store,
    whose counts stay on the device, is read when the side changes)."""
    model = load(model_path, tmp_path, hot_fraction, mode, FOREVER)
    learning = start_learning(model, FOREVER, GEN_WEIGHT)
    assert learning is not None and model.experts.observer is learning
    session = Session(model, ctx=64)
    out = list(generate(model, None, IDS, None, 6, stop_ids=(), session=session))
    learning.after_request(lambda: False)
    st, spec = learning.stats, model.spec
    fed = len(out) - 1  # the last token is not fed
    assert st.tokens == {"prompt": len(IDS), "generated": fed}
    assert st.routings["prompt"] == len(IDS) * spec.n_expert_used * len(spec.moe_layers)
    assert st.routings["generated"] == fed * spec.n_expert_used * len(spec.moe_layers)

    # an all-hot store (the same kernels: the same routing) counted as calibrate counts, call by call
    ref = load_model(model_path, device=DEVICE, dtype=DTYPE, store=StoreOptions(hot_fraction=1.0, miss_mode="zerocopy"))
    tap = RoutingTap(ref.experts, spec, ref.device, len(IDS), record=False)
    ref.experts = tap
    cache = ref.new_cache(64)
    tap.sides(np.zeros(len(IDS), dtype=bool))
    ref.forward(IDS, cache)
    for t in out[:-1]:
        tap.sides(np.ones(1, dtype=bool))
        ref.forward([t], cache)
    want = tap.counts()
    prof = learning.profile()
    assert np.allclose(prof.counts["prompt"], want[PROMPT]) and np.allclose(prof.counts["generated"], want[GENERATED])


def test_learning_moves_the_hot_set_to_the_traffic(model_path, tmp_path):
    """From a uniform start, requests teach the learner; between requests the hot set moves
    until no swap passes the hysteresis, and the experts the traffic uses most are then hot."""
    model = load(model_path, tmp_path, 0.25, "zerocopy", FOREVER)
    learning = start_learning(model, FOREVER, GEN_WEIGHT)
    store = model.experts
    session = Session(model, ctx=128)
    rng = np.random.default_rng(1)
    hot0 = store.hot.copy()
    for _ in range(4):
        prompt = rng.integers(0, model.spec.n_vocab, 24).tolist()
        list(generate(model, None, prompt, None, 4, stop_ids=(), session=session))
        learning.after_request(lambda: True)  # a request waiting: no step on its path
    assert learning.stats.replacements == 0 and (store.hot == hot0).all()
    while learning.idle(lambda: False):
        pass
    scores = learning.scores()
    assert learning.stats.experts_moved > 0 and learning.stats.bytes_moved > 0
    assert scores[store.hot].sum() > scores[hot0].sum()
    assert not plan_swaps_in_place(store.hot, scores, store.device_layout.units)
    for il in model.spec.moe_layers:  # per layer, the hot experts out-score the cold ones of their size
        same = [jl for jl, u in store.device_layout.units.items() if u == store.device_layout.units[il]]
        best_cold = max(scores[jl][~store.hot[jl]].max(initial=0) for jl in same)
        assert scores[il][store.hot[il]].min(initial=np.inf) * 1.1 >= best_cold


def test_engine_replaces_only_between_requests(model_path, tmp_path):
    """The engine thread moves experts after requests and while idle, never while one runs."""
    from sparkpack.runtime.server.engine import Engine, Job, SamplingOptions

    model = load(model_path, tmp_path, 0.25, "zerocopy", FOREVER)
    learning = start_learning(model, FOREVER, GEN_WEIGHT)
    store = model.experts
    seen: list[object] = []
    apply = store.apply_swaps

    def watched(swaps):
        seen.append(engine.running)
        return apply(swaps)
    store.apply_swaps = watched
    engine = Engine(Session(model, ctx=128), frozenset(), between=learning)
    done = threading.Semaphore(0)

    class Sink:
        def started(self, outcome):
            pass

        def token(self, token_id):
            assert engine.running is not None
            return False

        def end(self, outcome):
            done.release()

    rng = np.random.default_rng(2)
    for _ in range(3):
        engine.submit(Job(rng.integers(0, model.spec.n_vocab, 40).tolist(), 3, SamplingOptions(temperature=0), Sink()))
    for _ in range(3):
        assert done.acquire(timeout=120)
    engine.close()
    assert seen and all(r is None for r in seen) and learning.stats.requests == 3


def test_a_run_starts_from_the_profile_beside_the_model(synth_model, tmp_path, monkeypatch, capsys):
    """No profile: uniform placement, and the run writes one; the next run places from it and
    learns on. Another model's profile is refused in one line and left alone; --force replaces it."""
    model = tmp_path / "m.gguf"
    model.write_bytes(synth_model("qwen3moe", "Q4_K_M", skew=1.0).read_bytes())
    prof = tmp_path / "m.profile.json"
    args = [str(model), "--prompt-ids", ",".join(map(str, IDS)), "--max-tokens", "4", "--temperature", "0",
            "--hot-fraction", "0.5"]
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 0 and "uniform placement (no profile)" in err, err
    first = Profile.load(prof)
    assert first.decay is not None and first.tokens["prompt"] > 0 and first.decay.tokens_seen == len(IDS) + 3
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 0 and "profile m.profile.json" in err, err
    assert Profile.load(prof).decay.tokens_seen == 2 * (len(IDS) + 3)

    other = json.loads(prof.read_text())
    other["identity"]["header_hash"] = "sha256:" + "0" * 64
    prof.write_text(json.dumps(other))
    kept = prof.read_bytes()
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1 and "another model" in err and "--force" in err, err
    assert prof.read_bytes() == kept
    code, _, err = run_cli([*args, "--no-learn"], monkeypatch, capsys)  # read only: named, ignored, untouched
    assert code == 0 and "ignoring" in err and prof.read_bytes() == kept
    code, _, err = run_cli([*args, "--force"], monkeypatch, capsys)
    assert code == 0 and "uniform placement (no profile)" in err
    assert Profile.load(prof).decay.tokens_seen == len(IDS) + 3


@pytest.mark.parametrize("args,message", [
    (["-p", "hi", "--bootstrap", "auto"], "--bootstrap replays past sessions before serving: it needs --serve"),
    (["--serve", "--bootstrap", "auto", "--no-learn"], "cannot be combined with --no-learn"),
    (["--serve", "--bootstrap-background"], "--bootstrap-background needs --bootstrap"),
])
def test_learning_flag_misuse_is_one_line(synth_model, monkeypatch, capsys, args, message):
    code, _, err = run_cli([str(synth_model("qwen3moe")), *args], monkeypatch, capsys)
    assert code == 1 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3moe"])
def test_trace_records_what_was_learned(synth_model, tmp_path, arch):
    """``--trace-out``'s recorder, attached before any graph is captured (on a GPU: decode steps
    and, for qwen3moe, padded prefill calls replayed from graphs): one record per computed
    token, its side, and ids whose counts are exactly what the learner learned."""
    from sparkpack.calibrate.trace import read_trace
    from sparkpack.runtime.routing_trace import attach_trace

    model = load(synth_model(arch, "Q4_K_M", skew=1.0), tmp_path, 0.5, "auto", FOREVER)
    recorder = attach_trace(model, tmp_path / "t.trace")
    session = Session(model, ctx=128)
    if DEVICE == "cuda":
        session.warm_up()  # captures the graphs (with the recorder's copies in them)
    recorder.active = True
    learning = start_learning(model, FOREVER, GEN_WEIGHT)
    rng = np.random.default_rng(3)
    for n in (36, 7):  # a longer prompt (several padded calls on a GPU), then a short one
        prompt = rng.integers(0, model.spec.n_vocab, n).tolist()
        list(generate(model, None, prompt, None, 5, stop_ids=(), session=session))
        learning.after_request(lambda: False)
    tr = read_trace(recorder.close())
    prof = learning.profile()
    assert tr.n_tokens == recorder.tokens == sum(learning.stats.tokens.values())
    assert int(tr.generated.sum()) == learning.stats.tokens["generated"] == 8
    for side, mask in (("prompt", ~tr.generated), ("generated", tr.generated)):
        counts = np.zeros_like(prof.counts[side])
        for j, il in enumerate(tr.moe_layers):
            counts[il] = np.bincount(np.asarray(tr.ids[mask, j]).ravel(), minlength=tr.n_expert)
        assert np.allclose(counts, prof.counts[side]), side


@pytest.mark.slow
def test_a_chat_stopped_by_sigterm_writes_what_it_learned(synth_model, tmp_path):
    """spark-run's chat learns as it answers; SIGTERM (while it waits for the next line) ends it
    with 143 and the profile written."""
    import signal
    import subprocess
    import time

    from tests.procs import ENV, SPARK_RUN

    model = tmp_path / "m.gguf"
    model.write_bytes(synth_model("qwen3moe", "Q4_K_M", skew=1.0).read_bytes())
    proc = subprocess.Popen([*SPARK_RUN, str(model), "--hot-fraction", "0.5", "--device", "cpu", "--max-tokens", "3",
                             "--temperature", "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    proc.stdin.write("hello there\n")
    proc.stdin.flush()
    assert proc.stdout.readline()  # the reply's line; then input() waits for the next one
    time.sleep(0.5)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    prof = Profile.load(tmp_path / "m.profile.json")
    assert prof.tokens["prompt"] > 0 and prof.tokens["generated"] > 0
