"""A bounded walk of a GGUF header: every count and length checked against the bytes left.

gguf-py's reader trusts the counts it reads: a corrupted array count makes it loop for hours, a
tensor that runs past the end of the file fails inside numpy. ``scan_header`` walks the same
structure first (magic, version, key/value pairs, tensor index), refusing anything a real GGUF
cannot hold, so that gguf-py only ever sees a file whose structure is sound; then the tensor map
as a whole (``check_tensor_map``: ranges inside the data section, no two sharing a byte). It
also reads a header without the tensor data behind it (a pack's ``header.bin``), which gguf-py
cannot, so ``repack verify`` can check a manifest against the header it was written from.

Layout (little-endian, GGUF v2/v3): magic, u32 version, u64 tensor count, u64 key/value count,
the key/value pairs (string key, u32 value type, value; arrays are u32 element type, u64 count,
elements; strings u64 length then bytes), the tensor infos (string name, u32 n_dims, u64 ne[n_dims],
u32 type, u64 offset from the data section), padding to ``general.alignment`` (default 32), data.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import FormatError, shown

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS: ggml tensors have at most 4 dimensions
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
# value type -> struct format of one element (strings and arrays are handled apart)
SCALARS: dict[int, str] = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
                           11: "<q", 12: "<d"}
_MIN_KV = 8 + 4 + 1  # empty key, type, one byte of value
_MIN_TENSOR = 8 + 4 + 4 + 8  # empty name, n_dims 0, type, offset
_INT64_MAX = 2**63 - 1
_UINT64 = 2**64


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # GGUF order, ne[0] first
    qtype: int
    offset: int  # from the start of the data section
    nbytes: int


@dataclass(frozen=True)
class HeaderIndex:
    version: int
    fields: dict[str, tuple[int, int]]  # metadata key -> (value type, byte offset of its value), file order
    tensors: list[TensorEntry]  # in index order
    alignment: int
    data_offset: int  # where the data section starts (past the end only in a file without tensors)

    def value(self, buf: memoryview | bytes, key: str, where: object = None) -> Any:
        """A metadata value decoded from the walked buffer: int, float, bool, str, or a list of
        them, as gguf-py's ``ReaderField.contents()`` gives it."""
        vtype, pos = self.fields[key]
        cur = _Cursor(memoryview(buf).cast("B"), where)
        cur.pos = pos
        return _value(cur, vtype, key, True)


