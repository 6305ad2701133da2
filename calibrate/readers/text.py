"""Plain text, Markdown and source files: one raw document each, binary files skipped.

Documents are tokenised as they are, without a chat template: a README or a source file reaches
the model inside a tool result or a prompt, and its own tokens are what the experts see.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from ..conversation import Conversation, document
from .base import MAX_RECORD_CHARS, FileContext, open_bytes, read_text

SNIFF_BYTES = 8192


def is_binary(path: Path) -> bool:
    """NUL bytes or undecodable UTF-8 in the first block mean the file is not text."""
    with open_bytes(path) as f:
        head = f.read(SNIFF_BYTES)
    if b"\0" in head:
        return True
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start < len(head) - 4  # a multi-byte character cut by the block end is fine
    return False


def read_file(ctx: FileContext) -> Iterator[Conversation]:
    text = read_text(ctx.path, MAX_RECORD_CHARS)
    if text is None:  # more than a record may hold (a document is one record)
        ctx.skip("record too large", None, f"more than {MAX_RECORD_CHARS} characters")
        return
    if not text.strip():
        ctx.skip("empty file")
        return
    yield document(text, ctx.where())
