"""What lies on a request's path right after a long turn (issue 42: on the GPU the turn after a
cold 40k-token turn took 2.2x a plain turn of the same conversation).

- The request continuing the live sequence uses the live state (no restore) and its device work
  is queued after the copies out of the previous turn's state instead of beside them, on the CPU
  with a stand-in for the device's streams, on the GPU with copies slowed down on purpose; the
  host never waits for them.
- The conversation cache's background threads count the seconds of their pieces, which the
  server's per-request split reads (``runtime.server.request_split``).
"""
from __future__ import annotations

import threading

import pytest
import torch

from sparkpack.runtime import conversation_snapshot as snap
from sparkpack.runtime.conversation_cache import ConversationCache
from sparkpack.runtime.conversation_host import Activity
from sparkpack.runtime.generate import Session

BLOCK = 32  # positions per block (tiny prompts would fit in one of the server's)
BREAK = 5  # a stand-in for the chat template's control tokens (calls end before them)


def new_session(model) -> Session:
    return Session(model, prefill_chunk=16, ctx=2048, breaks=frozenset({BREAK}))


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(10, 1700, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(autouse=True)
def _one_thread():
    from tests.serve_proc import one_thread

    with one_thread():
        yield


def turns() -> tuple[list[int], list[int]]:
    """A long first turn and the next turn of its conversation (the reply, a new user message)."""
    first = [BREAK] + tokens(1, 300) + [BREAK] + tokens(2, 200)  # a system message, then the user's
    return first, first + tokens(3, 2) + [BREAK] + tokens(4, 30)


def request(cache: ConversationCache, ids: list[int]):
    resume = cache.prepare(ids)
    logits = cache.session.prompt(ids, marks=resume.marks)
    cache.after_prompt(ids, resume)
    return resume, logits


class Copies:
    """The copies out's event as the device would give it: still running until ``done``."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class Stream:
    """The device's current stream: records what its next work is ordered after."""

    def __init__(self):
        self.after: list[Copies] = []

    def wait_event(self, event: Copies) -> None:
        self.after.append(event)


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3moe"])
def test_the_next_turn_uses_the_live_state_after_the_copies_out(synth_model, arch, monkeypatch):
    """The turn after a long one keeps the live sequence's rows (no entry restored, nothing
    recomputed) and its device work is ordered after the previous turn's copies out (which ran
    beside it before: the restore path already waited for them, the live path did not); the
    host waits for neither. Its logits are a fresh session's bits."""
    from sparkpack.runtime.models import load_model

    model = load_model(synth_model(arch))
    cache = ConversationCache(new_session(model), 1 << 30, block=BLOCK)
    events: list[Copies] = []

    def event() -> Copies:
        events.append(Copies())
        return events[-1]

    monkeypatch.setattr(cache.snapshots.copier, "event", event)
    stream = Stream()
    monkeypatch.setattr(snap.torch.cuda, "current_stream", lambda device=None: stream)
    first, second = turns()
    request(cache, first)
    cache.request_ended(keep=True)  # the first turn's state: copied out, still running
    assert events and cache.copies_running()
    resume, logits = request(cache, second)
    assert resume.entry is None and resume.tier == "gpu"  # the live state, not a restore
    assert cache.session.reused >= len(first) - 16
    assert stream.after == [events[-1]]  # queued after the copies out (the last event covers them all)
    assert not events[-1].done  # the host did not wait for them
    assert torch.equal(logits, new_session(model).feed(second))
    cache.request_ended(keep=True)
    cache.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU machine runs it)")
def test_on_the_gpu_the_next_turn_waits_for_the_copies_out_on_the_device_only(synth_model, monkeypatch):
    """The copies out of the first turn's state made slow on purpose (a sleep on their side
    stream before them): the next turn's prepare returns while they still run, and the
    device's stream it computes on is queued behind them; the turn's logits are a fresh
    session's bits."""
    from tests.devices import open_model

    model = open_model(synth_model("qwen35moe", "Q4_K_M"), "cuda")
    cache = ConversationCache(new_session(model), 1 << 30, block=BLOCK)
    real, record = snap.copy_blocks_out, cache.snapshots.copier.event
    events = []

    def slow(*args):  # (on the side stream: the copies start after a second or so of products)
        x = torch.ones(8192, 8192, device="cuda")
        for _ in range(40):
            x @ x
        real(*args)

    def event():
        events.append(record())
        return events[-1]

    monkeypatch.setattr(snap, "copy_blocks_out", slow)
    monkeypatch.setattr(cache.snapshots.copier, "event", event)
    first, second = turns()
    request(cache, first)
    torch.cuda.synchronize()
    cache.request_ended(keep=True)
    assert cache.copies_running()
    pending = events[-1]
    resume = cache.prepare(second)
    assert resume.entry is None and not pending.query()  # the live state; the host did not wait
    assert not torch.cuda.current_stream().query()  # the device's next work waits for the copies
    logits = cache.session.prompt(second, marks=resume.marks)
    cache.after_prompt(second, resume)
    assert pending.query()
    fresh = new_session(model).feed(second)
    assert torch.equal(logits, fresh)
    cache.request_ended(keep=True)
    cache.close()


def test_activity_counts_the_piece_in_flight():
    """A piece still running counts up to the moment it is read; a finished one in full."""
    activity = Activity()
    started, release = threading.Event(), threading.Event()

    def work():
        with activity.piece():
            started.set()
            release.wait()

    t = threading.Thread(target=work)
    t.start()
    started.wait()
    a = activity.seconds()
    b = activity.seconds()
    assert 0 < a <= b
    release.set()
    t.join()
    done = activity.seconds()
    assert done >= b and activity.seconds() == done  # nothing in flight: it no longer grows


def test_the_writer_counts_its_files_and_waits_while_a_request_computes(synth_model, tmp_path):
    """The writer's files are pieces of its activity: none while another request computes,
    seconds once none does (what a request's split reads as the work beside it)."""
    import time

    from sparkpack.runtime.models import load_model

    model = load_model(synth_model("qwen3moe"))
    cache = ConversationCache(new_session(model), 1 << 30, tmp_path, block=BLOCK)
    first, _ = turns()
    cache.prepare(first)  # another request computing (``--parallel``)
    request(cache, first)
    cache.request_ended(keep=True)
    time.sleep(0.3)
    assert cache.disk.activity.seconds() == 0
    cache.request_ended(keep=False)
    cache.close()
    assert cache.disk.activity.seconds() > 0 and cache.background_seconds() >= cache.disk.activity.seconds()
