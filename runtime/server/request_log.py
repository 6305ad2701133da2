"""One log line per request (logger ``sparkpack.server``, INFO, on stderr when serving).

Why: when an agent fails against the server, the user sees the agent's message at best; the line
says which route the client called, what the prompt cost, how the generation ended and, for a
4xx or 5xx, the very message the client got. A route fills the request's ``RequestRecord``
(``record_of``) as it goes; ``http.DialectRoute`` writes the line when the response is made, or,
for a stream, ``generation.relay`` when the stream ends. /health and /metrics, which monitors
poll, log at DEBUG.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import Outcome

log = logging.getLogger("sparkpack.server")

QUIET_PATHS = ("/health", "/metrics")
OMITTED_HEADER = "x-sparkpack-omitted"


def client_name(user_agent: str | None) -> str:
    """A user agent's short form: its first product and, when the next word is a version, that
    (``claude-cli/2.1.197 (external, cli)`` -> ``claude-cli/2.1.197``, ``OpenAI/Python 1.99.0``
    stays whole)."""
    words = (user_agent or "").split()
    if not words:
        return "-"
    return " ".join(words[:2]) if len(words) > 1 and words[1][:1].isdigit() else words[0]


def omitted_text(omitted: dict[str, int]) -> str:
    """``{"image": 2, "document": 1}`` -> ``2 images, 1 document`` (the header's value)."""
    return ", ".join(f"{n} {kind}{'s' if n != 1 else ''}" for kind, n in sorted(omitted.items()))


@dataclass
class RequestRecord:
    method: str
    path: str
    client: str
    status: int = 200
    error: str | None = None
    outcome: Outcome | None = None  # the engine's counts, once the job ended
    omitted: dict[str, int] = field(default_factory=dict)
    streamed: bool = False  # the line is written when the stream ends
    started: float = field(default_factory=time.perf_counter)

    def line(self) -> str:
        parts = [f"{self.method} {self.path} {self.status}", f"client={json.dumps(self.client)}"]
        o = self.outcome
        if o is not None:
            ttft = f"{o.first_token_seconds:.3f}s" if o.first_token_seconds is not None else "-"
            parts += [f"prompt={o.prompt_tokens}", f"cached={o.cached_tokens}", f"ttft={ttft}",
                      f"output={o.completion_tokens}", f"finish={o.finish}"]
        if self.omitted:
            parts.append(f"omitted={json.dumps(omitted_text(self.omitted))}")
        parts.append(f"time={time.perf_counter() - self.started:.3f}s")
        if self.error is not None:
            parts.append(f"error={json.dumps(self.error, ensure_ascii=False)}")
        return " ".join(parts)

    def write(self) -> None:
        log.log(logging.DEBUG if self.path in QUIET_PATHS else logging.INFO, "%s", self.line())


def record_of(request) -> RequestRecord:
    """The request's record (``DialectRoute`` puts one on every request it handles)."""
    return request.state.record
