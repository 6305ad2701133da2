"""Files that are either the old version or the new one, never half of either.

Data goes to a hidden temporary name beside the target (``.NAME.sparkpack-tmp-PID``, one per
process; the project's name in it, so that the cleaner never takes another program's temporary for
ours), is fsynced, renamed over the target, and the folder is fsynced so the rename itself survives
a power cut. A failed write removes its temporary file; one left by a process killed mid-write
carries its pid, so the next writer can tell it is stale and remove it (``formats.leftovers``).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def temp_name(path: Path, pid: int | None = None) -> Path:
    """Where ``write_atomic`` writes ``path`` before the rename."""
    return path.with_name(f".{path.name}.sparkpack-tmp-{os.getpid() if pid is None else pid}")


def write_atomic(path: str | os.PathLike[str], data: bytes | str) -> Path:
    with atomic_writer(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return Path(path)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """``write_atomic`` for data written piece by piece (a file larger than one buffer should be):
    the file to write; at the end of the block it is fsynced and renamed over ``path``."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make a rename inside ``folder`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a temporary file named for it may still be written)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OverflowError:  # not a pid this system can have
        return False
    return True
