"""Where the user's past coding-agent sessions are, for a server to warm its learner from.

A server with no profile starts uniform and learns from what it serves. Most users of a coding
agent already have weeks of its sessions on disk: Claude Code keeps them under
``~/.claude/projects/<project>/<session>.jsonl``, Codex CLI under
``~/.codex/sessions/YYYY/MM/DD/rollout-*.jsonl``. ``--bootstrap auto`` finds them here and the
server replays them through its own session (``runtime.server.bootstrap``), read locally through
the calibrate readers (nothing leaves the machine), oldest first, so that with decay the newest
sessions weigh most; ``BootstrapResult`` is what it reports.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

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


@dataclass
class BootstrapResult:
    sessions: int = 0  # conversations replayed (a session file is one)
    documents: int = 0
    tokens: int = 0
    files: int = 0
    skipped: Counter[str] = field(default_factory=Counter)

    def summary(self) -> str:
        line = (f"learned from {self.sessions} sessions" + (f" and {self.documents} documents" if self.documents else "")
                + f", {self.tokens} tokens")
        if self.skipped:
            line += " (not replayed: " + ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items())) + ")"
        return line


def _mtime_then_name(p: Path) -> tuple[float, str]:
    return (p.stat().st_mtime, str(p))
