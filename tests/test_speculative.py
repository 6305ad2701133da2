"""Speculative decoding (``runtime.speculative``): a greedy run that drafts gives the plain run's
tokens, token for token, on every arch and residency, whatever the drafts (the prompt-lookup
drafter, and a forced drafter whose acceptance is set, so verify steps keep every length of
draft); the sequence is rolled back exactly (the logits after the run equal a plain session's);
sampled drafts keep the sampled distribution; the drafter protocol's hidden rows are the main
model's. ``SPARKPACK_TEST_DEVICE=cuda`` runs them on a GPU, verify steps captured."""
from __future__ import annotations

import os
import re

import pytest
import torch

from bench.forced_drafter import ForcedDrafter, known_continuation
from sparkpack.runtime.drafting import DraftLength, NgramDrafter
from sparkpack.runtime.generate import Session, generate
from sparkpack.runtime.models import StoreOptions, load_model
from sparkpack.runtime.sampling import Sampler
from sparkpack.runtime.speculative import Speculation
from tests.commands import drafted_stats, run_cli
from tests.marks import quick_first
from tests.serve_proc import replies_and_metrics

DEVICE = os.environ.get("SPARKPACK_TEST_DEVICE", "cpu")
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
ARCHS = ("qwen35moe", "laguna", "qwen3moe")
# a prompt that repeats itself, so prompt lookup finds matches
PROMPT = [5, 17, 23, 42, 8, 5, 17, 23, 42, 8, 5, 17, 61, 3, 5, 17, 23]
N = 16


def load(path, hot_fraction: float | None):
    store = None if hot_fraction is None else StoreOptions(hot_fraction=hot_fraction, miss_mode="async",
                                                           cache_slots=2)
    return load_model(path, device=DEVICE, dtype=DTYPE, store=store)


def drafting(model, drafter, k: int) -> Session:
    session = Session(model)
    session.draft = Speculation(drafter, k)
    return session


@pytest.mark.parametrize("arch", quick_first(ARCHS))
@pytest.mark.parametrize("hot_fraction", quick_first([1.0, 0.6, 0.1]))
def test_greedy_drafting_gives_the_plain_tokens(synth_model, arch, hot_fraction):
    """Drafts of a forced acceptance (kept and rejected ones: every rollback length) and prompt
    lookup (on a prompt holding a continuation the model wrote) give the plain greedy tokens;
    after the run the session holds what a plain session holds (its next logits are the same
    bits), so the rollbacks left no trace in the attention rows, DeltaNet states or rings."""
    model = load(synth_model(arch, "Q4_K_M", skew=1.0), hot_fraction)
    plain = list(generate(model, None, PROMPT, None, N, stop_ids=()))
    again = PROMPT + plain + PROMPT  # the model's own words in the prompt: prompt lookup finds them
    plain_session = Session(model)
    plain_again = list(generate(model, None, again, None, N, stop_ids=(), session=plain_session))
    after = plain_session.feed(again + plain_again)
    cases = [(PROMPT, plain, ForcedDrafter(known_continuation(PROMPT, plain), 0.6, model.spec.n_vocab, seed=1)),
             (again, plain_again, NgramDrafter())]
    for prompt, want, drafter in cases:
        session = drafting(model, drafter, k=4)
        got = list(generate(model, None, prompt, None, N, stop_ids=(), session=session))
        assert got == want, drafter.name
        st = session.draft.stats
        if drafter.name == "forced":
            assert 0 < st.accepted < st.drafted  # kept and rejected drafts: rollbacks happened
        else:
            assert torch.equal(session.feed(again + plain_again), after)


def test_sampled_drafting_keeps_the_distribution():
    """``Sampler.verify_draft``: over many draws, a drafted token judged by the rejection rule
    comes out with the sampler's probabilities (a wrong draft and a likely one alike)."""
    torch.manual_seed(0)
    logits = torch.randn(6) * 2
    sampler = Sampler(temperature=0.8, top_k=5, seed=3)
    p = torch.softmax(sampler.filtered_logits(logits.unsqueeze(0)), dim=-1)[0]
    n = 20000
    for draft in (int(p.argmax()), int(p.argmin()), 2):
        counts = torch.zeros(6)
        for _ in range(n):
            other = sampler.verify_draft(logits, draft)
            counts[draft if other is None else other] += 1
        freq = counts / n
        assert freq[p == 0].sum() == 0  # filtered tokens never come out
        assert torch.allclose(freq, p, atol=4 * (p * (1 - p) / n).sqrt().max().item() + 1e-3), (draft, freq, p)


