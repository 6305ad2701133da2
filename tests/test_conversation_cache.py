"""The conversation cache in process (``runtime.conversation_cache``, ``runtime.sequence_state``):
conversations taking turns in one session resume from their own states, a shared first message
is resumed from by a new conversation, through the host tier, the disk tier and after a restart,
and every turn's logits and greedy answer are a fresh session's bits; a bad file is ignored."""
from __future__ import annotations

import logging

import pytest
import torch

from sparkpack.runtime.conversation_cache import SUFFIX, ConversationCache
from sparkpack.runtime.generate import Session, generate
from sparkpack.runtime.models import load_model

CALL = 16
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
        self.cache = ConversationCache(self.session, ram, folder)

    def ask(self, ids: list[int]) -> tuple[int, str, list[int]]:
        resume = self.cache.prepare(ids)
        logits = self.session.prompt(ids, marks=resume.marks)
        self.cache.after_prompt(ids, resume)
        reused = self.session.reused
        assert torch.equal(logits, new_session(self.model).feed(ids)), f"{len(ids)} tokens after reusing {reused}"
        answer = list(generate(self.model, None, ids, None, 4, stop_ids=(), session=self.session))
        assert answer == list(generate(self.model, None, ids, None, 4, stop_ids=(), session=new_session(self.model)))
        self.cache.remember()
        return reused, resume.tier, answer


def system(seed: int, n: int) -> list[int]:
    return [BREAK] + ids_of(seed, n) + [BREAK]  # one message: control tokens around its text


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.slow
def test_conversations_taking_turns_resume_from_their_own_states(synth_model, arch, device, tmp_path):
    """On the CPU, and on the GPU (side-stream copies, pinned host memory, captured calls; the
    GPU machine runs it with CUDA, it skips without)."""
    from tests.devices import open_model

    model = open_model(synth_model(arch, "Q4_K_M" if device == "cuda" else "Q8_0"), device)
    served = Served(model, ram=1 << 30, folder=tmp_path)
    convs = {"A": system(1, 300) + ids_of(2, 40), "B": system(3, 200) + ids_of(4, 30), "side": system(5, 20)}
    seen: dict[str, list[int]] = {}
    order = ["A", "A", "side", "A", "B", "A", "B", "A"]
    for n, name in enumerate(order):
        ids = convs[name]
        reused, tier, answer = served.ask(ids)
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
    # each turn copied only its new rows: the last A turn's rows are A1's, A2's, ... chunks
    from sparkpack.runtime.sequence_state import Rows

    last = max(served.cache.entries.values(), key=lambda e: e.pos)
    assert max(len(p.chunks) for p in last.state.layers if isinstance(p, Rows)) >= 4
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
    # ... whose state shares the rows of that first message with A's (kept once in host memory)
    states = [e.state for e in again.cache.entries.values() if e.state is not None]
    assert again.cache.tier_counts()["host"][1] < sum(st.nbytes for st in states)


@pytest.mark.parametrize("arch", ["qwen35moe"])
def test_tiny_ram_evicts_and_recomputes_and_bad_files_are_ignored(synth_model, arch, tmp_path, caplog):
    model = load_model(synth_model(arch, "Q8_0"))
    served = Served(model, ram=1)  # nothing fits: every switch recomputes
    a, b = system(1, 100) + ids_of(2, 20), system(3, 100) + ids_of(4, 20)
    served.ask(a)
    served.ask(b)
    reused, tier, _ = served.ask(a + ids_of(5, 10))
    assert tier == "none" and reused == 0 and served.cache.stats.evictions >= 2
    # the disk tier: corrupt one file, truncate another, add a foreign one
    served = Served(model, ram=0, folder=tmp_path)
    served.ask(a)
    served.ask(b)
    served.cache.close()
    files = sorted(tmp_path.glob("*" + SUFFIX))
    assert len(files) >= 2
    for f in files:
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(data)
    (tmp_path / ("junk" + SUFFIX)).write_bytes(b"not a state")
    trunc = tmp_path / ("trunc" + SUFFIX)
    trunc.write_bytes(files[0].read_bytes()[:-100])
    with caplog.at_level(logging.WARNING, logger="sparkpack.cache"):
        again = Served(model, ram=0, folder=tmp_path)
        reused, tier, _ = again.ask(a + ids_of(5, 10))
    assert reused == 0 and tier == "none"
    text = caplog.text
    assert "junk" in text and "trunc" in text and "checksum" in text
