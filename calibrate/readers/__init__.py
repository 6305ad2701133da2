"""Read a user's real traffic, in whatever format it was logged, as normalised conversations.

``read_corpus(path)`` walks a file or folder, picks a reader per file (detect.py) and streams
``Conversation`` objects; the ``ReadStats`` it returns fills in as the stream is consumed. Bad
records are counted per reason, or raise ``SparkpackError`` naming file:line with ``strict=True``.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from sparkpack.formats.errors import SparkpackError

from ..conversation import Conversation
from . import claude_code, codex, datasets_reader, records, text
from .base import DECOMPRESS_ERRORS, FileContext, ReadStats, iter_jsonl, open_text
from .detect import detect_file, walk

__all__ = ["read_corpus", "ReadStats", "detect_file"]


def read_corpus(path: Path, strict: bool = False) -> tuple[Iterator[Conversation], ReadStats]:
    """(conversation stream, stats). A missing path fails at once; everything else while streaming."""
    path = Path(path)
    if not path.exists():
        raise SparkpackError(path, "no such file or folder")
    stats = ReadStats()
    return _stream(path, stats, strict), stats


def _stream(root: Path, stats: ReadStats, strict: bool) -> Iterator[Conversation]:
    for path in walk(root):
        ctx = FileContext(path, stats, strict)
        stats.files += 1
        stats.per_file.setdefault(str(path), 0)
        try:
            fmt = detect_file(path)
            stats.formats[fmt] += 1
            for conv in _read_file(ctx, fmt):
                stats.per_file[str(path)] += 1
                if conv.kind == "document":
                    stats.documents += 1
                else:
                    stats.conversations += 1
                yield conv
        except DECOMPRESS_ERRORS as e:  # permissions, a file removed while walking, a read error, bad gzip
            ctx.skip("unreadable file", None, getattr(e, "strerror", None) or str(e) or type(e).__name__)


def _read_file(ctx: FileContext, fmt: str) -> Iterator[Conversation]:
    if fmt == "empty":
        ctx.skip("empty file")
    elif fmt == "binary":
        ctx.skip("binary file")
    elif fmt == "text":
        yield from text.read_file(ctx)
    elif fmt == "claude_code":
        yield from claude_code.read_file(ctx)
    elif fmt == "codex":
        yield from codex.read_file(ctx)
    elif fmt == "dataset":
        for loc, row in datasets_reader.iter_rows(ctx):
            conv = records.read_record(row, ctx, loc, sep="#")
            if conv is not None:
                yield conv
    elif fmt == "jsonl":
        yield from _jsonl(ctx)
    elif fmt == "json":
        yield from _json(ctx)


def _jsonl(ctx: FileContext) -> Iterator[Conversation]:
    for lineno, value in iter_jsonl(ctx):
        conv = records.read_record(value, ctx, lineno)
        if conv is not None:
            yield conv


def _json(ctx: FileContext) -> Iterator[Conversation]:
    """A JSON file holds one record or a list of them; JSONL saved as .json is read as JSONL."""
    with open_text(ctx.path) as f:
        raw = f.read()
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        first = next((line for line in raw.splitlines() if line.strip()), "")
        try:
            first_is_record = isinstance(json.loads(first), dict)
        except json.JSONDecodeError:
            first_is_record = False
        if first_is_record:
            yield from _jsonl(ctx)
        else:
            ctx.skip("bad json", e.lineno, e.msg)
        return
    items = value if isinstance(value, list) else [value]
    for i, item in enumerate(items):
        conv = records.read_record(item, ctx, i, sep="#")
        if conv is not None:
            yield conv
