"""The conversations a server has seen, kept so that any of them resumes for the price of its new
tokens: an index of token prefixes over two tiers, host RAM and an optional folder.

Why: a coding agent does not send one linear conversation (a subagent taking turns with the main
thread, a title or commit-message request, two sessions open); with only the live sequence in
the GPU cache, each switch recomputed the whole conversation (issue 42). llama-server keeps a few
slots and a host-RAM prompt cache, SGLang a radix tree of KV pages with a host tier, vLLM hashed
blocks; here an entry is a ``SequenceState`` (``runtime.sequence_state``) taken where a fresh
session's call ends, so a resumed request gives a fresh run's bits.

- An entry: the token ids, the cuts within them, its parts: the blocks of its attention rows
  (named by the token prefix they depend on, ``block_keys``, and shared by every entry with that
  prefix: two turns of a conversation, two conversations with one system prompt) and its own
  part (recurrent states, windows). A part is in host memory (a slot of a ``SlotPool``: pinned
  slabs reused, their registration paid once) and/or in the folder (a file of its own).
- After each request the live state at ``PrefixReuse.exact`` becomes an entry: only the blocks no
  entry holds yet are copied, on a side stream (on a GPU), off the next request's path; the next
  request waits for those copies only where it would overwrite rows they read (``prepare``). The
  same conversation's older entry that it extends is dropped (its blocks stay, shared).
- Lookup: the entry sharing the longest prefix with a request that ends a call of the request's
  own schedule (``Session.cuts_of``): its end for DeltaNet and sliding-window models, any cut
  within it for full-attention models (their rows are a prefix). It wins over the live sequence
  only when it keeps more.
- Shared prefixes: on models whose state cannot be cut back, a request marks the end of its
  first message (system prompt and tools) and the last call end it shares with another entry;
  the session copies the states there on the way (``Session.prompt``'s ``marks``) and they
  become entries of their own, so a new conversation with the same start resumes from them.
- Bounds: the slots of all pools come from ``ram_bytes`` (a block shared by entries is held
  once, refcounted); when no slot is free, the least recently used entries leave the host tier
  (to the disk tier if there) until one is. The pools keep a reserve of a context's worth of free
  slots, topped up by a thread of their own after each request, so a snapshot seldom allocates.
- Between requests only: the reserve's thread and the folder's writer work while no request
  computes (``quiet``), a slab or a file at a time: an agent sends its next request right after
  the last one's reply, and a long turn's files and slabs took longer than that turn's successor
  (BENCHMARKS.md, issue 42). A request that needs a slot a queued write holds waits for it.
- The folder: every part a file (``blocks/NAME.spkb``), every entry a small file naming its
  parts (``NAME.spkv``), each written once by a thread of its own (temp file, fsync, rename;
  an XXH3-128 checksum, several times faster than zlib's crc32: BENCHMARKS.md); a dropped
  entry's file goes, and the parts no other entry names. A restarted server indexes the entry
  files (headers only) and reads a resumed entry's parts straight into slots, checking each as it
  is read; a file that is another model's, truncated or fails its checksum is ignored with one
  log line and the prompt is computed.
"""
from __future__ import annotations

import json
import logging
import queue
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sparkpack.formats.atomic_file import atomic_writer
from sparkpack.formats.checksums import PACK_ALGORITHM, new_hasher

from .generate import Session
from .prefix_reuse import shared_len
from .host_pool import HostBudget, SlotPool
from .pinned import REGISTERING
from .sequence_state import (BLOCK_TOKENS, Copier, SequenceState, StatePools, block_keys, blocks_of, copy_blocks_out,
                             state_pools, take_own, truncatable)

log = logging.getLogger("sparkpack.cache")

MAGIC = b"SPKVSEQ2"  # an entry file
BLOCK_MAGIC = b"SPKVBLK2"  # a part's file
SUFFIX = ".spkv"
BLOCK_SUFFIX = ".spkb"
BLOCKS = "blocks"  # the parts' subfolder
DEFAULT_CACHE_RAM = 8 * 2**30
_DIGEST = 32  # hex digits of an XXH3-128 digest, a file's last bytes
OWN_RESERVE = 2  # free own-part slots the reserve keeps


