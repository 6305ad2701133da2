"""Prefix reuse across requests (``Session.prompt``): what is kept gives the bits of a fresh
session over the same tokens, for the three archs (DeltaNet states through checkpoints), on the
CPU in float32 and on the GPU (SPARKPACK_TEST_DEVICE=cuda on the GPU machine; skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch

from sparkpack.formats.memory import recurrent_state_bytes
from sparkpack.runtime.cache import Cache, RecurrentState, StateCheckpoints
from sparkpack.runtime.call_plan import call_end
from sparkpack.runtime.generate import Session, generate
from sparkpack.runtime.models import load_model
from tests.devices import open_model
from tests.marks import quick_first

CALL = 16  # prefill tokens per call: reuse happens at multiples of it
ARCHS = ["qwen3moe", "laguna", "qwen35moe"]


@pytest.fixture(autouse=True)
def _one_thread():
    """Three times faster on the shared 2-core CI machine (a tiny model's matmuls are too small
    for two threads); a fresh run and a reused prefix compare with the same thread count."""
    from tests.serve_proc import one_thread

    with one_thread():
        yield


def ids_of(seed: int, n: int, vocab: int = 1700) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("arch", quick_first(ARCHS))
def test_reused_prefix_gives_the_bits_of_a_fresh_session(synth_model, arch, device):
    """An agent's turns as successive requests: each turn's logits equal a fresh session's
    ``feed`` bit for bit, including a turn that diverges in the middle of the previous answer
    (clients re-render it), one that goes back before it, and a repeated request; the greedy
    tokens after a reused prefix are a fresh session's too."""
    model = open_model(synth_model(arch, "Q4_K_M" if device == "cuda" else "Q8_0"), device)
    session = Session(model, prefill_chunk=CALL, ctx=256)

    def fresh(ids: list[int]) -> torch.Tensor:
        return Session(model, prefill_chunk=CALL, ctx=256).feed(ids)

    turn1 = ids_of(1, 45)
    answer = list(generate(model, None, turn1, None, 12, stop_ids=(), session=session))
    assert session.reuse.exact == 32  # the rows of the two whole calls; the rest came from a partial call or decode
    turn2 = turn1 + answer[:5] + ids_of(2, 30)  # the answer re-rendered differently after 5 tokens
    turns = [turn2, turn2 + ids_of(3, 40), turn2[:40] + ids_of(4, 9), turn2[:40] + ids_of(4, 9)]
    reused = []
    for ids in turns:
        got = session.prompt(ids)
        assert torch.equal(got, fresh(ids)), f"turn of {len(ids)} tokens after reusing {session.reused}"
        assert session.cache.pos == len(ids) == len(session.fed)
        reused.append(session.reused)
    # the whole calls before each divergence: 45 -> 32; 80 -> 80; 40 -> 32; the same 49 -> 48
    assert reused == [32, 80, 32, 48]
    if session.reuse.recurrent:
        assert session.reuse.checkpoints.positions == [16, 32, 48]
    tail = list(generate(model, None, turns[1], None, 8, stop_ids=(), session=session))
    assert session.reused == 32  # back to the 49-token turn's last whole call before position 40
    assert tail == list(generate(model, None, turns[1], None, 8, stop_ids=(),
                                 session=Session(model, prefill_chunk=CALL, ctx=256)))


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("kv_type", ["auto", "q8_0"])
def test_rings_go_back_by_their_rows_or_by_a_copy_of_the_window(synth_model, kv_type, device):
    """Laguna's sliding-window layers keep rings (``KVCache.ring``) of ``window_rows`` rows: a
    request that goes back to a position whose window is still in them keeps the prefix as it
    is; one that goes back past it restores the window copied where the earlier prompt's exact
    rows ended; one that goes back farther, with no copy, starts over. Every turn's logits are a
    fresh session's bits."""
    from sparkpack.formats.memory import window_rows

    model = open_model(synth_model("laguna", "Q4_K_M" if device == "cuda" else "Q8_0"), device)

    def new() -> Session:
        return Session(model, prefill_chunk=CALL, ctx=2048, kv_type=kv_type)

    session = new()
    rings = [la for la in session.cache.layers if la.ring]
    rows = window_rows(model.window, 512)
    assert rings and all(la.ring_rows == rows for la in rings)
    first = ids_of(11, rows + 130)  # past the rings' rows
    session.prompt(first)
    exact = session.reuse.exact
    assert session.reuse.checkpoints.positions == [exact] and session.cache.keeps(exact)

    def turn(ids: list[int]) -> int:
        got = session.prompt(ids)
        assert torch.equal(got, new().feed(ids)), f"turn of {len(ids)} tokens after reusing {session.reused}"
        return session.reused

    second = first[:exact - 40] + ids_of(12, 9)
    assert turn(second) == exact - 48  # its window still in the rings: kept as it is
    back = session.reuse.exact
    assert session.reuse.checkpoints.positions == [back]
    assert turn(second + ids_of(13, rows)) == back  # pushes the second prompt's windows out of the rings
    assert not session.cache.keeps(back) and session.reuse.checkpoints.positions[0] == back
    turns = [second[:back + 3] + ids_of(14, 7), first[:100] + ids_of(15, 5)]
    assert turn(turns[0]) == back  # back to the second prompt's exact rows: its windows' copy
    assert turn(turns[1]) == 0  # far back, no copy: from the start
    tail = list(generate(model, None, turns[0], None, 6, stop_ids=(), session=session))
    assert tail == list(generate(model, None, turns[0], None, 6, stop_ids=(), session=new()))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_any_sequence_of_conversations_reuses_what_a_fresh_session_would(synth_model, arch):
    """Conversations of any lengths one after another in one session (a long one, then shorter
    ones: after compaction, ``/clear`` or a new session): each turn reuses what a session that
    saw only its own conversation reuses, with its bits and greedy answer. Laguna's rings past a
    longer sequence (issue 41: 0 tokens reused turn after turn) are the case that failed."""
    from sparkpack.formats.memory import window_rows

    model = load_model(synth_model(arch, "Q8_0"))

    def new() -> Session:
        return Session(model, prefill_chunk=CALL, ctx=2048)

    session = new()
    if arch == "laguna":  # the long conversation wraps the rings, the short ones do not
        rows = max(la.ring_rows for la in session.cache.layers if getattr(la, "ring", False))
        assert rows == window_rows(model.window, 512) < 700
    reused, alone = [], []
    for seed, length in ((30, 700), (40, 150), (50, 150), (60, 400), (70, 60)):
        own = new()  # the same conversation's turns only
        ids = ids_of(seed, length)
        for turn in range(3):
            got = session.prompt(ids)
            want = own.prompt(ids)
            assert torch.equal(got, want), f"conversation {seed}, turn {turn} after reusing {session.reused}"
            reused.append(session.reused)
            alone.append(own.reused if turn else 0)
            answer = list(generate(model, None, ids, None, 5, stop_ids=(), session=session))
            assert answer == list(generate(model, None, ids, None, 5, stop_ids=(), session=own))
            ids = ids + answer[:3] + ids_of(seed + turn + 1, 20)
    assert reused == alone and all(r > 0 for i, r in enumerate(reused) if i % 3), reused


