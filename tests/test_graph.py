"""Decode steps and prefill calls replayed from CUDA graphs give the eager calls' bits, at any
residency (GPU: run on the GPU machine with SPARKPACK_TEST_DEVICE=cuda; CI has no CUDA and skips
those). The padded prefill calls themselves (what a captured call computes) are also checked on
the CPU, eagerly."""
from __future__ import annotations

import pytest
import torch

from sparkpack.runtime.generate import Session
from sparkpack.runtime.graph import PREFILL_SIZES, PrefillGraphs, capturable, prefill_is_padded
from sparkpack.runtime.models import StoreOptions, load_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]


@pytest.fixture(scope="module", params=["qwen35moe", "qwen3moe", "laguna"])
def model_path(request, synth_model):
    return synth_model(request.param, "Q4_K_M", skew=1.0)


def greedy(model, graphs: bool, n: int = 12, ctx: int = 64, kv_type: str = "auto"
           ) -> tuple[list[int], torch.Tensor, Session]:
    session = Session(model, ctx=ctx, graphs=graphs, kv_type=kv_type)
    ids = list(PROMPT)
    logits = session.feed(ids)
    steps = []
    for _ in range(n):
        ids.append(int(torch.argmax(logits)))
        logits = session.feed(ids)
        steps.append(logits)
    return ids[len(PROMPT):], torch.stack(steps), session


@cuda
@pytest.mark.parametrize("hot_fraction,slots", [(1.0, 0), (0.3, 0), (0.3, 6)])
def test_graph_replay_equals_eager(model_path, hot_fraction, slots):
    model = load_model(model_path, device="cuda", dtype=torch.bfloat16,
                       store=StoreOptions(hot_fraction=hot_fraction, cache_slots=slots, miss_mode="zerocopy"))
    if not capturable(model):  # tiny shapes may give some layer a quant type without a fused kernel
        pytest.skip("not every expert layer has fused-kernel quant types")
    tok_g, log_g, s = greedy(model, True)
    assert s.graph is not None and s.graph.replays >= 10
    model.experts.flush()
    st = model.experts.stats
    assert st.hot_hits + st.cache_hits + st.misses == st.tokens * model.spec.n_expert_used * len(
        model.spec.moe_layers)
    tok_e, log_e, _ = greedy(model, False)
    assert tok_g == tok_e and torch.equal(log_g, log_e)
    ref = load_model(model_path, device="cuda", dtype=torch.bfloat16,
                     store=StoreOptions(hot_fraction=1.0, cache_slots=0, miss_mode="zerocopy"))
    tok_r, log_r, _ = greedy(ref, True)
    assert tok_r == tok_g and torch.equal(log_r, log_g)


@cuda
def test_graph_replay_with_a_q8_0_kv_cache_equals_eager(model_path):
    """The q8_0 cache's quantize-on-write and expand-on-read inside the captured step."""
    model = load_model(model_path, device="cuda", dtype=torch.bfloat16,
                       store=StoreOptions(hot_fraction=1.0, cache_slots=0, miss_mode="zerocopy"))
    tok_g, log_g, s = greedy(model, True, kv_type="q8_0")
    assert s.graph is not None and s.graph.replays >= 10
    tok_e, log_e, _ = greedy(model, False, kv_type="q8_0")
    assert tok_g == tok_e and torch.equal(log_g, log_e)


@cuda
def test_reset_keeps_the_graph_valid(model_path):
    """After a reset (a new sequence in the same buffers) the captured step replays the eager
    steps' bits. The prompt goes in two pieces (3 tokens, then 7): pieces are padded calls of
    their own (all-attention models) or attend differently from a whole prompt (torch's fused
    attention from position 0 on qwen35moe), so the reference eager session is fed the same pieces."""
    model = load_model(model_path, device="cuda", dtype=torch.bfloat16,
                       store=StoreOptions(hot_fraction=0.5, miss_mode="zerocopy"))

    def pieces(session: Session) -> tuple[list[int], torch.Tensor]:
        ids = list(PROMPT)
        session.feed(ids[:3])
        logits = session.feed(ids)
        steps = []
        for _ in range(12):
            ids.append(int(torch.argmax(logits)))
            logits = session.feed(ids)
            steps.append(logits)
        return ids[len(PROMPT):], torch.stack(steps)

    _, _, session = greedy(model, True)
    graph = session.graph
    session.feed([7, 8, 9])  # not an extension: a new sequence in the same buffers
    tok_g, log_g = pieces(session)
    tok_e, log_e = pieces(Session(model, ctx=64, graphs=False))
    assert session.graph is graph and graph.replays >= 20 and tok_g == tok_e and torch.equal(log_g, log_e)


