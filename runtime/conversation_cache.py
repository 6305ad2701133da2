"""The conversations a server has seen, kept so that any of them resumes for the price of its new
tokens: an index of token prefixes over two tiers, host RAM and an optional folder.

Why: a coding agent does not send one linear conversation (a subagent taking turns with the main
thread, a title or commit-message request, two sessions open); with only the live sequence in
the GPU cache, each switch recomputed the whole conversation (issue 42). llama-server keeps a few
slots and a host-RAM prompt cache, SGLang a radix tree of KV pages with a host tier; here a
state is one ``SequenceState`` (``runtime.sequence_state``) per entry, taken where a fresh
session's call ends, so a resumed request gives a fresh run's bits.

- An entry: the token ids, the cuts within them, the state (host tier) and/or its file (disk
  tier). The live sequence stays in the session's GPU cache; after each request its state at
  ``Session.exact`` becomes an entry (on a GPU copied on a side stream, off the next request's
  path), replacing the same conversation's older entry that it extends.
- Lookup: the entry sharing the longest prefix with a request that ends a call of the request's
  own schedule (``Session.cuts_of``): its end for DeltaNet and sliding-window models, any cut
  within it for full-attention models (their rows are a prefix). It wins over the live sequence
  only when it keeps more.
- Shared prefixes: on models whose state cannot be cut back, a request marks the end of its
  first message (system prompt and tools) and the last call end it shares with another entry;
  the session copies the states there on the way (``Session.prompt``'s ``marks``) and they
  become entries of their own, so a new conversation with the same start resumes from them.
- Bounds: the host tier holds at most ``ram_bytes`` (least recently used out first); the
  folder keeps what it is given (written through: temp file, fsync, rename; an XXH3-128
  checksum; named by the model's key and the tokens). A file that is another model's, truncated
  or fails its checksum is ignored with one log line and the prompt is computed.
"""
from __future__ import annotations

import json
import logging
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sparkpack.formats.atomic_file import fsync_dir, temp_name
from sparkpack.formats.checksums import PACK_ALGORITHM, new_hasher

from .generate import Session, shared_len
from .sequence_state import SequenceState, truncatable

log = logging.getLogger("sparkpack.cache")

MAGIC = b"SPKVSEQ1"
SUFFIX = ".spkv"
DEFAULT_CACHE_RAM = 8 * 2**30
_DIGEST = 32  # hex digits of an XXH3-128 digest, the file's last bytes


@dataclass
class Entry:
    """One kept state. ``shared``: a shared-prefix checkpoint (never replaced by a longer turn)."""

    name: str
    tokens: tuple[int, ...]
    cuts: tuple[int, ...]
    nbytes: int
    state: SequenceState | None = None
    path: Path | None = None
    shared: bool = False
    used: int = 0

    @property
    def pos(self) -> int:
        return len(self.tokens)

    @property
    def tier(self) -> str:
        return "host" if self.state is not None else "disk"


@dataclass
class CacheStats:
    """What /metrics shows (``runtime.server.metrics``)."""

    hits: int = 0  # requests resumed from an entry
    live: int = 0  # requests that continued the sequence in the GPU cache
    misses: int = 0  # requests that kept nothing
    evictions: int = 0  # entries pushed out of the host tier
    restore_seconds: float = 0.0
    ignored_files: int = 0


@dataclass
class Resume:
    """What ``prepare`` did for one request: the entry resumed from (None: the live sequence or
    nothing), its tier, and the positions ``Session.prompt`` copies states at (``marks``)."""

    entry: Entry | None
    tier: str
    marks: frozenset[int] = field(default_factory=frozenset)


