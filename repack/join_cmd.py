"""``repack join``: a ``.sparkpack`` back to the exact GGUF it was split from."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from sparkpack.formats.errors import FormatError, SparkpackError
from sparkpack.formats.profile import hash_file_range
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
            mv = buf[:k]
            while len(mv):
                mv = mv[os.write(dst, mv):]
        off += k
        n -= k


def join_pack(pack_path: Path, out: Path, force: bool = False, progress=lambda n: None) -> Path:
    """Write the original GGUF, byte for byte, to ``out`` (atomically)."""
    pack = Pack.open(pack_path)
    if out.exists() and not force:
        raise SparkpackError(out, "already exists (use --force to replace it)")
    src = pack.manifest["source"]
    data_offset = int(src["data_offset"])
    hdr = pack.shard_path(HEADER_SHARD)
    if hash_file_range(hdr, 0, data_offset) != pack.identity.header_hash:
        raise FormatError(pack_path, f"shard {HEADER_SHARD} does not match the source identity (corrupt)")
    # every region of the original file after the header, in file order
    items: list[tuple[int, str, object]] = [(int(g[0]), "gap", g) for g in src["gaps"]]
    items += [(int(t["source_offset"]), "tensor", t) for t in pack.manifest["tensors"]]
    items.sort(key=lambda x: x[0])
    roles = {p.tensor: (il, p) for il, parts in pack.parts.items() for p in parts}
    buf = memoryview(bytearray(CHUNK))
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    fds: dict[str, int] = {}

    def fd_of(rel: str) -> int:
        if rel not in fds:
            fds[rel] = os.open(pack.shard_path(rel), os.O_RDONLY)
        return fds[rel]

    dst = -1
    try:
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        _copy_range(fd_of(HEADER_SHARD), 0, data_offset, dst, buf)
        pos = data_offset
        for off, kind, item in items:
            if off != pos:
                raise FormatError(pack_path, f"manifest layout has a hole or overlap at source byte {pos}")
            if kind == "gap":
                _, n, stored = item  # type: ignore[misc]
                if stored is None:
                    os.write(dst, bytes(int(n)))
                else:
                    _copy_range(fd_of(HEADER_SHARD), int(stored), int(n), dst, buf)
                pos += int(n)
                continue
            t = item  # type: ignore[assignment]
            if t["shard"] is not None:  # type: ignore[index]
                _copy_range(fd_of(t["shard"]), int(t["offset"]), int(t["nbytes"]), dst, buf)  # type: ignore[index]
            else:
                il, part = roles[t["name"]]  # type: ignore[index]
                for e in range(pack.n_expert):
                    rec = pack.expert_record(il, e)
                    if rec.compression is None:
                        _copy_range(fd_of(rec.shard), rec.offset + part.offset, part.nbytes, dst, buf)
                    else:
                        data = pack.expert_bytes(il, e)
                        os.write(dst, memoryview(data)[part.offset: part.offset + part.nbytes])
            pos += int(t["nbytes"])  # type: ignore[index]
            progress(int(t["nbytes"]))  # type: ignore[index]
        if pos != int(pack.identity.file_size):
            raise FormatError(pack_path, f"rebuilt {pos} bytes, the source had {pack.identity.file_size}")
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


@click.command("join")
@click.argument("pack", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path, dir_okay=False), required=True,
              help="GGUF file to write.")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
def join_cmd(pack: Path, output: Path, force: bool) -> None:
    """Rebuild the original GGUF (byte-identical) from a .sparkpack."""
    from tqdm import tqdm

    p = Pack.open(pack)
    check_output(output, force)
    total = sum(int(t["nbytes"]) for t in p.manifest["tensors"])
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="join", file=sys.stderr,
              disable=None) as bar, reported_as(output):
        join_pack(pack, output, force, bar.update)
    click.echo(f"wrote {output}")
