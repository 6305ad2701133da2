"""The conversation cache's snapshots: a session's state at a call end made an entry, the
blocks of it that no entry holds copied out of the device into host slots (on a side stream),
and the order of those copies before the next request's device work.

Why apart from the cache (``runtime.conversation_cache``), which decides what a request resumes
from and what to keep: taking a state is one job, run on the engine thread right after a
request while the next may already be waiting behind it, with its own device ordering and its
own account of where its time goes (``last``, which the next request's split reports).
"""
from __future__ import annotations

import time

import torch

from sparkpack.formats.checksums import PACK_ALGORITHM, new_hasher

from .conversation_files import remove
from .conversation_folder import FolderTier
from .conversation_host import HostTier
from .conversation_index import Entry, Index, Part
from .generate import Session
from .sequence_state import Copier, block_keys, copy_blocks_out, take_own


class Snapshots:
    """Entries of ``index`` taken from sessions' states, their parts in ``host``'s slots (and
    queued to ``disk``'s folder), named under the model's ``key`` in blocks of ``block``
    positions. One side stream on ``device`` for every session's copies, so the last copy's
    event covers them all."""

    def __init__(self, index: Index, host: HostTier, disk: FolderTier | None, key: str, block: int,
                 device: torch.device):
        self.index, self.host, self.disk, self.key, self.block = index, host, disk, key, block
        self.device = device
        self.copier = Copier(device)
        self._pending = None  # the event of the last copies out of the device (None: none, or on the CPU)
        self._ordered = False  # the device's work is queued after them already
        self._kept: dict[str, float] = {}  # the engine thread's seconds in the last request end's snapshot, by phase

    def copies_running(self) -> bool:
        """Whether the last copies out of the device (the previous request's state) still run."""
        return self._pending is not None and not self._pending.query()

    def order_after_copies(self) -> None:
        """The device's next work after the last copies out of its rows (the host does not wait;
        ``copies_running`` still says whether they run)."""
        if self._pending is not None and not self._ordered:
            torch.cuda.current_stream(self.device).wait_event(self._pending)
            self._ordered = True

    def last(self) -> dict[str, float]:
        """The engine thread's seconds in the snapshot of the last request's end, by phase:
        ``state`` (finding it, its checkpoint's copy waited for), ``lock`` (the name hashed, the
        index's lock, which the writer's thread takes too), ``slots`` (the blocks' names, slots
        taken, evicting), ``wait`` (the copies before them), ``copies`` (queued), ``index``
        (entries, older turns, the folder's queue), and ``writes`` when no slot was free (the
        folder's queued files waited for, then the phases again). Why: on the GPU the turn right
        after a cold long one waited in the queue for this work, whose copies are asynchronous
        (issue 42, BENCHMARKS.md). Empty after a request whose state was not kept."""
        return dict(self._kept)

    def keep(self, pos: int | None, shared: bool, session: Session) -> None:
        """The session's state at ``pos`` (default: its exact end) as an entry: its blocks that no
        entry holds copied into free slots (on the device's side stream), its own part too. With
        no room, once more after the queued files are written (the slots they hold). A request's
        end (not ``shared``) is what ``last`` reports; a shared prefix's snapshot (a mark, within
        its request's prompt) is that request's own time."""
        phases: dict[str, float] = {}
        if not shared:
            self._kept = phases
        clock = _Phases(phases)
        if self._keep_once(pos, shared, session, clock) is False and self._wait_for_writes():
            clock.mark("writes")
            self._keep_once(pos, shared, session, clock)

    def forget_last(self) -> None:
        """A request ended without its state kept: ``last`` is empty."""
        self._kept = {}

    def _keep_once(self, pos: int | None, shared: bool, session: Session, clock: _Phases) -> bool | None:
        try:
            return self._snapshot(pos, shared, session, clock)
        finally:
            clock.mark("index")

    def _snapshot(self, pos: int | None, shared: bool, session: Session, clock: _Phases) -> bool | None:
        source = session.state_at(pos)
        pools = self.host.open(session=session)
        clock.mark("state")
        if source is None or pools is None:
            return
        tokens, cuts, saved = source
        pos = len(tokens)
        name = self._name(tokens)
        with self.index.lock:
            clock.mark("lock")
            e = self.index.entries.get(name)
            if e is not None and e.in_host:
                e.shared = e.shared or shared
                self.index.touch(e)
                return
            names = block_keys(self.key, tokens, cuts, self.block)
            own = f"{name}-own" if pools.own is not None else None
            for n in names + ([own] if own else []):
                if n not in self.index.parts:
                    self.index.parts[n] = Part(n, own=n == own)
            want = names + ([own] if own else [])
            self.host.hold(want)
            need = [i for i, n in enumerate(names) if self.index.parts[n].slot is None]
            own_need = own is not None and self.index.parts[own].slot is None  # (else a queued write still holds it)
            slots = self.host.take(pools.blocks, len(need)) if need else []
            own_slot = None
            if slots is not None and own_need:
                own_slot = self.host.take(pools.own, 1)
                if own_slot is None:
                    pools.blocks.give(slots)
                    slots = None
            clock.mark("slots")
            if slots is None:  # no room: the state is not kept in host memory
                self.host.release(want)
                self.index.stats.evictions += 1
                return False
            if self._pending is not None:
                self._pending.synchronize()  # (slots written below on the host may still be read)
            clock.mark("wait")
            with self.copier.side():
                copy_blocks_out(session.cache, pools, [(need[k], s) for k, s in enumerate(slots)], pos)
                if own_need:
                    take_own(session.cache, pools, own_slot[0], pos, saved)
                event = self.copier.event()
            self._pending, self._ordered = event, False
            clock.mark("copies")
            for k, s in enumerate(slots):
                p = self.index.parts[names[need[k]]]
                p.slot, p.event = s, event
            if own_need:
                p = self.index.parts[own]
                p.slot, p.event = own_slot[0], event
            if e is None:
                e = Entry(name, tuple(tokens), tuple(cuts), want, own is not None, shared=shared)
                self.index.entries[name] = e
            else:  # (a disk entry whose parts are in host memory again)
                e.parts, e.has_own = want, own is not None
            e.in_host = True
            e.shared = e.shared or shared
            if not shared:  # the same conversation's older turn, which this one extends
                for old in [o for o in self.index.entries.values() if not o.shared and o is not e and o.pos < e.pos
                            and tokens[:o.pos] == list(o.tokens)]:
                    self.drop(old)
            self.index.touch(e)
            if self.disk is not None and e.path is None:
                self.disk.queue(e)
        self.host.wake()

    def drop(self, e: Entry) -> None:
        """Forget ``e``: its holds, its file, the part files no other entry file names."""
        with self.index.lock:
            self.index.entries.pop(e.name, None)
            if e.in_host:
                e.in_host = False
                self.host.release(e.parts)
            if e.path is not None:
                remove(e.path)
                e.path = None
                self.disk.unname(e.parts)

    def _name(self, tokens) -> str:
        h = new_hasher(PACK_ALGORITHM)
        h.update(self.key.encode())
        h.update(memoryview(torch.tensor(list(tokens), dtype=torch.int64).numpy()))
        return h.hexdigest()

    def _wait_for_writes(self) -> bool:
        return self.disk is not None and self.disk.wait_for_writes()


class _Phases:
    """Adds the seconds since the last ``mark`` to ``into[phase]``."""

    def __init__(self, into: dict[str, float]):
        self.into, self.t = into, time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.into[phase] = self.into.get(phase, 0.0) + now - self.t
        self.t = now
