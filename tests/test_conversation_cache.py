"""The conversation cache in process (``runtime.conversation_cache``, ``runtime.sequence_state``):
conversations taking turns in one session resume from their own states, a shared first message
is resumed from by a new conversation, through the host tier, the disk tier and after a restart,
and every turn's logits and greedy answer are a fresh session's bits; a bad file is ignored."""
from __future__ import annotations

import logging

import pytest
import torch

from sparkpack.runtime import conversation_snapshot as snap
from sparkpack.runtime.conversation_cache import ConversationCache
from sparkpack.runtime.conversation_files import BLOCK_SUFFIX, BLOCKS, SUFFIX
from sparkpack.runtime.generate import Session, generate
from sparkpack.runtime.models import load_model

CALL = 16
BLOCK = 32  # positions per block (the server's are longer: tiny prompts would fit in one)
ARCHS = ["qwen3moe", "laguna", "qwen35moe"]
BREAK = 5  # a stand-in for the chat template's control tokens


@pytest.fixture(autouse=True)
def _one_thread():
    from tests.serve_proc import one_thread

    with one_thread():
        yield


def ids_of(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1700, (n,), generator=g).tolist()


def new_session(model) -> Session:
    return Session(model, prefill_chunk=CALL, ctx=2048, breaks=frozenset({BREAK}))


class Served:
    """What the engine does around a request (``runtime.server.engine``), checked against a
    fresh session: logits bits and greedy answer."""

    def __init__(self, model, ram: int, folder=None):
        self.model = model
        self.session = new_session(model)
        self.cache = ConversationCache(self.session, ram, folder, block=BLOCK)

    def ask(self, ids: list[int]) -> tuple[int, str, list[int]]:
        resume = self.cache.prepare(ids)
        logits = self.session.prompt(ids, marks=resume.marks)
        self.cache.after_prompt(ids, resume)
        reused = self.session.reused
        assert torch.equal(logits, new_session(self.model).feed(ids)), f"{len(ids)} tokens after reusing {reused}"
        answer = list(generate(self.model, None, ids, None, 4, stop_ids=(), session=self.session))
        assert answer == list(generate(self.model, None, ids, None, 4, stop_ids=(), session=new_session(self.model)))
        self.cache.request_ended(keep=True)
        check_index(self.cache)
        return reused, resume.tier, answer


def check_index(cache: ConversationCache) -> None:
    """The refcounts: a part in host memory is held by each host entry naming it (and each write
    queued), a slot is either free or one part's, and the pools' bytes stay within the budget."""
    index, host = cache.index, cache.host
    with index.lock:
        held: dict[str, int] = {}
        for e in index.entries.values():
            for n in e.parts if e.in_host else ():
                held[n] = held.get(n, 0) + 1
        for n, p in index.parts.items():
            assert p.refs - p.queued == held.get(n, 0), (n, p)
            assert (p.slot is not None) == (p.refs > 0), (n, p)
        if host.pools is not None:
            for pool, own in ((host.pools.blocks, False), (host.pools.own, True)):
                if pool is not None:
                    slots = [p.slot for p in index.parts.values() if p.own == own and p.slot is not None]
                    assert len(set(slots)) == len(slots) == pool.used and not set(slots) & set(pool.free)
        assert host.budget.allocated <= host.budget.limit

