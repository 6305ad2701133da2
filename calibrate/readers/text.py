"""Plain text, Markdown and source files: one raw document each, binary files skipped.

Documents are tokenised as they are, without a chat template: a README or a source file reaches
the model inside a tool result or a prompt, and its own tokens are what the experts see.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from ..conversation import Conversation, document
from .base import FileContext, open_bytes, open_text

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
    with open_text(ctx.path) as f:
        text = f.read()
    if not text.strip():
        ctx.skip("empty file")
        return
    yield document(text, ctx.where())
