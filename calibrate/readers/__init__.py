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
from .base import (DECOMPRESS_ERRORS, MAX_RECORD_CHARS, WRONG_TYPES, FileContext, ReadStats, check_record, iter_jsonl,
                   read_text, text_size)
from .datasets_reader import is_saved_dataset
from .detect import detect_file, walk

MAX_JSON_FILE_CHARS = 128 << 20  # a .json file is parsed whole (~10x its size in memory)

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
            if not path.is_file() and not is_saved_dataset(path):  # a FIFO or device would block or never end
                ctx.skip("not a regular file")
                continue
            fmt = detect_file(path)
            stats.formats[fmt] += 1
            for conv in _read_file(ctx, fmt):
                size = text_size([conv.messages, conv.tools, conv.text])
                if size > MAX_RECORD_CHARS:  # tokenizing it would take gigabytes
                    ctx.skip("record too large", None, f"{conv.source}: {size} characters, more than "
                                                       f"{MAX_RECORD_CHARS}")
                    continue
                stats.per_file[str(path)] += 1
                if conv.kind == "document":
                    stats.documents += 1
                else:
                    stats.conversations += 1
                yield conv
        except DECOMPRESS_ERRORS as e:  # permissions, a file removed while walking, a read error, bad gzip
            ctx.skip("unreadable file", None, getattr(e, "strerror", None) or str(e) or type(e).__name__)
        except (*WRONG_TYPES, RecursionError) as e:  # past the per-record guards: the rest of the file is dropped
            ctx.skip("unreadable file", None, f"{type(e).__name__}: {str(e)[:60]}")


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
    raw = read_text(ctx.path, MAX_JSON_FILE_CHARS)
    if raw is None:
        ctx.skip("file too large", None, f"a .json file of more than {MAX_JSON_FILE_CHARS} characters is read "
                                         "whole; save it as JSONL (one record a line)")
        return
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as e:
        first = next((line for line in raw.splitlines() if line.strip()), "")
        try:
            first_is_record = isinstance(json.loads(first), dict)
        except (ValueError, RecursionError):
            first_is_record = False
        if first_is_record:
            yield from _jsonl(ctx)
        else:
            ctx.skip("bad json", getattr(e, "lineno", None), getattr(e, "msg", str(e))[:80])
        return
    if not check_record(raw, value, ctx, None):
        return
    items = value if isinstance(value, list) else [value]
    for i, item in enumerate(items):
        conv = records.read_record(item, ctx, i, sep="#")
        if conv is not None:
            yield conv