@dataclass
class Part:
    """A block of attention rows or an entry's own part: its slot in host memory (None: not
    there), the entries and queued writes holding it (``refs``), the entry files naming it
    (``disk_refs``), whether its file exists, and the event of the copy that fills its slot."""

    name: str
    own: bool
    slot: int | None = None
    refs: int = 0
    disk_refs: int = 0
    on_disk: bool = False
    queued: int = 0  # entries naming it waiting for the writer
    file_bytes: int = 0
    event: object = None


@dataclass
class Entry:
    """One kept state. ``shared``: a shared-prefix checkpoint (never replaced by a longer turn);
    ``in_host``: its parts' slots are held (host tier)."""

    name: str
    tokens: tuple[int, ...]
    cuts: tuple[int, ...]
    parts: list[str]  # its blocks in order, then its own part if any
    has_own: bool
    path: Path | None = None
    shared: bool = False
    in_host: bool = False
    used: int = 0

    @property
    def pos(self) -> int:
        return len(self.tokens)

    @property
    def tier(self) -> str:
        return "host" if self.in_host else "disk"


@dataclass
class CacheStats:
    """What /metrics shows (``runtime.server.metrics``)."""

    hits: int = 0  # requests resumed from an entry
    live: int = 0  # requests that continued the sequence in the GPU cache
    misses: int = 0  # requests that kept nothing
    evictions: int = 0  # entries pushed out of the host tier (or not let in: no room)
    restore_seconds: float = 0.0
    ignored_files: int = 0


@dataclass
class Resume:
    """What ``prepare`` did for one request: the entry resumed from (None: the live sequence or
    nothing), its tier, and the positions ``Session.prompt`` copies states at (``marks``)."""

    entry: Entry | None
    tier: str
    marks: frozenset[int] = field(default_factory=frozenset)


def model_key(session: Session, block: int = BLOCK_TOKENS) -> str:
    """What a state's bits depend on besides its tokens: the model file, the compute dtype and
    device, the KV cache type and where calls end. States are kept and looked up under it."""
    from .residency import identity_of

    model = session.model
    ident = identity_of(model.gguf)
    parts = {"model": ident.to_json(), "dtype": str(model.dtype), "device": model.device.type,
             "q8": any(getattr(la, "q8", False) for la in session.cache.layers), "calls": session.plan.call_tokens,
             "chunk": session.plan.prefill_chunk, "long_past": session.plan.long_past, "padded": session.prefill is not None,
             "breaks": sorted(session.plan.breaks), "block": block}
    h = new_hasher(PACK_ALGORITHM)
    h.update(json.dumps(parts, sort_keys=True).encode())
    return h.hexdigest()