def test_greedy_verify_at_temperature_zero_is_the_argmax():
    sampler = Sampler(temperature=0.0, repetition_penalty=1.3, seed=0)
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    assert sampler.verify_draft(logits, 1) is None
    assert sampler.verify_draft(logits, 2) == 1
    assert sampler.verify_draft(logits, 1, history=[1]) == 2  # the penalty moved the argmax


def test_sampled_drafting_runs_and_rolls_back(synth_model):
    """A sampled run that drafts: each token is a draw the rejection rule made, and the session
    ends holding what a plain session that decoded the same tokens holds (the same next logits)."""
    model = load(synth_model("qwen35moe", "Q4_K_M", skew=1.0), None)

    def greedy(tokens, k):  # the target's own greedy continuation of the sampled sequence
        return list(generate(model, None, list(tokens), None, k, stop_ids=()))

    session = drafting(model, ForcedDrafter(greedy, 0.8, model.spec.n_vocab), k=3)
    got = list(generate(model, None, PROMPT, Sampler(temperature=0.7, seed=4), N, stop_ids=(), session=session))
    assert len(got) == N and session.draft.stats.verify_steps > 0
    assert session.fed[:len(PROMPT) + N - 1] == PROMPT + got[:-1]
    reference = Session(model)  # the prompt, then the reply one decode step at a time
    for j in range(len(PROMPT), len(PROMPT) + N + 1):
        want = reference.feed((PROMPT + got)[:j])
    assert torch.equal(session.feed(PROMPT + got), want)


class HiddenRecorder:
    """A drafter that reads hidden rows and records them, proposing the known continuation."""

    name = "recorder"
    needs_hidden = True

    def __init__(self, oracle):
        self.oracle, self.rows, self.calls, self.rewinds = oracle, [], [], []

    def propose(self, tokens, k, hidden):
        self.calls.append((len(tokens), 0 if hidden is None else hidden.shape[0]))
        if hidden is not None:
            self.rows.append(hidden)
        out = self.oracle(tokens, k)
        return out[:1] + [0] * (len(out) - 1)  # the first kept, the rest rejected (mostly)

    def rewind(self, n_tokens):
        self.rewinds.append(n_tokens)


def test_hidden_rows_are_the_main_models_output_normed_rows(synth_model):
    """A drafter that reads hidden states gets, over its ``propose`` calls, one row per kept
    position in order (the prompt's first), each the main model's output-normed row there (the
    prompt's from its prefill call, ``forward_hidden``; a generated token's from its one-row
    decode step, whose kernels differ from a prefill call's on a GPU), and never a rejected row."""
    model = load(synth_model("qwen35moe", "Q4_K_M", skew=1.0), None)
    plain = list(generate(model, None, PROMPT, None, 12, stop_ids=()))
    recorder = HiddenRecorder(known_continuation(PROMPT, plain))
    session = drafting(model, recorder, k=3)
    assert list(generate(model, None, PROMPT, None, 12, stop_ids=(), session=session)) == plain
    for n_tokens, n_rows in recorder.calls:  # the rows before the last picked token, all handed over
        assert n_rows == 0 or sum(c[1] for c in recorder.calls if c[0] <= n_tokens) == n_tokens - 1
    rows = torch.cat(recorder.rows)
    fed = session.fed[:rows.shape[0]]
    cache = model.new_cache()
    _, prompt_rows = model.forward_hidden(fed[:len(PROMPT)], cache)
    want = torch.cat([prompt_rows] + [model.verify_rows([t], cache)[1] for t in fed[len(PROMPT):]])
    assert rows.shape == want.shape
    assert torch.allclose(rows.float(), want.float(), atol=1e-4, rtol=1e-4)
    # a next request keeping a prefix: the drafter is rewound to it and handed the rows after it
    again = PROMPT + plain[:5] + [7]
    recorder.calls, recorder.rows, recorder.rewinds = [], [], []
    list(generate(model, None, again, None, 3, stop_ids=(), session=session))
    kept = session.reused
    assert recorder.rewinds[0] == kept  # (the prompt's; each verify's after it) and recorder.calls[0] == (len(again) + 1, len(again) - kept)
    _, want = model.forward_hidden(again)
    assert torch.allclose(recorder.rows[0].float(), want[kept:].float(), atol=1e-4, rtol=1e-4)


