"""Chunked prefill (``runtime.generate.PromptFeed``): a prompt fed a few call groups at a time,
other sessions of the model decoding between its advances (what ``--parallel``'s server does),
gives the bits of the one-shot ``Session.prompt``: the same logits, the same call ends, exact
rows and DeltaNet state copies, after a reused prefix, a conversation-cache resume and a staged
group; and a feed given up midway leaves a whole state that a later prompt keeps."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sparkpack.formats.archs import model_spec
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.runtime.conversation_cache import ConversationCache
from sparkpack.runtime.expert_source import GGUFExpertSource
from sparkpack.runtime.expert_store import ExpertStore
from sparkpack.runtime.generate import GENERATED, Session
from sparkpack.runtime.models import load_model
from tests.devices import open_model
from tests.marks import quick_first

CALL = 16
BLOCK = 32  # positions per conversation-cache block (tiny prompts would fit in one of the server's)
BREAK = 5  # a stand-in for the chat template's control tokens
ARCHS = ["qwen35moe", "laguna", "qwen3moe"]


def ids_of(seed: int, n: int) -> list[int]:
    return torch.randint(10, 1700, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def system(seed: int, n: int) -> list[int]:
    return [BREAK] + ids_of(seed, n) + [BREAK]  # one message: control tokens around its text


@pytest.fixture(autouse=True)
def _one_thread():
    from tests.serve_proc import one_thread

    with one_thread():
        yield


def new_session(model) -> Session:
    return Session(model, prefill_chunk=CALL, ctx=512, breaks=frozenset({BREAK}))


def chunked(session: Session, ids: list[int], budget: int, other: Session | None = None,
            marks: frozenset[int] = frozenset(), stop_after: int | None = None) -> tuple[torch.Tensor | None, list[int]]:
    """``session.prompt(ids)`` advanced ``budget`` tokens at a time, ``other`` taking a decode step
    between advances; the last logits (None when given up after ``stop_after`` advances) and the
    tokens each advance fed."""
    feed = session.start_prompt(ids, marks=marks)
    fed: list[int] = []
    while not feed.done:
        if stop_after is not None and len(fed) == stop_after:
            return None, fed
        fed.append(feed.advance(budget))
        assert session.fed == ids[:feed.pos] and session.cache.pos == feed.pos
        if other is not None:
            other.feed(other.fed + [int(other.fed[-1]) % 1000 + 10], GENERATED)
    return feed.logits, fed


def same_state(a: Session, b: Session) -> None:
    assert a.reuse.cuts == b.reuse.cuts and a.reuse.exact == b.reuse.exact and a.fed == b.fed
    if a.reuse.checkpoints is not None:
        assert a.reuse.checkpoints.positions == b.reuse.checkpoints.positions


def model_on(synth_model, arch: str, device: str):
    return open_model(synth_model(arch, "Q4_K_M" if device == "cuda" else "Q8_0"), device)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("arch", quick_first(ARCHS))
def test_a_chunked_prompt_gives_the_one_shot_bits(synth_model, arch, device):
    """Turns of a conversation (a reused prefix, a divergence, a repeat), each fed one-shot in one
    session and chunked in another while a third decodes between the chunks: the logits, call
    ends, exact rows and state copies are equal; a budget below a call still feeds one call, a
    budget of two calls feeds two. On CUDA (skipped without): captured prefill calls and
    decode steps, half residency."""
    model = model_on(synth_model, arch, device)
    one_shot, chunks, other = new_session(model), new_session(model), new_session(model)
    other.prompt(ids_of(9, 20))
    turn1 = system(1, 40) + ids_of(2, 30)
    turns = [(turn1, 1), (turn1 + ids_of(3, 45), 2 * CALL), (turn1[:50] + ids_of(4, 21), CALL + 1),
             (turn1[:50] + ids_of(4, 21), 5)]
    for ids, budget in turns:
        want = one_shot.prompt(ids)
        got, fed = chunked(chunks, ids, budget, other)
        assert torch.equal(got, want) and chunks.reused == one_shot.reused
        same_state(chunks, one_shot)
        assert sum(fed) == len(ids) - chunks.reused and len(fed) > 1 or len(ids) - chunks.reused <= CALL
        assert all(n <= max(budget, CALL) for n in fed), fed  # (a call is never cut: one call when it does not fit)
        if budget == 2 * CALL:
            assert max(fed) > CALL
    assert torch.equal(got, new_session(model).feed(ids))


@pytest.mark.parametrize("arch", quick_first(ARCHS))
def test_a_prompt_given_up_midway_leaves_a_state_a_later_prompt_keeps(synth_model, arch):
    """A feed stopped after a few advances (a client gone) leaves the session holding the tokens
    fed so far; the same prompt again keeps its exact rows and gives a fresh session's bits."""
    model = load_model(synth_model(arch))
    session = new_session(model)
    ids = ids_of(5, 90)
    _, fed = chunked(session, ids, CALL, stop_after=3)
    assert fed == [CALL] * 3 and session.fed == ids[:3 * CALL]
    logits, _ = chunked(session, ids, CALL)
    assert session.reused == 3 * CALL and torch.equal(logits, new_session(model).feed(ids))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("arch", quick_first(ARCHS))
