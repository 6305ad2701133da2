"""``--bootstrap PATH|auto``: learn the placement from the user's past agent sessions before the
first request, or in idle time (``--bootstrap-background``).

The sessions are found (``calibrate.bootstrap``: Claude Code's and Codex's logs for ``auto``),
read locally through the calibrate readers, rendered with the model's chat template
(``calibrate.render``) and fed through the serving ``Session``, the same prefill path a request
takes, so the store's routing counts reach the live learner (``runtime.learning``) exactly as
served traffic does: prompt-side tokens as prompt, the assistant's turns as generated.

What is replayed: only the newest sessions, up to ``BOOTSTRAP_HALF_LIVES`` half-lives of tokens
(older traffic would weigh under 2**-5 = 3% after them, not worth the replay time), replayed
oldest first so that the newest weigh most. With ``auto``, only sessions written since the
profile was last saved: a restart with the same flag learns what is new, not everything again.
A replay in the background stops at the next segment boundary when a request comes; the rest of
that conversation is dropped and the next one replays in the next idle time.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sparkpack.calibrate.bootstrap import BootstrapResult, find_agent_logs
from sparkpack.calibrate.readers import read_corpus
from sparkpack.calibrate.readers.detect import walk
from sparkpack.calibrate.render import ChatRenderer, Rendered
from sparkpack.formats.errors import SparkpackError

from ..generate import GENERATED, PROMPT, Session

BOOTSTRAP_HALF_LIVES = 5


@dataclass
class Selected:
    """The conversations to replay, oldest first, and what was left out."""

    rendered: list[tuple[Rendered, bool]] = field(default_factory=list)  # (conversation, is a document)
    result: BootstrapResult = field(default_factory=BootstrapResult)
    tokens: int = 0
    older: int = 0  # conversations and files left out: older than the token budget reaches


def bootstrap_sources(spec: str, profile_path: Path | None, home: Path | None = None) -> list[Path]:
    """The session files ``--bootstrap SPEC`` replays, oldest first: ``auto`` -> the coding
    agents' logs written after the profile (all of them without one), else the files under
    the path."""
    if spec == "auto":
        since = profile_path.stat().st_mtime if profile_path is not None and profile_path.exists() else None
        return [p for p in find_agent_logs(home).all if since is None or p.stat().st_mtime > since]
    root = Path(spec)
    if not root.exists():
        raise SparkpackError(root, "no such file or folder to bootstrap from")
    return sorted(walk(root), key=lambda p: (p.stat().st_mtime, str(p)) if p.exists() else (0.0, str(p)))


def select(files: list[Path], renderer: ChatRenderer, budget_tokens: int) -> Selected:
    """The newest conversations of ``files`` (oldest first) whose tokens fit ``budget_tokens``:
    files are read newest first, a file's conversations taken from its end (logs append), and
    reading stops once the budget is full."""
    out = Selected()
    picked: list[tuple[Rendered, bool]] = []  # newest first
    for i, path in enumerate(reversed(files)):
        if out.tokens >= budget_tokens:
            out.older = len(files) - i
            break
        convs, stats = read_corpus(path)
        mine: list[tuple[Rendered, bool]] = []
        for conv in convs:
            r = renderer.render_or_reason(conv)
            if isinstance(r, str):
                out.result.skipped[r] += 1
                continue
            mine.append((r, conv.kind == "document"))
        out.result.files += stats.files
        out.result.skipped += stats.skipped
        for r, document in reversed(mine):
            if out.tokens >= budget_tokens:
                out.older += 1
                continue
            picked.append((r, document))
            out.tokens += len(r.ids)
    out.rendered = picked[::-1]
    return out


class BootstrapReplay:
    """Feeds the selected conversations through ``session``; ``run`` replays until done or
    ``busy()`` and says whether any are left."""

    def __init__(self, session: Session, selected: Selected):
        self.session = session
        self.todo = list(selected.rendered)
        self.result = selected.result
        self.seconds = 0.0
        self.older = selected.older

    def run(self, busy: Callable[[], bool] = lambda: False) -> bool:
        t0 = time.perf_counter()
        try:
            while self.todo and not busy():
                r, document = self.todo.pop(0)
                self.result.tokens += self._replay(r, busy)
                self.result.documents += document
                self.result.sessions += not document
        finally:
            self.seconds += time.perf_counter() - t0
        return bool(self.todo)

    def _replay(self, r: Rendered, busy: Callable[[], bool]) -> int:
        """One conversation in windows of the session's context, each fed in runs of tokens of
        one side; returns the tokens computed (a window's prefix the session kept is not)."""
        s = self.session
        ctx = max(2, s.cache_ctx)
        gen = np.asarray(r.generated, dtype=bool)
        computed = 0
        for w0 in range(0, len(r.ids), ctx):
            w1 = min(w0 + ctx, len(r.ids))
            cuts = [w0, *(w0 + 1 + np.flatnonzero(gen[w0 + 1: w1] != gen[w0: w1 - 1])).tolist(), w1]
            for a, b in zip(cuts, cuts[1:]):
                side = GENERATED if gen[a] else PROMPT
                if a == w0:
                    s.prompt(r.ids[w0:b], side)
                    computed += b - w0 - s.reused
                else:
                    s.feed(r.ids[w0:b], side)
                    computed += b - a
                if busy():
                    return computed
        return computed

    def summary(self) -> str:
        line = f"bootstrap: {self.result.summary()} in {self.seconds:.1f} s"
        if self.older:
            line += f"; {self.older} older sessions or files left out (their weight would be under 3%)"
        return line
