"""The conversation cache's index: its entries, the parts they name and the counts /metrics shows.

Why a module of its own: the cache (``runtime.conversation_cache``), its host tier
(``runtime.conversation_host``) and its folder (``runtime.conversation_folder``) all read and
change the one index, from the engine thread, the writer thread and a /metrics scrape; it lives
here with its lock so that none of them owns what the others need. What the entries give a
request (``best``, ``marks``) is read from here alone, so a server can ask before it picks the
session a request runs in.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from .prefix_reuse import shared_len


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
class Index:
    """The entries by name and the parts by name, under one lock (re-entrant: a tier's method
    holding it may call another's). ``touch`` orders entries by last use (the host tier's LRU).
    ``truncatable``: the model's states can be cut back to any call end within them (full
    attention only: ``runtime.sequence_state.truncatable``), else only an entry's end resumes."""

    entries: dict[str, Entry] = field(default_factory=dict)
    parts: dict[str, Part] = field(default_factory=dict)
    stats: CacheStats = field(default_factory=CacheStats)
    lock: threading.RLock = field(default_factory=threading.RLock)
    tick: int = 0
    truncatable: bool = True

    def touch(self, e: Entry) -> None:
        self.tick += 1
        e.used = self.tick

    def forget(self, p: Part) -> None:
        """Forget a part nothing has: no hold, no slot, no file, no queued write."""
        if p.refs <= 0 and p.slot is None and not p.on_disk and p.disk_refs <= 0 and p.queued <= 0:
            self.parts.pop(p.name, None)

    def best(self, ids: list[int], cuts: set[int], floor: int) -> tuple[Entry | None, int]:
        """The entry that keeps the most of ``ids`` (call ends ``cuts``), if more than ``floor``."""
        best, keep = None, floor
        with self.lock:
            candidates = list(self.entries.values())
        for e in candidates:
            n = self.usable(e, ids, cuts)
            if n > keep:
                best, keep = e, n
        return best, keep

    def usable(self, e: Entry, ids: list[int], cuts: set[int]) -> int:
        """How many tokens of ``ids`` entry ``e`` gives exactly (0: none)."""
        limit = min(shared_len(ids, e.tokens), len(ids) - 1)
        if e.pos <= limit and e.pos in cuts:
            return e.pos
        if not self.truncatable:
            return 0
        return max((c for c in e.cuts if c <= limit and c in cuts), default=0)

    def marks(self, ids: list[int], cuts: list[int], keep: int, breaks: frozenset[int],
              fed: list[int]) -> frozenset[int]:
        """Where to copy states during this prompt: the end of its first message (the first call
        end before a control token of ``breaks``: the system prompt and tools) and the last call
        end it shares with another entry or the live sequence (``fed``), where not kept already."""
        marks = set()
        first = next((c for c in cuts if c > 0 and ids[c] in breaks), None)
        if first is not None:
            marks.add(first)
        with self.lock:
            entries = list(self.entries.values())
        shared = max([shared_len(ids, e.tokens) for e in entries] + [shared_len(ids, fed)])
        limit = min(shared, len(ids) - 1)
        marks.add(max((c for c in cuts if c <= limit), default=0))
        have = {e.tokens for e in entries}
        return frozenset(m for m in marks if m > keep and tuple(ids[:m]) not in have)
