"""Bookkeeping shared by the readers: counts of what was read and skipped, and strict mode.

Real traffic logs are messy (a truncated last line, a record from another tool). A calibration run
must not die on line 40 000 of a log, but a user must be able to see what was dropped and why, and
``strict=True`` turns every drop into an error that names the file and line.
"""
from __future__ import annotations

import gzip
import io
import json
import re
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import zstandard

from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.safe_read import nesting_depth


@dataclass
class ReadStats:
    """Filled while the conversation stream is consumed (so final only once it is exhausted).

    ``conversations`` counts chats and ``documents`` raw documents; ``per_file`` maps each file read
    to how many of either it gave (0 for a skipped file); ``formats`` counts files per detected
    format; ``skipped`` counts dropped records (or files) per reason.
    """

    files: int = 0
    conversations: int = 0
    documents: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    images_skipped: int = 0
    formats: Counter[str] = field(default_factory=Counter)
    per_file: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        """One line for a CLI: what was read, then each skip reason with its count."""
        parts = [f"{self.files} files", f"{self.conversations} conversations", f"{self.documents} documents"]
        if self.images_skipped:
            parts.append(f"{self.images_skipped} images skipped")
        skips = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items()))
        return "; ".join(parts) + (f"; skipped: {skips}" if skips else "")


class FileContext:
    """Where a reader is (file, line) and what to do with a bad record: count it or raise."""

    def __init__(self, path: Path, stats: ReadStats, strict: bool):
        self.path = path
        self.stats = stats
        self.strict = strict

    def where(self, loc: int | str | None = None, sep: str = ":") -> str:
        return f"{self.path}{sep}{loc}" if loc is not None else str(self.path)

    def skip(self, reason: str, loc: int | str | None = None, detail: str = "", sep: str = ":") -> None:
        """Count a dropped record under ``reason``; in strict mode raise instead."""
        if self.strict:
            raise SparkpackError(self.where(loc, sep), f"{reason}{': ' + detail if detail else ''}")
        self.stats.skipped[reason] += 1

    def note(self, reason: str) -> None:
        """Count something left out on purpose (not malformed), which strict mode also accepts."""
        self.stats.skipped[reason] += 1

    def image(self) -> None:
        self.stats.images_skipped += 1


# What reading a record whose fields have unexpected types can raise (a number where a list
# belongs, an object where a string does): the record is skipped as "wrong types", not a crash.
WRONG_TYPES = (TypeError, AttributeError, KeyError, IndexError, ValueError)


class RecordError(ValueError):
    """A record that parsed as JSON but is not a usable conversation; the message is the skip reason."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


# Logs are often rotated into compressed files (``session.jsonl.gz``, ``*.zst``): they are read
# through a decompressor, and their format is that of the name without the compression suffix.
COMPRESSED_SUFFIXES = (".gz", ".zst", ".zstd")
# What a damaged compressed file raises while it is read (a truncated gzip stream: EOFError; a
# damaged deflate block: zlib.error).
DECOMPRESS_ERRORS = (OSError, EOFError, zlib.error, zstandard.ZstdError)


def format_suffix(path: Path) -> str:
    """``.jsonl`` for ``a.jsonl``, ``a.jsonl.gz`` and ``a.jsonl.zst``."""
    return Path(path.stem).suffix if path.suffix in COMPRESSED_SUFFIXES else path.suffix


def open_bytes(path: Path) -> IO[bytes]:
    """The file's contents as bytes, decompressed when its name says it is compressed."""
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    if path.suffix in (".zst", ".zstd"):
        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
    return open(path, "rb")


def open_text(path: Path) -> IO[str]:
    """UTF-8 text of the (maybe compressed) file; undecodable bytes become U+FFFD."""
    return io.TextIOWrapper(open_bytes(path), encoding="utf-8", errors="replace")


# Caps on what one record may hold. Tokenizing costs hundreds of bytes of memory per character,
# so a line of tens of MB runs the tokenizer into gigabytes; real
# records are far smaller (a long agent session is a few hundred thousand characters).
MAX_LINE_CHARS = 8 << 20  # one JSONL line; longer ones are skipped without being read whole
MAX_RECORD_CHARS = 2 << 20  # all text of one conversation or document: ~500k tokens, twice the longest context
MAX_RECORD_DEPTH = 64  # nesting of one JSON record
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]", re.ASCII)


def tag(value: Any) -> str | None:
    """A record's type or role field as a string, None otherwise: a list or object there (which
    a hostile record may put) cannot be looked up in a set of names."""
    return value if isinstance(value, str) else None


def iter_lines(path: Path, limit: int = MAX_LINE_CHARS) -> Iterator[tuple[int, str | None]]:
    """(line number, line) for each line of a (maybe compressed) text file; a line longer than
    ``limit`` characters is streamed past in ``limit``-sized pieces and given as None, so no
    line is ever held whole."""
    with open_text(path) as f:
        lineno = 0
        while True:
            line = f.readline(limit)
            if not line:
                return
            lineno += 1
            if len(line) < limit or line.endswith("\n"):
                yield lineno, line
                continue
            while line and not line.endswith("\n"):  # the rest of an over-long line
                line = f.readline(limit)
            yield lineno, None


def read_text(path: Path, limit: int) -> str | None:
    """The whole (maybe compressed) file as text, or None when it holds more than ``limit``
    characters: only ``limit + 1`` are ever read, so a file that decompresses to gigabytes costs
    no more than one that does not."""
    with open_text(path) as f:
        text = f.read(limit + 1)
    return None if len(text) > limit else text


def parse_record(line: str, ctx: FileContext, loc: int | str | None, sep: str = ":") -> tuple[bool, Any]:
    """(ok, value) of one JSON record; a bad one (syntax, nesting, a lone UTF-16 surrogate that
    no text can hold) is counted under its reason (or raises in strict mode)."""
    try:
        value = json.loads(line)
    except RecursionError:
        ctx.skip("nested too deeply", loc, "", sep)
        return False, None
    except ValueError as e:  # JSONDecodeError, or an integer too long to convert
        ctx.skip("bad json", loc, getattr(e, "msg", str(e))[:80], sep)
        return False, None
    return check_record(line, value, ctx, loc, sep), value


def check_record(text: str, value: Any, ctx: FileContext, loc: int | str | None, sep: str = ":") -> bool:
    """Whether ``value`` (parsed from ``text``) is safe to read: nested at most
    ``MAX_RECORD_DEPTH`` levels and free of lone surrogates; if not, it is counted."""
    if nesting_depth(value, MAX_RECORD_DEPTH) > MAX_RECORD_DEPTH:
        ctx.skip("nested too deeply", loc, f"more than {MAX_RECORD_DEPTH} levels", sep)
        return False
    if _SURROGATE_ESCAPE.search(text):  # only then can a string hold a lone surrogate
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            ctx.skip("invalid unicode", loc, "a lone UTF-16 surrogate", sep)
            return False
    return True


def iter_jsonl(ctx: FileContext) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) for each non-blank line; bad JSON and over-long lines are
    skipped and counted."""
    for lineno, line in iter_lines(ctx.path):
        if line is None:
            ctx.skip("record too large", lineno, f"line longer than {MAX_LINE_CHARS} characters")
            continue
        if not line.strip():
            continue
        ok, value = parse_record(line, ctx, lineno)
        if ok:
            yield lineno, value


def text_size(value: Any) -> int:
    """Characters of text in a conversation's messages, tools or document (keys included),
    counted without recursion."""
    n, todo = 0, [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            n += len(v)
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, (list, tuple)):
            todo.extend(v)
    return n