def test_draft_length_follows_acceptance():
    rule = DraftLength(4)
    assert rule.k == 4
    rule.update(4, 1)
    assert rule.k == 3
    rule.update(3, 2)  # at least half kept: stays
    assert rule.k == 3
    rule.update(3, 3)
    assert rule.k == 4
    rule.update(4, 4)  # never past the maximum
    assert rule.k == 4
    for _ in range(6):
        rule.update(rule.k, 0)
    assert rule.k == 1  # never below one
    rule.update(0, 0)  # no draft: nothing learned
    assert rule.k == 1
    with pytest.raises(ValueError):
        DraftLength(0)


def test_ngram_drafter_follows_the_sequence():
    d = NgramDrafter()
    assert d.propose([1, 2, 3, 1, 2], 2) == [3, 1]
    assert d.propose([1, 2, 3, 1, 2, 3, 1], 3) == [2, 3, 1]
    assert d.propose([7, 8, 7], 2) == [8, 7]  # another sequence: the index starts over
    assert d.propose([9], 2) == []


@pytest.fixture(scope="module")
def chat_model(tiny_hf_gguf):
    return tiny_hf_gguf("qwen35moe")[1]


def echo_prompt() -> str:
    """A prompt that repeats text, as an agent quoting a file back does (prompt lookup's case)."""
    code = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n"
    return f"Here is the file:\n{code}\nRepeat it exactly:\n{code}"


@pytest.mark.parametrize("residency", quick_first([[], ["--hot-fraction", "0.6"], ["--hot-fraction", "0.1"]]))
def test_spark_run_draft_gives_the_plain_reply(chat_model, monkeypatch, capsys, tmp_path, residency):
    """``spark-run --draft ngram`` (and a forced draft length) prints the plain greedy reply, and its
    stats report the drafting."""
    base = [str(chat_model), "--raw", "-p", echo_prompt(), "--temperature", "0", "--max-tokens", "24", *residency]
    draft = drafted_stats(base, "ngram", 3, tmp_path / "stats.json", monkeypatch, capsys)
    assert draft["drafter"] == "ngram" and draft["verify_steps"] > 0 and 1 <= draft["k"] <= 3
    assert draft["drafted"] >= draft["accepted"] >= 0


ONE_SHOT = ["--raw", "-p", "hi", "--max-tokens", "2"]


@pytest.mark.parametrize("args, message", [
    ([*ONE_SHOT, "--draft", "mtp"], "has no multi-token-prediction head"),
    ([*ONE_SHOT, "--draft", "ngram", "--draft-tokens", "0"], "--draft-tokens"),
    ([*ONE_SHOT, "--draft", "magic"], "--draft"),
    (["--draft", "ngram", "--serve", "--parallel", "2"], "cannot be combined with --parallel"),
])
def test_bad_draft_options_are_one_line_errors(chat_model, monkeypatch, capsys, args, message):
    code, out, err = run_cli([str(chat_model), *args], monkeypatch, capsys)
    assert code != 0 and message in err and "Traceback" not in err


@pytest.mark.parametrize("residency", quick_first([[], ["--hot-fraction", "0.6"], ["--hot-fraction", "0.1"]]))
def test_server_draft_gives_the_plain_reply_and_metrics(chat_model, residency):
    """Through a real server and the official OpenAI client: ``--draft ngram`` answers with the
    plain server's greedy reply, and ``/metrics`` counts the drafting."""
    messages = [{"role": "user", "content": echo_prompt()}]
    replies, metrics = replies_and_metrics(chat_model, [[*residency], [*residency, "--draft", "ngram"]], lambda s: s.openai(
        ).chat.completions.create(model="x", messages=messages, max_tokens=24, temperature=0).choices[0].message.content)
    assert replies[0] == replies[1]
    steps = re.search(r"^sparkpack_draft_verify_steps_total (\S+)$", metrics, re.M)
    assert steps and float(steps.group(1)) > 0
    assert re.search(r"^sparkpack_draft_length \S+$", metrics, re.M)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("hot_fraction,slots", [(1.0, 0), (0.3, 6)])
