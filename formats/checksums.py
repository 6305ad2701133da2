"""Checksums of pack bytes and model headers: the algorithms a manifest may name, and hashing.

A checksum is written ``"<algorithm>:<hex digest>"``. New packs use XXH3-128 (the ``xxhash``
package, which ``datasets`` already installs): an order of magnitude faster than SHA-256 on one
core, so checking every byte ``spark-run`` loads from a pack costs seconds, not a large share of
the load. It detects corruption (bit rot, truncation, a swapped or
zero-filled shard), which is what a pack's checksums are for; it does not stop someone who
rewrites a pack on purpose. Version-1 packs name SHA-256 and stay readable. Model identities
(``formats.profile``) keep SHA-256 of the GGUF header: profiles and packs already store them.
"""
from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from typing import Protocol

from .errors import FormatError

PACK_ALGORITHM = "xxh3_128"  # what split writes
IDENTITY_ALGORITHM = "sha256"  # the GGUF header hash of a model identity
_READ_CHUNK = 8 << 20


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


def _xxh3_128() -> Hasher:
    import xxhash

    return xxhash.xxh3_128()


# name -> (constructor, hex digits of a digest)
ALGORITHMS: dict[str, tuple[Callable[[], Hasher], int]] = {
    "sha256": (hashlib.sha256, 64),
    "xxh3_128": (_xxh3_128, 32),
}


def new_hasher(algorithm: str) -> Hasher:
    return ALGORITHMS[algorithm][0]()


def checksum(algorithm: str, data: bytes | bytearray | memoryview | object) -> str:
    """``"<algorithm>:<hex>"`` of a buffer (bytes, memoryview or a contiguous numpy array)."""
    h = new_hasher(algorithm)
    h.update(memoryview(data))  # type: ignore[arg-type]
    return f"{algorithm}:{h.hexdigest()}"


def is_checksum(value: object, algorithm: str) -> bool:
    """Whether ``value`` is a well-formed checksum string of ``algorithm``."""
    if not isinstance(value, str) or algorithm not in ALGORITHMS:
        return False
    digits = ALGORITHMS[algorithm][1]
    return re.fullmatch(rf"{re.escape(algorithm)}:[0-9a-f]{{{digits}}}", value) is not None


def hash_file_range(path: str | os.PathLike[str], start: int, nbytes: int,
                    algorithm: str = IDENTITY_ALGORITHM) -> str:
    """Checksum of a byte range of a file, read in chunks so memory stays flat (never through a
    memory map: touched pages of a map count as resident)."""
    h = new_hasher(algorithm)
    buf = bytearray(min(_READ_CHUNK, max(nbytes, 1)))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        left = nbytes
        while left:
            n = f.readinto(view[: min(left, len(buf))])
            if not n:
                raise FormatError(path, f"file ends {left} bytes early")
            h.update(view[:n])
            left -= n
    return f"{algorithm}:{h.hexdigest()}"