def test_a_ring_grown_for_a_longer_call_keeps_the_window_before_it():
    """A wrapped ring that a call longer than it was sized for grows keeps the window before the
    call, each position in its new row, and vouches for no earlier position: after the sequence
    went back, rows of earlier positions may hold later ones of the sequence gone back from."""
    from sparkpack.formats.memory import window_rows
    from sparkpack.runtime.cache import KVCache

    window = 8
    ring = KVCache(64, window=window, calls=1)
    assert ring.ring_rows == window_rows(window, 1) == 128
    keys = torch.arange(1000, dtype=torch.float32)[:, None, None].expand(1000, 1, 4).contiguous()
    for p in range(0, 300, 10):  # wraps at 128
        ring.append(keys[p:p + 10], -keys[p:p + 10], p)
    assert ring.rows == 128 and ring.holds(300 - 128, 300) and not ring.holds(300 - 129, 300)
    pos = 290  # gone back to 290, rows of 290..299 are another sequence's: then a call of 200
    ring.reserve(pos + 200, keys[:1], 200)
    assert ring.rows == window_rows(window, 200) and ring.since == pos - window + 1
    for p in range(pos - window + 1, pos):
        assert ring.k[0, p % ring.rows, 0] == p and ring.v[0, p % ring.rows, 0] == -p
    assert ring.holds(pos - window + 1, pos) and not ring.holds(pos - window, pos)


