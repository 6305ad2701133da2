"""Reading ``.sparkpack`` directories: checked manifest, checked hot tensors, checked expert bytes.

``Pack.open`` trusts nothing it has not checked: the manifest is read with bounded size and
nesting, checked against its own checksum (version 2), parsed into typed values whose layout is
recomputed and compared (``pack_manifest``), and checked against the directory (every shard a
regular file inside the pack with its recorded size) and against the model spec its metadata
builds (tensor shapes included). Version-1 manifests, which carry no checksum, are also compared
with the GGUF header kept in ``header.bin``.

Then every byte handed out is checked before it is used: a hot tensor against its checksum the
first time it is asked for, an expert range every time it is read (cold experts stream in long
after load, and a compressed frame is checked before it is decompressed, with its output bounded
by the manifest's size). ``check_source_header`` is what ``repack verify`` and ``join`` add: the
header bytes against the model identity, and the manifest against the header.
Format: docs/FORMAT.md.
"""
from __future__ import annotations

import json
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from .checksums import IDENTITY_ALGORITHM, checksum, hash_file_range
from .errors import FormatError, SparkpackError
from .gguf_header import scan_header
from .pack_manifest import (ALIGNMENT, COLD_DIR, HEADER_SHARD, HOT_SHARD, MANIFEST, MAX_MANIFEST_BYTES,
                            MAX_MANIFEST_DEPTH, PACK_FORMAT, PACK_VERSION, PART_ALIGNMENT, ExpertPart, ExpertRecord,
                            Manifest, PerThread, TensorRecord, cold_shard_name, parse_manifest)
from .safe_read import parse_json, read_bounded

__all__ = ["ALIGNMENT", "COLD_DIR", "HEADER_SHARD", "HOT_SHARD", "MANIFEST", "PACK_FORMAT", "PACK_VERSION",
           "PART_ALIGNMENT", "ExpertPart", "ExpertRecord", "Pack", "TensorRecord", "cold_shard_name", "is_pack"]


def is_pack(path: str | os.PathLike[str]) -> bool:
    p = Path(path)
    return p.is_dir() and (p / MANIFEST).is_file()


@dataclass(frozen=True)
class _SpecTensor:
    shape: tuple[int, ...]


class _ManifestAsGGUF:
    """The manifest seen as the few GGUF members ``formats.archs.model_spec`` reads."""

    def __init__(self, path: Path, m: Manifest):
        self.path, self.arch, self._meta = path, m.arch, m.metadata
        self.tensors = {n: _SpecTensor(t.shape) for n, t in m.tensors.items()}

    def get(self, key: str, default: Any = None) -> Any:
        return self._meta.get(key, default)


def _decompressor() -> Any:
    import zstandard

    return zstandard.ZstdDecompressor()


