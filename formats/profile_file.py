"""The profile file a live run learns into: beside the model, tied to its identity, written
atomically after requests (at most every ``every_s`` seconds), at exit and on SIGTERM.

Every write goes through ``Profile.save`` (temporary name, fsync, rename, fsync of the folder), so
a crash or ``kill -9`` at any moment leaves the old profile or the new one. A file that is not a
profile of this model (another model's, or not a profile at all) is refused with one line naming
it and is never overwritten unless the user says ``--force``: it may be the only copy of days of
learning for the model it belongs to.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from .archs import ModelSpec
from .errors import SparkpackError
from .leftovers import clean_folder
from .profile import ModelIdentity, Profile

SAVE_EVERY_S = 60.0  # at most this much learning is lost to a crash; a write costs milliseconds


class ProfileFile:
    """``path`` holds (or will hold) the profile of the model with ``identity`` and ``spec``."""

    def __init__(self, path: str | os.PathLike[str], identity: ModelIdentity, spec: ModelSpec, *,
                 force: bool = False, every_s: float = SAVE_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self.path = Path(path)
        self.identity, self.spec = identity, spec
        self.force = force
        self.every_s = every_s
        self.clock = clock
        self.last_save: float | None = None
        self.saves = 0

    def load(self) -> Profile:
        """The profile to start learning from: the file's, or an empty one when there is none
        (or when ``force`` replaces a file that is not this model's profile). Temporary files
        that killed writers left beside it are removed."""
        self.remove_stale_temps()
        if not self.path.exists():
            return Profile.new(self.identity, self.spec)
        try:
            prof = Profile.load(self.path)
            prof.check_model(self.identity, self.spec, self.path)
        except SparkpackError as e:
            if self.force:
                return Profile.new(self.identity, self.spec)
            raise SparkpackError(self.path, f"{e.problem}; not overwriting it (--force starts a new profile "
                                            "there)") from None
        return prof

    def save(self, profile: Profile) -> Path:
        """Write now (atomically)."""
        if profile.identity != self.identity:
            raise SparkpackError(self.path, "refusing to save a profile of another model here")
        profile.save(self.path)
        self.last_save = self.clock()
        self.saves += 1
        return self.path

    def due(self) -> bool:
        """Whether ``every_s`` seconds have passed since the last write (or none was made yet)."""
        return self.last_save is None or self.clock() - self.last_save >= self.every_s

    def save_if_due(self, snapshot: Callable[[], Profile]) -> bool:
        """After a request: write ``snapshot()`` when ``due``. Returns whether it wrote."""
        if not self.due():
            return False
        self.save(snapshot())
        return True

    def remove_stale_temps(self) -> list[str]:
        """Remove what writers that died mid-write (their process is gone) left in the profile's
        folder, as every command does for the folder it writes into (``formats.leftovers``); one
        line per file removed."""
        return clean_folder(self.path.parent)


@contextlib.contextmanager
def saved_at_exit(file: ProfileFile, snapshot: Callable[[], Profile]) -> Iterator[None]:
    """Save ``snapshot()`` however the block ends: normally, by an error, Ctrl-C or SIGTERM.

    SIGTERM's default action kills the process without running any cleanup, so while the block
    runs it raises ``SystemExit(143)`` instead, and a SIGTERM arriving during the final save
    waits for it to finish. This is done only where no one else handles SIGTERM (a server
    framework that installs its own handler saves from its shutdown hook) and only in the main
    thread (the only one Python delivers signals to)."""
    installed = (threading.current_thread() is threading.main_thread()
                 and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None))
    if installed:
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        late: list[int] = []
        if installed:
            signal.signal(signal.SIGTERM, lambda signum, frame: late.append(signum))
        try:
            file.save(snapshot())
        finally:
            if installed:
                signal.signal(signal.SIGTERM, previous)
        if late:
            raise SystemExit(128 + late[0])


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