class ConversationCache:
    """The entries of one session's model (``model_key``). ``ram_bytes`` 0: no host tier (the
    parts pass through host memory on their way to and from the folder); ``folder`` None: no
    disk tier. ``block``: positions per block (``BLOCK_TOKENS``; tests take fewer). Used from
    the engine thread; files are written by a thread of their own (``close`` waits for it), so a
    request never waits for the disk. A request's methods take the session it runs in (default
    ``session``): a ``--parallel`` server's sessions, all opened alike (one ``model_key``), share
    the entries; the copies out of any of them are ordered before a later request's prompt
    (one side stream, so the last copy's event covers them all)."""

    def __init__(self, session: Session, ram_bytes: int, folder: Path | None = None, block: int = BLOCK_TOKENS):
        self.session = session
        self.block = block
        self.ram_bytes = ram_bytes
        self.folder = folder
        self.key = model_key(session, block)
        self.truncatable = truncatable(session.cache)
        self.entries: dict[str, Entry] = {}
        self.parts: dict[str, Part] = {}
        self.stats = CacheStats()
        self._tick = 0
        self.lock = threading.RLock()  # the index, between the engine thread, the writer and any reader of it
        device = session.model.device
        self.copier = Copier(device)
        self.budget = HostBudget(ram_bytes)
        self.pools: StatePools | None = None
        self._pending: tuple[object, int, bool] | None = None  # the last copies out: event, rows, from a ring
        self._closing = False
        # Set while no request computes: the writer and the reserve's thread work only then, a
        # file or a slab at a time, so what one request leaves behind (its blocks' files, the
        # reserve it used) never slows the next one down, which may come right after.
        self.quiet = threading.Event()
        self.quiet.set()
        self._computing = 0  # requests between prepare and request_ended (several under --parallel)
        self._want = threading.Event()  # the reserve may need topping up
        self._reserver: threading.Thread | None = None
        self._writes: queue.Queue[Entry | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        if folder is not None:
            (folder / BLOCKS).mkdir(parents=True, exist_ok=True)
            self._scan()
            self._writer = threading.Thread(target=self._write_loop, name="sparkpack-cache-writer", daemon=True)
            self._writer.start()
        self._open_pools()

    def close(self) -> None:
        """Finish the files queued for writing; stop topping up the reserve."""
        self._closing = True
        self.quiet.set()
        self._want.set()
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join()
            self._writer = None
        if self._reserver is not None:
            self._reserver.join()
            self._reserver = None

    # -- host memory ----------------------------------------------------------------------------
    def _open_pools(self, e: Entry | None = None, session: Session | None = None) -> StatePools | None:
        """The pools, made once the cache's layers hold their first token (on a GPU, after the
        warm-up: at start-up) or, before, from the layouts in the files of entry ``e``, with
        their first reserve allocated now and topped up later by a thread. Without a host tier
        the budget is one context's state: what passes to the disk. ``session``: the one whose
        layers are read (any of a ``--parallel`` server's: their layouts are alike)."""
        if self.pools is not None:
            return self.pools
        cache = (session if session is not None else self.session).cache
        pin = self.session.model.device.type == "cuda"
        known = None
        if e is not None and state_pools(cache, self.budget, pin, self.block) is None:
            try:
                known = tuple(part_layout(self._part_path(n)) for n in (e.parts[0], e.parts[-1]))
            except (OSError, ValueError):
                return None
            known = known if e.has_own else (known[0], [])
        pools = state_pools(cache, self.budget, pin, self.block, known)
        if pools is None:
            return None
        self.pools = pools
        self._reserve_blocks = blocks_of(self.session.cache_ctx, self.block)
        if self.ram_bytes == 0 and self.folder is not None:
            self.budget.limit = self._reserve_blocks * _slot_bytes(pools.blocks) + OWN_RESERVE * _slot_bytes(pools.own)
        self._top_up()
        self._reserver = threading.Thread(target=self._reserve_loop, name="sparkpack-cache-reserve", daemon=True)
        self._reserver.start()
        return pools

    @property
    def reserved_bytes(self) -> int:
        """Host bytes the pools hold (used or free)."""
        return self.budget.allocated

    def _top_up(self, between_requests: bool = False) -> None:
        """Slabs until the reserve is full; ``between_requests``: each one only while no request
        computes (the reserve's thread)."""
        pools = self.pools
        for pool, n in ((pools.blocks, self._reserve_blocks), (pools.own, OWN_RESERVE)):
            while pool is not None and len(pool.free) < n and not self._closing:
                if between_requests:
                    self.quiet.wait()
                if self._closing or not pool.grow():
                    break

    def _reserve_loop(self) -> None:
        """Why a thread: registering a slab takes a while (page faults, locking), and after a long
        first turn the engine would pay it right before the next request."""
        while not self._closing:
            self._want.wait()
            self._want.clear()
            if not self._closing:
                self._top_up(between_requests=True)

    def _take(self, pool: SlotPool, n: int) -> list[int] | None:
        """``n`` slots of ``pool``, the least recently used entries leaving the host tier until
        they are free (the parts the caller holds stay); None when they cannot be."""
        while (slots := pool.take(n)) is None:
            victims = sorted((e for e in self.entries.values() if e.in_host), key=lambda e: e.used)
            if not victims:
                return None
            self._leave_host(victims[0])
            self.stats.evictions += 1
        return slots

    def _hold(self, names: list[str]) -> None:
        for n in names:
            self.parts[n].refs += 1

    def _release(self, names: list[str]) -> None:
        """Drop one hold on each part; a part no one holds gives its slot back (and is forgotten
        when no file has it either)."""
        for n in names:
            p = self.parts.get(n)
            if p is None:
                continue
            p.refs -= 1
            if p.refs <= 0:
                if p.slot is not None:
                    (self.pools.own if p.own else self.pools.blocks).give([p.slot])
                    p.slot, p.event = None, None
                self._forget(p)

    def _forget(self, p: Part) -> None:
        """Forget a part nothing has: no hold, no slot, no file, no queued write."""
        if p.refs <= 0 and p.slot is None and not p.on_disk and p.disk_refs <= 0 and p.queued <= 0:
            self.parts.pop(p.name, None)

    def _leave_host(self, e: Entry) -> None:
        with self.lock:
            if not e.in_host:
                return
            e.in_host = False
            self._release(e.parts)
            if e.path is None and self._writer is None:
                self.entries.pop(e.name, None)

    # -- tiers, for /metrics ------------------------------------------------------------------
    def tier_counts(self) -> dict[str, tuple[int, int]]:
        """(entries, bytes) per tier, a part shared by entries counted once. (Read by /metrics in
        another thread: it works on copies of the index.)"""
        with self.lock:
            entries = list(self.entries.values())
            parts = list(self.parts.values())
        host = sum(_slot_bytes(self.pools.own if p.own else self.pools.blocks) for p in parts if p.slot is not None) \
            if self.pools is not None else 0
        disk = [e for e in entries if e.path is not None]
        disk_bytes = sum(p.file_bytes for p in parts if p.on_disk)
        return {"host": (sum(e.in_host for e in entries), host), "disk": (len(disk), disk_bytes)}

    # -- a request ------------------------------------------------------------------------------
    def prepare(self, ids: list[int], session: Session | None = None) -> Resume:
        """Before ``Session.prompt(ids)``: resume the session from the entry that keeps the most
        of ``ids`` if that is more than the live sequence keeps; say which positions to mark. The
        copies out of the last request's rows are waited for (on the device) only where this
        request overwrites them."""
        with self.lock:
            self._computing += 1
            self.quiet.clear()
        session = session if session is not None else self.session
        cuts = set(session.cuts_of(ids))
        live = session.reusable(ids)
        best, keep = self._best(ids, cuts, live)
        resume = Resume(None, "gpu" if live else "none")
        if best is not None:
            t0, tier = time.perf_counter(), best.tier
            state = self._load(best)
            if state is not None:
                self._order_after_copies()
                session.resume(state.cut(keep) if keep < best.pos else state)
                if self.ram_bytes == 0:  # no host tier: the slots go once the copies to the device are queued
                    self._leave_host(best)
                self.stats.restore_seconds += time.perf_counter() - t0
                self._touch(best)
                resume = Resume(best, tier)
            else:
                keep = live = session.reusable(ids)
        if resume.entry is None and self._pending is not None:
            _, rows, ring = self._pending
            if ring or live < rows:
                self._order_after_copies()
        if not self.truncatable:
            resume.marks = self._marks(ids, sorted(cuts), keep, session)
        return resume

    def keeps(self, ids: list[int], session: Session | None = None) -> int:
        """How many tokens of ``ids`` the best entry keeps, read from the index alone (a
        ``--parallel`` server asks before it picks the session a request runs in)."""
        session = session if session is not None else self.session
        return self._best(ids, set(session.cuts_of(ids)), 0)[1]

    def _best(self, ids: list[int], cuts: set[int], floor: int) -> tuple[Entry | None, int]:
        """The entry that keeps the most of ``ids`` (call ends ``cuts``), if more than ``floor``."""
        best, keep = None, floor
        with self.lock:
            candidates = list(self.entries.values())
        for e in candidates:
            n = self._usable(e, ids, cuts)
            if n > keep:
                best, keep = e, n
        return best, keep

    def _order_after_copies(self) -> None:
        """The device's next work after the copies out of its rows (the host does not wait)."""
        if self._pending is not None:
            event = self._pending[0]
            if event is not None:
                torch.cuda.current_stream(self.session.model.device).wait_event(event)
            self._pending = None

    def after_prompt(self, ids: list[int], resume: Resume, session: Session | None = None) -> None:
        """After ``Session.prompt``: one log line, the counts, and the marked states as entries."""
        session = session if session is not None else self.session
        reused = session.reused
        if resume.entry is not None:
            self.stats.hits += 1
            log.info("resumed %d of %d prompt tokens from entry %s (%s tier, %d tokens)", reused, len(ids),
                     resume.entry.name[:16], resume.tier, resume.entry.pos)
        elif reused:
            self.stats.live += 1
            log.info("resumed %d of %d prompt tokens from the live sequence (gpu)", reused, len(ids))
        else:
            self.stats.misses += 1
            log.info("no entry: all %d prompt tokens computed", len(ids))
        for m in sorted(resume.marks):
            self._keep(m, shared=True, session=session)

    def request_ended(self, keep: bool, session: Session | None = None) -> None:
        """After a request (``prepare`` began it): once no request computes, the background work
        may go on; ``keep`` (it did not fail): the live sequence's state at its exact end becomes
        an entry (it replaces the same conversation's older turn, and shares its blocks)."""
        with self.lock:
            self._computing = max(0, self._computing - 1)
            if not self._computing:
                self.quiet.set()
        if keep:
            self._keep(None, shared=False, session=session if session is not None else self.session)

    def _keep(self, pos: int | None, shared: bool, session: Session) -> None:
        """The session's state at ``pos`` (default: its exact end) as an entry: its blocks that no
        entry holds copied into free slots (on the device's side stream), its own part too. With
        no room, once more after the queued files are written (the slots they hold)."""
        if self._keep_once(pos, shared, session) is False and self._wait_for_writes():
            self._keep_once(pos, shared, session)

    def _keep_once(self, pos: int | None, shared: bool, session: Session) -> bool | None:
        source = session.state_at(pos)
        pools = self._open_pools(session=session)
        if source is None or pools is None:
            return
        tokens, cuts, saved = source
        pos = len(tokens)
        name = self._name(tokens)
        with self.lock:
            e = self.entries.get(name)
            if e is not None and e.in_host:
                e.shared = e.shared or shared
                self._touch(e)
                return
            names = block_keys(self.key, tokens, cuts, self.block)
            own = f"{name}-own" if pools.own is not None else None
            for n in names + ([own] if own else []):
                if n not in self.parts:
                    self.parts[n] = Part(n, own=n == own)
            want = names + ([own] if own else [])
            self._hold(want)
            need = [i for i, n in enumerate(names) if self.parts[n].slot is None]
            own_need = own is not None and self.parts[own].slot is None  # (else a queued write still holds it)
            slots = self._take(pools.blocks, len(need)) if need else []
            own_slot = None
            if slots is not None and own_need:
                own_slot = self._take(pools.own, 1)
                if own_slot is None:
                    pools.blocks.give(slots)
                    slots = None
            if slots is None:  # no room: the state is not kept in host memory
                self._release(want)
                self.stats.evictions += 1
                return False
            if self._pending is not None and self._pending[0] is not None:
                self._pending[0].synchronize()  # (slots written below on the host may still be read)
            with self.copier.side():
                copy_blocks_out(session.cache, pools, [(need[k], s) for k, s in enumerate(slots)], pos)
                if own_need:
                    take_own(session.cache, pools, own_slot[0], pos, saved)
                event = self.copier.event()
            ring = saved is None and session.cache.windowed
            self._pending = (event, max(pos, self._pending[1] if self._pending else 0),
                             ring or bool(self._pending and self._pending[2]))
            for k, s in enumerate(slots):
                p = self.parts[names[need[k]]]
                p.slot, p.event = s, event
            if own_need:
                p = self.parts[own]
                p.slot, p.event = own_slot[0], event
            if e is None:
                e = Entry(name, tuple(tokens), tuple(cuts), want, own is not None, shared=shared)
                self.entries[name] = e
            else:  # (a disk entry whose parts are in host memory again)
                e.parts, e.has_own = want, own is not None
            e.in_host = True
            e.shared = e.shared or shared
            if not shared:  # the same conversation's older turn, which this one extends
                for old in [o for o in self.entries.values() if not o.shared and o is not e and o.pos < e.pos
                            and tokens[:o.pos] == list(o.tokens)]:
                    self._drop(old)
            self._touch(e)
            if self._writer is not None and e.path is None:
                self._hold(e.parts)  # (the writer's; released once written)
                for n in e.parts:
                    self.parts[n].queued += 1
                self._writes.put(e)
        self._want.set()

    # -- index ----------------------------------------------------------------------------------
    def _usable(self, e: Entry, ids: list[int], cuts: set[int]) -> int:
        """How many tokens of ``ids`` entry ``e`` gives exactly (0: none)."""
        limit = min(shared_len(ids, e.tokens), len(ids) - 1)
        if e.pos <= limit and e.pos in cuts:
            return e.pos
        if not self.truncatable:
            return 0
        return max((c for c in e.cuts if c <= limit and c in cuts), default=0)

    def _marks(self, ids: list[int], cuts: list[int], keep: int, session: Session) -> frozenset[int]:
        """Where to copy states during this prompt: the end of its first message (the first call
        end before a control token: the system prompt and tools) and the last call end it shares
        with another entry or the live sequence, where not kept already."""
        marks = set()
        first = next((c for c in cuts if c > 0 and ids[c] in session.plan.breaks), None)
        if first is not None:
            marks.add(first)
        with self.lock:
            entries = list(self.entries.values())
        shared = max([shared_len(ids, e.tokens) for e in entries] + [shared_len(ids, session.fed)])
        limit = min(shared, len(ids) - 1)
        marks.add(max((c for c in cuts if c <= limit), default=0))
        have = {e.tokens for e in entries}
        return frozenset(m for m in marks if m > keep and tuple(ids[:m]) not in have)

    def _touch(self, e: Entry) -> None:
        self._tick += 1
        e.used = self._tick

    def _drop(self, e: Entry) -> None:
        """Forget ``e``: its holds, its file, the part files no other entry file names."""
        with self.lock:
            self.entries.pop(e.name, None)
            if e.in_host:
                e.in_host = False
                self._release(e.parts)
            if e.path is not None:
                e.path.unlink(missing_ok=True)
                e.path = None
                self._unname(e.parts)

    def _unname(self, names: list[str]) -> None:
        """One entry file fewer names ``names``: a part no entry file names loses its file."""
        for n in names:
            p = self.parts.get(n)
            if p is None:
                continue
            p.disk_refs -= 1
            if p.disk_refs <= 0 and p.on_disk and p.queued <= 0:
                self._part_path(n).unlink(missing_ok=True)
                p.on_disk = False
                self._forget(p)

    def _name(self, tokens) -> str:
        h = new_hasher(PACK_ALGORITHM)
        h.update(self.key.encode())
        h.update(memoryview(torch.tensor(list(tokens), dtype=torch.int64).numpy()))
        return h.hexdigest()

    def state(self, e: Entry) -> SequenceState | None:
        """``e``'s state when it is in host memory."""
        with self.lock:
            if not e.in_host:
                return None
            parts = [self.parts[n] for n in e.parts]
            blocks = parts[:len(parts) - e.has_own]
            own = parts[-1].slot if e.has_own else None
            events = list({id(p.event): p.event for p in parts if p.event is not None}.values())
            return SequenceState(e.tokens, e.cuts, [p.slot for p in blocks], own, self.pools, events)

    # -- disk tier ------------------------------------------------------------------------------
    def _part_path(self, name: str) -> Path:
        return self.folder / BLOCKS / (name + BLOCK_SUFFIX)

    def _load(self, e: Entry) -> SequenceState | None:
        state = self._load_once(e)
        if state is None and e.name in self.entries and not e.in_host and self._wait_for_writes():
            state = self._load_once(e)  # (the slots the writer held are free now)
        return state

    def _load_once(self, e: Entry) -> SequenceState | None:
        """The entry's state, its parts not in host memory read from their files into slots
        (checked as they are read); None when the entry's files are unusable (one log line; the
        entry is forgotten) or there is no room."""
        if e.in_host:
            return self.state(e)
        pools = self._open_pools(e)
        if pools is None or e.path is None:
            return None
        with self.lock:
            missing = [self.parts[n] for n in e.parts if self.parts[n].slot is None]
            self._hold(e.parts)
            got: list[tuple[Part, int]] = []
            for p in missing:
                slots = self._take(pools.own if p.own else pools.blocks, 1)
                if slots is None:
                    for q, s in got:
                        (pools.own if q.own else pools.blocks).give([s])
                    self._release(e.parts)
                    return None
                got.append((p, slots[0]))
        if self.session.model.device.type == "cuda":
            torch.cuda.synchronize(self.session.model.device)  # (slots given back may still be read by a copy)
        path = e.path
        try:
            for p, s in got:
                path = self._part_path(p.name)
                read_part(path, self.key, p.name, pools.own if p.own else pools.blocks, s)
        except (OSError, ValueError) as err:
            log.warning("ignoring conversation cache file %s: %s (recomputing)", path,
                        err.strerror if isinstance(err, OSError) and err.strerror else err)
            self.stats.ignored_files += 1
            with self.lock:
                for q, s in got:
                    (pools.own if q.own else pools.blocks).give([s])
                self._release(e.parts)
                self.entries.pop(e.name, None)
            return None
        with self.lock:
            for p, s in got:
                p.slot, p.event = s, None
            e.in_host = True
            self._touch(e)
        self._want.set()
        return self.state(e)

    def _write_loop(self) -> None:
        while (e := self._writes.get()) is not None:
            try:
                self._write(e)
            finally:
                self._writes.task_done()
        self._writes.task_done()

    def _wait_for_writes(self) -> bool:
        """Wait until the queued files are written (their holds on slots released); False when none
        were queued. Called without the lock (the writer takes it)."""
        if self._writer is None or self._writes.unfinished_tasks == 0:
            return False
        was_quiet = self.quiet.is_set()
        self.quiet.set()  # (this thread waits for them: they may go on during a request)
        try:
            self._writes.join()
        finally:
            if not was_quiet:
                self.quiet.clear()
        return True

    def _write(self, e: Entry) -> None:
        name = e.name
        with self.lock:
            parts = [self.parts[n] for n in e.parts]
            if self.entries.get(name) is not e:  # dropped meanwhile: nothing to write
                for p in parts:
                    p.queued -= 1
                self._release(e.parts)
                return
        try:
            for p in parts:
                if not p.on_disk and p.slot is not None:
                    self.quiet.wait()
                    if p.event is not None:
                        with REGISTERING:  # (a wait on the device from this thread would break a capture)
                            p.event.synchronize()
                    pool = self.pools.own if p.own else self.pools.blocks
                    path = self._part_path(p.name)
                    write_part(path, self.key, p.name, pool, p.slot)
                    with self.lock:
                        p.on_disk, p.file_bytes = True, path.stat().st_size
            path = self.folder / (name + SUFFIX)
            write_entry(path, self.key, e)
        except OSError as err:
            log.warning("cannot write conversation cache file: %s", err)
            with self.lock:
                for p in parts:
                    p.queued -= 1
                self._release(e.parts)
            return
        with self.lock:
            for p in parts:
                p.disk_refs += 1
                p.queued -= 1
            if self.entries.get(name) is e:
                e.path = path
            else:  # dropped meanwhile (a longer turn of its conversation replaced it)
                path.unlink(missing_ok=True)
                self._unname(e.parts)
            self._release(e.parts)  # the writer's hold
            if self.ram_bytes == 0 and e.in_host:
                self._leave_host(e)

    def _scan(self) -> None:
        """Index the folder's entry files of this model (their headers only; the parts are
        checked when used)."""
        for path in sorted(self.folder.glob("*" + SUFFIX)):
            try:
                meta = read_entry(path)
            except (OSError, ValueError) as err:
                log.warning("ignoring conversation cache file %s: %s", path, err)
                self.stats.ignored_files += 1
                continue
            if meta["key"] != self.key:
                continue  # another model's or other session options' (the folder may be shared)
            name = path.name[: -len(SUFFIX)]
            self.entries[name] = Entry(name, tuple(meta["tokens"]), tuple(meta["cuts"]), meta["parts"],
                                       bool(meta["own"]), path=path, shared=bool(meta["shared"]))
            for n in meta["parts"]:
                p = self.parts.get(n)
                if p is None:
                    try:
                        size = self._part_path(n).stat().st_size
                    except OSError:
                        size = 0  # (found missing when the entry is resumed)
                    p = self.parts[n] = Part(n, own=n.endswith("-own"), on_disk=True, file_bytes=size)
                p.disk_refs += 1


def _slot_bytes(pool: SlotPool | None) -> int:
    return pool.slot_bytes if pool is not None else 0


# -- the files: MAGIC, u32 length, meta JSON, [payload: a part's tensors' bytes in layout order],
# XXH3-128 digest of all but MAGIC and the length --
def _head(magic: bytes, meta: dict) -> bytes:
    head = json.dumps(meta).encode()
    return magic + struct.pack("<I", len(head)) + head


def write_entry(path: Path, key: str, e: Entry) -> None:
    """An entry's file: its tokens, cuts and parts' names (atomically: temp name, fsync, rename)."""
    meta = {"key": key, "tokens": list(e.tokens), "cuts": list(e.cuts), "shared": e.shared, "parts": e.parts,
            "own": e.has_own}
    head = _head(MAGIC, meta)
    h = new_hasher(PACK_ALGORITHM)
    h.update(head[len(MAGIC) + 4:])
    with atomic_writer(path) as f:
        f.write(head)
        f.write(h.hexdigest().encode())


def _read_head(f, path: Path, magic: bytes) -> tuple[dict, bytes]:
    first = f.read(len(magic) + 4)
    if len(first) < len(magic) + 4 or first[: len(magic)] != magic:
        raise ValueError("not a sparkpack conversation state")
    (n,) = struct.unpack("<I", first[len(magic):])
    raw = f.read(n)
    if len(raw) < n:
        raise ValueError(f"{path.stat().st_size} bytes, shorter than its header says (truncated?)")
    try:
        meta = json.loads(raw)
    except ValueError:
        raise ValueError("its header is not readable") from None
    if not isinstance(meta, dict):
        raise ValueError("its header is not readable")
    return meta, raw


def read_entry(path: Path) -> dict:
    """An entry file's header, its checksum checked (ValueError: not one of ours, truncated, corrupted)."""
    with open(path, "rb") as f:
        meta, raw = _read_head(f, path, MAGIC)
        digest = f.read()
    if len(digest) != _DIGEST:
        raise ValueError(f"{path.stat().st_size} bytes where its header says {len(MAGIC) + 4 + len(raw) + _DIGEST} "
                         "(truncated?)")
    h = new_hasher(PACK_ALGORITHM)
    h.update(raw)
    if h.hexdigest().encode() != digest:
        raise ValueError("checksum mismatch (corrupted)")
    if not {"key", "tokens", "cuts", "shared", "parts", "own"} <= meta.keys() \
            or not all(isinstance(meta[k], list) and all(type(x) is int for x in meta[k]) for k in ("tokens", "cuts")) \
            or not isinstance(meta["parts"], list) or not all(isinstance(x, str) for x in meta["parts"]):
        raise ValueError("its header lacks fields or has fields of the wrong type")
    return meta


def write_part(path: Path, key: str, name: str, pool: SlotPool, slot: int) -> None:
    """A part's file: its slot's tensors (atomically); an existing file is the same part."""
    if path.exists():
        return
    meta = {"key": key, "name": name, "layout": [[str(d).removeprefix("torch."), list(s)] for s, d in pool.layout]}
    head = _head(BLOCK_MAGIC, meta)
    h = new_hasher(PACK_ALGORITHM)
    h.update(head[len(BLOCK_MAGIC) + 4:])
    with atomic_writer(path) as f:
        f.write(head)
        for j in range(len(pool.layout)):
            data = memoryview(pool.tensor(slot, j).view(torch.uint8).reshape(-1).numpy())
            h.update(data)
            f.write(data)
        f.write(h.hexdigest().encode())


def part_layout(path: Path) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The tensors' shapes and dtypes a part's file says it holds (checked when it is read)."""
    with open(path, "rb") as f:
        meta, _ = _read_head(f, path, BLOCK_MAGIC)
    try:
        return [(tuple(int(x) for x in shape), getattr(torch, dtype)) for dtype, shape in meta["layout"]]
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ValueError("its header lacks fields or has fields of the wrong type") from None


def read_part(path: Path, key: str, name: str, pool: SlotPool, slot: int) -> None:
    """Read a part's file straight into ``slot``, hashing each tensor as it lands (ValueError: not
    this model's part, truncated, corrupted)."""
    with open(path, "rb") as f:
        meta, raw = _read_head(f, path, BLOCK_MAGIC)
        layout = [[str(d).removeprefix("torch."), list(s)] for s, d in pool.layout]
        if meta.get("key") != key or meta.get("name") != name:
            raise ValueError("it belongs to another model or other session options")
        if meta.get("layout") != layout:
            raise ValueError("its tensors are not this model's state")
        h = new_hasher(PACK_ALGORITHM)
        h.update(raw)
        for j in range(len(pool.layout)):
            data = memoryview(pool.tensor(slot, j).view(torch.uint8).reshape(-1).numpy())
            if f.readinto(data) != len(data):
                raise ValueError("shorter than its header says (truncated?)")
            h.update(data)
        digest = f.read()
    if len(digest) != _DIGEST:
        raise ValueError("not the size its header says (truncated?)")
    if h.hexdigest().encode() != digest:
        raise ValueError("checksum mismatch (corrupted)")
