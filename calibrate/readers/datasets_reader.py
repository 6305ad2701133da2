"""Parquet / Arrow files and ``datasets.save_to_disk`` folders, read locally, streamed by row.

Rows are plain dicts, so they go through the same record readers as JSONL (the column heuristics
live in records.py and prompts.py). Parquet is read in row batches with pyarrow (which ``datasets``
is built on) so a large file is never loaded whole and nothing is written to the datasets cache.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .base import FileContext

BATCH_ROWS = 256


def is_saved_dataset(path: Path) -> bool:
    """A ``save_to_disk`` folder: a Dataset (state.json) or a DatasetDict (dataset_dict.json)."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def iter_rows(ctx: FileContext) -> Iterator[tuple[str, dict[str, Any]]]:
    """(location label, row) pairs; unreadable files are skipped as "bad dataset"."""
    try:
        yield from _rows(ctx.path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        ctx.skip("bad dataset", None, str(e).splitlines()[0] if str(e) else type(e).__name__)


def _rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    if path.is_dir():
        import datasets

        loaded = datasets.load_from_disk(str(path))
        splits = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [("", loaded)]
        for split, ds in splits:
            for i, row in enumerate(ds):
                yield (f"{split}/{i}" if split else str(i)), row
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        i = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS):
            for row in batch.to_pylist():
                yield str(i), row
                i += 1
    else:  # .arrow: datasets writes the IPC stream format, other tools the IPC file format
        import pyarrow as pa

        with pa.memory_map(str(path)) as source:
            try:
                reader: Any = pa.ipc.open_stream(source)
                batches = iter(reader)
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(k) for k in range(reader.num_record_batches))
            i = 0
            for batch in batches:
                for row in batch.to_pylist():
                    yield str(i), row
                    i += 1