class _Cursor:
    """Reads from a buffer, refusing every read that would run past its end."""

    def __init__(self, buf: memoryview, where: object):
        self.buf, self.pos, self.where = buf, 0, where

    def left(self) -> int:
        return len(self.buf) - self.pos

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.left():
            raise FormatError(self.where, f"{what} at byte {self.pos} needs {n} bytes, only {self.left()} are "
                                          "left: the file is truncated or its header is corrupt")

    def unpack(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return v

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.pos += n

    def skip_strings(self, count: int, key: str) -> None:
        """Step over ``count`` strings (a tokenizer's 250k tokens: the hot loop of the walk)."""
        buf, pos, end, unpack = self.buf, self.pos, len(self.buf), struct.unpack_from
        for j in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.need(8, f"element {j} of {key}")
            pos += 8 + unpack("<Q", buf, pos)[0]
            if pos > end:
                raise FormatError(self.where, f"element {j} of {key} runs past the end of the header: the file "
                                              "is truncated or its header is corrupt")
        self.pos = pos

    def string(self, what: str, decode: bool = True) -> str | None:
        n = self.unpack("<Q", what)
        self.need(n, what)
        raw = self.buf[self.pos: self.pos + n]
        self.pos += n
        if not decode:
            return None
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(self.where, f"{what} at byte {self.pos - n} is not valid UTF-8") from None


def scan_header(buf: memoryview | bytes, where: object, *, file_size: int | None = None) -> HeaderIndex:
    """Walk the header in ``buf`` (the file, or at least its header) and return its index;
    values are stepped over (``HeaderIndex.value`` decodes one on demand).

    ``file_size`` is the size of the whole file when ``buf`` holds only its header (tensor
    ranges are checked against it); by default ``len(buf)``.
    """
    cur = _Cursor(memoryview(buf).cast("B"), where)
    size = len(cur.buf) if file_size is None else file_size
    cur.need(8, "the GGUF preamble")
    if bytes(cur.buf[:4]) != GGUF_MAGIC:
        raise FormatError(where, f"not a GGUF file (magic {bytes(cur.buf[:4])!r}, expected b'GGUF')")
    cur.pos = 4
    version = cur.unpack("<I", "version")
    if version not in SUPPORTED_VERSIONS:
        raise FormatError(where, f"unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors = cur.unpack("<Q", "tensor count")
    n_kv = cur.unpack("<Q", "metadata count")
    if n_kv > cur.left() // _MIN_KV:
        raise FormatError(where, f"header claims {n_kv} metadata entries, more than its {cur.left()} bytes can hold")
    if n_tensors > cur.left() // _MIN_TENSOR:
        raise FormatError(where, f"header claims {n_tensors} tensors, more than its {cur.left()} bytes can hold")
    fields: dict[str, tuple[int, int]] = {}
    alignment = DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = cur.string(f"metadata key {i}")
        assert key is not None
        label = shown(key)  # the key as messages name it
        if key in fields:
            raise FormatError(where, f"metadata key {label} appears twice")
        vtype = cur.unpack("<I", f"type of metadata key {label}")
        fields[key] = (vtype, cur.pos)
        value = _value(cur, vtype, label, key == "general.alignment")
        if key == "general.alignment":
            if vtype != 4 or value == 0 or value & (value - 1):
                raise FormatError(where, f"general.alignment must be a power of two stored as uint32, got {value!r}")
            alignment = value
    if n_tensors > cur.left() // _MIN_TENSOR:
        raise FormatError(where, f"header claims {n_tensors} tensors, more than its {cur.left()} bytes can hold")
    raw: list[tuple[str, tuple[int, ...], int, int]] = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = cur.string(f"name of tensor {i}")
        assert name is not None
        label = shown(name)
        if name in names:
            raise FormatError(where, f"tensor {label} appears twice in the tensor index")
        names.add(name)
        n_dims = cur.unpack("<I", f"tensor {label} dimension count")
        if n_dims > MAX_DIMS:
            raise FormatError(where, f"tensor {label} has {n_dims} dimensions; ggml tensors have at most {MAX_DIMS}")
        cur.need(8 * n_dims, f"tensor {label} shape")
        shape = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.pos)
        cur.pos += 8 * n_dims
        qtype = cur.unpack("<I", f"tensor {label} type")
        offset = cur.unpack("<Q", f"tensor {label} offset")
        raw.append((name, tuple(int(d) for d in shape), qtype, offset))
    data_offset = -(-cur.pos // alignment) * alignment
    # (a file without tensors, such as a vocab-only GGUF, may end before the alignment padding:
    # ggml and gguf-py read it, as an empty data section)
    if raw and data_offset > size:
        raise FormatError(where, f"the tensor data section would start at byte {data_offset}, past the end of "
                                 f"the file ({size} bytes): the file is truncated")
    tensors = [_tensor(where, name, shape, qtype, offset, alignment, data_offset, size)
               for name, shape, qtype, offset in raw]
    check_tensor_map(where, [(t.name, data_offset + t.offset, t.nbytes) for t in tensors], data_offset, size)
    return HeaderIndex(version, fields, tensors, alignment, data_offset)


def check_tensor_map(where: object, spans: list[tuple[str, int, int]], data_offset: int, size: int) -> None:
    """The tensor map as a whole: every range (name, absolute start, byte count) inside the data
    section ``[data_offset, size)`` and no byte in two tensors.

    Each tensor can be sound on its own while the map is not: a tensor moved onto another's bytes
    reads them as its own (a norm over attention weights gave all-NaN logits with exit 0, issue
    43). ggml refuses such files, so every reader here does too, once, where the index is read
    (a GGUF, a pack's header copy, a pack manifest's tensor list). Sorted by start, a range that
    begins before the furthest end seen so far overlaps the tensor that reached it."""
    reach: tuple[str, int, int] | None = None  # the tensor that ends furthest so far, with its range
    for name, start, nbytes in sorted(spans, key=lambda s: (s[1], s[1] + s[2])):
        end = start + nbytes
        if start < data_offset:
            raise FormatError(where, f"tensor {shown(name)} starts at byte {start}, inside the header: the data "
                                     f"section starts at byte {data_offset}")
        if end > size:
            raise FormatError(where, f"tensor {shown(name)} ends at byte {end}, past the end of the file ({size} "
                                     "bytes): the file is truncated or its tensor index is corrupt")
        if reach is not None and nbytes and start < reach[2]:
            raise FormatError(where, f"tensors {shown(reach[0])} (bytes {reach[1]}..{reach[2]}) and {shown(name)} "
                                     f"(bytes {start}..{end}) overlap: the tensor index is corrupt")
        if reach is None or end > reach[2]:
            reach = (name, start, end)


def _value(cur: _Cursor, vtype: int, key: str, decode: bool) -> Any:
    if vtype == STRING:
        return cur.string(f"value of {key}", decode)
    if vtype in SCALARS:
        fmt = SCALARS[vtype]
        if not decode:
            cur.skip(struct.calcsize(fmt), f"value of {key}")
            return None
        return cur.unpack(fmt, f"value of {key}")
    if vtype != ARRAY:
        raise FormatError(cur.where, f"metadata key {key} has unknown value type {vtype}")
    etype = cur.unpack("<I", f"array type of {key}")
    count = cur.unpack("<Q", f"array length of {key}")
    if etype == STRING:
        if count > cur.left() // 8:
            raise FormatError(cur.where, f"metadata key {key} claims {count} strings, more than the {cur.left()} "
                                         "bytes left can hold")
        if decode:
            return [cur.string(f"element {j} of {key}") for j in range(count)]
        cur.skip_strings(count, key)
        return None
    if etype == ARRAY:
        raise FormatError(cur.where, f"metadata key {key} is an array of arrays, which no model uses")
    if etype not in SCALARS:
        raise FormatError(cur.where, f"metadata key {key} is an array of unknown type {etype}")
    fmt = SCALARS[etype]
    width = struct.calcsize(fmt)
    if count > cur.left() // width:
        raise FormatError(cur.where, f"metadata key {key} claims {count} elements, more than the {cur.left()} bytes "
                                     "left can hold")
    if not decode:
        cur.pos += count * width
        return None
    values = list(struct.unpack_from(f"<{count}{fmt[1]}", cur.buf, cur.pos))
    cur.pos += count * width
    return values


def _tensor(where: object, name: str, shape: tuple[int, ...], qtype: int, offset: int, alignment: int,
            data_offset: int, size: int) -> TensorEntry:
    label = shown(name)
    try:
        kind = GGMLQuantizationType(qtype)
        block, type_size = GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
        raise FormatError(where, f"tensor {label} has unknown type id {qtype}") from None
    if any(d > _INT64_MAX for d in shape) or math.prod(shape) > _INT64_MAX:
        raise FormatError(where, f"tensor {label} has an impossible shape {list(shape)}")
    if shape and shape[0] % block:
        raise FormatError(where, f"tensor {label}: a row of {shape[0]} elements is not a whole number of "
                                 f"{kind.name} blocks ({block})")
    nbytes = math.prod(shape) // block * type_size
    if offset % alignment:
        raise FormatError(where, f"tensor {label} starts at data offset {offset}, not a multiple of the "
                                 f"alignment {alignment}")
    if data_offset + offset >= _UINT64:  # ggml adds the two as uint64: the sum wraps back into the header
        raise FormatError(where, f"tensor {label} has data offset {offset}, which wraps to byte "
                                 f"{data_offset + offset - _UINT64}, inside the header: the data section starts at "
                                 f"byte {data_offset}")
    return TensorEntry(name, shape, qtype, offset, nbytes)
