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
  path), replacing the same conversation's older entry that it extends and sharing its
  attention rows: a turn copies only its new rows (and the small recurrent states or windows).
- Lookup: the entry sharing the longest prefix with a request that ends a call of the request's
  own schedule (``Session.cuts_of``): its end for DeltaNet and sliding-window models, any cut
  within it for full-attention models (their rows are a prefix). It wins over the live sequence
  only when it keeps more.
- Shared prefixes: on models whose state cannot be cut back, a request marks the end of its
  first message (system prompt and tools) and the last call end it shares with another entry;
  the session copies the states there on the way (``Session.prompt``'s ``marks``) and they
  become entries of their own, so a new conversation with the same start resumes from them.
- Bounds: the host tier holds at most ``ram_bytes`` (rows shared between entries counted once;
  least recently used out first); the folder keeps every entry (written through by a thread of
  its own: temp file, fsync, rename; an XXH3-128 checksum; named by the model's key and the
  tokens; a replaced turn's file is deleted). A file that is another model's, truncated or
  fails its checksum is ignored with one log line and the prompt is computed.
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

from .generate import Session, shared_len
from .sequence_state import Rows, SequenceState, truncatable

log = logging.getLogger("sparkpack.cache")

MAGIC = b"SPKVSEQ1"
SUFFIX = ".spkv"
DEFAULT_CACHE_RAM = 8 * 2**30
_DIGEST = 32  # hex digits of an XXH3-128 digest, the file's last bytes
_ALIGN = 64  # the header and each tensor padded to it: tensors are read in place, aligned for their dtype


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


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
    ``folder`` None: no disk tier. Used from the engine thread; files are written by a thread of
    their own (``close`` waits for it), so a request never waits for the disk."""

    def __init__(self, session: Session, ram_bytes: int, folder: Path | None = None):
        self.session = session
        self.ram_bytes = ram_bytes
        self.folder = folder
        self.key = model_key(session)
        self.truncatable = truncatable(session.cache)
        self.entries: dict[str, Entry] = {}
        self.stats = CacheStats()
        self._tick = 0
        self._lock = threading.Lock()  # the entries' paths, between this thread and the writer
        self._writes: queue.Queue[tuple[Entry, SequenceState] | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            self._scan()
            self._writer = threading.Thread(target=self._write_loop, name="sparkpack-cache-writer", daemon=True)
            self._writer.start()

    def close(self) -> None:
        """Finish the files queued for writing."""
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join()
            self._writer = None

    # -- tiers, for /metrics ------------------------------------------------------------------
    def tier_counts(self) -> dict[str, tuple[int, int]]:
        """(entries, bytes) per tier; host bytes count rows shared between entries once. (Read
        by /metrics in another thread: it works on a copy of the index.)"""
        entries = list(self.entries.values())
        states = [st for st in (e.state for e in entries) if st is not None]
        disk = [e for e in entries if e.path is not None]
        return {"host": (len(states), _unique_bytes(states)), "disk": (len(disk), sum(e.nbytes for e in disk))}

    def _host_bytes(self) -> int:
        return _unique_bytes([e.state for e in self.entries.values() if e.state is not None])

    # -- a request ------------------------------------------------------------------------------
    def prepare(self, ids: list[int]) -> Resume:
        """Before ``Session.prompt(ids)``: resume the session from the entry that keeps the most
        of ``ids`` if that is more than the live sequence keeps; say which positions to mark."""
        session = self.session
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
                session.resume(state.cut(keep) if keep < best.pos else state)
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
            state = session.snapshot(m, self._parent(session.fed[:m]))
            if state is not None:
                self._add(state, shared=True)

    def remember(self) -> None:
        """After a request: the live sequence's state at its exact end becomes an entry (it
        replaces the same conversation's older turn, and shares its attention rows)."""
        session = self.session
        state = session.snapshot(None, self._parent(session.fed[:session.exact]))
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

    def _parent(self, tokens: list[int]) -> SequenceState | None:
        """The longest state in host memory of a prefix of ``tokens`` that ends one of the
        session's calls: its attention rows are those the session holds. On full-attention
        models a longer entry cut back to such a call end serves too (another conversation with
        the same system prompt: its rows are kept once)."""
        cuts = set(self.session.cuts)
        best, at = None, 0
        for e in self.entries.values():
            if e.state is None:
                continue
            n = min(shared_len(tokens, e.tokens), len(tokens) - 1)
            c = e.pos if e.pos <= n and e.pos in cuts else \
                max((c for c in e.cuts if c <= n and c in cuts), default=0) if self.truncatable else 0
            if c > at:
                best, at = e, c
        if best is None:
            return None
        return best.state if at == best.pos else best.state.cut(at)

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
        marks.add(max((c for c in cuts if c <= limit), default=0))
        have = {e.tokens for e in self.entries.values()}
        return frozenset(m for m in marks if m > keep and tuple(ids[:m]) not in have)

    def _touch(self, e: Entry) -> None:
        self._tick += 1
        e.used = self._tick

    def _add(self, state: SequenceState, shared: bool) -> None:
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
        if self._writer is not None and e.path is None:
            self._writes.put((e, state))
        self._touch(e)
        self._evict()
        if e.state is None and e.path is None and self._writer is None:
            self.entries.pop(name, None)

    def _evict(self) -> None:
        """Least recently used out of the host tier until it fits (to the disk tier if there)."""
        total = self._host_bytes()
        for e in sorted((e for e in self.entries.values() if e.state is not None), key=lambda e: e.used):
            if total <= self.ram_bytes:
                break
            e.state = None
            total = self._host_bytes()  # (rows it shared with others stay)
            self.stats.evictions += 1
            if e.path is None and self._writer is None:
                del self.entries[e.name]

    def _drop(self, e: Entry) -> None:
        with self._lock:
            self.entries.pop(e.name, None)
            if e.path is not None:
                e.path.unlink(missing_ok=True)
                e.path = None

    def _name(self, tokens: tuple[int, ...]) -> str:
        h = new_hasher(PACK_ALGORITHM)
        h.update(self.key.encode())
        h.update(memoryview(torch.tensor(tokens, dtype=torch.int64).numpy()))
        return h.hexdigest()

    # -- disk tier ------------------------------------------------------------------------------
    def _load(self, e: Entry) -> SequenceState | None:
        """The entry's state, read from its file if not in host memory (then kept there); None
        when it has neither (a file still being written) or the file is unusable (one log line;
        the entry is forgotten)."""
        if e.state is not None:
            return e.state
        with self._lock:
            path = e.path
        if path is None:
            return None
        try:
            state = read_state(path, self.key)
        except (OSError, ValueError) as err:
            log.warning("ignoring conversation cache file %s: %s (recomputing)", path, err)
            self.stats.ignored_files += 1
            self.entries.pop(e.name, None)
            return None
        if self.ram_bytes > 0:
            e.state = state
            self._touch(e)
            self._evict()
        return state

    def _write_loop(self) -> None:
        while (job := self._writes.get()) is not None:
            e, state = job
            path = self.folder / (e.name + SUFFIX)
            try:
                write_state(path, self.key, state, e.shared)
            except OSError as err:
                log.warning("cannot write conversation cache file %s: %s", path, err)
                continue
            with self._lock:
                if self.entries.get(e.name) is e:
                    e.path, e.nbytes = path, path.stat().st_size
                else:  # dropped meanwhile (a longer turn of its conversation replaced it)
                    path.unlink(missing_ok=True)

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
            name = path.name[: -len(SUFFIX)]
            self.entries[name] = Entry(name, tuple(meta["tokens"]), tuple(meta["cuts"]), path.stat().st_size,
                                       path=path, shared=bool(meta["shared"]))


def _unique_bytes(states: list[SequenceState]) -> int:
    """The host bytes of ``states``, rows shared between them counted once."""
    storages = {}
    for st in states:
        for t in st.tensors():  # (views of one allocation, or of one file's bytes, count it once)
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


# -- the file format: MAGIC, u32 length, meta JSON (space-padded), payload (the tensors' bytes in
# order, each zero-padded), digest of all but MAGIC and the length --
def write_state(path: Path, key: str, state: SequenceState, shared: bool) -> None:
    """Write ``state`` to ``path`` atomically (temp name, fsync, rename)."""
    state.wait()
    layers, tensors = [], []
    for part in state.layers:
        if part is None:
            layers.append(None)
            continue
        these = part.tensors() if isinstance(part, Rows) else list(part)
        spec: dict = {"tensors": [[_dtype_name(t.dtype), list(t.shape)] for t in these]}
        if isinstance(part, Rows):  # chunks of len(KVCache.state()) tensors
            spec.update(chunk=len(part.chunks[0]), dtype=_dtype_name(part.dtype))
        layers.append(spec)
        tensors += these
    meta = {"key": key, "tokens": list(state.tokens), "cuts": list(state.cuts), "shared": shared,
            "layers": layers, "payload": sum(_padded(t.nbytes) for t in tensors)}
    head = json.dumps(meta).encode()
    head += b" " * (_padded(len(MAGIC) + 4 + len(head)) - len(MAGIC) - 4 - len(head))
    h = new_hasher(PACK_ALGORITHM)
    h.update(head)
    with atomic_writer(path) as f:
        f.write(MAGIC + struct.pack("<I", len(head)) + head)
        for t in tensors:
            data = memoryview(t.contiguous().view(torch.uint8).numpy())
            pad = bytes(_padded(t.nbytes) - t.nbytes)
            for part in (data, pad):
                h.update(part)
                f.write(part)
        f.write(h.hexdigest().encode())


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
    if not isinstance(meta, dict) or not {"key", "tokens", "cuts", "shared", "layers", "payload"} <= meta.keys() \
            or not all(isinstance(meta[k], list) and all(type(x) is int for x in meta[k]) for k in ("tokens", "cuts")) \
            or type(meta["payload"]) is not int or not isinstance(meta["layers"], list):
        raise ValueError("its header lacks fields or has fields of the wrong type")
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
    data = bytearray(path.stat().st_size)
    with open(path, "rb") as f:
        if f.readinto(data) != len(data):
            raise ValueError("it changed while read")
    start = len(MAGIC) + 4
    h = new_hasher(PACK_ALGORITHM)
    h.update(memoryview(data)[start: len(data) - _DIGEST])
    if h.hexdigest().encode() != bytes(data[len(data) - _DIGEST:]):
        raise ValueError("checksum mismatch (corrupted)")
    raw = torch.frombuffer(data, dtype=torch.uint8)  # the tensors are views of the file's bytes
    at = start + meta["head"]
    layers: list = []
    for spec in meta["layers"]:
        if spec is None:
            layers.append(None)
            continue
        tensors = []
        for dtype, shape in spec["tensors"]:
            dt = getattr(torch, dtype)
            n = dt.itemsize * int(torch.Size(shape).numel())
            tensors.append(raw[at: at + n].view(dt).view(shape))
            at += _padded(n)
        if "chunk" in spec:
            k = spec["chunk"]
            layers.append(Rows([tuple(tensors[i:i + k]) for i in range(0, len(tensors), k)], getattr(torch, spec["dtype"])))
        else:
            layers.append(tuple(tensors))
    return SequenceState(tuple(meta["tokens"]), tuple(meta["cuts"]), layers)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
