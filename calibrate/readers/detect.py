"""Which reader a file needs, from its extension and a sniff of its first records.

JSONL is ambiguous: a Claude Code session, a Codex rollout and a list of chat records share the
extension, and only session files must be grouped into one conversation. The first records decide.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from . import claude_code, codex
from .base import format_suffix, iter_lines
from .datasets_reader import is_saved_dataset
from .text import is_binary

SNIFF_RECORDS = 20
SNIFF_LINES = 200  # a log of a million lines that are not records is not read to its end to say so
JSON_LINES = {".jsonl", ".ndjson"}
DATASET_FILES = {".parquet", ".arrow"}
SNIFFED_TEXT = {".log", ".txt", ""}


def sniff_records(path: Path, limit: int = SNIFF_RECORDS) -> list[dict]:
    """Up to ``limit`` of the first ``SNIFF_LINES`` lines that parse as JSON objects (bad or
    over-long lines ignored here)."""
    out: list[dict] = []
    for lineno, line in iter_lines(path):
        if len(out) >= limit or lineno > SNIFF_LINES:
            break
        value = _object(line)
        if value is not None:
            out.append(value)
    return out


def _object(line: str | None) -> dict | None:
    try:
        value = json.loads(line) if line is not None else None
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _starts_with_object(path: Path) -> bool:
    first = next((line for _, line in iter_lines(path) if line is None or line.strip()), None)
    return _object(first) is not None


def detect_file(path: Path) -> str:
    """One of: dataset, claude_code, codex, jsonl, json, text, binary, empty. A compressed
    file (``.gz``, ``.zst``) is judged by its contents and the name under the compression."""
    if is_saved_dataset(path) or path.suffix in DATASET_FILES:
        return "dataset"
    if path.stat().st_size == 0:
        return "empty"
    if is_binary(path):
        return "binary"
    suffix = format_suffix(path)
    if suffix in SNIFFED_TEXT and not _starts_with_object(path):  # logs are often JSONL
        return "text"
    if suffix in JSON_LINES or suffix in (".json", *SNIFFED_TEXT):
        head = sniff_records(path)
        if claude_code.looks_like(head):
            return "claude_code"
        if codex.looks_like(head):
            return "codex"
        return "json" if suffix == ".json" else "jsonl"
    return "text"


def walk(root: Path) -> Iterator[Path]:
    """Files (and saved-dataset folders) under ``root`` in a stable order, hidden entries skipped."""
    if not root.is_dir() or is_saved_dataset(root):
        yield root
        return
    for child in sorted(root.iterdir()):
        if child.name.startswith(".") or child.name == "__pycache__":
            continue
        if child.is_dir():
            yield from walk(child)
        else:  # FIFOs and devices too: the reader counts them as "not a regular file"
            yield child
