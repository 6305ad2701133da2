"""Reading ``.sparkpack`` directories: the manifest, zero-copy hot tensors, expert bytes.

A pack is only trusted after ``Pack.open`` has checked the manifest against the directory: every
shard path stays inside the pack, every (offset, size) lies inside its shard, and the placement
covers every expert. The runtime's expert store then reads experts with ``expert_bytes`` (one
contiguous range per expert, so streaming one is one copy). Format: docs/FORMAT.md.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from .errors import FormatError, SparkpackError
from .profile import ModelIdentity

PACK_FORMAT = "sparkpack"
PACK_VERSION = 1
MANIFEST = "manifest.json"
HEADER_SHARD = "header.bin"
HOT_SHARD = "hot.bin"
COLD_DIR = "cold"
ALIGNMENT = 4096  # start of every tensor and expert in the hot shard
PART_ALIGNMENT = 64  # start of gate/up/down inside one expert's range


def cold_shard_name(layer: int, expert: int, compressed: bool = False) -> str:
    return f"{COLD_DIR}/L{layer:03d}/E{expert:04d}.bin" + (".zst" if compressed else "")


def is_pack(path: str | os.PathLike[str]) -> bool:
    p = Path(path)
    return p.is_dir() and (p / MANIFEST).is_file()


@dataclass(frozen=True)
class ExpertRecord:
    layer: int
    expert: int
    hot: bool
    shard: str  # path relative to the pack
    offset: int  # of the expert's range inside the shard (0 for cold shards)
    nbytes: int  # uncompressed bytes of the expert's range
    stored_nbytes: int  # bytes in the shard (differs from nbytes when compressed)
    compression: str | None
    checksum: str  # of the uncompressed range
    shard_checksum: str | None  # of the stored bytes, when compressed


@dataclass(frozen=True)
class ExpertPart:
    role: str  # gate | up | gate_up | down
    tensor: str
    offset: int  # inside the expert's range
    nbytes: int


class Pack:
    """An opened, structurally validated pack. Use ``Pack.open``."""

    def __init__(self, path: Path, manifest: dict[str, Any]):
        self.path = path
        self.manifest = manifest
        self.arch: str = manifest["arch"]
        self.spec: dict[str, Any] = manifest["spec"]
        self.n_layer: int = int(self.spec["n_layer"])
        self.n_expert: int = int(self.spec["n_expert"])
        self.identity = ModelIdentity.from_json(manifest["source"]["identity"], path / MANIFEST)
        self.compression: str | None = manifest.get("compression")
        self.tensors: dict[str, dict[str, Any]] = {t["name"]: t for t in manifest["tensors"]}
        self.parts: dict[int, list[ExpertPart]] = {}
        self.records: dict[tuple[int, int], ExpertRecord] = {}
        self.hot = np.zeros((self.n_layer, self.n_expert), dtype=bool)
        for lay in manifest["experts"]:
            il = int(lay["layer"])
            self.parts[il] = [ExpertPart(p["role"], p["tensor"], int(p["offset"]), int(p["nbytes"]))
                              for p in lay["parts"]]
            for e, r in enumerate(lay["experts"]):
                rec = ExpertRecord(il, e, bool(r["hot"]), str(r["shard"]), int(r["offset"]), int(lay["expert_nbytes"]),
                                   int(r["stored_nbytes"]), r.get("compression"), str(r["checksum"]),
                                   r.get("shard_checksum"))
                self.records[(il, e)] = rec
                self.hot[il, e] = rec.hot
        self._hot_map: np.ndarray | None = None
        self._local = threading.local()  # zstd decompressors are not thread-safe: one per thread

    # --- opening and validation ---------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "Pack":
        path = Path(path)
        mpath = path / MANIFEST
        if not path.exists():
            raise SparkpackError(path, "no such pack")
        if not path.is_dir() or not mpath.is_file():
            raise FormatError(path, f"not a sparkpack (expected a directory with {MANIFEST})")
        try:
            manifest = json.loads(mpath.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(mpath, f"unreadable manifest ({str(e)[:100]})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != PACK_FORMAT:
            raise FormatError(mpath, f"not a sparkpack manifest (format is not {PACK_FORMAT!r})")
        if manifest.get("version") != PACK_VERSION:
            raise FormatError(mpath, f"pack format version {manifest.get('version')} is not supported "
                                     f"(expected {PACK_VERSION})")
        try:
            pack = cls(path, manifest)
        except SparkpackError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise FormatError(mpath, f"malformed manifest ({type(e).__name__}: {str(e)[:80]})") from None
        pack._validate()
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

    def _shard_size(self, rel: str, cache: dict[str, int]) -> int:
        if rel not in cache:
            p = self.shard_path(rel)
            try:
                cache[rel] = p.stat().st_size
            except FileNotFoundError:
                raise FormatError(self.path, f"shard {rel} is missing") from None
        return cache[rel]

    def _validate(self) -> None:
        mpath = self.path / MANIFEST
        sizes: dict[str, int] = {}
        for s in self.manifest["shards"]:
            have = self._shard_size(s["path"], sizes)
            if have != int(s["nbytes"]):
                raise FormatError(self.path, f"shard {s['path']} has {have} bytes, the manifest says {s['nbytes']}")
        for t in self.tensors.values():
            if t["shard"] is None:
                continue
            off, n = int(t["offset"]), int(t["nbytes"])
            if off < 0 or n < 0 or off + n > self._shard_size(t["shard"], sizes):
                raise FormatError(mpath, f"tensor {t['name']}: range {off}+{n} is outside shard {t['shard']}")
        for il, parts in self.parts.items():
            if not 0 <= il < self.n_layer:
                raise FormatError(mpath, f"expert layer {il} out of range (model has {self.n_layer} layers)")
            for p in parts:
                if p.offset < 0 or p.nbytes < 0:
                    raise FormatError(mpath, f"layer {il}: expert part {p.role} has a negative range")
            for e in range(self.n_expert):
                rec = self.records.get((il, e))
                if rec is None:
                    raise FormatError(mpath, f"placement is missing layer {il} expert {e}")
                if parts and parts[-1].offset + parts[-1].nbytes > rec.nbytes:
                    raise FormatError(mpath, f"layer {il}: expert parts run past the expert's {rec.nbytes} bytes")
                size = self._shard_size(rec.shard, sizes)
                if rec.offset < 0 or rec.stored_nbytes < 0 or rec.offset + rec.stored_nbytes > size:
                    raise FormatError(mpath, f"layer {il} expert {e}: range {rec.offset}+{rec.stored_nbytes} is "
                                             f"outside shard {rec.shard} ({size} bytes)")
                if rec.compression not in (None, "zstd"):
                    raise FormatError(mpath, f"layer {il} expert {e}: unknown compression {rec.compression!r}")
                if rec.compression is None and rec.stored_nbytes != rec.nbytes:
                    raise FormatError(mpath, f"layer {il} expert {e}: stored size {rec.stored_nbytes} differs "
                                             f"from the expert size {rec.nbytes}")

    # --- data ---------------------------------------------------------------------------------

    def _hot(self) -> np.ndarray:
        if self._hot_map is None:
            p = self.shard_path(HOT_SHARD)
            self._hot_map = (np.memmap(p, dtype=np.uint8, mode="r") if p.stat().st_size
                             else np.zeros(0, dtype=np.uint8))
        return self._hot_map

    def tensor(self, name: str) -> np.ndarray:
        """A non-expert tensor's bytes: a zero-copy uint8 view of the mmapped hot shard."""
        t = self.tensors.get(name)
        if t is None:
            raise KeyError(f"no tensor {name} in {self.path}")
        if t["shard"] is None:
            raise KeyError(f"{name} is an expert tensor; read it per expert with expert_bytes()")
        return self._hot()[int(t["offset"]): int(t["offset"]) + int(t["nbytes"])]

    def non_expert_tensors(self) -> list[str]:
        return [n for n, t in self.tensors.items() if t["shard"] is not None]

    def is_hot(self, layer: int, expert: int) -> bool:
        return bool(self.hot[layer, expert])

    def expert_record(self, layer: int, expert: int) -> ExpertRecord:
        try:
            return self.records[(layer, expert)]
        except KeyError:
            raise KeyError(f"layer {layer} expert {expert} is not in the pack") from None

    def read_stored(self, rec: ExpertRecord) -> bytes:
        """The expert's bytes as stored in its cold shard (compressed when the pack is)."""
        with open(self.shard_path(rec.shard), "rb") as f:
            f.seek(rec.offset)
            data = f.read(rec.stored_nbytes)
        if len(data) != rec.stored_nbytes:
            raise FormatError(self.path, f"shard {rec.shard} is truncated")
        return data

    def expert_bytes(self, layer: int, expert: int, verify: bool = False) -> np.ndarray:
        """The expert's contiguous range (gate/up/down at ``parts`` offsets).

        Hot experts are zero-copy views of the hot shard; cold ones are read (and decompressed)
        from their shard. ``verify`` checks the checksum and raises ``FormatError`` naming the shard.
        """
        rec = self.expert_record(layer, expert)
        if rec.hot:
            out = self._hot()[rec.offset: rec.offset + rec.nbytes]
        else:
            data = self.read_stored(rec)
            if rec.compression == "zstd":
                data = self._decompress(rec, data)
            out = np.frombuffer(data, dtype=np.uint8)
        if verify and checksum(out) != rec.checksum:
            raise FormatError(self.path, f"shard {rec.shard}: layer {layer} expert {expert} fails its checksum")
        return out

    def _decompress(self, rec: ExpertRecord, data: bytes) -> bytes:
        import zstandard

        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = self._local.dctx = zstandard.ZstdDecompressor()
        try:
            out = dctx.decompress(data, max_output_size=rec.nbytes)
        except zstandard.ZstdError as e:
            raise FormatError(self.path, f"shard {rec.shard} does not decompress ({e})") from None
        if len(out) != rec.nbytes:
            raise FormatError(self.path, f"shard {rec.shard} decompresses to {len(out)} bytes, expected {rec.nbytes}")
        return out

    def expert_parts(self, layer: int, expert: int, verify: bool = False) -> dict[str, np.ndarray]:
        """role -> bytes of that role's block, exactly as the GGUF stores it."""
        data = self.expert_bytes(layer, expert, verify)
        return {p.role: data[p.offset: p.offset + p.nbytes] for p in self.parts[layer]}

    def close(self) -> None:
        self._hot_map = None


def checksum(data: np.ndarray | bytes | memoryview) -> str:
    from .profile import HASH_NAME

    return f"{HASH_NAME}:{hashlib.new(HASH_NAME, memoryview(data)).hexdigest()}"