@cuda
def test_decoding_past_ctx_captures_again_on_the_grown_buffers(model_path):
    """Past --ctx a step runs eagerly and the KV buffers double; the graph captured on the old
    buffers must not be replayed on stale memory."""
    model = load_model(model_path, device="cuda", dtype=torch.bfloat16,
                       store=StoreOptions(hot_fraction=0.5, miss_mode="zerocopy"))
    tok_g, log_g, s = greedy(model, True, n=20, ctx=16)  # 10 prompt tokens + 20: one growth, to 32
    assert s.graph is not None and s.graph.captures == 2 and s.graph.replays > 10
    tok_e, log_e, _ = greedy(model, False, n=20, ctx=16)
    assert tok_g == tok_e and torch.equal(log_g, log_e)


@cuda
@pytest.mark.parametrize("hot_fraction", [1.0, 0.3])
def test_programmatic_dependent_launch_changes_no_bit(model_path, hot_fraction, monkeypatch):
    """Kernels launched with PDL (Hopper: each starts while its predecessor drains, then waits for
    it) against the same steps launched plainly: same tokens, same logits, prefill and decode."""
    from sparkpack.runtime.kernels import pdl

    def run(flag: str):
        monkeypatch.setenv("SPARKPACK_PDL", flag)
        pdl.reset()
        model = load_model(model_path, device="cuda", dtype=torch.bfloat16,
                           store=StoreOptions(hot_fraction=hot_fraction, cache_slots=4, miss_mode="zerocopy"))
        on = pdl.enabled(torch.empty(0, device="cuda"))
        tokens, logits, _ = greedy(model, True, n=16)
        return on, tokens, logits

    try:
        on, tok_p, log_p = run("1")
        off, tok_n, log_n = run("0")
    finally:
        pdl.reset()
    if not on:
        pytest.skip("PDL needs a Hopper or newer GPU and a Triton with griddepcontrol")
    assert not off and tok_p == tok_n and torch.equal(log_p, log_n)


@cuda
@pytest.mark.parametrize("hot_fraction", [1.0, 0.3])
def test_decoding_one_step_ahead_gives_the_one_token_at_a_time_bits(model_path, hot_fraction):
    """``generate`` launches the step that feeds a token before the host reads that token
    (``Session.decode``): the tokens are those of eager steps fed one at a time, a stop token
    leaves the session fed up to and including it, and the next ``feed`` continues from there
    with the eager step's logits, also past ``ctx`` (where the steps fall back to eager ones)."""
    from sparkpack.runtime.generate import generate

    model = load_model(model_path, device="cuda", dtype=torch.bfloat16,
                       store=StoreOptions(hot_fraction=hot_fraction, cache_slots=2, miss_mode="zerocopy"))
    if not capturable(model):  # as test_graph_replay_equals_eager
        pytest.skip("not every expert layer has fused-kernel quant types")
    tok_e, log_e, _ = greedy(model, False, n=20, ctx=16)
    session = Session(model, ctx=16)  # 10 prompt tokens + 20: one growth, to 32
    assert list(generate(model, None, PROMPT, None, 20, stop_ids=(), session=session)) == tok_e
    assert session.timing.ahead_steps > 0 and session.graph.captures == 2
    assert session.timing.capture_seconds > 0 and session.timing.decode_tokens + 2 <= 19  # captures apart
    assert session.fed == PROMPT + tok_e[:-1]
    assert torch.equal(session.feed(PROMPT + tok_e), log_e[-1])
    first = next((i for i in range(2, 18) if tok_e[i] not in tok_e[:i]), None)  # a token new at i
    assert first is not None, "the tiny model repeats one token: no stop token to try"
    session = Session(model, ctx=64)
    assert list(generate(model, None, PROMPT, None, 20, stop_ids=[tok_e[first]], session=session)) == tok_e[:first]
    assert session.fed == PROMPT + tok_e[:first + 1] and session.timing.ahead_steps == first
    assert torch.equal(session.feed(PROMPT + tok_e[:first + 2]), log_e[first + 1])


