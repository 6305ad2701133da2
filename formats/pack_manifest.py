"""A pack's ``manifest.json`` parsed once into typed, cross-checked values.

Nothing downstream reads the JSON: ``parse_manifest`` checks every field's type and range and
then that the fields agree with each other the way ``repack split`` writes them, deriving what can
be derived and requiring the manifest to say the same:

* the tensors and gaps tile the source's data section exactly, in source order;
* the hot shard's layout (non-expert tensors in source order, then hot experts by (layer,
  expert), each at the next multiple of 4096) and each layer's expert parts (the layer's expert
  tensors in role order, one expert's slice each, at multiples of 64) are recomputed from the
  tensor index and must match;
* cold shards have their fixed names, one per cold expert.

So an edited offset, part, gap or size is refused at open, whatever else the manifest says.
Format: docs/FORMAT.md.
"""
from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .checksums import ALGORITHMS, IDENTITY_ALGORITHM, checksum, is_checksum
from .errors import FormatError
from .experts import ROLE_ORDER, ExpertPart
from .gguf_header import MAX_DIMS, check_tensor_map
from .profile import ModelIdentity
from .quants import quant_name, tensor_nbytes

PACK_FORMAT = "sparkpack"
PACK_VERSION = 2  # what split writes
READABLE_VERSIONS = (1, 2)  # 1: SHA-256, no manifest checksum
MANIFEST = "manifest.json"
MANIFEST_CHECKSUM_KEY = "manifest_checksum"
HEADER_SHARD = "header.bin"
HOT_SHARD = "hot.bin"
COLD_DIR = "cold"
ALIGNMENT = 4096  # start of every tensor and expert in the hot shard
PART_ALIGNMENT = 64  # start of gate/up/down inside one expert's range
MAX_MANIFEST_BYTES = 256 << 20  # a full-size model's manifest is ~15 MB (vocabulary included)
MAX_MANIFEST_DEPTH = 16  # the format nests 5 deep


def cold_shard_name(layer: int, expert: int, compressed: bool = False) -> str:
    return f"{COLD_DIR}/L{layer:03d}/E{expert:04d}.bin" + (".zst" if compressed else "")


def align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Shard:
    path: str
    kind: str  # header | hot
    nbytes: int
    checksum: str | None


@dataclass(frozen=True)
class Gap:
    """Bytes of the source's data section outside every tensor (alignment padding)."""

    source_offset: int
    nbytes: int
    header_offset: int | None  # where header.bin keeps them; None: they are zeros


@dataclass(frozen=True)
class SourceGGUF:
    file_name: str
    identity: ModelIdentity
    data_offset: int
    gguf_alignment: int
    gaps: tuple[Gap, ...]


@dataclass(frozen=True)
class TensorRecord:
    name: str
    shape: tuple[int, ...]  # GGUF order
    qtype: int
    source_offset: int
    nbytes: int
    shard: str | None  # hot.bin, or None for a 3-D expert tensor (its bytes live in expert ranges)
    offset: int | None  # in the hot shard
    checksum: str | None

    @property
    def type_name(self) -> str:
        return quant_name(self.qtype)


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
class Placement:
    """What split planned; informational (``repack inspect`` shows it)."""

    hot_experts: int
    total_experts: int
    uniform: bool | None
    profile: str | None
    expected_cold_hit_rate: dict[str, float] | None


@dataclass(frozen=True)
class SpecSummary:
    """The part of the manifest's ``spec`` the pack layout depends on; checked against the spec
    rebuilt from the metadata when the pack is opened."""

    n_layer: int
    n_expert: int
    moe_layers: tuple[int, ...]
    expert_tensors: dict[int, dict[str, str]]


@dataclass(frozen=True)
class Manifest:
    version: int
    algorithm: str  # of every checksum in the pack (header identity aside)
    compression: str | None
    arch: str
    source: SourceGGUF
    shards: dict[str, Shard]  # path -> shard
    spec: SpecSummary
    metadata: dict[str, Any]
    tensors: dict[str, TensorRecord]  # in source order
    parts: dict[int, tuple[ExpertPart, ...]]  # MoE layer -> its experts' parts
    records: dict[tuple[int, int], ExpertRecord]
    placement: Placement


