"""Streaming GGUF writer for synthetic models: header first, then every tensor chunk written in
place at its final offset.

A full-size preset is ~20 GB, so no tensor is ever held whole. The header fixes every tensor's
offset, so the file is first extended to its final size and then chunks of at most
``CHUNK_BYTES`` are generated and ``pwrite``n straight to their offsets, by worker processes when
``jobs > 1`` (no chunk travels between processes, which would cap throughput at pipe speed), with
a bounded number in flight. Every chunk has its own seed (model seed, tensor index, chunk index),
so the file is byte-identical whatever the number of workers.
"""
from __future__ import annotations

import os
import sys
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType as T

from .quant_blocks import float_bytes, make_rng, random_tensor_bytes
from sparkpack.formats.atomic_file import temp_name
from sparkpack.formats.quants import row_nbytes, tensor_nbytes
from .routing_skew import expert_factors

from .tensors import TensorPlan

CHUNK_BYTES = 8 << 20
PARALLEL_MIN_BYTES = 64 << 20  # below this, worker start-up costs more than it saves
ROUTER_SEED = 1 << 20  # seed-space offset of the per-layer routing-skew factors

Job = tuple[int, int, int, float, tuple[int, ...]]  # offset, qtype, n_elements, scale, seed


def special_values(t: TensorPlan, seed: int, index: int, skew: float) -> np.ndarray:
    """Float32 values of the small non-"weight" tensors (norms, router, SSM parameters)."""
    rng = make_rng(seed, index)
    n = t.n_elements
    if t.init == "norm":
        return 1.0 + 0.05 * rng.standard_normal(n, dtype=np.float32)
    if t.init == "router":
        n_embd, n_expert = t.shape
        il = int(t.name.split(".")[1])
        factors = expert_factors(skew, n_expert, make_rng(seed, ROUTER_SEED + il))
        w = rng.standard_normal((n_expert, n_embd), dtype=np.float32) * np.float32(t.scale)
        return w * factors[:, None]
    if t.init == "probs_bias":
        return 1e-3 * rng.standard_normal(n, dtype=np.float32)
    if t.init == "ssm_a":  # -exp(A_log), A_log ~ log U(1, 16) as in the reference init
        return -rng.uniform(1.0, 16.0, n).astype(np.float32)
    if t.init == "ssm_dt":
        return rng.uniform(-1.0, 1.0, n).astype(np.float32)
    if t.init == "conv":
        return 0.3 * rng.standard_normal(n, dtype=np.float32)
    raise ValueError(f"unknown init {t.init!r} for {t.name}")


def _chunk_jobs(t: TensorPlan, qtype: T, seed: int, index: int, offset: int) -> Iterator[Job]:
    """Row-aligned chunk jobs of one weight tensor starting at file offset ``offset``."""
    n_cols = t.shape[0]
    n_rows = t.n_elements // n_cols
    row_bytes = row_nbytes(n_cols, qtype)
    rows_per_chunk = max(1, CHUNK_BYTES // row_bytes)
    for ci, r0 in enumerate(range(0, n_rows, rows_per_chunk)):
        rows = min(rows_per_chunk, n_rows - r0)
        yield offset + r0 * row_bytes, int(qtype), rows * n_cols, t.scale, (seed, index, ci)


_FDS: dict[str, int] = {}  # per process: the output file, opened once


def _fill(path: str, job: Job) -> int:
    """Generate one chunk and write it at its offset; returns its size."""
    offset, qtype, n_elements, scale, seed = job
    fd = _FDS.get(path)
    if fd is None:
        fd = _FDS[path] = os.open(path, os.O_WRONLY)
    data = random_tensor_bytes(qtype, n_elements, scale, make_rng(*seed))
    _pwrite_all(fd, data, offset)
    return data.nbytes


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def write_data(path: Path, data_start: int, plans: list[TensorPlan], qtypes: list[T], *, seed: int, skew: float,
               alignment: int, jobs: int, progress: bool) -> None:
    """Fill the data section of ``path`` (already extended to its final size) in place."""
    from tqdm import tqdm

    jobs_list: list[Job] = []
    fd = os.open(path, os.O_WRONLY)
    offset = data_start
    total = sum(tensor_nbytes(t.shape, q) for t, q in zip(plans, qtypes))
    bar = tqdm(total=total, unit="B", unit_scale=True, file=sys.stderr, disable=None if progress else True,
               desc="synth", smoothing=0.1)
    try:
        for index, (t, q) in enumerate(zip(plans, qtypes)):
            nbytes = tensor_nbytes(t.shape, q)
            if t.init == "weight":
                jobs_list += _chunk_jobs(t, q, seed, index, offset)
            else:
                if q != T.F32:
                    raise ValueError(f"{t.name}: {t.init} tensors are kept in F32, got {q.name}")
                data = float_bytes(special_values(t, seed, index, skew), q)
                if data.nbytes != nbytes:
                    raise AssertionError(f"{t.name}: {data.nbytes} bytes, expected {nbytes}")
                _pwrite_all(fd, data, offset)
                bar.update(nbytes)
            offset += nbytes + (-nbytes % alignment)
        if jobs > 1 and total > PARALLEL_MIN_BYTES:
            _run_parallel(str(path), jobs_list, jobs, bar)
        else:
            for job in jobs_list:
                bar.update(_fill(str(path), job))
    finally:
        os.close(fd)
        stale = _FDS.pop(str(path), None)
        if stale is not None:
            os.close(stale)
        bar.close()


def _run_parallel(path: str, jobs_list: list[Job], jobs: int, bar) -> None:
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        window: deque[Future[int]] = deque()
        try:
            for job in jobs_list:
                window.append(pool.submit(_fill, path, job))
                if len(window) >= 2 * jobs:
                    bar.update(window.popleft().result())
            while window:
                bar.update(window.popleft().result())
        except BaseException:
            for fut in window:
                fut.cancel()
            raise


def write_index(w: gguf.GGUFWriter, plans: list[TensorPlan], qtypes: list[T]) -> int:
    """The header, the metadata ``w`` holds and the tensor index of ``plans`` in ``qtypes``, the
    file then sized for their data, left sparse (its padding stays zero; ``write_data`` fills the
    rest in place). Returns where the data section starts."""
    for t, q in zip(plans, qtypes):
        w.add_tensor_info(t.name, tuple(reversed(t.shape)), np.dtype(np.float32), tensor_nbytes(t.shape, q),
                          raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    f = w.fout[0]
    w.write_padding(f, f.tell())
    data_start = f.tell()
    align = w.data_alignment
    f.truncate(data_start + sum(n + (-n % align) for n in (tensor_nbytes(t.shape, q) for t, q in zip(plans, qtypes))))
    return data_start


def write_gguf(path: Path, writer_setup, plans: list[TensorPlan], qtypes: list[T], *, arch: str, seed: int,
               skew: float, jobs: int, progress: bool) -> Path:
    """Write the whole file to a temp name next to ``path`` and rename it into place."""
    path = Path(path)
    tmp = temp_name(path)
    w = gguf.GGUFWriter(str(tmp), arch)
    try:
        writer_setup(w)
        data_start = write_index(w, plans, qtypes)
        align = w.data_alignment
        w.close()
        write_data(tmp, data_start, plans, qtypes, seed=seed, skew=skew, alignment=align, jobs=jobs,
                   progress=progress)
        os.replace(tmp, path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return path