class Pack:
    """An opened, checked pack. Use ``Pack.open``."""

    def __init__(self, path: Path, m: Manifest):
        self.path = path
        self.manifest = m
        self.arch = m.arch
        self.version = m.version
        self.algorithm = m.algorithm
        self.identity = m.source.identity
        self.compression = m.compression
        self.metadata = m.metadata
        self.tensors: dict[str, TensorRecord] = m.tensors
        self.parts: dict[int, tuple[ExpertPart, ...]] = m.parts
        self.records: dict[tuple[int, int], ExpertRecord] = m.records
        self.n_layer, self.n_expert = m.spec.n_layer, m.spec.n_expert
        self.hot = np.zeros((self.n_layer, self.n_expert), dtype=bool)
        for (il, e), rec in self.records.items():
            self.hot[il, e] = rec.hot
        self._hot_map: np.ndarray | None = None
        self._checked: set[str] = set()  # hot tensors whose bytes matched their checksum
        self._lock = threading.Lock()
        self._dctx = PerThread(_decompressor)

    # --- opening and validation ---------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "Pack":
        path = Path(path)
        mpath = path / MANIFEST
        if not path.exists():
            raise SparkpackError(path, "no such pack")
        if not path.is_dir() or not mpath.exists():
            raise FormatError(path, f"not a sparkpack (expected a directory with {MANIFEST})")
        raw = read_bounded(mpath, "a pack manifest", MAX_MANIFEST_BYTES)
        d = parse_json(raw, mpath, "a pack manifest", MAX_MANIFEST_DEPTH, constants=True)
        pack = cls(path, parse_manifest(d, raw, mpath))
        pack._check_directory()
        pack._check_spec()
        if pack.version == 1:  # no manifest checksum: the header it was written from vouches for it
            pack.check_source_header()
        return pack

    def shard_path(self, rel: str) -> Path:
        """The file of a shard, refusing names that would leave the pack directory."""
        p = PurePosixPath(rel)
        if not rel or p.is_absolute() or ".." in p.parts or "\\" in rel or rel.startswith("~"):
            raise FormatError(self.path / MANIFEST, f"shard path {rel!r} points outside the pack")
        full = self.path / p
        try:
            full.resolve().relative_to(self.path.resolve())
        except ValueError:
            raise FormatError(self.path / MANIFEST, f"shard path {rel!r} points outside the pack") from None
        return full

    def _shard_size(self, rel: str) -> int:
        """Size of a shard, which must be a regular file: a FIFO or device would block or stream
        without end."""
        p = self.shard_path(rel)
        try:
            st = os.stat(p)
        except FileNotFoundError:
            raise FormatError(self.path, f"shard {rel} is missing") from None
        except OSError as e:
            raise FormatError(self.path, f"shard {rel} cannot be read ({e.strerror or e})") from None
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(self.path, f"shard {rel} is not a regular file")
        return st.st_size

    def _check_directory(self) -> None:
        for s in self.manifest.shards.values():
            have = self._shard_size(s.path)
            if have != s.nbytes:
                raise FormatError(self.path, f"shard {s.path} has {have} bytes, the manifest says {s.nbytes}")
        for rec in self.records.values():
            if rec.hot:
                continue
            size = self._shard_size(rec.shard)
            if size != rec.stored_nbytes:
                raise FormatError(self.path, f"shard {rec.shard} has {size} bytes, the manifest says "
                                             f"{rec.stored_nbytes} (truncated or replaced)")

    def unlisted_cold_files(self) -> list[str]:
        """Files under ``cold/`` that the manifest does not name, sorted. Split writes exactly one
        file there per cold expert, so another one is a shard of another split (two packs mixed
        by a copy) or damage; readers never open it, ``repack verify`` refuses the pack."""
        listed = {rec.shard for rec in self.records.values() if not rec.hot}
        found = []
        for root, dirs, files in os.walk(self.path / COLD_DIR):
            for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
                rel = PurePosixPath(Path(root, name).relative_to(self.path)).as_posix()
                if rel not in listed:
                    found.append(rel)
        return sorted(found)

    def _check_spec(self) -> None:
        """The spec the metadata builds (tensor shapes checked) must agree with the layout."""
        from .archs import model_spec

        spec = model_spec(_ManifestAsGGUF(self.path / MANIFEST, self.manifest))  # type: ignore[arg-type]
        s = self.manifest.spec
        if (spec.n_layer, spec.n_expert, tuple(spec.moe_layers), spec.expert_tensors) != \
                (s.n_layer, s.n_expert, s.moe_layers, s.expert_tensors):
            raise FormatError(self.path / MANIFEST, "spec (layers, experts, expert tensors) differs from the one "
                                                    "the metadata gives")

    def check_source_header(self) -> None:
        """``header.bin`` holds the source GGUF's header (its hash is the model identity) and the
        manifest's tensor index, data offset and metadata are the ones that header holds: what
        ``join`` relies on to rebuild the original file."""
        src = self.manifest.source
        hdr = self.shard_path(HEADER_SHARD)
        if hash_file_range(hdr, 0, src.data_offset, IDENTITY_ALGORITHM) != self.identity.header_hash:
            raise FormatError(self.path, f"shard {HEADER_SHARD} does not match the source identity (corrupt)")
        with open(hdr, "rb") as f:
            buf = f.read(src.data_offset)
        where = f"{self.path}/{HEADER_SHARD}"
        index = scan_header(buf, where, file_size=self.identity.file_size)
        mpath = self.path / MANIFEST
        if (index.data_offset, index.alignment) != (src.data_offset, src.gguf_alignment):
            raise FormatError(mpath, "source.data_offset or gguf_alignment differs from the source header")
        header_tensors = {t.name: (t.shape, t.qtype, index.data_offset + t.offset, t.nbytes) for t in index.tensors}
        manifest_tensors = {n: (t.shape, t.qtype, t.source_offset, t.nbytes) for n, t in self.tensors.items()}
        if header_tensors != manifest_tensors:
            bad = sorted(set(header_tensors.items()) ^ set(manifest_tensors.items()))[0][0]
            raise FormatError(mpath, f"tensor {bad} differs from the source header's tensor index")
        if list(index.fields) != list(self.metadata):
            raise FormatError(mpath, "metadata keys differ from the source header's")
        for key in index.fields:
            if _json(index.value(buf, key, where)) != _json(self.metadata[key]):
                raise FormatError(mpath, f"metadata {key} differs from the source header's value")

    # --- data ---------------------------------------------------------------------------------

    def _hot(self) -> np.ndarray:
        if self._hot_map is None:
            p = self.shard_path(HOT_SHARD)
            self._hot_map = (np.memmap(p, dtype=np.uint8, mode="r") if self._shard_size(HOT_SHARD)
                             else np.zeros(0, dtype=np.uint8))
        return self._hot_map

    def tensor(self, name: str) -> np.ndarray:
        """A non-expert tensor's bytes: a zero-copy view of the mmapped hot shard, checked against
        its checksum the first time it is asked for."""
        t = self.tensors.get(name)
        if t is None:
            raise KeyError(f"no tensor {name} in {self.path}")
        if t.shard is None or t.offset is None or t.checksum is None:
            raise KeyError(f"{name} is an expert tensor; read it per expert with expert_bytes()")
        view = self._hot()[t.offset: t.offset + t.nbytes]
        if name not in self._checked:
            if checksum(self.algorithm, view) != t.checksum:
                raise FormatError(self.path, f"shard {HOT_SHARD} fails its checksum at tensor {name} (corrupt)")
            with self._lock:
                self._checked.add(name)
        return view

    def non_expert_tensors(self) -> list[str]:
        return [n for n, t in self.tensors.items() if t.shard is not None]

    def is_hot(self, layer: int, expert: int) -> bool:
        return bool(self.hot[layer, expert])

    def expert_record(self, layer: int, expert: int) -> ExpertRecord:
        try:
            return self.records[(layer, expert)]
        except KeyError:
            raise KeyError(f"layer {layer} expert {expert} is not in the pack") from None

    def read_stored(self, rec: ExpertRecord) -> bytes:
        """The expert's bytes as stored in its cold shard (compressed when the pack is), checked
        against the stored bytes' checksum when the manifest has one."""
        try:
            with open(self.shard_path(rec.shard), "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise FormatError(self.path, f"shard {rec.shard} is not a regular file")
                f.seek(rec.offset)
                data = f.read(rec.stored_nbytes)
        except OSError as e:
            raise FormatError(self.path, f"shard {rec.shard} cannot be read ({e.strerror or e})") from None
        if len(data) != rec.stored_nbytes:
            raise FormatError(self.path, f"shard {rec.shard} is truncated")
        if rec.shard_checksum is not None and checksum(self.algorithm, data) != rec.shard_checksum:
            raise FormatError(self.path, f"shard {rec.shard} fails its checksum (corrupt)")
        return data

    def expert_bytes(self, layer: int, expert: int) -> np.ndarray:
        """The expert's contiguous range (gate/up/down at ``parts`` offsets), checked against its
        checksum on every read (``FormatError`` naming the shard).

        Hot experts are zero-copy views of the hot shard; cold ones are read (and decompressed)
        from their shard.
        """
        rec = self.expert_record(layer, expert)
        if not rec.hot:
            return self.read_expert(layer, expert)
        out = self._hot()[rec.offset: rec.offset + rec.nbytes]
        self._check_expert(rec, out)
        return out

    def read_expert(self, layer: int, expert: int) -> np.ndarray:
        """The expert's checked range read from its shard, never through the hot shard's map:
        tools that read a whole pack (verify, join) keep their memory flat."""
        rec = self.expert_record(layer, expert)
        data = self.read_stored(rec)
        if rec.compression == "zstd":
            data = self._decompress(rec, data)
        out = np.frombuffer(data, dtype=np.uint8)
        self._check_expert(rec, out)
        return out

    def _check_expert(self, rec: ExpertRecord, data: np.ndarray) -> None:
        if checksum(self.algorithm, data) != rec.checksum:
            where = f" at layer {rec.layer} expert {rec.expert}" if rec.hot else ""
            raise FormatError(self.path, f"shard {rec.shard} fails its checksum{where} (corrupt)")

    def _decompress(self, rec: ExpertRecord, data: bytes) -> bytes:
        """One zstd frame to exactly ``rec.nbytes`` bytes; never more is produced, whatever size
        the frame claims (a corrupt header claiming 1 TiB made zstd allocate it)."""
        import zstandard

        dctx = self._dctx.get()
        try:
            claimed = zstandard.frame_content_size(data)
            if claimed not in (-1, rec.nbytes):
                raise FormatError(self.path, f"shard {rec.shard} claims {claimed} bytes, expected {rec.nbytes}")
            chunks, have = [], 0
            with dctx.stream_reader(data, read_across_frames=False) as reader:
                while have <= rec.nbytes:
                    chunk = reader.read(rec.nbytes + 1 - have)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    have += len(chunk)
            out = b"".join(chunks)
        except zstandard.ZstdError as e:
            raise FormatError(self.path, f"shard {rec.shard} does not decompress ({e})") from None
        if len(out) != rec.nbytes:
            raise FormatError(self.path, f"shard {rec.shard} decompresses to {len(out)} bytes, expected {rec.nbytes}")
        return out

    def expert_parts(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        """role -> bytes of that role's block, exactly as the GGUF stores it (checked)."""
        data = self.expert_bytes(layer, expert)
        return {p.role: data[p.offset: p.offset + p.nbytes] for p in self.parts[layer]}

    def close(self) -> None:
        self._hot_map = None


def _json(v: Any) -> str:
    """A value in the manifest's JSON spelling (NaN included), for comparing with the header."""
    return json.dumps(v, sort_keys=True)