class _Reader:
    """Typed field access with errors that name the manifest and the field's path."""

    def __init__(self, where: object):
        self.where = where

    def fail(self, field: str, problem: str) -> FormatError:
        return FormatError(self.where, f"{field}: {problem}")

    def obj(self, v: Any, field: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self.fail(field, f"is {_kind(v)}, expected an object")
        return v

    def list(self, v: Any, field: str) -> list[Any]:
        if not isinstance(v, list):
            raise self.fail(field, f"is {_kind(v)}, expected an array")
        return v

    def key(self, d: dict[str, Any], key: str, field: str) -> Any:
        if key not in d:
            raise self.fail(field, f"has no {key!r}")
        return d[key]

    def int(self, v: Any, field: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(field, f"is {_kind(v)}, expected an integer")
        if not lo <= v <= hi:
            raise self.fail(field, f"is {v}, expected {lo}..{hi}")
        return v

    def str(self, v: Any, field: str) -> str:
        if not isinstance(v, str):
            raise self.fail(field, f"is {_kind(v)}, expected a string")
        return v

    def opt_str(self, v: Any, field: str) -> str | None:
        return None if v is None else self.str(v, field)

    def checksum(self, v: Any, algorithm: str, field: str) -> str:
        if not is_checksum(v, algorithm):
            raise self.fail(field, f"is not a {algorithm} checksum")
        return v

    def equal(self, have: Any, want: Any, field: str) -> None:
        if have != want:
            raise self.fail(field, f"is {have!r}, but the pack's layout gives {want!r}")


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a bool"
    if isinstance(v, (list, dict)):
        return "an array" if isinstance(v, list) else "an object"
    if isinstance(v, str):
        return f"the string {v[:40]!r}"
    return repr(v) if isinstance(v, (int, float)) else type(v).__name__


def check_manifest_checksum(raw: bytes, algorithm: str, value: Any, where: object) -> None:
    """``manifest_checksum`` is the last key; it covers every byte before ``,"manifest_checksum"``."""
    r = _Reader(where)
    r.checksum(value, algorithm, MANIFEST_CHECKSUM_KEY)
    tail = f',"{MANIFEST_CHECKSUM_KEY}":"{value}"}}'.encode()
    body = raw.rstrip()
    if not body.endswith(tail) or checksum(algorithm, body[: len(body) - len(tail)]) != value:
        raise FormatError(where, "manifest fails its checksum (corrupt or edited)")


def manifest_bytes(manifest: dict[str, Any], algorithm: str) -> bytes:
    """The file split writes: the JSON, then its checksum as the last key."""
    body = json.dumps(manifest, separators=(",", ":"))[:-1].encode()
    return body + f',"{MANIFEST_CHECKSUM_KEY}":"{checksum(algorithm, body)}"}}\n'.encode()


def parse_manifest(d: Any, raw: bytes, where: object) -> Manifest:
    """Check ``d`` (the parsed ``raw`` bytes) field by field; see the module docstring."""
    r = _Reader(where)
    d = r.obj(d, "manifest")
    if d.get("format") != PACK_FORMAT:
        raise FormatError(where, f"not a sparkpack manifest (format is not {PACK_FORMAT!r})")
    version = d.get("version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise FormatError(where, f"pack format version {str(version)[:20]} is not supported (this version of "
                                 f"sparkpack reads {', '.join(map(str, READABLE_VERSIONS))})")
    algorithm = r.str(r.key(d, "checksum", "manifest"), "checksum")
    if algorithm not in ALGORITHMS or (version == 1 and algorithm != "sha256"):
        raise r.fail("checksum", f"unknown algorithm {algorithm!r}")
    if version >= 2:
        check_manifest_checksum(raw, algorithm, d.get(MANIFEST_CHECKSUM_KEY), where)
    try:  # strings must be valid text (a JSON \ud800 escape is not), or messages and tokens break later
        json.dumps(d, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise FormatError(where, "manifest holds invalid text (a lone UTF-16 surrogate)") from None
    r.equal(d.get("alignment"), ALIGNMENT, "alignment")
    compression = d.get("compression")
    if compression not in (None, "zstd"):
        raise r.fail("compression", f"unknown compression {str(compression)[:20]!r}")
    arch = r.str(r.key(d, "arch", "manifest"), "arch")
    metadata = r.obj(r.key(d, "metadata", "manifest"), "metadata")
    if metadata.get("general.architecture") != arch:
        raise r.fail("metadata", "general.architecture differs from arch")
    source = _source(r, r.obj(r.key(d, "source", "manifest"), "source"))
    shards = _shards(r, r.list(r.key(d, "shards", "manifest"), "shards"), algorithm)
    spec = _spec(r, r.obj(r.key(d, "spec", "manifest"), "spec"))
    tensors = _tensors(r, r.list(r.key(d, "tensors", "manifest"), "tensors"), algorithm, spec)
    _check_source_layout(r, source, tensors, shards[HEADER_SHARD])
    parts, records, hot_end = _experts(r, r.list(r.key(d, "experts", "manifest"), "experts"), spec, tensors,
                                       algorithm, compression, _hot_tensors_end(r, tensors), version)
    r.equal(shards[HOT_SHARD].nbytes, hot_end, f"shards[{HOT_SHARD}].nbytes")
    placement = _placement(r, r.obj(r.key(d, "placement", "manifest"), "placement"), records)
    return Manifest(version, algorithm, compression, arch, source, shards, spec, metadata, tensors, parts, records,
                    placement)


def _source(r: _Reader, s: dict[str, Any]) -> SourceGGUF:
    ident = r.obj(r.key(s, "identity", "source"), "source.identity")
    identity = ModelIdentity(r.int(r.key(ident, "file_size", "source.identity"), "source.identity.file_size"),
                             r.int(r.key(ident, "header_bytes", "source.identity"), "source.identity.header_bytes"),
                             r.checksum(ident.get("header_hash"), IDENTITY_ALGORITHM, "source.identity.header_hash"))
    data_offset = r.int(r.key(s, "data_offset", "source"), "source.data_offset", 8, identity.file_size)
    r.equal(identity.header_bytes, data_offset, "source.identity.header_bytes")
    gguf_alignment = r.int(r.key(s, "gguf_alignment", "source"), "source.gguf_alignment", 1, 1 << 30)
    if gguf_alignment & (gguf_alignment - 1):
        raise r.fail("source.gguf_alignment", f"{gguf_alignment} is not a power of two")
    gaps = []
    for i, g in enumerate(r.list(r.key(s, "gaps", "source"), "source.gaps")):
        g = r.list(g, f"source.gaps[{i}]")
        if len(g) != 3:
            raise r.fail(f"source.gaps[{i}]", "must be [source_offset, nbytes, header_offset or null]")
        stored = None if g[2] is None else r.int(g[2], f"source.gaps[{i}][2]")
        gaps.append(Gap(r.int(g[0], f"source.gaps[{i}][0]"), r.int(g[1], f"source.gaps[{i}][1]", 1), stored))
    return SourceGGUF(r.str(r.key(s, "file_name", "source"), "source.file_name"), identity, data_offset, gguf_alignment,
                  tuple(gaps))


def _shards(r: _Reader, items: list[Any], algorithm: str) -> dict[str, Shard]:
    out: dict[str, Shard] = {}
    for i, s in enumerate(items):
        s = r.obj(s, f"shards[{i}]")
        path = r.str(r.key(s, "path", f"shards[{i}]"), f"shards[{i}].path")
        kind = {HEADER_SHARD: "header", HOT_SHARD: "hot"}.get(path)
        if kind is None or path in out:
            raise r.fail(f"shards[{i}].path", f"{path[:60]!r} is not {HEADER_SHARD} or {HOT_SHARD} (once each)")
        r.equal(s.get("kind"), kind, f"shards[{i}].kind")
        ck = s.get("checksum")
        if kind == "header" or ck is not None:
            r.checksum(ck, algorithm, f"shards[{i}].checksum")
        out[path] = Shard(path, kind, r.int(r.key(s, "nbytes", f"shards[{i}]"), f"shards[{i}].nbytes"), ck)
    if set(out) != {HEADER_SHARD, HOT_SHARD}:
        raise r.fail("shards", f"must list {HEADER_SHARD} and {HOT_SHARD}")
    return out


def _spec(r: _Reader, s: dict[str, Any]) -> SpecSummary:
    n_layer = r.int(r.key(s, "n_layer", "spec"), "spec.n_layer", 1, 1 << 20)
    n_expert = r.int(r.key(s, "n_expert", "spec"), "spec.n_expert", 1, 1 << 20)
    moe = tuple(r.int(x, "spec.moe_layers", 0, n_layer - 1) for x in r.list(r.key(s, "moe_layers", "spec"),
                                                                                 "spec.moe_layers"))
    if list(moe) != sorted(set(moe)):
        raise r.fail("spec.moe_layers", "must be increasing")
    names = r.obj(r.key(s, "expert_tensors", "spec"), "spec.expert_tensors")
    experts: dict[int, dict[str, str]] = {}
    for il in moe:
        roles = r.obj(names.get(str(il)), f"spec.expert_tensors.{il}")
        if set(roles) not in ({"gate", "up", "down"}, {"gate_up", "down"}):
            raise r.fail(f"spec.expert_tensors.{il}", "must name gate, up and down (or gate_up and down)")
        experts[il] = {k: r.str(v, f"spec.expert_tensors.{il}.{k}") for k, v in roles.items()}
    if len(names) != len(moe):
        raise r.fail("spec.expert_tensors", "must name the expert tensors of exactly the MoE layers")
    seen: dict[str, str] = {}
    for il, roles in experts.items():  # one tensor read as two roles' experts would mix their bytes
        for role, name in roles.items():
            if name in seen:
                raise r.fail(f"spec.expert_tensors.{il}.{role}", f"names {name[:80]}, already {seen[name]}")
            seen[name] = f"spec.expert_tensors.{il}.{role}"
    return SpecSummary(n_layer, n_expert, moe, experts)


def _tensors(r: _Reader, items: list[Any], algorithm: str, spec: SpecSummary) -> dict[str, TensorRecord]:
    expert_names = {n for roles in spec.expert_tensors.values() for n in roles.values()}
    out: dict[str, TensorRecord] = {}
    for i, t in enumerate(items):
        f = f"tensors[{i}]"
        t = r.obj(t, f)
        name = r.str(r.key(t, "name", f), f + ".name")
        if name in out:
            raise r.fail(f + ".name", f"tensor {name} is listed twice")
        dims = r.list(r.key(t, "shape", f), f + ".shape")
        if not 1 <= len(dims) <= MAX_DIMS:
            raise r.fail(f + ".shape", f"has {len(dims)} dimensions, expected 1..{MAX_DIMS}")
        shape = tuple(r.int(x, f + ".shape", 1, 2**62) for x in dims)
        qtype = r.int(r.key(t, "qtype", f), f + ".qtype", 0, 1 << 16)
        if quant_name(qtype).startswith("type"):
            raise r.fail(f + ".qtype", f"unknown tensor type {qtype}")
        r.equal(t.get("type"), quant_name(qtype), f + ".type")
        if math.prod(shape) > 2**62:
            raise r.fail(f + ".shape", f"{list(shape)} is impossibly large")
        try:
            want = tensor_nbytes(shape, qtype)
        except ValueError as e:
            raise r.fail(f + ".shape", str(e)) from None
        nbytes = r.int(r.key(t, "nbytes", f), f + ".nbytes")
        r.equal(nbytes, want, f + ".nbytes")
        source_offset = r.int(r.key(t, "source_offset", f), f + ".source_offset")
        shard = t.get("shard")
        if name in expert_names:
            if shard is not None or t.get("offset") is not None or t.get("checksum") is not None:
                raise r.fail(f, f"{name} is an expert tensor: shard, offset and checksum must be null")
            out[name] = TensorRecord(name, shape, qtype, source_offset, nbytes, None, None, None)
            continue
        r.equal(shard, HOT_SHARD, f + ".shard")
        out[name] = TensorRecord(name, shape, qtype, source_offset, nbytes, HOT_SHARD,
                                 r.int(r.key(t, "offset", f), f + ".offset"),
                                 r.checksum(t.get("checksum"), algorithm, f + ".checksum"))
    missing = expert_names - set(out)
    if missing:
        raise r.fail("tensors", f"expert tensor {sorted(missing)[0]} is not in the tensor index")
    order = [t.source_offset for t in out.values()]
    if order != sorted(order):
        raise r.fail("tensors", "are not in source order")
    return out


def _check_source_layout(r: _Reader, source: SourceGGUF, tensors: dict[str, TensorRecord], header: Shard) -> None:
    """Tensors and gaps tile [data_offset, file_size) in order, as split found them; stored gaps
    follow the header in header.bin, one after the other."""
    check_tensor_map(r.where, [(t.name, t.source_offset, t.nbytes) for t in tensors.values()],
                     source.data_offset, source.identity.file_size)
    pos, gaps = source.data_offset, []
    for t in tensors.values():
        if (t.source_offset - source.data_offset) % source.gguf_alignment:
            raise r.fail("tensors", f"{t.name} is not aligned to the source's {source.gguf_alignment} bytes")
        if t.source_offset > pos:
            gaps.append((pos, t.source_offset - pos))
        pos = t.source_offset + t.nbytes
    if pos < source.identity.file_size:
        gaps.append((pos, source.identity.file_size - pos))
    r.equal([(g.source_offset, g.nbytes) for g in source.gaps], gaps, "source.gaps")
    at = source.data_offset
    for i, g in enumerate(source.gaps):
        if g.header_offset is not None:
            r.equal(g.header_offset, at, f"source.gaps[{i}][2]")
            at += g.nbytes
    r.equal(header.nbytes, at, f"shards[{HEADER_SHARD}].nbytes")


def _hot_tensors_end(r: _Reader, tensors: dict[str, TensorRecord]) -> int:
    pos = 0
    for t in tensors.values():
        if t.shard is not None:
            pos = align(pos, ALIGNMENT)
            r.equal(t.offset, pos, f"tensor {t.name} offset")
            pos += t.nbytes
    return pos


def _experts(r: _Reader, layers: list[Any], spec: SpecSummary, tensors: dict[str, TensorRecord], algorithm: str,
             compression: str | None, hot_pos: int, version: int
             ) -> tuple[dict[int, tuple[ExpertPart, ...]], dict[tuple[int, int], ExpertRecord], int]:
    if len(layers) != len(spec.moe_layers):
        raise r.fail("experts", f"lists {len(layers)} layers, the model has {len(spec.moe_layers)} MoE layers")
    parts: dict[int, tuple[ExpertPart, ...]] = {}
    records: dict[tuple[int, int], ExpertRecord] = {}
    for i, (lay, il) in enumerate(zip(layers, spec.moe_layers)):
        f = f"experts[{i}]"
        lay = r.obj(lay, f)
        r.equal(lay.get("layer"), il, f + ".layer")
        want, rel = [], 0
        for role in ROLE_ORDER:
            name = spec.expert_tensors[il].get(role)
            if name is None:
                continue
            t = tensors[name]
            if len(t.shape) != 3 or t.shape[2] != spec.n_expert or t.nbytes % spec.n_expert:
                raise r.fail(f"tensor {name}", f"shape {list(t.shape)} does not hold {spec.n_expert} experts")
            rel = align(rel, PART_ALIGNMENT)
            want.append({"role": role, "tensor": name, "offset": rel, "nbytes": t.nbytes // spec.n_expert})
            rel += t.nbytes // spec.n_expert
        r.equal(lay.get("parts"), want, f + ".parts")
        r.equal(lay.get("expert_nbytes"), rel, f + ".expert_nbytes")
        parts[il] = tuple(ExpertPart(p["role"], p["tensor"], tensors[p["tensor"]].qtype,
                                     (tensors[p["tensor"]].shape[0], tensors[p["tensor"]].shape[1]), p["offset"],
                                     p["nbytes"]) for p in want)
        recs = r.list(r.key(lay, "experts", f), f + ".experts")
        if len(recs) != spec.n_expert:
            raise FormatError(r.where, f"placement is missing layer {il} experts: {f}.experts lists {len(recs)} of "
                                       f"{spec.n_expert}")
        for e, rec in enumerate(recs):
            fe = f"{f}.experts[{e}]"
            rec = r.obj(rec, fe)
            hot = rec.get("hot")
            if not isinstance(hot, bool):
                raise r.fail(fe + ".hot", f"is {_kind(hot)}, expected true or false")
            ck = r.checksum(rec.get("checksum"), algorithm, fe + ".checksum")
            if hot:
                hot_pos = align(hot_pos, ALIGNMENT)
                r.equal((rec.get("shard"), rec.get("offset"), rec.get("stored_nbytes"), rec.get("compression")),
                        (HOT_SHARD, hot_pos, rel, None), fe)
                records[(il, e)] = ExpertRecord(il, e, True, HOT_SHARD, hot_pos, rel, rel, None, ck, None)
                hot_pos += rel
                continue
            comp = compression
            r.equal((rec.get("shard"), rec.get("offset"), rec.get("compression")),
                    (cold_shard_name(il, e, comp is not None), 0, comp), fe)
            stored = r.int(r.key(rec, "stored_nbytes", fe), fe + ".stored_nbytes", 1)
            shard_ck = rec.get("shard_checksum")
            if comp is None:
                r.equal(stored, rel, fe + ".stored_nbytes")
                if shard_ck is not None:
                    raise r.fail(fe + ".shard_checksum", "must be null for an uncompressed shard")
            elif shard_ck is not None or version >= 2:
                r.checksum(shard_ck, algorithm, fe + ".shard_checksum")
            records[(il, e)] = ExpertRecord(il, e, False, cold_shard_name(il, e, comp is not None), 0, rel, stored,
                                            comp, ck, shard_ck)
    return parts, records, hot_pos


def _placement(r: _Reader, p: dict[str, Any], records: dict[tuple[int, int], ExpertRecord]) -> Placement:
    n_hot = sum(rec.hot for rec in records.values())
    r.equal(p.get("hot_experts"), n_hot, "placement.hot_experts")
    r.equal(p.get("total_experts"), len(records), "placement.total_experts")
    uniform = p.get("uniform")
    if uniform is not None and not isinstance(uniform, bool):
        raise r.fail("placement.uniform", f"is {_kind(uniform)}, expected true, false or null")
    rate = p.get("expected_cold_hit_rate") or None  # {} for a uniform placement
    if rate is not None:
        rate = r.obj(rate, "placement.expected_cold_hit_rate")
        for side in ("generated", "prompt"):
            v = rate.get(side)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise r.fail(f"placement.expected_cold_hit_rate.{side}", f"is {_kind(v)}, expected a share 0..1")
        rate = {side: float(rate[side]) for side in ("generated", "prompt")}
    return Placement(n_hot, len(records), uniform, r.opt_str(p.get("profile"), "placement.profile"), rate)


class PerThread(threading.local):
    """One object per thread, made by ``make`` on the thread's first ``get``: zstd compressors
    and decompressors are not thread-safe, and the pack's workers share one instance of this."""

    def __init__(self, make: Callable[[], Any]) -> None:  # threading.local runs it once in each thread
        self.make, self.obj = make, None

    def get(self) -> Any:
        if self.obj is None:
            self.obj = self.make()
        return self.obj
