"""The conversation cache's host tier: the pinned slot pools its parts live in, the reserve of free
slots a thread keeps topped up, and the holds on parts that decide when a slot goes back.

Why a class of its own: which slots are free and who holds them is one job (a slot is either free
or one part's, a part's slot goes back when its last hold does), whatever the entries mean; the
cache (``runtime.conversation_cache``) asks it for slots and says which entries hold which parts,
the folder tier (``runtime.conversation_folder``) reads parts into slots it takes here.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from .conversation_index import Entry, Index, Part
from .conversation_quiet import Quiet
from .generate import Session
from .host_pool import HostBudget, Layout, SlotPool
from .sequence_state import SequenceState, StatePools, blocks_of, state_pools

OWN_RESERVE = 2  # free own-part slots the reserve keeps


class Activity:
    """The seconds a background thread has spent on its pieces of work (a slab, a file), readable
    at any moment with the piece in flight counted up to then. Why: what the cache does beside a
    request is invisible in the request's own timing, and a turn right after a long one was
    slower than a plain turn with its cause unmeasured (issue 42); the server's per-request split reads
    the difference over the request (``runtime.server.request_split``)."""

    def __init__(self) -> None:
        self._done = 0.0
        self._since: float | None = None
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def piece(self) -> Iterator[None]:
        with self._lock:
            self._since = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self._done += time.perf_counter() - self._since
                self._since = None

    def seconds(self) -> float:
        """Seconds worked so far, the piece in flight included."""
        with self._lock:
            return self._done + (time.perf_counter() - self._since if self._since is not None else 0.0)


class HostTier:
    """The slots of ``session``'s states, within ``ram_bytes`` (0: parts only pass through host
    memory on their way to and from the folder; ``spills``: there is a folder to pass to).
    Leaving the host tier, an entry without a file is forgotten unless it ``spills``."""

    def __init__(self, index: Index, session: Session, ram_bytes: int, block: int, spills: bool,
                 quiet: Quiet):
        self.index = index
        self.quiet = quiet  # the reserve grows only once no request has computed for a moment
        self.session = session
        self.ram_bytes = ram_bytes
        self.block = block
        self.spills = spills
        self.budget = HostBudget(ram_bytes)
        self.pools: StatePools | None = None
        self._reserve_blocks = 0
        self._closing = False
        self._want = threading.Event()  # the reserve may need topping up
        self._reserver: threading.Thread | None = None
        self.activity = Activity()  # the reserve thread's slabs

    def open(self, known: Callable[[], tuple[Layout, Layout]] | None = None,
             session: Session | None = None) -> StatePools | None:
        """The pools, made once the cache's layers hold their first token (on a GPU, after the
        warm-up: at start-up) or, before, from the layouts ``known`` reads (an entry's files;
        OSError or ValueError: not now), with their first reserve allocated now and topped up
        later by a thread. Without a host tier the budget is one context's state: what passes
        to the disk. ``session``: the one whose layers are read (any of a ``--parallel`` server's:
        their layouts are alike)."""
        if self.pools is not None:
            return self.pools
        session = session if session is not None else self.session
        pin = session.model.device.type == "cuda"
        layouts = None
        if known is not None and state_pools(session.cache, self.budget, pin, self.block) is None:
            try:
                layouts = known()
            except (OSError, ValueError):
                return None
        pools = state_pools(session.cache, self.budget, pin, self.block, layouts)
        if pools is None:
            return None
        self.pools = pools
        self._reserve_blocks = blocks_of(session.cache_ctx, self.block)
        if self.ram_bytes == 0 and self.spills:
            self.budget.limit = self._reserve_blocks * _slot_bytes(pools.blocks) + OWN_RESERVE * _slot_bytes(pools.own)
        self._top_up()
        self._reserver = threading.Thread(target=self._reserve_loop, name="sparkpack-cache-reserve", daemon=True)
        self._reserver.start()
        return pools

    def close(self) -> None:
        """Stop topping up the reserve."""
        self._closing = True
        self._want.set()
        if self._reserver is not None:
            self._reserver.join()
            self._reserver = None

    def wake(self) -> None:
        """Slots were taken: the reserve thread tops the pools up again."""
        self._want.set()

    @property
    def reserved_bytes(self) -> int:
        """Host bytes the pools hold (used or free)."""
        return self.budget.allocated

    def _top_up(self, between_requests: bool = False) -> None:
        """Slabs until the reserve is full; ``between_requests``: each one only while no request
        computes (the reserve's thread: a long turn's successor may come right after it). The own
        parts' few slots first: a budget smaller than a context's blocks would otherwise go to
        free block slots, and a state (which needs its own part) could never be kept."""
        pools = self.pools
        for pool, n in ((pools.own, OWN_RESERVE), (pools.blocks, self._reserve_blocks)):
            while pool is not None and len(pool.free) < n and not self._closing:
                if between_requests:
                    self.quiet.wait()
                with self.activity.piece() if between_requests else contextlib.nullcontext():
                    grown = not self._closing and pool.grow()
                if not grown:
                    break

    def _reserve_loop(self) -> None:
        """Why a thread: registering a slab takes a while (page faults, locking), and after a long
        first turn the engine would pay it right before the next request."""
        while not self._closing:
            self._want.wait()
            self._want.clear()
            if not self._closing:
                self._top_up(between_requests=True)

    def pool_of(self, p: Part) -> SlotPool:
        return self.pools.own if p.own else self.pools.blocks

    def take(self, pool: SlotPool, n: int) -> list[int] | None:
        """``n`` slots of ``pool``, the least recently used entries leaving the host tier until
        they are free (the parts the caller holds stay); None when they cannot be."""
        while (slots := pool.take(n)) is None:
            victims = sorted((e for e in self.index.entries.values() if e.in_host), key=lambda e: e.used)
            if not victims:
                return None
            self.leave(victims[0])
            self.index.stats.evictions += 1
        return slots

    def hold(self, names: list[str]) -> None:
        for n in names:
            self.index.parts[n].refs += 1

    def release(self, names: list[str]) -> None:
        """Drop one hold on each part; a part no one holds gives its slot back (and is forgotten
        when no file has it either)."""
        for n in names:
            p = self.index.parts.get(n)
            if p is None:
                continue
            p.refs -= 1
            if p.refs <= 0:
                if p.slot is not None:
                    self.pool_of(p).give([p.slot])
                    p.slot, p.event = None, None
                self.index.forget(p)

    def leave(self, e: Entry) -> None:
        """``e`` leaves the host tier (its slots go where no other entry holds them)."""
        with self.index.lock:
            if not e.in_host:
                return
            e.in_host = False
            self.release(e.parts)
            if e.path is None and not self.spills:
                self.index.entries.pop(e.name, None)

    def state(self, e: Entry) -> SequenceState | None:
        """``e``'s state when it is in host memory."""
        with self.index.lock:
            if not e.in_host:
                return None
            parts = [self.index.parts[n] for n in e.parts]
            blocks = parts[:len(parts) - e.has_own]
            own = parts[-1].slot if e.has_own else None
            events = list({id(p.event): p.event for p in parts if p.event is not None}.values())
            return SequenceState(e.tokens, e.cuts, [p.slot for p in blocks], own, self.pools, events)

    def held_bytes(self, parts: list[Part]) -> int:
        """Host bytes of those of ``parts`` that have a slot."""
        if self.pools is None:
            return 0
        return sum(_slot_bytes(self.pool_of(p)) for p in parts if p.slot is not None)


def _slot_bytes(pool: SlotPool | None) -> int:
    return pool.slot_bytes if pool is not None else 0