@pytest.mark.slow
def test_an_eager_session_sizes_its_rings_for_whole_chunks(synth_model):
    """Where prompts go in whole chunks at any context (the CPU here), the rings are sized for
    them: a long prompt wraps them without growing them, so no window is given up."""
    from sparkpack.formats.memory import window_rows

    model = load_model(synth_model("laguna"))
    session = Session(model, prefill_chunk=256, ctx=4096)
    rings = [la for la in session.cache.layers if la.ring]
    assert rings and all(la.ring_rows == window_rows(model.window, 512) for la in rings)  # (a padded call's 512)
    session = Session(model, prefill_chunk=1024, ctx=4096)
    rings = [la for la in session.cache.layers if la.ring]
    assert all(la.ring_rows == window_rows(model.window, 1024) for la in rings)  # (a GPU would plan 512)
    session.prompt(ids_of(21, 2600))
    assert all(la.rows == window_rows(model.window, 1024) and la.since == 0 for la in rings)
    assert session.cache.keeps(2048)  # the window before the last whole call's start


BREAK = 5  # a stand-in for the chat template's control tokens (ids_of never draws it)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_call_ends_before_a_break_so_the_next_turn_keeps_nearly_all(synth_model, arch):
    """A turn's prompt ends a few tokens after a break (the assistant header): the call before it
    ends there, so the next turn, which repeats the prompt up to where the reply starts, keeps
    all but those few tokens instead of falling back to the last whole fixed-size call; the
    logits are still a fresh session's bits (one with the same breaks)."""
    model = load_model(synth_model(arch, "Q8_0"))
    breaks = frozenset({BREAK})
    session = Session(model, prefill_chunk=CALL, ctx=256, breaks=breaks)
    turn1 = ids_of(7, 20) + [BREAK] + ids_of(8, 22) + [BREAK] + ids_of(9, 2)
    session.prompt(turn1)
    # calls: [0,16) full; [16,20) ends at the break 4 tokens in (>= 16 // 8); [20,36) full, the
    # break at 20 being its first token; [36,43) ends at the second break; [43,46) still open
    assert session.reuse.cuts == [0, 16, 20, 36, 43] and session.reuse.exact == 43
    turn2 = turn1[:45] + ids_of(10, 12)
    got = session.prompt(turn2)
    assert session.reused == 43  # fixed calls alone would keep 32
    assert torch.equal(got, Session(model, prefill_chunk=CALL, ctx=256, breaks=breaks).feed(turn2))
    plain = Session(model, prefill_chunk=CALL, ctx=256)
    plain.prompt(turn1)
    plain.prompt(turn2)
    assert plain.reused == 32


@pytest.mark.parametrize("arch", ARCHS)
def test_a_call_end_at_the_first_differing_token_counts_only_if_the_new_ids_end_a_call_there(synth_model, arch):
    """A call of the previous prompt ended before a break token; the new prompt is the same up to
    that token and has another there, so a fresh session's call goes on past it: the rows before
    it are not the new prompt's, and the session keeps only up to the call end before."""
    from sparkpack.runtime.prefix_reuse import shared_len

    model = load_model(synth_model(arch, "Q8_0"))
    breaks = frozenset({BREAK})
    session = Session(model, prefill_chunk=CALL, ctx=256, breaks=breaks)
    turn1 = ids_of(7, 20) + [BREAK] + ids_of(8, 22)
    session.prompt(turn1)
    assert 20 in session.reuse.cuts
    turn2 = turn1[:20] + ids_of(9, 30)
    fresh = Session(model, prefill_chunk=CALL, ctx=256, breaks=breaks)
    assert session.reusable(turn2) == 16 and 20 not in fresh.cuts_of(turn2)
    assert torch.equal(session.prompt(turn2), fresh.feed(turn2)) and session.reused == 16
    assert shared_len(turn2, tuple(turn2[:2000] + [1])) == len(turn2)  # a list against a tuple