def system(seed: int, n: int) -> list[int]:
    return [BREAK] + ids_of(seed, n) + [BREAK]  # one message: control tokens around its text


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.slow
def test_conversations_taking_turns_resume_from_their_own_states(synth_model, arch, device, tmp_path, monkeypatch):
    """On the CPU, and on the GPU (side-stream copies, pinned host memory, captured calls; the
    GPU machine runs it with CUDA, it skips without)."""
    from tests.devices import open_model

    model = open_model(synth_model(arch, "Q4_K_M" if device == "cuda" else "Q8_0"), device)
    copied: list[int] = []
    real = snap.copy_blocks_out

    def counting(cache, pools, pairs, pos):  # how many blocks each state copies out of the device
        copied.append(len(pairs))
        real(cache, pools, pairs, pos)

    monkeypatch.setattr(snap, "copy_blocks_out", counting)
    served = Served(model, ram=1 << 30, folder=tmp_path)
    convs = {"A": system(1, 300) + ids_of(2, 40), "B": system(3, 200) + ids_of(4, 30), "side": system(5, 20)}
    seen: dict[str, list[int]] = {}
    order = ["A", "A", "side", "A", "B", "A", "B", "A"]
    for n, name in enumerate(order):
        ids = convs[name]
        before = len(copied)
        reused, tier, answer = served.ask(ids)
        if name == "A" and name in seen:  # a later turn copies its new blocks (and those it and a mark end in)
            assert 0 < sum(copied[before:]) <= (len(ids) - len(seen["A"])) // BLOCK + 4 < len(ids) // BLOCK, \
                copied[before:]
        if name in seen and name != "side":
            prev = seen[name]
            # the previous turn's prompt but the tail after its last whole call
            assert reused >= max(c for c in served.session.cuts_of(prev) if c < len(prev)) - 1 and reused > 0, \
                (n, name, reused)
        seen[name] = ids
        convs[name] = ids + answer[:2] + [BREAK] + ids_of(10 + n, 25)
    served.cache.close()  # (the files written)
    counts = served.cache.tier_counts()
    assert counts["host"][0] >= 3 and counts["disk"][0] == counts["host"][0]
    assert served.cache.stats.hits >= 3
    # a restart: a new session and cache over the folder resume the last turn of A from disk
    served.cache.close()
    again = Served(model, ram=1 << 30, folder=tmp_path)
    reused, tier, _ = again.ask(convs["A"])
    assert tier == "disk" and reused >= len(seen["A"]) - CALL
    # a second conversation with A's first message: resumed from the end of that message
    other = system(1, 300) + ids_of(99, 30)
    reused, tier, _ = again.ask(other)
    assert reused >= 300 - CALL, reused
    # ... whose state shares the blocks of that first message with A's (kept once in host memory)
    host = [e for e in again.cache.entries.values() if e.in_host]
    named = [n for e in host for n in e.parts]
    assert len(set(named)) <= len(named) - 300 // BLOCK + 1, (len(set(named)), len(named))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen35moe"])
def test_tiny_ram_evicts_and_recomputes_and_bad_files_are_ignored(synth_model, arch, tmp_path, caplog):
    model = load_model(synth_model(arch, "Q8_0"))
    served = Served(model, ram=1)  # nothing fits: every switch recomputes
    a, b = system(1, 100) + ids_of(2, 20), system(3, 100) + ids_of(4, 20)
    served.ask(a)
    served.ask(b)
    reused, tier, _ = served.ask(a + ids_of(5, 10))
    assert tier == "none" and reused == 0 and served.cache.stats.evictions >= 2
    # the disk tier: every part corrupted, an entry file truncated, a file not ours
    served = Served(model, ram=0, folder=tmp_path)
    served.ask(a)
    served.ask(b)
    served.cache.close()
    entries = sorted(tmp_path.glob("*" + SUFFIX))
    parts = sorted((tmp_path / BLOCKS).glob("*" + BLOCK_SUFFIX))
    assert len(entries) >= 2 and len(parts) > len(entries)
    for f in parts:
        data = bytearray(f.read_bytes())
        data[-100] ^= 0xFF  # (in the tensors' bytes)
        f.write_bytes(data)
    (tmp_path / ("junk" + SUFFIX)).write_bytes(b"not a state")
    trunc = tmp_path / ("trunc" + SUFFIX)
    trunc.write_bytes(entries[0].read_bytes()[:-10])
    with caplog.at_level(logging.WARNING, logger="sparkpack.cache"):
        again = Served(model, ram=0, folder=tmp_path)
        reused, tier, _ = again.ask(a + ids_of(5, 10))
    assert reused == 0 and tier == "none"
    text = caplog.text
    assert "junk" in text and "trunc" in text and "checksum" in text and BLOCK_SUFFIX in text


