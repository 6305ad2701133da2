"""Reading files nobody checked yet: regular files only, sizes bounded, JSON nesting bounded.

A FIFO or a device where a model, shard or profile should be would block a reader forever or
stream without end; a 2 GB "manifest" or a list nested 100 000 deep would exhaust memory or the
interpreter's stack. Every reader of user-supplied files goes through these few functions so each
of those cases becomes one ``SparkpackError`` line naming the file.
"""
from __future__ import annotations

import json
import os
import stat
from typing import Any

from .errors import FormatError, SparkpackError

_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket"}


def require_regular(path: str | os.PathLike[str], what: str) -> os.stat_result:
    """``os.stat`` of ``path``, which must be a regular file (symlinks followed)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise SparkpackError(path, "no such file") from None
    except OSError as e:
        raise SparkpackError(path, f"cannot read ({e.strerror or e})") from None
    if stat.S_ISDIR(st.st_mode):
        raise SparkpackError(path, f"is a directory, expected {what}")
    if not stat.S_ISREG(st.st_mode):
        kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
        raise FormatError(path, f"is {kind}, expected {what} (a regular file)")
    return st


def read_bounded(path: str | os.PathLike[str], what: str, max_bytes: int) -> bytes:
    """The whole content of a regular file of at most ``max_bytes`` bytes."""
    st = require_regular(path, what)
    if st.st_size > max_bytes:
        raise FormatError(path, f"is {st.st_size} bytes, more than {max_bytes} ({what} cannot be this large)")
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew while we looked
        raise FormatError(path, f"is more than {max_bytes} bytes ({what} cannot be this large)")
    return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def parse_json(text: str | bytes, where: object, what: str, max_depth: int | None = None,
               constants: bool = False) -> Any:
    """``json.loads`` with every failure as one ``FormatError``: bad syntax, invalid UTF-8, NaN
    or Infinity (unless ``constants``: a GGUF's metadata may hold them), integers too long to
    convert, nesting deeper than the interpreter's stack or than ``max_depth``."""
    try:
        value = json.loads(text, parse_constant=None if constants else _no_constant)
    except RecursionError:
        raise FormatError(where, f"not {what}: nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise FormatError(where, f"not {what}: invalid JSON ({str(e)[:100]})") from None
    if max_depth is not None and nesting_depth(value, max_depth) > max_depth:
        raise FormatError(where, f"not {what}: nested more than {max_depth} levels deep")
    return value


def load_json(path: str | os.PathLike[str], what: str, max_bytes: int, max_depth: int | None = None) -> Any:
    """A JSON file of at most ``max_bytes`` (``parse_json``'s checks, no NaN or Infinity)."""
    return parse_json(read_bounded(path, what, max_bytes), path, what, max_depth)


def nesting_depth(value: Any, limit: int) -> int:
    """Depth of nested lists/objects (a scalar is 0), counted without recursion and only up to
    ``limit + 1`` (enough to know it is too deep)."""
    depth, level = 0, [value] if isinstance(value, (list, dict)) else []
    while level and depth <= limit:
        depth += 1
        nxt: list[Any] = []
        for v in level:
            for x in (v.values() if isinstance(v, dict) else v):
                if isinstance(x, (list, dict)):
                    nxt.append(x)
        level = nxt
    return depth
