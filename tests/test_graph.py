"""Decode steps replayed from a CUDA graph give the eager steps' bits, at any residency (GPU only:
run on the GPU machine with SPARKPACK_TEST_DEVICE=cuda; CI has no CUDA and skips them)."""
from __future__ import annotations

import pytest
import torch

from runtime.generate import Session
from runtime.graph import capturable
from runtime.models import StoreOptions, load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
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


@pytest.mark.parametrize("hot_fraction,slots,prefetch", [(1.0, 0, False), (0.3, 0, False), (0.3, 0, True),
                                                         (0.3, 6, True)])
def test_graph_replay_equals_eager(model_path, hot_fraction, slots, prefetch):
    model = load_model(model_path, device="cuda", dtype=torch.bfloat16,
                       store=StoreOptions(hot_fraction=hot_fraction, cache_slots=slots, mode="zerocopy",
                                          prefetch=prefetch))
    if not capturable(model):  # tiny shapes may give some layer a quant type without a fused kernel
        pytest.skip("not every expert layer has fused-kernel quant types")
    tok_g, log_g, s = greedy(model, True)
    assert s.graph is not None and s.graph.replays >= 10
    st = model.experts.stats
    assert (model.experts.n_prefetch > 0) == prefetch and (st.prefetched > 0) == prefetch
    assert st.hot_hits + st.cache_hits + st.prefetch_hits + st.misses == st.tokens * model.spec.n_expert_used * len(
        model.spec.moe_layers)
    tok_e, log_e, _ = greedy(model, False)
    assert tok_g == tok_e and torch.equal(log_g, log_e)
    ref = load_model(model_path, device="cuda", dtype=torch.bfloat16,
                     store=StoreOptions(hot_fraction=1.0, cache_slots=0, mode="zerocopy"))
    tok_r, log_r, _ = greedy(ref, True)
    assert tok_r == tok_g and torch.equal(log_r, log_g)


def test_graph_replay_with_a_q8_0_kv_cache_equals_eager(model_path):
    """The q8_0 cache's quantize-on-write and expand-on-read inside the captured step."""
    model = load_model(model_path, device="cuda", dtype=torch.bfloat16,
                       store=StoreOptions(hot_fraction=1.0, cache_slots=0, mode="zerocopy"))
    tok_g, log_g, s = greedy(model, True, kv_type="q8_0")
    assert s.graph is not None and s.graph.replays >= 10
    tok_e, log_e, _ = greedy(model, False, kv_type="q8_0")
    assert tok_g == tok_e and torch.equal(log_g, log_e)


def test_reset_keeps_the_graph_valid(model_path):
    """After a reset (a new sequence in the same buffers) the captured step replays the eager
    steps' bits. The prompt goes in two pieces (3 tokens, then 7): a prompt's first call attends
    through torch's fused attention and later calls through the unfused form, so the reference
    eager session is fed the same pieces."""
    model = load_model(model_path, device="cuda", dtype=torch.bfloat16,
                       store=StoreOptions(hot_fraction=0.5, mode="zerocopy", prefetch=True))

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


def test_decoding_past_ctx_captures_again_on_the_grown_buffers(model_path):
    """Past --ctx a step runs eagerly and the KV buffers double; the graph captured on the old
    buffers must not be replayed on stale memory."""
    model = load_model(model_path, device="cuda", dtype=torch.bfloat16,
                       store=StoreOptions(hot_fraction=0.5, mode="zerocopy", prefetch=True))
    tok_g, log_g, s = greedy(model, True, n=20, ctx=16)  # 10 prompt tokens + 20: one growth, to 32
    assert s.graph is not None and s.graph.captures == 2 and s.graph.replays > 10
    tok_e, log_e, _ = greedy(model, False, n=20, ctx=16)
    assert tok_g == tok_e and torch.equal(log_g, log_e)


@pytest.mark.parametrize("hot_fraction", [1.0, 0.3])
def test_programmatic_dependent_launch_changes_no_bit(model_path, hot_fraction, monkeypatch):
    """Kernels launched with PDL (Hopper: each starts while its predecessor drains, then waits for
    it) against the same steps launched plainly: same tokens, same logits, prefill and decode."""
    from runtime.kernels import pdl

    def run(flag: str):
        monkeypatch.setenv("SPARKPACK_PDL", flag)
        pdl.reset()
        model = load_model(model_path, device="cuda", dtype=torch.bfloat16,
                           store=StoreOptions(hot_fraction=hot_fraction, cache_slots=4, mode="zerocopy", prefetch=True))
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


@pytest.mark.parametrize("hot_fraction", [1.0, 0.3])
def test_decoding_one_step_ahead_gives_the_one_token_at_a_time_bits(model_path, hot_fraction):
    """``generate`` launches the step that feeds a token before the host reads that token
    (``Session.decode``): the tokens are those of eager steps fed one at a time, a stop token
    leaves the session fed up to and including it, and the next ``feed`` continues from there
    with the eager step's logits, also past ``ctx`` (where the steps fall back to eager ones)."""
    from runtime.generate import generate

    model = load_model(model_path, device="cuda", dtype=torch.bfloat16,
                       store=StoreOptions(hot_fraction=hot_fraction, cache_slots=2, mode="zerocopy"))
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
