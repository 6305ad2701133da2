"""The one rule for what a command writes (a GGUF, a pack, a profile, a trace).

An existing output is refused unless the user says ``--force`` (calibrate also accepts
``--merge``), and the place it goes is tried before any long work starts: a calibration must not
replay for minutes and then fail to save. What killed writers left in that folder is cleared
first (``formats.leftovers``), one line each. Every writer builds its output under a hidden temp
name beside it and renames it into place, so errors are reported under the user's ``-o`` path,
never under the temp name they never typed.
"""
from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click
from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.leftovers import clean_folder

# Errors that say the destination, not the input, is the problem.
_DESTINATION_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


def check_output(path: Path, force: bool, how: str = "use --force to replace it") -> None:
    """Refuse ``path`` if it exists (unless ``force``) and fail now if its folder cannot take it.

    The folder is tried by creating a file in it: permission bits say nothing for root, and a
    read-only filesystem only shows when written to. The file is unnamed (O_TMPFILE where the
    filesystem has it) so an interruption cannot leave it behind."""
    clear_stale(path.parent)  # first: a pack moved aside by a killed split --force comes back here
    if path.exists() and not force:
        raise SparkpackError(path, f"already exists ({how})")
    folder = path.parent
    if not folder.exists():
        raise SparkpackError(path, f"cannot write here: folder {folder} does not exist")
    if not folder.is_dir():
        raise SparkpackError(path, f"cannot write here: {folder} is not a folder")
    try:
        with tempfile.TemporaryFile(prefix=f".{path.name}.probe-", dir=folder):
            pass
    except OSError as e:
        raise SparkpackError(path, f"cannot write here: {e.strerror or e}") from None


def clear_stale(folder: Path) -> None:
    """Remove (or restore) what killed writers left in ``folder``, saying what in one line each."""
    for line in clean_folder(folder):
        click.echo(f"repack: {line}", err=True)


@contextmanager
def reported_as(path: Path) -> Iterator[None]:
    """Report a failure to write ``path``'s temp files (disk full, the temp folder removed under
    us...) as a failure to write ``path``."""
    try:
        yield
    except OSError as e:
        parts = Path(os.fspath(e.filename)).parts if e.filename else ()
        in_temp = any(part.startswith(f".{path.name}.") for part in parts)  # the temp file, or inside it
        if e.errno in _DESTINATION_ERRNOS or in_temp:
            raise SparkpackError(path, f"cannot write: {e.strerror or e}") from None
        raise
