"""From a job's tokens to the events a route formats: detokenize, parse, cut at stop strings.

``EventStream`` is the engine's ``TokenSink`` for one request. In the engine thread it turns each
token into text (whole UTF-8 characters only), the output parser's events (reasoning, visible
text, tool calls) and applies the request's stop strings to the visible text, so generation ends
at the token that completes a stop; the events go to the route's asyncio loop through a queue.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from .engine import Outcome
from .output import OutputParser, TextDelta


class StopStrings:
    """Cuts visible text at the first of ``stops``; text that may be the start of one is held
    back until the next piece decides."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """The text safe to show now; after a match, ``matched`` is set and nothing more comes."""
        if not self.stops or self.matched is not None:
            return "" if self.matched is not None else text
        buf = self.held + text
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            i, self.matched = min(hits)
            self.held = ""
            return buf[:i]
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(buf)), 0, -1)
                    if buf.endswith(s[:k])), default=0)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        out, self.held = self.held, ""
        return "" if self.matched is not None else out


class PlainText:
    """The parser of raw completions: all text is visible text."""

    def feed(self, text: str) -> list:
        return [TextDelta(text)] if text else []

    def finish(self) -> list:
        return []


@dataclass(frozen=True)
class Started:
    """The prompt is computed: its token counts are known (Anthropic's message_start reports them)."""

    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Finished:
    """The last item of a stream: the job's outcome and the stop string that ended it, if any."""

    outcome: Outcome
    stop_sequence: str | None = None


class EventStream:
    """A job's ``TokenSink``; ``events()`` yields ``Started``, lists of parser events, then
    ``Finished`` (a job cancelled in the queue or failing in its prefill skips ``Started``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tokenizer, parser: OutputParser | PlainText, stops: list[str],
                 implicit: list[str] = ()):
        """``implicit``: stop strings of the model rather than the request (not reported)."""
        self.loop = loop
        self.decoder = tokenizer.decoder(skip_special=True)  # what spark-run prints
        self.parser = parser
        self.stops = StopStrings([*stops, *implicit])
        self.implicit = frozenset(implicit) - frozenset(stops)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.outcome: Outcome | None = None  # the engine's, counting as it goes, once the job started

    def started(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self._post(Started(outcome.prompt_tokens, outcome.cached_tokens))

    def token(self, token_id: int) -> bool:
        self._post(self._cut(self.parser.feed(self.decoder.push(token_id))))
        return self.stops.matched is not None

    def end(self, outcome: Outcome) -> None:
        """The held text and the end, posted last whatever happens: a client waits for
        ``Finished`` (a parser that failed on a token would fail here again, and the reply
        would never end)."""
        try:
            events = []
            if self.stops.matched is None:
                events = self._cut(self.parser.feed(self.decoder.flush()) + self.parser.finish())
                rest = self.stops.flush()
                if rest:
                    events.append(TextDelta(rest))
            self._post(events)
        finally:
            matched = self.stops.matched
            self._post(Finished(outcome, None if matched in self.implicit else matched))

    def _cut(self, events: list) -> list:
        """Stop strings apply to the visible text; other events pass (held text goes first)."""
        out = []
        for ev in events:
            if self.stops.matched is not None:
                break
            if isinstance(ev, TextDelta):
                text = self.stops.feed(ev.text)
                if text:
                    out.append(TextDelta(text))
            else:
                held = self.stops.flush()
                if held:
                    out.append(TextDelta(held))
                out.append(ev)
        return out

    def _post(self, item) -> None:
        if item == []:
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass

    async def events(self) -> AsyncIterator[list | Finished]:
        while True:
            item = await self.queue.get()
            yield item
            if isinstance(item, Finished):
                return