@pytest.mark.slow
def test_eviction_keeps_the_blocks_other_entries_share(synth_model, tmp_path, caplog):
    """A host tier of about one conversation and a half: two conversations with one system
    prompt share its blocks, a third pushes entries out; every turn is a fresh run's bits, the
    refcounts stay right (``check_index``), and a part that belongs to another model is ignored."""
    model = load_model(synth_model("qwen3moe", "Q8_0"))
    probe = Served(model, ram=1 << 30)
    a, b, c = system(1, 300) + ids_of(2, 40), system(1, 300) + ids_of(3, 40), system(7, 300) + ids_of(4, 40)
    probe.ask(a)
    ram = probe.cache.host.pools.blocks.slot_bytes * (len(a) // BLOCK + 6)
    served = Served(model, ram=ram, folder=tmp_path / "states")
    served.ask(a)
    reused, tier, _ = served.ask(b)
    assert reused >= 300 - CALL  # the system prompt A computed (here still in the GPU cache)
    host = [e for e in served.cache.entries.values() if e.in_host]
    named = [n for e in host for n in e.parts]
    assert len(host) == 2 and len(set(named)) <= len(named) - 300 // BLOCK + 1
    served.ask(c)
    assert served.cache.stats.evictions >= 1
    for ids in (a, b, c, a):
        served.ask(ids + ids_of(len(ids), 20))  # (bits checked in ``ask``)
    served.cache.close()
    # a part of another model under a part's name: ignored with one line, the prompt computed
    part = sorted((tmp_path / "states" / BLOCKS).glob("*" + BLOCK_SUFFIX))[0]
    raw = bytearray(part.read_bytes())
    at = raw.index(served.cache.key.encode())
    raw[at: at + 8] = b"00000000"
    part.write_bytes(raw)
    with caplog.at_level(logging.WARNING, logger="sparkpack.cache"):
        again = Served(model, ram=ram, folder=tmp_path / "states")
        for ids in (a, b, c):
            again.ask(ids + ids_of(len(ids), 20) + ids_of(9, 5))
    assert caplog.text.count("another model") == 1 and str(part) in caplog.text


def test_the_folder_is_written_only_while_no_request_computes(synth_model, tmp_path):
    """A kept state's files wait while another request computes (``quiet``: an agent's next
    request comes right after the last reply, and the writes used to run beside it), and are
    written once none does; ``close`` writes what is queued."""
    import time

    model = load_model(synth_model("qwen3moe", "Q8_0"))
    session = new_session(model)
    cache = ConversationCache(session, 1 << 30, tmp_path, block=BLOCK)
    ids = system(1, 100) + ids_of(2, 20)
    cache.prepare(ids)  # a second request in flight (``--parallel``): it has not ended yet
    resume = cache.prepare(ids)
    session.prompt(ids, marks=resume.marks)
    cache.after_prompt(ids, resume)
    cache.request_ended(keep=True)  # its state kept and queued; the other request still computes
    time.sleep(0.5)  # (long enough for the writer to write a tiny model's files, were it free to)
    assert not list(tmp_path.glob("*" + SUFFIX))
    cache.request_ended(keep=False)
    cache.close()
    assert len(list(tmp_path.glob("*" + SUFFIX))) == 1


def _request(cache: ConversationCache, session: Session, ids: list[int], keep: bool = True):
    """A request as the engine runs it, without its reply (``Served.ask`` checks the bits)."""
    resume = cache.prepare(ids)
    session.prompt(ids, marks=resume.marks)
    cache.after_prompt(ids, resume)
    cache.request_ended(keep=keep)
    return resume


PHASES = {"state", "lock", "slots", "wait", "copies", "index"}


def test_the_previous_snapshot_is_the_last_request_ends(synth_model):
    """``last_keep``, which the next request's split reports by phase, is the snapshot of the
    last request's end: a shared prefix's snapshot taken within a later prompt (a mark) is that
    request's own time and leaves it as it was; a request whose state is not kept empties it."""
    model = load_model(synth_model("qwen35moe", "Q8_0"))
    session = new_session(model)
    cache = ConversationCache(session, 1 << 30, block=BLOCK)
    _request(cache, session, system(7, 40) + ids_of(8, 20))
    before = cache.last_keep()
    assert set(before) == PHASES and all(s >= 0 for s in before.values()), before
    a = system(1, 100) + ids_of(2, 20)
    resume = cache.prepare(a)
    session.prompt(a, marks=resume.marks)
    cache.after_prompt(a, resume)
    assert resume.marks and len(cache.entries) == 3  # the first message's state kept on the way...
    assert cache.last_keep() == before  # ... and not counted as the previous request's end
    cache.request_ended(keep=True)
    assert set(cache.last_keep()) == PHASES and cache.last_keep() != before
    _request(cache, session, a + ids_of(3, 10), keep=False)
    assert cache.last_keep() == {}
    cache.close()


def test_a_snapshot_waiting_for_the_folders_writes_says_so(synth_model, tmp_path):
    """A host tier of four blocks and another request computing (so the writer waits): the second
    state's slots are held by the first one's queued files, its snapshot waits for them, and
    that wait is a phase of the previous snapshot (``writes``) beside the others."""
    model = load_model(synth_model("qwen3moe", "Q8_0"))
    session = new_session(model)
    probe = ConversationCache(session, 1 << 30, block=BLOCK)
    c = system(7, 40) + ids_of(8, 20)  # two blocks kept
    _request(probe, session, c)
    slot = probe.host.pools.blocks.slot_bytes
    probe.close()
    session = new_session(model)
    cache = ConversationCache(session, 4 * slot, tmp_path, block=BLOCK)
    cache.prepare(ids_of(9, 20))  # another request (``--parallel``) computes until the end
    _request(cache, session, c)
    assert set(cache.last_keep()) == PHASES and not list(tmp_path.glob("*" + SUFFIX))  # (queued)
    a = system(1, 100) + ids_of(2, 20)  # four blocks: only once c's files are written
    _request(cache, session, a)
    assert set(cache.last_keep()) == PHASES | {"writes"}, cache.last_keep()
    assert [e.pos for e in cache.entries.values() if e.in_host] == [max(session.cuts_of(a))]
    cache.request_ended(keep=False)
    cache.close()


def test_a_host_tier_smaller_than_a_context_still_keeps_states(synth_model):
    """The reserve of free slots (a context's blocks) tops up the own parts' few slots first: a
    budget smaller than the blocks' reserve went to free block slots, and a state, which needs
    its own part (DeltaNet's recurrent states here), was never kept."""
    model = load_model(synth_model("qwen35moe", "Q8_0"))
    session = new_session(model)
    probe = ConversationCache(session, 1 << 30, block=BLOCK)
    c = system(7, 40) + ids_of(8, 20)
    _request(probe, session, c)
    pools = probe.host.pools
    ram = 8 * pools.blocks.slot_bytes + 3 * pools.own.slot_bytes  # the reserve wants 64 blocks
    probe.close()
    session = new_session(model)
    cache = ConversationCache(session, ram, block=BLOCK)
    _request(cache, session, c)
    assert any(e.in_host for e in cache.entries.values()) and cache.stats.evictions == 0
    reused = session.reused
    _request(cache, session, ids_of(11, 30))  # another conversation
    _request(cache, session, c + ids_of(12, 10))  # back: resumed from the host tier
    assert cache.stats.hits == 1 and session.reused >= len(c) - CALL > reused
    cache.close()


def test_host_memory_that_cannot_be_had_is_no_room(monkeypatch):
    """A slab the host cannot pin (out of memory) is as if over budget: ``grow`` says no and the
    budget gets its claim back (it kept it, and the snapshot that asked raised, failing the
    request and every later one that resumed the same entry)."""
    from sparkpack.runtime import host_pool

    budget = host_pool.HostBudget(1 << 20)
    pool = host_pool.SlotPool([((4, 8), torch.float32)], budget, pin=False)

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(host_pool, "pinned_empty", out_of_memory)
    assert not pool.grow() and budget.allocated == 0 and pool.take(1) is None
    monkeypatch.undo()
    assert pool.take(2) is not None and budget.allocated > 0


def test_the_writer_goes_on_after_an_unexpected_failure(synth_model, tmp_path, monkeypatch, caplog):
    """A part's file failing with something other than an OSError (a bug, the device failing the
    copy it waits for) is logged; the writer thread goes on with the next entry, so a snapshot
    that waits for the queued files (no free slot) does not wait forever."""
    from sparkpack.runtime import conversation_folder

    model = load_model(synth_model("qwen3moe", "Q8_0"))
    session = new_session(model)
    real, calls = conversation_folder.write_part, []

    def first_fails(*args, **kwargs):
        calls.append(args[2])
        if len(calls) == 1:
            raise ValueError("a bug")
        real(*args, **kwargs)

    monkeypatch.setattr(conversation_folder, "write_part", first_fails)
    cache = ConversationCache(session, 1 << 30, tmp_path, block=BLOCK)
    with caplog.at_level(logging.ERROR, logger="sparkpack.cache"):
        _request(cache, session, system(7, 40) + ids_of(8, 20))
        cache.disk.wait_for_writes()
    assert "writing a conversation state failed" in caplog.text
    _request(cache, session, system(1, 100) + ids_of(2, 20))
    cache.close()
    assert len(list(tmp_path.glob("*" + SUFFIX))) == 1 and len(calls) > 2  # the second entry's files
    check_index(cache)


def test_the_background_work_waits_for_the_request_ends_snapshot(synth_model, tmp_path, monkeypatch):
    """The reserve's thread and the writer work while no request computes (``quiet``); a
    request's end snapshot is still its work: ``quiet`` is set after it, not before (the slabs
    and files then ran beside it while the next request queued behind it)."""
    model = load_model(synth_model("qwen3moe", "Q8_0"))
    session = new_session(model)
    cache = ConversationCache(session, 1 << 30, tmp_path, block=BLOCK)
    seen: list[bool] = []
    real = snap.copy_blocks_out

    def watching(*args):
        seen.append(cache.quiet.is_set())
        real(*args)

    monkeypatch.setattr(snap, "copy_blocks_out", watching)
    _request(cache, session, system(7, 40) + ids_of(8, 20))
    assert seen == [False] and cache.quiet.is_set()
    cache.close()


def test_the_background_work_waits_for_a_calm_moment():
    """``Quiet.wait`` returns once no request has computed for ``calm`` seconds in a row: a
    request that begins and ends meanwhile starts the calm over; ``at_once`` (the engine waits
    for the threads itself, or nothing has run yet) lets them through without it."""
    import threading
    import time

    from sparkpack.runtime.conversation_quiet import Quiet

    def returns(quiet: Quiet, within: float = 5.0) -> bool:
        """Whether ``wait`` returns within ``within`` seconds (well before a calm of a minute)."""
        waiter = threading.Thread(target=quiet.wait, daemon=True)
        waiter.start()
        waiter.join(within)
        return not waiter.is_alive()

    slow = Quiet(calm=60)
    assert returns(slow)  # nothing has computed yet
    slow.clear()
    slow.set()
    assert not returns(slow, within=1.0)  # a request just ended
    slow.set(at_once=True)
    assert returns(slow)

    quiet = Quiet(calm=2.0)
    quiet.clear()
    done: list[float] = []
    waiter = threading.Thread(target=lambda: (quiet.wait(), done.append(time.monotonic())))
    waiter.start()
    quiet.set()  # a request ended...
    time.sleep(0.2)
    quiet.clear()  # ... the next came right after
    assert not done  # (well within the calm)
    time.sleep(0.1)
    again = time.monotonic()
    quiet.set()
    waiter.join(20)
    assert done and done[0] - again >= 2.0 - 0.01, (done, again)  # the calm counted from the last end


def test_a_turn_replaced_while_its_files_wait_is_not_written(synth_model, tmp_path, monkeypatch):
    """Files wait for a calm moment; an agent's quick turns replace each other meanwhile (a turn's
    entry drops the older one it extends): the writer, waiting inside the dropped turn's files,
    stops there (it wrote them all and then deleted them, holding their slots until then),
    writes the surviving turn's, and the folder holds that turn alone, which a restart resumes."""
    from sparkpack.runtime import conversation_folder

    model = load_model(synth_model("qwen35moe", "Q8_0"))
    session = new_session(model)
    written: list[str] = []
    real = conversation_folder.write_part

    def counting(path, key, name, pool, slot):
        written.append(name)
        real(path, key, name, pool, slot)

    monkeypatch.setattr(conversation_folder, "write_part", counting)
    cache = ConversationCache(session, 1 << 30, tmp_path, block=BLOCK)
    cache.prepare(ids_of(9, 20))  # another request computes: the writer waits
    first = ids_of(8, 100)  # (no message break: no shared-prefix entry queued before it)
    _request(cache, session, first)
    second = first + ids_of(10, 40)
    _request(cache, session, second)  # the same conversation's next turn: the first's entry goes
    cache.request_ended(keep=False)
    cache.close()
    kept = [e for e in cache.entries.values() if e.path is not None]
    assert len(kept) == 1 and sorted(tmp_path.glob("*" + SUFFIX)) == [kept[0].path]
    # the dropped turn's own part (its DeltaNet states) was never written, nor any part twice
    owns = [n for n in written if n.endswith("-own")]
    assert len(owns) == 1 and len(written) == len(set(written)), written
    again = ConversationCache(new_session(model), 1 << 30, tmp_path, block=BLOCK)
    resume = again.prepare(second + ids_of(11, 10))
    assert resume.tier == "disk"  # (a restart: the surviving turn, read from its files)
    again.session.prompt(second + ids_of(11, 10), marks=resume.marks)
    assert again.session.reused >= len(second) - CALL
    again.request_ended(keep=False)
    again.close()
