"""Run the real commands as child processes and signal them in the middle of their work."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPACK = [sys.executable, "-m", "sparkpack.repack.cli"]
SPARK_RUN = [sys.executable, "-m", "sparkpack.runtime.cli"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")  # tiny models on a shared 2-core machine


def default_sigint() -> None:
    """``preexec_fn`` for a child that a test interrupts: SIGINT back to its default. A shell's
    background job (``pytest ... &``) ignores SIGINT, a child inherits that, and Python then never
    turns Ctrl-C into KeyboardInterrupt (the interrupt tests failed so, and only so)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class Stopped:
    returncode: int
    stderr: str


def run(argv: list[str], cwd: Path = REPO, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=ENV, timeout=300, **kw)


def mid_work(argv: list[str], working: Callable[[], bool], action: Callable[[subprocess.Popen], None],
             attempts: int = 5) -> Stopped:
    """Start ``argv``; once ``working()`` (say, its temp output exists) freeze it with SIGSTOP,
    check it is still working, do ``action(proc)`` to it and let it go on: the action lands in
    the middle of the work, not before or after it. A run that finishes before it is caught is
    started again."""
    for _ in range(attempts):
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                env=ENV, preexec_fn=default_sigint)
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if working():
                os.kill(proc.pid, signal.SIGSTOP)
                # SIGSTOP lands asynchronously: only once the process is stopped does "still
                # working" mean it (on an idle machine a split renamed its pack in between)
                caught = _stopped(proc) and working()
                if caught:
                    action(proc)
                if proc.returncode is None:  # not reaped by poll(): the pid is still ours
                    os.kill(proc.pid, signal.SIGCONT)
                if caught:
                    _, err = proc.communicate(timeout=120)
                    return Stopped(proc.returncode, err)
            time.sleep(0.001)
        proc.communicate(timeout=120)
    raise AssertionError(f"{argv[3:5]} always finished before it could be caught: give it more work")


def _stopped(proc: subprocess.Popen, timeout: float = 10.0) -> bool:
    """Wait until ``proc`` is in the stopped state; False when it exited instead."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with open(f"/proc/{proc.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return proc.poll() is None
        if state in ("T", "t"):
            return True
        time.sleep(0.0005)
    return proc.poll() is None


def signal_mid_work(argv: list[str], working: Callable[[], bool], sig: int = signal.SIGTERM) -> Stopped:
    """``mid_work`` sending ``sig`` (delivered when the process continues)."""
    return mid_work(argv, working, lambda proc: os.kill(proc.pid, sig))


def error_lines(stderr: str) -> list[str]:
    """The non-blank lines of stderr (click ends a ^C line with a blank one)."""
    return [ln for ln in stderr.splitlines() if ln.strip()]
