"""Read-only, zero-copy access to a GGUF file.

The model files we handle are 18-21 GiB, so nothing here reads tensor data eagerly: the file is
memory-mapped and tensors are handed out as views of that map. Everything the rest of the project
needs from a GGUF goes through ``GGUFModel``; parse failures of any kind become one
``FormatError`` line naming the file.

The header is read by ``gguf_header.scan_header``, a walk that bounds every count by the bytes
left, not by ``gguf.GGUFReader``: that reader trusts counts (a corrupted array count makes it
loop for hours), needed a private method overridden to check tensor ranges, and builds a Python
object per array element, slow and large for a 248k-token vocabulary that the walk steps over
(values are decoded only when asked for). tests/test_gguf_header.py checks every value against gguf-py's
reader, which stays the referee.
"""
from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from .errors import FormatError, SparkpackError
from .gguf_header import ARRAY as _ARRAY
from .gguf_header import GGUF_MAGIC, SUPPORTED_VERSIONS, scan_header
from .quants import quant_name
from .safe_read import require_regular


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor index. ``shape`` is in GGUF order (ne[0] first, the fastest axis)."""

    name: str
    shape: tuple[int, ...]
    qtype: int  # a gguf.GGMLQuantizationType value
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return quant_name(self.qtype)

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from file ``fd`` at ``offset`` (``preadv`` until done: it may return less);
    returns the bytes read, fewer than asked where the file ends first."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            break
        done += got
    return done


class GGUFModel:
    """A memory-mapped GGUF file: metadata, tensor index and zero-copy tensor bytes."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.file_size = self._check_preamble()
        try:
            self._file = open(self.path, "rb", buffering=0)  # also for ``read_into`` (threads share it)
            self._map: mmap.mmap | None = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise SparkpackError(self.path, f"cannot map the file ({_short(e)})") from None
        self._data = np.frombuffer(self._map, dtype=np.uint8)
        self._index = scan_header(self._data, self.path)
        self._values: dict[str, Any] = {}
        self.alignment = self._index.alignment
        self.tensors: dict[str, TensorInfo] = {
            t.name: TensorInfo(t.name, t.shape, t.qtype, self._index.data_offset + t.offset, t.nbytes)
            for t in self._index.tensors}

    def _check_preamble(self) -> int:
        """Reject the common non-GGUF cases with a message that says which; returns the file size."""
        st = require_regular(self.path, "a .gguf file")
        try:
            with open(self.path, "rb") as f:
                head = f.read(8)
        except OSError as e:
            raise SparkpackError(self.path, f"cannot read ({e.strerror})") from None
        if len(head) < 8:
            raise FormatError(self.path, f"only {len(head)} bytes long, too short to be a GGUF file")
        if head[:4] != GGUF_MAGIC:
            raise FormatError(self.path, f"not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
        version = int.from_bytes(head[4:8], "little")
        if version not in SUPPORTED_VERSIONS:
            raise FormatError(self.path, f"unsupported GGUF version {version} (supported: 2, 3)")
        return st.st_size

    # --- metadata -------------------------------------------------------------------------

    @property
    def metadata_keys(self) -> list[str]:
        return list(self._index.fields)

    def has(self, key: str) -> bool:
        return key in self._index.fields

    def value_type(self, key: str) -> tuple[int, int | None]:
        """The GGUF value type a key is stored with, and its elements' type for an array (what an
        edit that keeps the key's type writes)."""
        vtype, pos = self._index.fields[key]
        sub = int(np.frombuffer(self._data[pos:pos + 4].tobytes(), "<u4")[0]) if vtype == _ARRAY else None
        return int(vtype), sub

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata value as a Python scalar, str or list (arrays of strings become list[str]).
        Decoded on first use and kept (a tokenizer's token list is asked for more than once)."""
        if key not in self._index.fields:
            return default
        if key not in self._values:
            self._values[key] = self._index.value(self._data, key, self.path)
        return self._values[key]

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise FormatError(self.path, f"missing metadata key {key}")
        return value

    @cached_property
    def arch(self) -> str:
        arch = self.require("general.architecture")
        if not isinstance(arch, str):
            raise FormatError(self.path, f"metadata key general.architecture is {type(arch).__name__}, expected a string")
        return arch

    # --- tensor data ----------------------------------------------------------------------

    @property
    def data_offset(self) -> int:
        """Where the tensor data section starts (every tensor offset is at or after it)."""
        return self._index.data_offset

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise FormatError(self.path, f"missing tensor {name}") from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a uint8 view of the file map (no copy)."""
        t = self.tensor(name)
        return self.bytes_at(t.offset, t.nbytes)

    def bytes_at(self, offset: int, nbytes: int) -> np.ndarray:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.file_size:
            raise FormatError(self.path, f"byte range {offset}+{nbytes} outside the file")
        return self._data[offset : offset + nbytes]

    def read_into(self, offset: int, out: np.ndarray) -> None:
        """Fill ``out`` (contiguous uint8) with the bytes at ``offset`` by reading the file, not
        through the map. Why: pages touched through the map stay in the process's resident set
        (file-backed) while it runs, so loading a model's experts through it shows the whole file
        as resident memory; read into a buffer, they stay in the page cache only, and the
        buffer (a device pool's staging, the pinned host pool) is the memory the process holds."""
        n = out.nbytes
        if offset < 0 or offset + n > self.file_size:
            raise FormatError(self.path, f"byte range {offset}+{n} outside the file")
        if self._file is None:
            raise SparkpackError(self.path, "read after close")
        try:
            done = pread_into(self._file.fileno(), memoryview(out).cast("B"), offset)
        except OSError as e:
            raise SparkpackError(self.path, f"cannot read ({e.strerror or e})") from None
        if done < n:
            raise FormatError(self.path, f"file ends inside byte range {offset}+{n} (truncated while open?)")

    def header_bytes(self) -> np.ndarray:
        """Everything before the tensor data: magic, metadata, tensor index (identifies the model)."""
        return self._data[: self.data_offset]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        mm, self._map = self._map, None
        self._data = None  # type: ignore[assignment]
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # a view is still alive; the map is freed with it

    def __enter__(self) -> "GGUFModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:200]
