"""What a killed writer leaves beside its output, and cleaning it up on the next run.

Every writer here builds its output under a hidden name carrying its process id and renames it
into place when done: ``.NAME.tmp-PID`` (``atomic_file.temp_name``: a pack directory, a joined
GGUF, a profile, a checkpoint) and, for ``split --force``, the old pack moved aside as
``.NAME.old-PID`` until the new one is in. A ``kill -9`` leaves those names behind (a joined GGUF's can be gigabytes). The next
run of the same command calls ``clean_leftovers(output)`` first: an old pack is restored when
nothing took its place (killed between the two renames) or deleted when the new one did, and
temporaries are deleted; each action is reported in one line. Only names whose process is no
longer running are touched: a live one belongs to a run still going.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from .atomic_file import pid_alive


@dataclass(frozen=True)
class Leftover:
    path: Path
    kind: str  # "tmp" | "old"
    pid: int


def old_name(out: Path, pid: int | None = None) -> Path:
    """Where ``split --force`` keeps the pack it replaces until the new one is in place."""
    return out.parent / f".{out.name}.old-{os.getpid() if pid is None else pid}"


def leftovers(out: Path) -> list[Leftover]:
    """Temporaries and moved-aside outputs of ``out`` whose process is gone (old ones first)."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(tmp|old)-(\d{{1,10}})")
    found = []
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return []
    for p in entries:
        m = pattern.fullmatch(p.name)
        if m is None:
            continue
        pid = int(m.group(2))
        if pid != os.getpid() and not pid_alive(pid):
            found.append(Leftover(p, m.group(1), pid))
    return sorted(found, key=lambda x: (x.kind != "old", x.pid))


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


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)