def test_call_ends_read_only_the_tokens_before_them():
    """The cuts of any prefix are the cuts of the whole sequence before its end (a cut at its
    very end may wait for the next token): what makes a kept prefix the rows a fresh session
    computes for a longer prompt."""
    def cuts(ids: list[int]) -> list[int]:
        out = [0]
        while (end := call_end(ids, out[-1], 16, frozenset({1, 2}))) <= len(ids):
            out.append(end)
        return out

    g = torch.Generator().manual_seed(11)
    for _ in range(50):
        ids = torch.randint(0, 12, (200,), generator=g).tolist()
        full = cuts(ids)
        for n in range(1, 200, 7):
            part = cuts(ids[:n])
            assert [c for c in part if c < n] == [c for c in full if c < n] and set(part) <= set(full)


def test_checkpoints_are_bounded_and_keep_old_prefixes_reachable(synth_model):
    """At most ``limit`` copies, each of at most ``recurrent_state_bytes``; the oldest survives
    (a later divergence far back still finds one) while the newest is never dropped."""
    model = load_model(synth_model("qwen35moe"))
    session = Session(model, prefill_chunk=8, ctx=256, checkpoints=4)
    ids = ids_of(5, 90)
    session.prompt(ids)
    kept = session.reuse.checkpoints.positions
    assert len(kept) == 4 and kept[0] == 8 and kept[-1] == 88, kept
    assert 0 < session.reuse.checkpoints.nbytes <= 4 * recurrent_state_bytes(model.spec)
    back = ids[:20] + ids_of(6, 5)
    assert torch.equal(session.prompt(back), Session(model, prefill_chunk=8, ctx=256).feed(back))
    assert session.reused == 8


def test_checkpoint_spacing_policy():
    """The victim is the interior copy whose neighbours are closest; the newest is never dropped."""
    cache = Cache([RecurrentState(torch.zeros(2, 3), torch.zeros(1, 2, 2))])
    cp = StateCheckpoints(limit=3)
    for pos in (10, 20, 30, 80, 90):
        cache.pos = pos
        cache.layers[0].ssm.fill_(pos)
        cp.save(cache)
    assert cp.positions == [10, 30, 90]
    cp.restore(cache, 30)
    assert cache.pos == 30 and int(cache.layers[0].ssm[0, 0, 0]) == 30
    cp.discard_after(10)
    assert cp.positions == [10]


def test_warm_up_allocates_every_checkpoint_buffer_and_the_copies_stay_exact(synth_model):
    """After the warm-up the session holds ``limit + 1`` checkpoint buffers (pinned on a GPU:
    slow to allocate inside a user's first prompt), a long prompt allocates none of its own, and
    a turn restored from those reused buffers gives a fresh session's bits."""
    model = load_model(synth_model("qwen35moe"))
    fresh = Cache([RecurrentState()])
    cp = StateCheckpoints(limit=2)
    cp.reserve(fresh)  # no state yet: nothing to size buffers by
    assert not cp.spare
    started = Cache([RecurrentState(torch.zeros(2, 3), torch.zeros(1, 2, 2))])
    off = StateCheckpoints(limit=0)  # checkpoints off (calibration's sessions): nothing is allocated
    off.reserve(started)
    assert not off.spare
    cp.reserve(started)
    assert len(cp.spare) == 3
    session = Session(model, prefill_chunk=8, ctx=256, checkpoints=4)
    session.warm_up()
    buffers = {id(t) for copy in session.reuse.checkpoints.spare for pair in copy if pair is not None for t in pair}
    assert len(session.reuse.checkpoints.spare) == 5 and not session.reuse.checkpoints.saved
    ids = ids_of(7, 90)
    session.prompt(ids)
    saved = session.reuse.checkpoints.saved
    used = {id(t) for copy in saved.values() for pair in copy if pair is not None for t in pair}
    assert len(session.reuse.checkpoints.saved) == 4 and used <= buffers
    back = ids[:50] + ids_of(8, 7)
    assert torch.equal(session.prompt(back), Session(model, prefill_chunk=8, ctx=256).feed(back))