def model_key(session: Session) -> str:
    """What a state's bits depend on besides its tokens: the model file, the compute dtype and
    device, the KV cache type and where calls end. States are kept and looked up under it."""
    from .residency import identity_of

    model = session.model
    ident = identity_of(model.gguf)
    parts = {"model": ident.to_json(), "dtype": str(model.dtype), "device": model.device.type,
             "q8": any(getattr(la, "q8", False) for la in session.cache.layers), "calls": session.call_tokens,
             "chunk": session.prefill_chunk, "long_past": session.long_past, "padded": session.prefill is not None,
             "breaks": sorted(session.breaks)}
    h = new_hasher(PACK_ALGORITHM)
    h.update(json.dumps(parts, sort_keys=True).encode())
    return h.hexdigest()


class ConversationCache:
    """The entries of one session's model (``model_key``). ``ram_bytes`` 0: no host tier;
    ``folder`` None: no disk tier. Used from the engine thread only."""

    def __init__(self, session: Session, ram_bytes: int, folder: Path | None = None):
        self.session = session
        self.ram_bytes = ram_bytes
        self.folder = folder
        self.key = model_key(session)
        self.truncatable = truncatable(session.cache)
        self.entries: dict[str, Entry] = {}
        self.stats = CacheStats()
        self._tick = 0
        self._pending: list = []  # torch.cuda.Events of snapshots still copying
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            self._scan()

    # -- tiers, for /metrics ------------------------------------------------------------------
    def tier_counts(self) -> dict[str, tuple[int, int]]:
        """(entries, bytes) per tier."""
        host = [e for e in self.entries.values() if e.state is not None]
        disk = [e for e in self.entries.values() if e.path is not None]
        return {"host": (len(host), sum(e.nbytes for e in host)), "disk": (len(disk), sum(e.nbytes for e in disk))}

    # -- a request ------------------------------------------------------------------------------
    def prepare(self, ids: list[int]) -> Resume:
        """Before ``Session.prompt(ids)``: resume the session from the entry that keeps the most
        of ``ids`` if that is more than the live sequence keeps; say which positions to mark."""
        session = self.session
        for ready in self._pending:  # the last snapshots' copies, before the cache is written again
            torch.cuda.current_stream(session.model.device).wait_event(ready)
        self._pending = []
        cuts = set(session.cuts_of(ids))
        live = session.reusable(ids)
        best, keep = None, live
        for e in self.entries.values():
            n = self._usable(e, ids, cuts)
            if n > keep:
                best, keep = e, n
        resume = Resume(None, "gpu" if live else "none")
        if best is not None:
            t0, tier = time.perf_counter(), best.tier
            state = self._load(best)
            if state is not None:
                if self.truncatable and keep < best.pos:
                    state = _cut(state, keep)
                session.resume(state)
                self.stats.restore_seconds += time.perf_counter() - t0
                self._touch(best)
                resume = Resume(best, tier)
            else:
                keep = live
        if not self.truncatable:
            resume.marks = self._marks(ids, sorted(cuts), keep)
        return resume

    def after_prompt(self, ids: list[int], resume: Resume) -> None:
        """After ``Session.prompt``: one log line, the counts, and the marked states as entries."""
        session = self.session
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
            state = session.snapshot(m)
            if state is not None:
                self._add(state, shared=True)

    def remember(self) -> None:
        """After a request: the live sequence's state at its exact end becomes an entry (it
        replaces the same conversation's older turn)."""
        state = self.session.snapshot()
        if state is not None:
            self._add(state, shared=False)

    # -- index ----------------------------------------------------------------------------------
    def _usable(self, e: Entry, ids: list[int], cuts: set[int]) -> int:
        """How many tokens of ``ids`` entry ``e`` gives exactly (0: none)."""
        limit = min(shared_len(ids, e.tokens), len(ids) - 1)
        if e.pos <= limit and e.pos in cuts:
            return e.pos
        if not self.truncatable:
            return 0
        return max((c for c in e.cuts if c <= limit and c in cuts), default=0)

    def _marks(self, ids: list[int], cuts: list[int], keep: int) -> frozenset[int]:
        """Where to copy states during this prompt: the end of its first message (the first call
        end before a control token: the system prompt and tools) and the last call end it shares
        with another entry or the live sequence, where not kept already."""
        session = self.session
        marks = set()
        first = next((c for c in cuts if c > 0 and ids[c] in session.breaks), None)
        if first is not None:
            marks.add(first)
        shared = max([shared_len(ids, e.tokens) for e in self.entries.values()] + [shared_len(ids, session.fed)])
        limit = min(shared, len(ids) - 1)
        last = max((c for c in cuts if c <= limit), default=0)
        marks.add(last)
        have = {e.tokens for e in self.entries.values()}
        return frozenset(m for m in marks if m > keep and tuple(ids[:m]) not in have)

    def _touch(self, e: Entry) -> None:
        self._tick += 1
        e.used = self._tick

    def _add(self, state: SequenceState, shared: bool) -> None:
        if state.ready is not None:
            self._pending.append(state.ready)
        tokens = state.tokens
        name = self._name(tokens)
        e = self.entries.get(name)
        if e is None:
            e = Entry(name, tokens, state.cuts, state.nbytes, shared=shared)
            self.entries[name] = e
        e.shared = e.shared or shared
        if not shared:  # the same conversation's older turn, which this one extends
            for old in [o for o in self.entries.values() if not o.shared and o is not e and o.pos < e.pos
                        and tokens[:o.pos] == o.tokens]:
                self._drop(old)
        if self.ram_bytes > 0:
            e.state = state
        if self.folder is not None and e.path is None:
            self._write(e, state)
        self._touch(e)
        self._evict()
        if e.state is None and e.path is None:
            self.entries.pop(name, None)

    def _evict(self) -> None:
        """Least recently used out of the host tier until it fits (to the disk tier if there)."""
        host = sorted((e for e in self.entries.values() if e.state is not None), key=lambda e: e.used)
        total = sum(e.nbytes for e in host)
        for e in host:
            if total <= self.ram_bytes:
                break
            e.state = None
            total -= e.nbytes
            self.stats.evictions += 1
            if e.path is None:
                del self.entries[e.name]

    def _drop(self, e: Entry) -> None:
        self.entries.pop(e.name, None)
        if e.path is not None:
            e.path.unlink(missing_ok=True)

    def _name(self, tokens: tuple[int, ...]) -> str:
        h = new_hasher(PACK_ALGORITHM)
        h.update(self.key.encode())
        h.update(memoryview(torch.tensor(tokens, dtype=torch.int64).numpy()))
        return h.hexdigest()

    # -- disk tier ------------------------------------------------------------------------------
    def _load(self, e: Entry) -> SequenceState | None:
        """The entry's state, read from its file if not in host memory (then kept there); None
        when the file is unusable (one log line; the entry is forgotten)."""
        if e.state is not None:
            return e.state
        try:
            state = read_state(e.path, self.key)
        except (OSError, ValueError) as err:
            log.warning("ignoring conversation cache file %s: %s (recomputing)", e.path, err)
            self.stats.ignored_files += 1
            self.entries.pop(e.name, None)
            return None
        if self.ram_bytes > 0:
            e.state = state
            self._touch(e)
            self._evict()
        return state

    def _write(self, e: Entry, state: SequenceState) -> None:
        path = self.folder / (e.name + SUFFIX)
        try:
            write_state(path, self.key, state, e.shared)
        except OSError as err:
            log.warning("cannot write conversation cache file %s: %s", path, err)
            return
        e.path = path

    def _scan(self) -> None:
        """Index the folder's files of this model (their headers only; payloads are checked when used)."""
        for path in sorted(self.folder.glob("*" + SUFFIX)):
            try:
                meta = read_meta(path)
            except (OSError, ValueError) as err:
                log.warning("ignoring conversation cache file %s: %s", path, err)
                self.stats.ignored_files += 1
                continue
            if meta["key"] != self.key:
                continue  # another model's or other session options' (the folder may be shared)
            tokens = tuple(meta["tokens"])
            name = path.name[: -len(SUFFIX)]
            self.entries[name] = Entry(name, tokens, tuple(meta["cuts"]), meta["payload"], path=path,
                                       shared=meta["shared"])


