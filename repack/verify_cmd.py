"""``repack verify``: every checksum and size in a pack's manifest, checked against its shards."""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import click
from sparkpack.formats.errors import FormatError
from sparkpack.formats.profile import HASH_NAME, hash_file_range
from sparkpack.formats.sparkpack import HEADER_SHARD, HOT_SHARD, Pack, checksum


def verify_pack(path: Path, progress=lambda n: None) -> Pack:
    """Raise ``FormatError`` naming the first shard whose bytes do not match the manifest.

    Order: header shard, hot shard (tensors in file order, then hot experts), cold shards by
    (layer, expert), so "first" is reproducible.
    """
    pack = Pack.open(path)  # sizes, ranges, paths
    # Hot bytes are hashed through pread, not the mmap: touching a 10 GB map would count it all
    # as resident memory.
    hot_file = pack.shard_path(HOT_SHARD)
    for s in pack.manifest["shards"]:
        if s["path"] == HEADER_SHARD and hash_file_range(pack.shard_path(HEADER_SHARD), 0, int(s["nbytes"])) != s["checksum"]:
            raise FormatError(path, f"shard {HEADER_SHARD} fails its checksum (corrupt)")
    for t in pack.manifest["tensors"]:
        if t["shard"] is None:
            continue
        if hash_file_range(hot_file, int(t["offset"]), int(t["nbytes"])) != t["checksum"]:
            raise FormatError(path, f"shard {t['shard']} fails its checksum at tensor {t['name']} (corrupt)")
        progress(int(t["nbytes"]))
    order = sorted(pack.records.values(), key=lambda r: (not r.hot, r.layer, r.expert))
    for rec in order:
        if rec.compression is not None and rec.shard_checksum is not None:
            stored = pack.read_stored(rec)
            if f"{HASH_NAME}:{hashlib.new(HASH_NAME, stored).hexdigest()}" != rec.shard_checksum:
                raise FormatError(path, f"shard {rec.shard} fails its checksum (corrupt)")
        if rec.hot:
            ok = hash_file_range(hot_file, rec.offset, rec.nbytes) == rec.checksum
        else:
            ok = checksum(pack.expert_bytes(rec.layer, rec.expert)) == rec.checksum
        if not ok:
            what = f"at layer {rec.layer} expert {rec.expert} " if rec.hot else ""
            raise FormatError(path, f"shard {rec.shard} fails its checksum {what}(corrupt)")
        progress(rec.nbytes)
    return pack


@click.command("verify")
@click.argument("pack", type=click.Path(path_type=Path))
def verify_cmd(pack: Path) -> None:
    """Check every shard of a .sparkpack against its manifest; exit 1 naming the first bad one."""
    from tqdm import tqdm

    p = Pack.open(pack)
    total = sum(int(t["nbytes"]) for t in p.manifest["tensors"])
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="verify", file=sys.stderr,
              disable=None) as bar:
        verify_pack(pack, bar.update)
    n_cold = sum(1 for r in p.records.values() if not r.hot)
    click.echo(f"{pack}: OK ({len(p.manifest['tensors'])} tensors, {int(p.hot.sum())} hot experts, "
               f"{n_cold} cold shards)")
