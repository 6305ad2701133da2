"""``repack verify``: everything ``join`` and ``spark-run`` rely on, checked against the shards.

A pack that verifies joins to its source GGUF byte for byte and loads: ``Pack.open`` checks the
manifest (its checksum, types, the layout it recomputes: tensor offsets, expert parts, gaps) and
that the metadata builds a spec the tensor shapes agree with; verify then checks the header
shard (its checksum, the model identity's header hash, and that the manifest's tensor index,
data offset and metadata are the header's), every checksum of every tensor and expert, and that
``cold/`` holds no file the manifest does not name.
"""
from __future__ import annotations

import sys
from pathlib import Path

import click
from sparkpack.formats.checksums import hash_file_range
from sparkpack.formats.errors import FormatError
from sparkpack.formats.sparkpack import HEADER_SHARD, HOT_SHARD, Pack


def verify_pack(path: Path, progress=lambda n: None) -> Pack:
    """Raise ``FormatError`` naming the first shard whose bytes do not match the manifest.

    Order: header shard, hot shard (tensors in file order, then hot experts), cold shards by
    (layer, expert), so "first" is reproducible.
    """
    pack = Pack.open(path)
    header = pack.manifest.shards[HEADER_SHARD]
    if hash_file_range(pack.shard_path(HEADER_SHARD), 0, header.nbytes, pack.algorithm) != header.checksum:
        raise FormatError(path, f"shard {HEADER_SHARD} fails its checksum (corrupt)")
    pack.check_source_header()
    # Hot bytes are hashed through pread, not the mmap: touching a 10 GB map would count it all
    # as resident memory.
    hot_file = pack.shard_path(HOT_SHARD)
    for t in pack.tensors.values():
        if t.shard is None:
            continue
        if hash_file_range(hot_file, t.offset or 0, t.nbytes, pack.algorithm) != t.checksum:
            raise FormatError(path, f"shard {t.shard} fails its checksum at tensor {t.name} (corrupt)")
        progress(t.nbytes)
    for rec in sorted(pack.records.values(), key=lambda r: (not r.hot, r.layer, r.expert)):
        pack.read_expert(rec.layer, rec.expert)
        progress(rec.nbytes)
    unlisted = pack.unlisted_cold_files()
    if unlisted:
        more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
        raise FormatError(path, f"{unlisted[0]}{more} is not a shard the manifest names: a file of another pack?")
    return pack


@click.command("verify")
@click.argument("pack", type=click.Path(path_type=Path))
def verify_cmd(pack: Path) -> None:
    """Check every shard of a .sparkpack against its manifest; exit 1 naming the first bad one."""
    from tqdm import tqdm

    from .outputs import clear_stale

    clear_stale(pack.absolute().parent)  # what a killed split or join left beside the pack
    p = Pack.open(pack)
    total = sum(t.nbytes for t in p.tensors.values())
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="verify", file=sys.stderr,
              disable=None) as bar:
        verify_pack(pack, bar.update)
    n_cold = sum(1 for r in p.records.values() if not r.hot)
    click.echo(f"{pack}: OK ({len(p.tensors)} tensors, {int(p.hot.sum())} hot experts, {n_cold} cold shards, "
               f"{p.algorithm} checksums)")
