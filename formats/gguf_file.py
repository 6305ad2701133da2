"""Read-only, zero-copy access to a GGUF file.

The model files we handle are 18-21 GiB, so nothing here reads tensor data eagerly: the file is
memory-mapped by ``gguf.GGUFReader`` and tensors are handed out as views of that map. Everything
the rest of the project needs from a GGUF goes through ``GGUFModel``; parse failures of any kind
become one ``FormatError`` line naming the file.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from .errors import FormatError, SparkpackError
from .quants import quant_name, tensor_nbytes

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)


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


class GGUFModel:
    """A memory-mapped GGUF file: metadata, tensor index and zero-copy tensor bytes."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._check_preamble()
        import gguf  # imported here so that ``formats`` loads fast for --help

        try:
            self._reader = _checked_reader(gguf)(self.path, "r")
        except SparkpackError:
            raise
        except _TruncatedTensor as e:
            raise FormatError(self.path, str(e)) from None
        except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError, MemoryError) as e:
            raise FormatError(self.path, f"malformed or truncated GGUF ({_short(e)})") from None
        self.file_size = self.path.stat().st_size
        self.alignment = int(getattr(self._reader, "alignment", 32))
        self.tensors: dict[str, TensorInfo] = {}
        for t in self._reader.tensors:
            info = TensorInfo(
                name=t.name,
                shape=tuple(int(d) for d in t.shape),
                qtype=int(t.tensor_type),
                offset=int(t.data_offset),
                nbytes=int(t.n_bytes),
            )
            if info.offset + info.nbytes > self.file_size:
                raise FormatError(
                    self.path,
                    f"tensor {info.name} ends at byte {info.offset + info.nbytes}, past the end of the file "
                    f"({self.file_size} bytes): the file is truncated or its tensor index is corrupt",
                )
            expected = tensor_nbytes(info.shape, info.qtype)
            if expected != info.nbytes:
                raise FormatError(self.path, f"tensor {info.name}: byte size {info.nbytes} does not match shape")
            self.tensors[info.name] = info

    def _check_preamble(self) -> None:
        """Reject the common non-GGUF cases before gguf-py prints its own less helpful errors."""
        try:
            with open(self.path, "rb") as f:
                head = f.read(8)
        except FileNotFoundError:
            raise SparkpackError(self.path, "no such file") from None
        except IsADirectoryError:
            raise SparkpackError(self.path, "is a directory, expected a .gguf file") from None
        except OSError as e:
            raise SparkpackError(self.path, f"cannot read ({e.strerror})") from None
        if len(head) < 8:
            raise FormatError(self.path, f"only {len(head)} bytes long, too short to be a GGUF file")
        if head[:4] != GGUF_MAGIC:
            raise FormatError(self.path, f"not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
        version = int.from_bytes(head[4:8], "little")
        if version not in SUPPORTED_VERSIONS:
            raise FormatError(self.path, f"unsupported GGUF version {version} (supported: 2, 3)")

    # --- metadata -------------------------------------------------------------------------

    @cached_property
    def metadata_keys(self) -> list[str]:
        return [k for k in self._reader.fields if not k.startswith("GGUF.")]

    def has(self, key: str) -> bool:
        return key in self._reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata value as a Python scalar, str or list (arrays of strings become list[str])."""
        field = self._reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:  # gguf-py raises assorted errors on corrupt values
            raise FormatError(self.path, f"metadata key {key} is corrupt ({_short(e)})") from None

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise FormatError(self.path, f"missing metadata key {key}")
        return value

    @cached_property
    def arch(self) -> str:
        return str(self.require("general.architecture"))

    # --- tensor data ----------------------------------------------------------------------

    @property
    def data_offset(self) -> int:
        """Where the tensor data section starts (every tensor offset is at or after it)."""
        return int(self._reader.data_offset) if hasattr(self._reader, "data_offset") else min(
            (t.offset for t in self.tensors.values()), default=self.file_size
        )

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
        if offset < 0 or offset + nbytes > self.file_size:
            raise FormatError(self.path, f"byte range {offset}+{nbytes} outside the file")
        return self._reader.data[offset : offset + nbytes]

    def header_bytes(self) -> np.ndarray:
        """Everything before the tensor data: magic, metadata, tensor index (identifies the model)."""
        return self._reader.data[: self.data_offset]

    def close(self) -> None:
        mm = getattr(self._reader.data, "_mmap", None)
        self._reader = None  # type: ignore[assignment]
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # a view is still alive; the map is freed with it

    def __enter__(self) -> "GGUFModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _TruncatedTensor(ValueError):
    pass


def _checked_reader(gguf):
    """gguf.GGUFReader that checks each tensor's byte range before viewing it.

    The stock reader reshapes a short memmap slice when a tensor runs past the end of the file and
    fails with a numpy message; checking first lets the user read which tensor and why.
    """

    class CheckedReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):  # type: ignore[override]
            size = len(self.data)
            for field in fields:
                _, name_data, _, dims, raw_dtype, offset_tensor = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    qtype = gguf.GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise ValueError(f"tensor {name} has unknown type id {int(raw_dtype[0])}") from None
                n_elems = 1
                for d in dims.tolist():
                    n_elems *= int(d)
                bs, ts = gguf.GGML_QUANT_SIZES[qtype]
                end = int(start_offs) + int(offset_tensor[0]) + n_elems * ts // bs
                if end > size:
                    raise _TruncatedTensor(
                        f"tensor {name} ends at byte {end}, past the end of the file ({size} bytes): "
                        "the file is truncated or its tensor index is corrupt")
            return super()._build_tensors(start_offs, fields)

    return CheckedReader


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:200]
