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
