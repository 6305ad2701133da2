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
  entry holds yet are copied, on a side stream (on a GPU), while the reply goes out; the next
  request's device work is queued after them (``prepare``), never beside them. The same
  conversation's older entry that it extends is dropped (its blocks stay, shared).
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
- Between requests only: the reserve's thread and the folder's writer work once no request has
  computed for a moment (``runtime.conversation_quiet``), a slab or a file at a time: an agent
  sends its next request right after the last one's reply, and a long turn's files and slabs
  took longer than that turn's successor (BENCHMARKS.md, issue 42). A request that needs a slot
  a queued write holds waits for it.
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
import time
from dataclasses import dataclass, field
from pathlib import Path

from sparkpack.formats.checksums import PACK_ALGORITHM, new_hasher

from .conversation_folder import FolderTier
from .conversation_host import HostTier
from .conversation_index import CacheStats, Entry, Index
from .conversation_quiet import Quiet
from .conversation_snapshot import Snapshots
from .generate import Session
from .sequence_state import BLOCK_TOKENS, SequenceState, truncatable

log = logging.getLogger("sparkpack.cache")

DEFAULT_CACHE_RAM = 8 * 2**30


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
    (one side stream, so the last copy's event covers them all).

    Which entry a request resumes from and what becomes an entry is decided here; taking a state
    is ``runtime.conversation_snapshot``'s, the slots are the host tier's
    (``runtime.conversation_host``), the files the folder tier's (``runtime.conversation_folder``),
    and all of them share one ``Index``."""

    def __init__(self, session: Session, ram_bytes: int, folder: Path | None = None, block: int = BLOCK_TOKENS):
        self.session = session
        self.block = block
        self.ram_bytes = ram_bytes
        self.key = model_key(session, block)
        self.truncatable = truncatable(session.cache)
        self.index = Index(truncatable=self.truncatable)
        # Set while no request computes: the writer and the reserve's thread work only once it
        # has been for a moment, a file or a slab at a time, so what one request leaves behind
        # (its blocks' files, the reserve it used) does not slow the next one down, which may
        # come right after.
        self.quiet = Quiet()
        self._computing = 0  # requests between prepare and request_ended (several under --parallel)
        self.host = HostTier(self.index, session, ram_bytes, block, spills=folder is not None, quiet=self.quiet)
        self.disk: FolderTier | None = FolderTier(self.index, self.host, self.key, folder, self.quiet) \
            if folder is not None else None
        self.snapshots = Snapshots(self.index, self.host, self.disk, self.key, block, session.model.device)
        self.host.open()

    @property
    def stats(self) -> CacheStats:
        return self.index.stats

    @property
    def entries(self) -> dict[str, Entry]:
        return self.index.entries

    @property
    def reserved_bytes(self) -> int:
        """Host bytes the pools hold (used or free)."""
        return self.host.reserved_bytes

    def close(self) -> None:
        """Finish the files queued for writing; stop topping up the reserve."""
        self.quiet.set(at_once=True)
        self.host.close()
        if self.disk is not None:
            self.disk.close()

    # -- tiers, for /metrics ------------------------------------------------------------------
    def tier_counts(self) -> dict[str, tuple[int, int]]:
        """(entries, bytes) per tier, a part shared by entries counted once. (Read by /metrics in
        another thread: it works on copies of the index.)"""
        with self.index.lock:
            entries = list(self.index.entries.values())
            parts = list(self.index.parts.values())
        host = self.host.held_bytes(parts)
        disk = [e for e in entries if e.path is not None]
        disk_bytes = sum(p.file_bytes for p in parts if p.on_disk)
        return {"host": (sum(e.in_host for e in entries), host), "disk": (len(disk), disk_bytes)}

    def background_seconds(self) -> float:
        """Seconds the writer and the reserve's thread have worked so far (a request's split reads
        what ran beside it: ``runtime.server.request_split``)."""
        return self.host.activity.seconds() + (self.disk.activity.seconds() if self.disk is not None else 0.0)

    def last_keep(self) -> dict[str, float]:
        """The engine's seconds in the last request's state snapshots, by phase (``Snapshots.last``)."""
        return self.snapshots.last()

    def copies_running(self) -> bool:
        """Whether the last copies out of the device (the previous request's state) still run."""
        return self.snapshots.copies_running()

    def order_after_copies(self) -> None:
        """The device's next work after the copies out of the last request's state, which read
        the session's rows: for work between requests that writes them (a bootstrap replay in
        the serving session); a request's own is ordered by ``prepare``."""
        self.snapshots.order_after_copies()

    # -- a request ------------------------------------------------------------------------------
    def prepare(self, ids: list[int], session: Session | None = None) -> Resume:
        """Before ``Session.prompt(ids)``: resume the session from the entry that keeps the most
        of ``ids`` if that is more than the live sequence keeps; say which positions to mark. The
        request's device work is queued after the copies out of the last request's state (the
        host does not wait), also where it overwrites none of the rows they read: run beside a
        request, a long state's copies out and the request slowed each other down on the GPU
        (BENCHMARKS.md, issue 42), where alone they end before the next request arrives."""
        with self.index.lock:
            self._computing += 1
            self.quiet.clear()
        session = session if session is not None else self.session
        self.snapshots.order_after_copies()
        cuts = set(session.cuts_of(ids))
        live = session.reusable(ids)
        best, keep = self.index.best(ids, cuts, live)
        resume = Resume(None, "gpu" if live else "none")
        if best is not None:
            t0, tier = time.perf_counter(), best.tier
            state = self._load(best)
            if state is not None:
                session.resume(state.cut(keep) if keep < best.pos else state)
                if self.ram_bytes == 0:  # no host tier: the slots go once the copies to the device are queued
                    self.host.leave(best)
                self.index.stats.restore_seconds += time.perf_counter() - t0
                self.index.touch(best)
                resume = Resume(best, tier)
            else:
                keep = live = session.reusable(ids)
        if not self.truncatable:
            resume.marks = self.index.marks(ids, sorted(cuts), keep, session.plan.breaks, session.fed)
        return resume

    def keeps(self, ids: list[int], session: Session | None = None) -> int:
        """How many tokens of ``ids`` the best entry keeps, read from the index alone (a
        ``--parallel`` server asks before it picks the session a request runs in)."""
        session = session if session is not None else self.session
        return self.index.best(ids, set(session.cuts_of(ids)), 0)[1]

    def after_prompt(self, ids: list[int], resume: Resume, session: Session | None = None) -> None:
        """After ``Session.prompt``: one log line, the counts, and the marked states as entries."""
        session = session if session is not None else self.session
        reused = session.reused
        if resume.entry is not None:
            self.index.stats.hits += 1
            log.info("resumed %d of %d prompt tokens from entry %s (%s tier, %d tokens)", reused, len(ids),
                     resume.entry.name[:16], resume.tier, resume.entry.pos)
        elif reused:
            self.index.stats.live += 1
            log.info("resumed %d of %d prompt tokens from the live sequence (gpu)", reused, len(ids))
        else:
            self.index.stats.misses += 1
            log.info("no entry: all %d prompt tokens computed", len(ids))
        for m in sorted(resume.marks):
            self.snapshots.keep(m, shared=True, session=session)

    def request_ended(self, keep: bool, session: Session | None = None) -> None:
        """After a request (``prepare`` began it): ``keep`` (it did not fail): the live sequence's
        state at its exact end becomes an entry (it replaces the same conversation's older turn,
        and shares its blocks); then, once no request computes, the background work may go on.
        Why the snapshot first: it is still the request's work on the engine thread. Set free
        before it, the reserve's thread registered slabs and the writer hashed and wrote files
        beside it, competing with it for the host and the driver (a slab's registration), while
        the next request may already queue behind it (issue 42)."""
        try:
            if keep:
                self.snapshots.keep(None, shared=False, session=session if session is not None else self.session)
            else:
                self.snapshots.forget_last()
        finally:  # (a failed snapshot still ends the request: the threads would wait forever)
            with self.index.lock:
                self._computing = max(0, self._computing - 1)
                if not self._computing:
                    self.quiet.set()

    def state(self, e: Entry) -> SequenceState | None:
        """``e``'s state when it is in host memory."""
        return self.host.state(e)

    def _load(self, e: Entry) -> SequenceState | None:
        """``e``'s state, from host memory or read from its files."""
        if e.in_host or self.disk is None:
            return self.host.state(e)
        return self.disk.load(e)