def eager_prefill(model, prompts: list[list[int]], ctx: int) -> tuple[list[torch.Tensor], Session]:
    """Each prompt fed whole into one cache by plain ``forward`` calls (no padding)."""
    session = Session(model, ctx=ctx)
    session.prefill = None
    return [session.feed(p) for p in prompts], session


def padded_feeds(model, prompts: list[list[int]], ctx: int, capture: bool) -> tuple[list[torch.Tensor], Session]:
    """The same through ``PrefillGraphs`` (every prompt extends the previous one)."""
    session = Session(model, ctx=ctx, graphs=capture)
    session.prefill = PrefillGraphs(model, session.cache, capture)
    return [session.feed(p) for p in prompts], session


@pytest.mark.parametrize("arch", ["qwen3moe", "laguna"])
def test_a_prefill_is_padded_call_computes_the_real_tokens_alone(synth_model, arch):
    """Padded prefill calls run eagerly on the CPU: padded to 16 and 32 tokens with the first
    position and the real count read from tensors, they give the unpadded calls' logits (to
    float32 round-off: the products have other shapes), write the same KV rows, advance the cache
    by the real tokens only, and the expert store counts the real tokens' routings alone, at
    partial residency with cache slots. A longer extension goes in calls of at most 512 tokens
    (512, then 8 padded to 16) where the plain session makes one call. (On the CPU attention and
    routing counts take the torch forms; the GPU kernels of a captured call are tested on CUDA
    below and in test_attention_kernel / test_kernels.)"""
    path = synth_model(arch, "Q4_K_M", skew=1.0)
    opts = StoreOptions(hot_fraction=0.5, cache_slots=2, miss_mode="zerocopy")
    prompts = [PROMPT[:3], PROMPT, PROMPT + list(range(40, 57))]  # 3 -> 16, 7 -> 16, 17 -> 32
    prompts.append(prompts[-1] + [3 + i % 89 for i in range(520)])
    ref_model, pad_model = load_model(path, store=opts), load_model(path, store=opts)
    want, ref = eager_prefill(ref_model, prompts, 64)
    got, pad = padded_feeds(pad_model, prompts, 64, capture=False)
    assert [PrefillGraphs.size(n) for n in (1, 2, 16, 17, 500, 512, 513)] == [None, 16, 16, 32, 512, 512, None]
    assert PREFILL_SIZES[-1] == 512 and pad.cache.pos == ref.cache.pos == 547
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.allclose(g, w, rtol=1e-4, atol=1e-4)
    for la, lb in zip(pad.cache.layers, ref.cache.layers):
        assert torch.allclose(la.k[:, :547], lb.k[:, :547], rtol=1e-4, atol=1e-4)
    pad_model.experts.flush()
    ref_model.experts.flush()
    a, b = pad_model.experts.stats, ref_model.experts.stats
    # (cache hits and misses split differently: the store promotes experts between calls, and the
    # padded session makes one call more)
    assert a.tokens == b.tokens == 547 and a.hot_hits == b.hot_hits
    assert a.cache_hits + a.misses == b.cache_hits + b.misses


def test_padding_that_would_grow_the_kv_cache_runs_eagerly(synth_model):
    """A call whose real tokens fit the KV buffers but whose padding would not is left to the
    eager path: padding never doubles the cache."""
    model = load_model(synth_model("qwen3moe", "Q4_K_M"), store=StoreOptions(hot_fraction=1.0, miss_mode="zerocopy"))
    session = Session(model, ctx=16)
    graphs = PrefillGraphs(model, session.cache, capture=False)
    assert graphs.feed(PROMPT) is not None and session.cache.pos == 10  # 16 positions: fits
    assert graphs.feed(PROMPT[:5]) is None and session.cache.pos == 10  # 15 real, padded to 26
    assert all(la.k.shape[1] == 16 for la in session.cache.layers)