def _cut(state: SequenceState, pos: int) -> SequenceState:
    """A full-attention state cut back to ``pos`` (its rows are a prefix)."""
    layers = [None if t is None else tuple(r[:, :pos] for r in t[:-1]) + (t[-1],) for t in state.layers]
    return SequenceState(state.tokens[:pos], tuple(c for c in state.cuts if c <= pos), layers)


# -- the file format: MAGIC, u32 length, meta JSON, payload (the tensors' bytes in order), digest --
def write_state(path: Path, key: str, state: SequenceState, shared: bool) -> None:
    """Write ``state`` to ``path`` atomically (temp name, fsync, rename)."""
    state.wait()
    tensors = [t for layer in state.layers if layer is not None for t in layer]
    meta = {"key": key, "tokens": list(state.tokens), "cuts": list(state.cuts), "shared": shared,
            "layers": [None if layer is None else [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in layer]
                       for layer in state.layers],
            "payload": sum(t.nbytes for t in tensors)}
    head = json.dumps(meta).encode()
    h = new_hasher(PACK_ALGORITHM)
    h.update(head)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(head)) + head)
            for t in tensors:
                data = memoryview(t.contiguous().view(torch.uint8).numpy())
                h.update(data)
                f.write(data)
            f.write(h.hexdigest().encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def read_meta(path: Path) -> dict:
    """A file's header, checked for shape and size (ValueError: not one of ours, or truncated)."""
    with open(path, "rb") as f:
        first = f.read(len(MAGIC) + 4)
        if len(first) < len(MAGIC) + 4 or first[: len(MAGIC)] != MAGIC:
            raise ValueError("not a sparkpack conversation state")
        (n,) = struct.unpack("<I", first[len(MAGIC):])
        try:
            meta = json.loads(f.read(n))
        except ValueError:
            raise ValueError("its header is not readable") from None
    if not isinstance(meta, dict) or not {"key", "tokens", "cuts", "shared", "layers", "payload"} <= meta.keys():
        raise ValueError("its header lacks fields")
    size = len(MAGIC) + 4 + n + meta["payload"] + _DIGEST
    if path.stat().st_size != size:
        raise ValueError(f"{path.stat().st_size} bytes where its header says {size} (truncated?)")
    meta["head"] = n
    return meta


def read_state(path: Path, key: str) -> SequenceState:
    """The state in ``path`` after checking its checksum and model key (ValueError otherwise)."""
    meta = read_meta(path)
    if meta["key"] != key:
        raise ValueError("it belongs to another model or other session options")
    data = path.read_bytes()
    start = len(MAGIC) + 4
    body = memoryview(data)[start: len(data) - _DIGEST]
    h = new_hasher(PACK_ALGORITHM)
    h.update(body)
    if h.hexdigest().encode() != data[len(data) - _DIGEST:]:
        raise ValueError("checksum mismatch (corrupted)")
    raw = torch.frombuffer(bytearray(body[meta["head"]:]), dtype=torch.uint8) if meta["payload"] else None
    layers: list = []
    at = 0
    for spec in meta["layers"]:
        if spec is None:
            layers.append(None)
            continue
        tensors = []
        for dtype, shape in spec:
            dt = getattr(torch, dtype)
            n = dt.itemsize * int(torch.Size(shape).numel())
            tensors.append(raw[at: at + n].clone().view(dt).view(shape))  # (a copy: aligned for its dtype)
            at += n
        layers.append(tuple(tensors))
    return SequenceState(tuple(meta["tokens"]), tuple(meta["cuts"]), layers)
