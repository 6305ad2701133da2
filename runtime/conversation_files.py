"""The conversation cache's files: an entry file (``NAME.spkv``: its tokens, cuts and the names of
its parts) and a part file (``blocks/NAME.spkb``: one part's tensors), each MAGIC, a u32 length,
a JSON header, the payload (a part's tensors' bytes in layout order) and an XXH3-128 digest of
all but MAGIC and the length.

Why apart from the folder tier (``runtime.conversation_folder``): the format is a contract with
files written by earlier runs (a restarted server reads them), checked field by field here, and
the tier's threads and refcounts are another job. Written atomically (temp name, fsync, rename);
a reader raises ValueError for a file that is not ours, truncated or corrupted.
"""
from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sparkpack.formats.atomic_file import atomic_writer
from sparkpack.formats.checksums import PACK_ALGORITHM, new_hasher

from .host_pool import Layout, SlotPool

if TYPE_CHECKING:
    from .conversation_index import Entry

MAGIC = b"SPKVSEQ2"  # an entry file
BLOCK_MAGIC = b"SPKVBLK2"  # a part's file
SUFFIX = ".spkv"
BLOCK_SUFFIX = ".spkb"
BLOCKS = "blocks"  # the parts' subfolder
_DIGEST = 32  # hex digits of an XXH3-128 digest, a file's last bytes


def remove(path: Path) -> None:
    """Delete a file the cache no longer names; a failure (a read-only or failing disk) is one
    log line, never raised: the threads that drop files hold slots and the engine's requests
    behind them. A file left over costs disk space; a restarted server ignores an entry whose
    parts are gone (one log line) and computes its prompt."""
    try:
        path.unlink(missing_ok=True)
    except OSError as err:
        logging.getLogger("sparkpack.cache").warning("cannot remove conversation cache file %s: %s", path, err)


def _head(magic: bytes, meta: dict) -> bytes:
    head = json.dumps(meta).encode()
    return magic + struct.pack("<I", len(head)) + head


def write_entry(path: Path, key: str, e: "Entry") -> None:
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


def part_layout(path: Path) -> Layout:
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