def test_a_chunked_prompt_resumed_from_the_conversation_cache(synth_model, arch, device):
    """Two sessions sharing a conversation cache (as ``--parallel``'s do), every prompt chunked: a
    conversation's next turn in the other session resumes from the entry the first left, a shared
    first message's mark becomes an entry, a turn given up midway leaves an entry of its exact
    rows; every prompt's logits are a fresh session's."""
    model = model_on(synth_model, arch, device)
    a, b = new_session(model), new_session(model)
    cache = ConversationCache(a, 1 << 30, block=BLOCK)

    def ask(session: Session, ids: list[int], stop_after: int | None = None) -> tuple[int, str]:
        resume = cache.prepare(ids, session)
        logits, _ = chunked(session, ids, CALL, marks=resume.marks, stop_after=stop_after)
        if logits is not None:
            cache.after_prompt(ids, resume, session)
            assert torch.equal(logits, new_session(model).feed(ids))
        cache.request_ended(keep=True, session=session)
        return session.reused, resume.tier

    first = system(1, 60) + ids_of(2, 30)
    assert ask(a, first) == (0, "none")
    reused, tier = ask(b, first + ids_of(3, 40))
    assert tier == "host" and reused >= len(first) - CALL
    other = system(1, 60)[:-1] + [BREAK] + ids_of(7, 50)  # the same first message: its mark's entry
    reused, tier = ask(a, other)
    assert tier in ("host", "gpu") and reused >= 60, (reused, tier)
    given_up = ids_of(8, 100)
    ask(b, given_up, stop_after=4)
    assert any(e.pos == 4 * CALL and list(e.tokens) == given_up[:4 * CALL] for e in cache.entries.values())
    reused, tier = ask(a, given_up)
    assert (reused, tier) == (4 * CALL, "host")
    cache.close()


@pytest.mark.parametrize("arch", quick_first(["qwen35moe", "laguna"]))
def test_staged_groups_stay_whole(synth_model, arch):
    """Where the store stages, calls run in groups layer by layer: an advance runs whole groups
    (one when the budget holds less), the same groups as the one-shot prompt, with its bits."""
    gguf = GGUFModel(synth_model(arch, "Q4_K_M", skew=1.0))
    spec = model_spec(gguf)
    hot = np.zeros((spec.n_layer, spec.n_expert), dtype=bool)
    hot[list(spec.moe_layers), :spec.n_expert // 2] = True  # half of every MoE layer's experts on the "device"

    def staged_session() -> Session:
        model = load_model(gguf)
        store = ExpertStore(GGUFExpertSource(gguf, spec), spec, "cpu", torch.float32, hot, mode="zerocopy")
        store.staged_prefill = lambda n_tokens: n_tokens >= 2
        model.experts = model.store = store
        return Session(model, prefill_chunk=CALL, ctx=128, breaks=frozenset({BREAK}))

    one_shot, chunks = staged_session(), staged_session()
    assert chunks.plan.staged and chunks.plan.group_tokens == 128
    groups: list[int] = []
    forward_calls = chunks.model.forward_calls
    chunks.model.forward_calls = lambda c, *a: groups.append(len(c)) or forward_calls(c, *a)
    ids = ids_of(6, 200)
    got, fed = chunked(chunks, ids, 1)
    assert torch.equal(got, one_shot.prompt(ids)) and fed == [128, 72] and groups == [8, 5]
    same_state(chunks, one_shot)
