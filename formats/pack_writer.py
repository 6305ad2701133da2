"""Write a ``.sparkpack`` directory from a GGUF: the streaming, crash-safe half of ``repack split``.

Everything is copied with ``preadv`` into one reusable buffer of a few MiB, never through the
GGUF's memory map, so resident memory stays flat however large the model (file-backed pages of a
map count toward RSS). Each piece is hashed while it passes through the buffer. The pack is built
in a hidden temporary directory beside the destination and renamed into place only when complete:
an interrupted split leaves nothing at the destination that could load as a pack. Layout and
fsync policy: docs/FORMAT.md.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .archs import ModelSpec
from .atomic_file import temp_name
from .checksums import PACK_ALGORITHM, checksum, hash_file_range, new_hasher
from .errors import FormatError, SparkpackError
from .experts import expert_slices, expert_tensor_names
from .gguf_file import GGUFModel, pread_into
from .leftovers import clean_leftovers, old_name
from .pack_manifest import (ALIGNMENT, COLD_DIR, HEADER_SHARD, HOT_SHARD, MANIFEST, PACK_FORMAT, PACK_VERSION,
                            PART_ALIGNMENT, PerThread, cold_shard_name, manifest_bytes)
from .profile import model_identity

CHUNK = 8 << 20
DEFAULT_JOBS = min(8, os.cpu_count() or 1)
ZSTD_LEVEL = 3


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    got = pread_into(fd, view, offset)
    if got < len(view):
        raise FormatError(None, f"source file ends early at byte {offset + got}")


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class _Buffers(threading.local):
    """One copy buffer per worker thread, allocated on first use."""

    def __init__(self) -> None:  # threading.local runs it once in each thread
        self.buf: memoryview | None = None

    def get(self, n: int) -> memoryview:
        buf = self.buf
        if buf is None or len(buf) < n:
            self.buf = buf = memoryview(bytearray(max(n, CHUNK)))
        return buf


def _compressor() -> Any:
    import zstandard

    return zstandard.ZstdCompressor(level=ZSTD_LEVEL)


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (set, frozenset)):
        return sorted(_jsonable(x) for x in v)
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, (bytes, bytearray)):
        return v.decode("utf-8", "replace")
    return v


def spec_json(spec: ModelSpec) -> dict[str, Any]:
    d = asdict(spec)
    d["expert_tensors"] = {str(k): v for k, v in spec.expert_tensors.items()}
    d["moe_layers"] = spec.moe_layers
    return _jsonable(d)


def _sync_dir_tree(path: Path) -> None:
    """Flush the new pack to disk once, before it is renamed into place.

    ``syncfs`` on the pack's filesystem costs one call instead of an fsync per cold shard (10k of
    them on a full-size model); without libc we fall back to ``os.sync``.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.syncfs(fd) != 0:
                os.sync()
        except (OSError, AttributeError):
            os.sync()
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_pack(model: GGUFModel, spec: ModelSpec, out: Path, hot: np.ndarray, *, compress: bool = False,
               force: bool = False, plan_info: dict[str, Any] | None = None,
               progress: Callable[[int], None] = lambda n: None, jobs: int = DEFAULT_JOBS) -> Path:
    """Write ``out`` (a ``.sparkpack`` directory) with the experts marked in ``hot`` in the hot shard.

    ``progress`` is called with byte counts as data is copied (the total is the GGUF's tensor bytes);
    ``jobs`` threads copy pieces in parallel.
    """
    out = Path(out)
    if out.exists() and not force:
        raise SparkpackError(out, "already exists (use --force to replace it)")
    if not out.parent.is_dir():
        raise SparkpackError(out.parent, "output directory does not exist")
    check_packable(model, spec)
    clean_leftovers(out)  # (split reports them; this covers other callers)
    tmp = temp_name(out)
    if tmp.exists():
        shutil.rmtree(tmp)
    try:  # the mkdir too: a signal handled as it returns would leave the folder behind
        tmp.mkdir()
        manifest = _write_contents(model, spec, tmp, hot, compress, plan_info or {}, progress, jobs)
        (tmp / MANIFEST).write_bytes(manifest_bytes(manifest, PACK_ALGORITHM))
        _sync_dir_tree(tmp)
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_packable(model: GGUFModel, spec: ModelSpec) -> None:
    """Refuse what a pack cannot hold before any byte is written, so that every pack split
    writes is one its reader accepts: tensors of 1 to 4 dimensions, none of them zero, and
    expert tensors that divide into whole experts."""
    for t in model.tensors.values():
        if not t.shape or 0 in t.shape:
            raise FormatError(model.path, f"tensor {t.name} has shape {list(t.shape)}: a dimension of size 0 "
                                          "(or none at all) holds no weights; cannot pack this file")
    for il, roles in spec.expert_tensors.items():
        for name in roles.values():
            if model.tensors[name].nbytes % spec.n_expert:
                raise FormatError(model.path, f"expert tensor {name} does not divide into {spec.n_expert} experts")


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished pack in; an old pack is moved aside first and deleted only after."""
    old = None
    if out.exists():
        old = old_name(out)
        if old.exists():
            shutil.rmtree(old)
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    _fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _source_layout(model: GGUFModel) -> list[tuple[int, int]]:
    """Byte ranges of the data section not covered by any tensor (GGUF alignment padding); the
    header reader has refused a map whose tensors overlap (``gguf_header.check_tensor_map``)."""
    gaps, pos = [], model.data_offset
    for t in sorted(model.tensors.values(), key=lambda t: t.offset):
        if t.offset > pos:
            gaps.append((pos, t.offset - pos))
        pos = t.offset + t.nbytes
    if pos < model.file_size:
        gaps.append((pos, model.file_size - pos))
    return gaps


def _write_contents(model: GGUFModel, spec: ModelSpec, tmp: Path, hot: np.ndarray, compress: bool,
                    plan_info: dict[str, Any], progress: Callable[[int], None], jobs: int) -> dict[str, Any]:
    """Lay everything out first (offsets are known before any byte moves), then copy the pieces in
    parallel: each tensor or expert is an independent task that reads, hashes and writes its own
    range (``pwrite`` into the hot shard, or its own cold file). ``preadv``, ``pwrite``, hashlib and
    zstd release the GIL, so threads scale until the disk is the limit."""
    identity = model_identity(model)
    experts = expert_tensor_names(spec)
    src_fd = os.open(model.path, os.O_RDONLY)
    try:
        hdr_pos, gaps = _write_header(model, src_fd, tmp)
    except BaseException:
        os.close(src_fd)
        raise
    hdr_sum = hash_file_range(tmp / HEADER_SHARD, 0, hdr_pos, PACK_ALGORITHM)

    # --- layout -----------------------------------------------------------------------------
    pos = 0
    tensors_json: list[dict[str, Any]] = []
    tasks: list[tuple[Any, ...]] = []  # (kind, json record to complete, args...)
    for t in sorted(model.tensors.values(), key=lambda t: t.offset):
        entry: dict[str, Any] = {"name": t.name, "shape": list(t.shape), "type": t.type_name, "qtype": t.qtype,
                                 "source_offset": t.offset, "nbytes": t.nbytes}
        if t.name in experts:
            entry.update(shard=None, offset=None, checksum=None)
        else:
            pos = _align(pos, ALIGNMENT)
            entry.update(shard=HOT_SHARD, offset=pos)
            tasks.append(("tensor", entry, [(t.offset, 0, t.nbytes)], pos, t.nbytes))
            pos += t.nbytes
        tensors_json.append(entry)
    layers_json = []
    (tmp / COLD_DIR).mkdir()
    for il in spec.moe_layers:
        parts, rel = [], 0
        for s in expert_slices(model, spec, il, 0):
            rel = _align(rel, PART_ALIGNMENT)
            parts.append({"role": s.role, "tensor": s.tensor, "offset": rel, "nbytes": s.nbytes})
            rel += s.nbytes
        enb = rel
        records = []
        if not hot[il].all():
            (tmp / COLD_DIR / f"L{il:03d}").mkdir()
        for e in range(spec.n_expert):
            pieces = [(s.offset, p["offset"], s.nbytes) for s, p in zip(expert_slices(model, spec, il, e), parts)]
            if hot[il, e]:
                pos = _align(pos, ALIGNMENT)
                rec: dict[str, Any] = {"hot": True, "shard": HOT_SHARD, "offset": pos, "stored_nbytes": enb,
                                       "compression": None}
                tasks.append(("hot_expert", rec, pieces, pos, enb))
                pos += enb
            else:
                rec = {"hot": False, "shard": cold_shard_name(il, e, compressed=compress), "offset": 0,
                       "compression": "zstd" if compress else None}
                tasks.append(("cold_expert", rec, pieces, 0, enb))
            records.append(rec)
        layers_json.append({"layer": il, "expert_nbytes": enb, "parts": parts, "experts": records})
    hot_size = pos

    # --- copy -------------------------------------------------------------------------------
    hot_fd = os.open(tmp / HOT_SHARD, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(hot_fd, hot_size)  # padding is the zeros of the file's holes
        _run_tasks(tasks, src_fd, hot_fd, tmp, compress, progress, jobs)
    finally:
        os.close(hot_fd)
        os.close(src_fd)

    n_hot = int(hot.sum())
    n_total = len(spec.moe_layers) * spec.n_expert
    return {
        "format": PACK_FORMAT,
        "version": PACK_VERSION,
        "alignment": ALIGNMENT,
        "checksum": PACK_ALGORITHM,
        "compression": "zstd" if compress else None,
        "arch": spec.arch,
        "source": {"file_name": model.path.name, "identity": identity.to_json(), "data_offset": model.data_offset,
                   "gguf_alignment": model.alignment, "gaps": gaps},
        "shards": [{"path": HEADER_SHARD, "kind": "header", "nbytes": hdr_pos, "checksum": hdr_sum},
                   {"path": HOT_SHARD, "kind": "hot", "nbytes": hot_size}],
        "spec": spec_json(spec),
        "metadata": {k: _jsonable(model.get(k)) for k in model.metadata_keys},
        "tensors": tensors_json,
        "experts": layers_json,
        "placement": {"hot_experts": n_hot, "total_experts": n_total, **_jsonable(plan_info)},
    }


def _write_header(model: GGUFModel, src_fd: int, tmp: Path) -> tuple[int, list[list[Any]]]:
    """header.bin: the original header bytes, then every padding gap that is not all zeros."""
    fd = os.open(tmp / HEADER_SHARD, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        pos = 0
        while pos < model.data_offset:
            buf = memoryview(bytearray(min(CHUNK, model.data_offset - pos)))
            _pread_all(src_fd, buf, pos)
            _pwrite_all(fd, buf, pos)
            pos += len(buf)
        gaps: list[list[Any]] = []
        for off, n in _source_layout(model):
            raw = memoryview(bytearray(n))
            _pread_all(src_fd, raw, off)
            if any(raw):
                _pwrite_all(fd, raw, pos)
                gaps.append([off, n, pos])
                pos += n
            else:
                gaps.append([off, n, None])
    finally:
        os.close(fd)
    return pos, gaps


def _run_tasks(tasks: list[tuple[Any, ...]], src_fd: int, hot_fd: int, tmp: Path, compress: bool,
               progress: Callable[[int], None], jobs: int) -> None:
    bufs = _Buffers()
    compressors = PerThread(_compressor)

    def run(task: tuple[Any, ...]) -> int:
        kind, rec, pieces, dst_off, nbytes = task
        h = new_hasher(PACK_ALGORITHM)
        if kind == "tensor":  # possibly huge: stream it in chunks
            (src_off, _, n), = pieces
            buf = bufs.get(CHUNK)
            done = 0
            while done < n:
                k = min(CHUNK, n - done)
                _pread_all(src_fd, buf[:k], src_off + done)
                h.update(buf[:k])
                _pwrite_all(hot_fd, buf[:k], dst_off + done)
                done += k
            rec["checksum"] = f"{PACK_ALGORITHM}:{h.hexdigest()}"
            return n
        # one expert: a few MB, assembled in the buffer with zeroed padding, then one write
        buf = bufs.get(nbytes)[:nbytes]
        cursor = 0
        for src_off, rel, n in pieces:
            buf[cursor:rel] = bytes(rel - cursor)
            _pread_all(src_fd, buf[rel: rel + n], src_off)
            cursor = rel + n
        buf[cursor:] = bytes(nbytes - cursor)
        h.update(buf)
        rec["checksum"] = f"{PACK_ALGORITHM}:{h.hexdigest()}"
        if kind == "hot_expert":
            _pwrite_all(hot_fd, buf, dst_off)
            return nbytes
        data: memoryview | bytes = compressors.get().compress(buf) if compress else buf
        fd = os.open(tmp / rec["shard"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _pwrite_all(fd, memoryview(data), 0)
        finally:
            os.close(fd)
        rec["stored_nbytes"] = len(data)
        if compress:
            rec["shard_checksum"] = checksum(PACK_ALGORITHM, data)
        return nbytes

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        # bounded window of futures: results are tiny, but 10k pending tasks need not all exist
        pending: set = set()
        it = iter(tasks)
        exhausted = False
        while True:
            while not exhausted and len(pending) < 4 * max(1, jobs):
                try:
                    pending.add(pool.submit(run, next(it)))
                except StopIteration:
                    exhausted = True
            if not pending:
                break
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for f in done:
                progress(f.result())  # re-raises a worker's error here
