"""``repack join``: a ``.sparkpack`` back to the exact GGUF it was split from, every checksum
checked on the way (a corrupt shard is refused, never written out as a different model)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from sparkpack.formats.atomic_file import temp_name
from sparkpack.formats.checksums import hash_file_range, new_hasher
from sparkpack.formats.errors import FormatError, SparkpackError
from sparkpack.formats.pack_manifest import Gap, TensorRecord
from sparkpack.formats.sparkpack import HEADER_SHARD, Pack

from .outputs import check_output, reported_as

CHUNK = 8 << 20


def _copy_range(src: int, off: int, n: int, dst: int, buf: memoryview) -> None:
    """Append ``n`` bytes of ``src`` at ``off`` to ``dst``: in the kernel where it can
    (``copy_file_range``, no user-space copy), else through ``buf``."""
    while n:
        try:
            k = os.copy_file_range(src, dst, n, off)
        except OSError:
            k = -1
        if k <= 0:
            k = os.preadv(src, [buf[: min(n, len(buf))]], off)
            if k <= 0:
                raise FormatError(None, "shard ended early")
            _write_all(dst, buf[:k])
        off += k
        n -= k


def join_pack(pack_path: Path, out: Path, force: bool = False, progress=lambda n: None) -> Path:
    """Write the original GGUF, byte for byte, to ``out`` (atomically), checking every checksum
    the manifest has while it writes: on any mismatch nothing is left at ``out`` (or at a
    temporary name)."""
    pack = Pack.open(pack_path)
    if out.exists() and not force:
        raise SparkpackError(out, "already exists (use --force to replace it)")
    src = pack.manifest.source
    hdr = pack.shard_path(HEADER_SHARD)
    header = pack.manifest.shards[HEADER_SHARD]
    if hash_file_range(hdr, 0, header.nbytes, pack.algorithm) != header.checksum:
        raise FormatError(pack_path, f"shard {HEADER_SHARD} fails its checksum (corrupt)")
    pack.check_source_header()  # header hash = identity; tensor index, data offset, metadata = the header's
    # every region of the original file after the header, in file order (Pack.open checked they tile it)
    items: list[tuple[int, Gap | TensorRecord]] = [(g.source_offset, g) for g in src.gaps]
    items += [(t.source_offset, t) for t in pack.tensors.values()]
    items.sort(key=lambda x: x[0])
    roles = {p.tensor: (il, p) for il, parts in pack.parts.items() for p in parts}
    buf = memoryview(bytearray(CHUNK))
    tmp = temp_name(out)
    fds: dict[str, int] = {}
    checked: set[tuple[int, int]] = set()  # experts whose whole range matched its checksum

    def fd_of(rel: str) -> int:
        if rel not in fds:
            fds[rel] = os.open(pack.shard_path(rel), os.O_RDONLY)
        return fds[rel]

    dst = -1
    try:
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        _copy_range(fd_of(HEADER_SHARD), 0, src.data_offset, dst, buf)
        for _, item in items:
            if isinstance(item, Gap):
                if item.header_offset is None:
                    _write_all(dst, memoryview(bytes(item.nbytes)))
                else:
                    _copy_range(fd_of(HEADER_SHARD), item.header_offset, item.nbytes, dst, buf)
                continue
            if item.shard is not None:
                if _copy_hashed(fd_of(item.shard), item.offset or 0, item.nbytes, dst, buf,
                                pack.algorithm) != item.checksum:
                    raise FormatError(pack_path, f"shard {item.shard} fails its checksum at tensor {item.name} "
                                                 "(corrupt)")
            else:
                il, part = roles[item.name]
                for e in range(pack.n_expert):
                    rec = pack.expert_record(il, e)
                    if (il, e) in checked and rec.compression is None:
                        _copy_range(fd_of(rec.shard), rec.offset + part.offset, part.nbytes, dst, buf)
                        continue
                    data = pack.read_expert(il, e)  # whole range, checked
                    checked.add((il, e))
                    _write_all(dst, memoryview(data)[part.offset: part.offset + part.nbytes])
            progress(item.nbytes)
        if os.fstat(dst).st_size != pack.identity.file_size:
            raise FormatError(pack_path, f"rebuilt {os.fstat(dst).st_size} bytes, the source had "
                                         f"{pack.identity.file_size}")
        os.fsync(dst)
    except BaseException:  # Ctrl-C and SIGTERM (formats.errors.Terminated) included
        if dst >= 0:
            os.close(dst)
        tmp.unlink(missing_ok=True)
        raise
    finally:
        for fd in fds.values():
            os.close(fd)
    os.close(dst)
    os.replace(tmp, out)
    return out


def _write_all(fd: int, view: memoryview) -> None:
    while len(view):
        view = view[os.write(fd, view):]


def _copy_hashed(src: int, off: int, n: int, dst: int, buf: memoryview, algorithm: str) -> str:
    """Append ``n`` bytes of ``src`` at ``off`` to ``dst`` through ``buf``, returning their checksum."""
    h = new_hasher(algorithm)
    while n:
        k = os.preadv(src, [buf[: min(n, len(buf))]], off)
        if k <= 0:
            raise FormatError(None, "shard ended early")
        h.update(buf[:k])
        _write_all(dst, buf[:k])
        off += k
        n -= k
    return f"{algorithm}:{h.hexdigest()}"


@click.command("join")
@click.argument("pack", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path, dir_okay=False), required=True,
              help="GGUF file to write.")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
def join_cmd(pack: Path, output: Path, force: bool) -> None:
    """Rebuild the original GGUF (byte-identical) from a .sparkpack."""
    from tqdm import tqdm

    check_output(output, force)  # (first clears a killed join's partial output)
    p = Pack.open(pack)
    total = sum(t.nbytes for t in p.tensors.values())
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="join", file=sys.stderr,
              disable=None) as bar, reported_as(output):
        join_pack(pack, output, force, bar.update)
    click.echo(f"wrote {output}")
