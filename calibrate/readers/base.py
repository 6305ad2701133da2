"""Bookkeeping shared by the readers: counts of what was read and skipped, and strict mode.

Real traffic logs are messy (a truncated last line, a record from another tool). A calibration run
must not die on line 40 000 of a log, but a user must be able to see what was dropped and why, and
``strict=True`` turns every drop into an error that names the file and line.
"""
from __future__ import annotations

import gzip
import io
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import zstandard

from sparkpack.formats.errors import SparkpackError


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


class RecordError(ValueError):
    """A record that parsed as JSON but is not a usable conversation; the message is the skip reason."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


# Logs are often rotated into compressed files (``session.jsonl.gz``, ``*.zst``): they are read
# through a decompressor, and their format is that of the name without the compression suffix.
COMPRESSED_SUFFIXES = (".gz", ".zst", ".zstd")
# What a damaged compressed file raises while it is read (a truncated gzip stream: EOFError).
DECOMPRESS_ERRORS = (OSError, EOFError, zstandard.ZstdError)


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


def iter_jsonl(ctx: FileContext) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) for each non-blank line; bad JSON is skipped and counted."""
    with open_text(ctx.path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                ctx.skip("bad json", lineno, e.msg)

