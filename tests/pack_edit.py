"""Editing packs the way a corruption or a hand edit would (tests and the fuzz run).

``edit_manifest`` re-seals the manifest checksum by default, so an edit meets the checks behind
it; ``to_version_1`` rewrites a pack as the version-1 writer did (SHA-256, no manifest
checksum), to check old packs stay readable and checked."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sparkpack.formats.checksums import ALGORITHMS
from sparkpack.formats.pack_manifest import MANIFEST_CHECKSUM_KEY, manifest_bytes


def read_manifest(pack: Path) -> dict[str, Any]:
    m = json.loads((pack / "manifest.json").read_text())
    m.pop(MANIFEST_CHECKSUM_KEY, None)
    return m


def write_manifest(pack: Path, m: dict[str, Any], reseal: bool = True, old_checksum: str | None = None) -> None:
    """Write ``m``; a version-2 manifest gets a fresh checksum (``reseal``) or keeps
    ``old_checksum``, as a corruption would leave it."""
    algorithm = m.get("checksum")
    if reseal and m.get("version") == 2 and isinstance(algorithm, str) and algorithm in ALGORITHMS:
        (pack / "manifest.json").write_bytes(manifest_bytes(m, algorithm))
    elif old_checksum is not None:
        (pack / "manifest.json").write_text(json.dumps({**m, MANIFEST_CHECKSUM_KEY: old_checksum}))
    else:
        (pack / "manifest.json").write_text(json.dumps(m))


def edit_manifest(pack: Path, fn: Callable[[dict[str, Any]], Any], reseal: bool = True) -> None:
    old = json.loads((pack / "manifest.json").read_text()).get(MANIFEST_CHECKSUM_KEY)
    m = read_manifest(pack)
    fn(m)
    write_manifest(pack, m, reseal, old)


def first_cold(m: dict[str, Any]) -> dict[str, Any]:
    return next(r for lay in m["experts"] for r in lay["experts"] if not r["hot"])


def _sha(path: Path, offset: int = 0, n: int | None = None) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read() if n is None else f.read(n)
    return "sha256:" + hashlib.sha256(data).hexdigest()


def to_version_1(pack: Path) -> None:
    """Every checksum as SHA-256, version 1, no manifest checksum: what split wrote before."""
    from sparkpack.formats.sparkpack import Pack

    p = Pack.open(pack)
    m = read_manifest(pack)
    m["version"], m["checksum"] = 1, "sha256"
    for s in m["shards"]:
        if s.get("checksum"):
            s["checksum"] = _sha(pack / s["path"], 0, s["nbytes"])
    for t in m["tensors"]:
        if t["shard"]:
            t["checksum"] = _sha(pack / t["shard"], t["offset"], t["nbytes"])
    for lay in m["experts"]:
        for e, r in enumerate(lay["experts"]):
            r["checksum"] = "sha256:" + hashlib.sha256(p.read_expert(lay["layer"], e)).hexdigest()
            if r.get("shard_checksum"):
                r["shard_checksum"] = _sha(pack / r["shard"])
    write_manifest(pack, m, reseal=False)


def overlap_in_header(pack: Path, mover: str, target: str, how: str) -> None:
    """``header.bin``'s tensor index with ``mover`` moved onto ``target`` (``gguf_edit.OVERLAPS``),
    the identity hash and the shard's checksum re-computed and the manifest re-sealed around it: only a check of the
    header's tensor map as a whole can refuse it."""
    from sparkpack.formats.checksums import IDENTITY_ALGORITHM, hash_file_range
    from tests.gguf_edit import move_tensor

    move_tensor(pack / "header.bin", mover, target, how)
    m = read_manifest(pack)
    n = m["source"]["data_offset"]
    m["source"]["identity"]["header_hash"] = hash_file_range(pack / "header.bin", 0, n, IDENTITY_ALGORITHM)
    for s in m["shards"]:
        if s["path"] == "header.bin":
            s["checksum"] = hash_file_range(pack / "header.bin", 0, s["nbytes"], m["checksum"])
    write_manifest(pack, m)


def overlap_in_manifest(pack: Path, mover: str, target: str, how: str) -> None:
    """The manifest's tensor list with ``mover``'s source offset on ``target``'s range (kept in
    source order, re-sealed); "inside the header" puts it at byte 0 of the source."""
    def move(m: dict[str, Any]) -> None:
        ts = {t["name"]: t for t in m["tensors"]}
        t, align = ts[target], m["source"]["gguf_alignment"]
        ts[mover]["source_offset"] = {"onto": t["source_offset"], "same offset": t["source_offset"],
                                      "partial": t["source_offset"] + t["nbytes"] // 2 // align * align,
                                      "inside the header": 0}[how]
        m["tensors"].sort(key=lambda x: x["source_offset"])
    edit_manifest(pack, move)