@cuda
@pytest.mark.parametrize("hot_fraction", [1.0, 0.3])
def test_captured_prefill_replays_the_eager_padded_calls(model_path, hot_fraction):
    """Prefill calls replayed from their graphs give the bits of the same padded calls run
    eagerly, and so does the decode after them: several sizes; a size replayed for new tokens at
    a new position; a reset; a KV growth, after which a size captured on the old buffers is
    captured again. Every residency gives the all-hot bits, results are within bf16 round-off of
    unpadded calls, and the store's device counts hold the real tokens' routings alone. (Staging
    off: a staging store runs the calls it stages eagerly, in groups; it too gives these bits.)"""
    model = load_model(model_path, device="cuda", dtype=torch.bfloat16,
                       store=StoreOptions(hot_fraction=hot_fraction, cache_slots=2, miss_mode="zerocopy", stage_tokens=None))
    session = Session(model, ctx=64)
    if not prefill_is_padded(model, session.cache):
        assert model.arch == "qwen35moe" or not capturable(model)
        assert session.prefill is None
        pytest.skip("prefill calls are padded on all-attention models with a capturable store only")
    first = PROMPT[::-1] + list(range(70, 90))
    seqs = [[PROMPT[:4], PROMPT + list(range(50, 70))],  # 4 tokens -> 16 at 0, 26 -> 32 at 4
            [first[:5], first,  # 5 -> 16 at 0 (a replay), 25 -> 32 at 5 (a replay at a new position)
             first + list(range(5, 45)),  # 40 -> 64 at 30: past ctx, the buffers grow
             first + list(range(5, 48))]]  # 3 -> 16 at 70: captured again on the grown buffers

    def run(capture: bool, m=model) -> tuple[torch.Tensor, Session]:
        s = Session(m, ctx=64, graphs=capture)
        out = []
        for prompts in seqs:
            s.reset()
            out += [s.feed(p) for p in prompts]
            ids = list(prompts[-1])
            for _ in range(4):
                ids.append(int(torch.argmax(out[-1])))
                out.append(s.feed(ids))
        return torch.stack(out), s

    got, s = run(True)
    assert (s.prefill.captures, s.prefill.replays) == (4, 2)  # 16, 32, then 64 and 16 on the grown buffers
    model.experts.flush()
    st = model.experts.stats
    assert st.tokens == sum(len(p[-1]) + 4 for p in seqs)
    assert st.hot_hits + st.cache_hits + st.misses == st.tokens * model.spec.n_expert_used * len(model.spec.moe_layers)
    want, _ = run(False)
    assert torch.equal(got, want)
    if hot_fraction < 1.0:
        ref = load_model(model_path, device="cuda", dtype=torch.bfloat16,
                         store=StoreOptions(hot_fraction=1.0, cache_slots=0, miss_mode="zerocopy"))
        assert torch.equal(run(True, ref)[0], got)
        staging = load_model(model_path, device="cuda", dtype=torch.bfloat16,
                             store=StoreOptions(hot_fraction=hot_fraction, cache_slots=2, miss_mode="zerocopy"))
        staged, s = run(True, staging)
        staging.experts.flush()
        assert staging.experts.stats.staged_layers > 0 and s.prefill.captures == 2  # 16, again after the growth (32, 64 stage)
        assert torch.equal(staged, got)
    plain, _ = eager_prefill(model, seqs[0], 64)
    for g, w in zip(got[:2], plain):
        assert (g.float() - w.float()).norm() < 3e-2 * w.float().norm()


@cuda
def test_warm_up_captures_before_the_prompt_and_changes_no_bit(model_path):
    """After ``Session.warm_up`` a prompt and its reply run on graphs captured beforehand (no
    capture inside the user's prompt or first decode step), with the bits of an unwarmed session."""
    model = load_model(model_path, device="cuda", dtype=torch.bfloat16,
                       store=StoreOptions(hot_fraction=0.5, cache_slots=4, miss_mode="zerocopy"))
    tok_ref, log_ref, _ = greedy(model, True, ctx=1024)
    warm = Session(model, ctx=1024)
    warm.warm_up()
    if warm.prefill is not None:  # (sizes a staging store stages run eagerly)
        assert warm.prefill.captures == sum(1 for s in PREFILL_SIZES
                                            if s + 1 <= 1022 and not model.experts.staged_prefill(s))
    captures = (warm.graph.captures if warm.graph is not None else 0,
                warm.prefill.captures if warm.prefill is not None else 0)
    ids = list(PROMPT)
    logits = warm.feed(ids)
    steps = []
    for _ in range(12):
        ids.append(int(torch.argmax(logits)))
        logits = warm.feed(ids)
        steps.append(logits)
    assert ids[len(PROMPT):] == tok_ref and torch.equal(torch.stack(steps), log_ref)
    assert (warm.graph.captures if warm.graph is not None else 0,
            warm.prefill.captures if warm.prefill is not None else 0) == captures
    assert warm.timing.capture_seconds == 0
