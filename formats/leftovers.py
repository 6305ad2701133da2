"""What a killed writer leaves beside its output, and cleaning it up on the next run.

Every writer here builds its output under a hidden name carrying its process id and renames it
into place when done: ``.NAME.sparkpack-tmp-PID`` (``atomic_file.temp_name``: a pack directory, a joined
or synthetic or converted GGUF, a profile, a checkpoint, a report) and, for ``split --force``,
the old pack moved aside as ``.NAME.sparkpack-old-PID`` until the new one is in. A ``kill -9`` leaves those
names behind (a joined GGUF's can be gigabytes). Every command that writes into a folder (and
``repack verify``) calls ``clean_folder`` first: an old pack is restored when nothing took its
place (killed between the two renames) or deleted when the new one did, and temporaries are
deleted; each action is reported in one line.

Only this project's names are touched, and only when they cannot belong to a writer still at
work: the pid in the name must not be a running process (a live one is a run still going; a
reused pid only keeps a leftover a while longer), the entry must be this user's and not a link,
and a directory must hold nothing but what a pack writer puts there (someone else's
``.x.sparkpack-tmp-1234`` folder is not ours to delete).
"""
from __future__ import annotations

import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from .atomic_file import pid_alive

_NAME = re.compile(r"\.(.+)\.sparkpack-(tmp|old)-(\d{1,10})")
# what a pack directory (being written, or moved aside) holds: pack_manifest's file names
_PACK_ENTRIES = {"header.bin", "hot.bin", "cold", "manifest.json"}


@dataclass(frozen=True)
class Leftover:
    path: Path
    kind: str  # "tmp" | "old"
    pid: int


def old_name(out: Path, pid: int | None = None) -> Path:
    """Where ``split --force`` keeps the pack it replaces until the new one is in place."""
    return out.parent / f".{out.name}.sparkpack-old-{os.getpid() if pid is None else pid}"


def _stale(folder: Path) -> dict[str, list[Leftover]]:
    """Output name -> the leftovers of dead writers of it in ``folder`` (old ones first)."""
    found: dict[str, list[Leftover]] = {}
    try:
        entries = list(folder.iterdir())
    except OSError:
        return {}
    for p in entries:
        m = _NAME.fullmatch(p.name)
        if m is None or m.group(1) in (".", "..") or not _ours(p):  # (no output is named . or ..)
            continue
        pid = int(m.group(3))
        if pid != os.getpid() and not pid_alive(pid):
            found.setdefault(m.group(1), []).append(Leftover(p, m.group(2), pid))
    return {name: sorted(lfs, key=lambda x: (x.kind != "old", x.pid)) for name, lfs in found.items()}


def _ours(p: Path) -> bool:
    """A file or a directory this user owns (a shared folder's other leftovers are their owners'),
    not a link (the writers make none), and a directory holding only what a pack writer writes."""
    try:
        st = p.lstat()
    except OSError:
        return False
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.geteuid():
        return False
    if not stat.S_ISDIR(st.st_mode):
        return True
    try:
        return {e.name for e in p.iterdir()} <= _PACK_ENTRIES
    except OSError:
        return False


def leftovers(out: Path) -> list[Leftover]:
    """Temporaries and moved-aside outputs of ``out`` whose process is gone (old ones first)."""
    return _stale(out.parent).get(out.name, [])


def clean_leftovers(out: Path) -> list[str]:
    """Restore or delete what dead writers of ``out`` left; one message per action."""
    out = Path(out)
    said = []
    for lf in leftovers(out):
        if lf.kind == "old" and not os.path.lexists(out):
            os.rename(lf.path, out)
            said.append(f"restored {out} from {lf.path.name}, moved aside by a run that was killed (process {lf.pid})")
            continue
        _remove(lf.path)
        what = (f"the previous {out.name} kept by" if lf.kind == "old" else "an unfinished output of")
        said.append(f"removed {lf.path.name}, {what} a run that was killed (process {lf.pid})")
    return said


def clean_folder(folder: Path) -> list[str]:
    """``clean_leftovers`` for every output of ``folder`` that dead writers left something of."""
    folder = Path(folder)
    return [line for name in sorted(_stale(folder)) for line in clean_leftovers(folder / name)]


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)
