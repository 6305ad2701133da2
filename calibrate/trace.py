"""Routing traces: which experts every replayed token was routed to, in every MoE layer.

A profile keeps only totals, which is enough to choose a placement but not to judge one: how often
an LRU cache of spare slots rescues a cold expert depends on the order of routings. The trace keeps
that order, compactly, so evaluation can rerun placements and cache sizes without the model.

File layout (little-endian)::

    magic  b"SPKTRACE"                      8 bytes
    version u32, n_moe u32, k u32, n_expert u32, n_tokens u64, meta_len u32
    meta    JSON (utf-8, meta_len bytes): {"moe_layers": [...], "arch": ..., "identity": {...}}
    records n_tokens x (side u8, ids [n_moe, k] of u8 when n_expert <= 256 else u16), packed

``side`` is 1 for generated-side (assistant) tokens, 0 for prompt-side ones. ``n_tokens`` is written
when the trace is closed; until then the data lives under ``<name>.partial`` so a reader never sees
half a trace, and an interrupted calibration can continue it (``TraceWriter.reopen``).
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sparkpack.formats.archs import ModelSpec
from sparkpack.formats.errors import FormatError, SparkpackError
from sparkpack.formats.profile import ModelIdentity

MAGIC = b"SPKTRACE"
VERSION = 1
_HEAD = struct.Struct("<8sIIIIQI")


def record_dtype(n_moe: int, k: int, n_expert: int) -> np.dtype:
    id_type = np.uint8 if n_expert <= 256 else np.uint16
    return np.dtype([("side", np.uint8), ("ids", id_type, (n_moe, k))], align=False)


@dataclass
class Trace:
    """A trace in memory: ``ids [n_tokens, n_moe, k]``, ``generated [n_tokens]`` (bool)."""

    ids: np.ndarray
    generated: np.ndarray
    n_expert: int
    moe_layers: list[int]
    meta: dict[str, Any]

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])


def trace_header(spec: ModelSpec, identity: ModelIdentity) -> tuple[list[int], int, int, dict[str, Any]]:
    """``TraceWriter``'s header arguments after the path for a trace of this model: its MoE
    layers, top-k, experts, and its arch and identity (what ``check_trace_model`` holds a trace to)."""
    return spec.moe_layers, spec.n_expert_used, spec.n_expert, {"arch": spec.arch, "identity": identity.to_json()}


def check_trace_model(tr: Trace, spec: ModelSpec, identity: ModelIdentity, path: Path) -> None:
    """Refuse, in one line, a trace recorded on another model."""
    if tr.meta.get("identity") != identity.to_json():
        raise SparkpackError(path, "trace was recorded on another model")
    if tr.moe_layers != spec.moe_layers or tr.n_expert != spec.n_expert:
        raise SparkpackError(path, "trace does not match the model's MoE layers or expert count")


class TraceWriter:
    """Appends token records to ``<path>.partial``; ``close()`` seals it under ``path``."""

    def __init__(self, path: str | os.PathLike[str], moe_layers: list[int], k: int, n_expert: int,
                 meta: dict[str, Any] | None = None, *, _resume_tokens: int | None = None):
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.n_moe, self.k, self.n_expert = len(moe_layers), k, n_expert
        self.dtype = record_dtype(self.n_moe, k, n_expert)
        blob = json.dumps(dict(meta or {}, moe_layers=list(moe_layers)), sort_keys=True).encode()
        self._header_len = _HEAD.size + len(blob)
        if _resume_tokens is None:
            self._f = open(self.partial, "wb")
            self._f.write(_HEAD.pack(MAGIC, VERSION, self.n_moe, k, n_expert, 0, len(blob)))
            self._f.write(blob)
            self.n_tokens = 0
        else:
            self._f = open(self.partial, "r+b")
            head = self._f.read(self._header_len)
            if len(head) != self._header_len or head[_HEAD.size:] != blob:
                self._f.close()
                raise SparkpackError(self.partial, "the partial trace does not belong to this run; "
                                                   "delete it or run without --resume")
            self._f.truncate(self._header_len + _resume_tokens * self.dtype.itemsize)
            self._f.seek(0, os.SEEK_END)
            self.n_tokens = _resume_tokens

    @classmethod
    def reopen(cls, path: str | os.PathLike[str], moe_layers: list[int], k: int, n_expert: int,
               meta: dict[str, Any] | None, n_tokens: int) -> "TraceWriter":
        """Continue an interrupted trace: keep its first ``n_tokens`` records (those a checkpoint
        counted), drop anything written after that checkpoint."""
        partial = Path(path).with_name(Path(path).name + ".partial")
        if not partial.exists():
            raise SparkpackError(partial, "cannot resume the trace: its partial file is missing")
        return cls(path, moe_layers, k, n_expert, meta, _resume_tokens=n_tokens)

    def append(self, ids: np.ndarray, generated: np.ndarray) -> None:
        """``ids [T, n_moe, k]`` expert ids, ``generated [T]`` bool."""
        rec = np.empty(len(ids), dtype=self.dtype)
        rec["side"] = generated
        rec["ids"] = ids
        self._f.write(rec.tobytes())
        self.n_tokens += len(ids)

    def flush(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> Path:
        """Write the token count and move the file into place atomically."""
        self._f.seek(0)
        self._f.write(_HEAD.pack(MAGIC, VERSION, self.n_moe, self.k, self.n_expert, self.n_tokens,
                                 self._header_len - _HEAD.size))
        self.flush()
        self._f.close()
        os.replace(self.partial, self.path)
        return self.path

    def abandon(self) -> None:
        """Close without sealing (the partial file stays for ``--resume``)."""
        if not self._f.closed:
            self.flush()
            self._f.close()


def is_trace(path: str | os.PathLike[str]) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except (IsADirectoryError, FileNotFoundError, PermissionError):
        return False


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Load a sealed trace (memory-mapped) after checking its header, size and id range."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(_HEAD.size)
            if len(head) < _HEAD.size:
                raise FormatError(path, f"only {len(head)} bytes long, too short to be a routing trace")
            magic, version, n_moe, k, n_expert, n_tokens, meta_len = _HEAD.unpack(head)
            if magic != MAGIC:
                raise FormatError(path, "not a routing trace (wrong magic)")
            if version != VERSION:
                raise FormatError(path, f"trace version {version} is not supported (expected {VERSION})")
            if not (n_moe > 0 and k > 0 and 0 < k <= n_expert <= 65536):
                raise FormatError(path, f"bad trace header: {n_moe} MoE layers, top-{k} of {n_expert} experts")
            blob = f.read(meta_len)
    except FileNotFoundError:
        raise SparkpackError(path, "no such trace file") from None
    try:
        meta = json.loads(blob.decode())
        moe_layers = [int(x) for x in meta["moe_layers"]]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise FormatError(path, "trace metadata is corrupt") from None
    if len(moe_layers) != n_moe:
        raise FormatError(path, f"trace metadata lists {len(moe_layers)} MoE layers, the header {n_moe}")
    dtype = record_dtype(n_moe, k, n_expert)
    offset = _HEAD.size + meta_len
    expected = offset + n_tokens * dtype.itemsize
    if size != expected:
        raise FormatError(path, f"trace is {size} bytes, expected {expected} for {n_tokens} tokens "
                                "(truncated or not sealed)")
    rec = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(n_tokens,)) if n_tokens else \
        np.zeros(0, dtype=dtype)
    ids, side = rec["ids"], rec["side"]
    if n_tokens and int(ids.max()) >= n_expert:
        raise FormatError(path, f"trace names expert {int(ids.max())}, but the model has {n_expert}")
    if n_tokens and int(side.max()) > 1:
        raise FormatError(path, "trace has a side flag other than 0/1")
    return Trace(ids=ids, generated=side.astype(bool), n_expert=n_expert, moe_layers=moe_layers, meta=meta)
