"""Warm a new learner from the user's past agent sessions before (or while) serving.

A server with no profile starts uniform and learns from what it serves. Most users of a coding
agent already have weeks of its sessions on disk: Claude Code keeps them under
``~/.claude/projects/<project>/<session>.jsonl``, Codex CLI under
``~/.codex/sessions/YYYY/MM/DD/rollout-*.jsonl``. ``--bootstrap auto`` finds them, reads them
locally through the calibrate readers (nothing leaves the machine) and replays them through the
model into the learner, oldest first, so that with decay the newest sessions weigh most;
``--bootstrap PATH`` does the same for any file or folder the readers understand.
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sparkpack.formats.decayed_routing import DecayedRouting

from .conversation import Conversation
from .readers import ReadStats, read_corpus
from .replay import GENERATED, PROMPT, Replayer, ReplayState

# (tool, folder under HOME, pattern under it): where coding agents keep their session logs
AGENT_LOGS = (
    ("Claude Code", ".claude/projects", "*/*.jsonl"),
    ("Codex", ".codex/sessions", "**/rollout-*.jsonl"),
)


@dataclass
class AgentLogs:
    """Session files found per tool, each list oldest first (by modification time)."""

    files: dict[str, list[Path]] = field(default_factory=dict)

    @property
    def all(self) -> list[Path]:
        """Every session file, oldest first: the order to learn them in."""
        return sorted((p for ps in self.files.values() for p in ps), key=_mtime_then_name)

    @property
    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.all)

    def __bool__(self) -> bool:
        return any(self.files.values())

    def summary(self) -> str:
        """``12 Claude Code and 3 Codex sessions (4.1 MB)``."""
        parts = [f"{len(ps)} {tool}" for tool, ps in self.files.items() if ps]
        return f"{' and '.join(parts)} session{'s' if len(self.all) != 1 else ''} ({self.nbytes / 1e6:.1f} MB)"


def find_agent_logs(home: Path | None = None) -> AgentLogs:
    """The session logs of the coding agents under ``home`` (default: the user's home)."""
    home = Path.home() if home is None else Path(home)
    found = AgentLogs()
    for tool, folder, pattern in AGENT_LOGS:
        root = home / folder
        files = [p for p in root.glob(pattern) if p.is_file()] if root.is_dir() else []
        found.files[tool] = sorted(files, key=_mtime_then_name)
    return found


def bootstrap_hint(home: Path | None = None) -> str | None:
    """The one line a server prints when agent logs exist and ``--bootstrap`` was not given."""
    logs = find_agent_logs(home)
    if not logs:
        return None
    return (f"found {logs.summary()} of your coding agents: `--bootstrap auto` learns which experts they use "
            "before serving (read locally, nothing is uploaded)")


def bootstrap_files(spec: str | Path, home: Path | None = None) -> list[Path]:
    """What ``--bootstrap SPEC`` replays: ``auto`` -> the agent logs found, else the path itself
    (a file or a folder; the readers walk folders)."""
    if str(spec) == "auto":
        return find_agent_logs(home).all
    return [Path(spec)]


@dataclass
class BootstrapResult:
    sessions: int = 0  # conversations replayed (a session file is one)
    documents: int = 0
    tokens: int = 0
    files: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    stopped: bool = False  # ``stop`` was set, or ``max_tokens`` was reached
    done: list[str] = field(default_factory=list)  # ids of the conversations consumed (``skip`` resumes after them)

    def summary(self) -> str:
        line = (f"learned from {self.sessions} sessions" + (f" and {self.documents} documents" if self.documents else "")
                + f", {self.tokens} tokens")
        if self.skipped:
            line += " (not replayed: " + ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items())) + ")"
        return line


def bootstrap(learner: DecayedRouting, replayer: Replayer, paths: Iterable[Path], *, max_tokens: int | None = None,
              stop: threading.Event | None = None, skip: Iterable[str] = ()) -> BootstrapResult:
    """Replay the conversations in ``paths`` (in that order) through ``replayer``'s model and
    teach ``learner`` each one's routings, prompt and generated sides apart, as it goes.

    ``stop`` (set from another thread: a request arriving, Ctrl-C) ends it after the conversation
    being replayed; a later call with ``skip=result.done`` goes on from there, so a server can
    bootstrap in the background between requests. The replayer's router runs a session of its
    own and puts its routing tap in front of the model's expert provider only while it routes, so
    nothing else may run the model meanwhile: between requests, not beside them."""
    result = BootstrapResult()
    skip = list(skip)
    stats: list[ReadStats] = []
    state = ReplayState(counts=np.zeros((2, *learner.shape), dtype=np.int64))
    seen = [state.counts, 0, 0]  # counts, prompt tokens, generated tokens at the last conversation

    def after_each(st: ReplayState) -> None:
        prev, p0, g0 = seen
        if st.counts is not prev:  # a counted conversation (a refused one leaves the counts alone)
            delta = st.counts - prev
            learner.observe(delta[PROMPT], st.tokens[PROMPT] - p0, "prompt")
            learner.observe(delta[GENERATED], st.tokens[GENERATED] - g0, "generated")
            seen[:] = [st.counts, st.tokens[PROMPT], st.tokens[GENERATED]]
        if stop is not None and stop.is_set():
            raise _Stopped

    try:
        replayer.replay(_conversations(paths, stats), state, max_tokens=max_tokens, after_each=after_each,
                        skip=skip)
    except _Stopped:
        result.stopped = True
    result.sessions, result.documents, result.tokens = state.conversations, state.documents, state.total_tokens
    result.stopped |= state.truncated
    result.done = skip + state.done
    result.files = sum(s.files for s in stats)
    result.skipped = state.skipped + sum((s.skipped for s in stats), Counter())
    return result


class _Stopped(Exception):
    pass


def _conversations(paths: Iterable[Path], stats: list[ReadStats]) -> Iterator[Conversation]:
    for path in paths:
        convs, st = read_corpus(path)
        stats.append(st)
        yield from convs


def _mtime_then_name(p: Path) -> tuple[float, str]:
    return (p.stat().st_mtime, str(p))