def test_captured_verify_rows_are_the_captured_single_steps(synth_model, arch, hot_fraction, slots):
    """On a GPU: a verify step replayed from its CUDA graph (``VerifyGraphs``), and its capture
    run, give row for row the bits of the captured single decode steps (``DecodeGraph``) over
    the same tokens, also after a rollback; a greedy drafting run equals the plain one."""
    from sparkpack.runtime.graph import capturable

    model = load_model(synth_model(arch, "Q4_K_M", skew=1.0), device="cuda", dtype=torch.bfloat16,
                       store=StoreOptions(hot_fraction=hot_fraction, cache_slots=slots, miss_mode="zerocopy"))
    if not capturable(model):
        pytest.skip("not every expert layer has fused-kernel quant types")
    plain = Session(model, ctx=128)
    ids = list(PROMPT)
    want = [plain.feed(ids)]
    for _ in range(14):
        ids.append(int(torch.argmax(want[-1])))
        want.append(plain.feed(ids))
    assert plain.graph is not None and plain.graph.replays > 0
    session = Session(model, ctx=128)
    session.feed(PROMPT)
    at = len(PROMPT)
    for n, k in ((4, 2), (4, 4), (3, 1), (4, 3)):  # (rows, kept): captured, replayed, after rollbacks
        rows, _ = session.verify(ids[at:at + n])
        for i in range(n):
            assert torch.equal(rows[i], want[at - len(PROMPT) + i + 1]), (n, k, i)
        session.keep(k)
        at += k
    assert session.verify_graphs.replays >= 2 and session.verify_graphs.captures >= 2
    oracle = known_continuation(PROMPT, ids[len(PROMPT):])
    drafted = drafting(model, ForcedDrafter(oracle, 0.7, model.spec.n_vocab), k=3)
    got = list(generate(model, None, PROMPT, None, 14, stop_ids=(), session=drafted))
    assert got == ids[len(PROMPT):]
    assert drafted.verify_graphs is not None and drafted.verify_graphs.replays > 0


def test_vram_plan_counts_the_verify_rows_states(synth_model):
    """A drafting run's plan holds one more DeltaNet state per drafted token, and a session's row
    copies (after a verify step of the most rows) stay within it; ``--draft`` reaches the plan."""
    from sparkpack.formats.archs import model_spec
    from sparkpack.formats.gguf_file import GGUFModel
    from sparkpack.formats.memory import MemoryTarget, recurrent_state_bytes
    from sparkpack.formats.placement import Budget, plan_residency
    from sparkpack.runtime.options import run_options

    path = synth_model("qwen35moe", "Q4_K_M", skew=1.0)
    with GGUFModel(path) as m:
        spec = model_spec(m)
        target = MemoryTarget.gpu(spec, 512)
        budget = Budget(vram=1536 * 1024**2)
        off = plan_residency(spec, m.tensors, budget, target)
        on = plan_residency(spec, m.tensors, budget, MemoryTarget(**{**target.__dict__, "draft_tokens": 4}))
    assert off.state_bytes == recurrent_state_bytes(spec) > 0
    assert on.state_bytes == 5 * off.state_bytes and on.expert_budget == off.expert_budget - 4 * off.state_bytes
    assert run_options(path, device="cpu", hot_fraction=1.0, draft="ngram", draft_tokens=3).store.draft_tokens == 3
    assert run_options(path, device="cpu", hot_fraction=1.0, draft_tokens=3).store.draft_tokens == 0
    model = load(path, None)
    session = drafting(model, NgramDrafter(), k=4)
    session.feed(PROMPT)
    session.verify(PROMPT[:5])
    session.keep(2)
    copies = sum(t.nbytes for d in (session.row_states.conv, session.row_states.ssm) for t in d.values())
    assert 0 < copies <= 4 * recurrent_state_bytes(spec)


def test_pending_rows_follow_rewinds_and_resumes():
    """The rows a drafter has not been handed yet stay those of the kept positions, in order:
    cut where the sequence goes back, dropped past a resumed state's start."""
    rec = HiddenRecorder(lambda tokens, k: [])
    spec = Speculation(rec, 2)
    rows = torch.arange(10.0).unsqueeze(1)  # row i: position i
    spec.pending.append(rows[:6])  # a prompt of 6 tokens
    assert torch.equal(spec.hidden(), rows[:6]) and spec.pending_from == 6
    spec.kept(rows[6:9], 3)  # a verify kept positions 6..8
    spec.rewind(8)  # a next request keeps 8 tokens
    assert rec.rewinds[-1] == 8 and torch.equal(spec.hidden(), rows[6:8])
    spec.rewind(5)  # back into rows handed over: the drafter drops them itself
    assert rec.rewinds[-1] == 5 and spec.pending_from == 5 and spec.hidden() is None
    spec.start_at(40)  # a resumed state of 40 tokens: rows start there
    assert rec.rewinds[-1] == 0 and spec.pending_from == 40 and spec.hidden() is None
    spec.kept(rows[:2], 2)
    spec.rewind(41)
    assert torch.equal(spec.hidden(), rows[:1]) and spec.pending_from == 41
