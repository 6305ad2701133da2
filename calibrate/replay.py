"""Replay rendered conversations through a model and count which experts the router picks.

The model sits behind ``Router``: a window of token ids and their sides in, per-side routing
counts out. The runtime implements it (``runtime.calibration.ModelRouter``: the prefill path
spark-run uses for a prompt of the same tokens), so this package needs neither torch nor the
runtime.

What is counted: every token of a conversation once, on its side (prompt, or generated for the
tokens of assistant turns: ``calibrate.render``). A conversation is one sequence, cut into windows
of ``ctx`` tokens that start from a fresh state; a window is one pass, whatever its turns, so a
multi-turn agent log is prefilled once and in the longest calls (a call per turn would pay a
call's fixed cost per turn, a large part of a prefill call's time on the GPU's eager paths).

Each conversation starts from a fresh state (it is an independent request), so its counts do not
depend on what was replayed before it. That is what makes ``--resume`` exact: skipping the
conversations a checkpoint already counted and adding the rest gives the uninterrupted totals.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from sparkpack.formats.archs import ModelSpec

from .conversation import Conversation
from .render import ChatRenderer, Rendered

PROMPT, GENERATED = 0, 1


class Router(Protocol):
    """Something that routes token ids through a model and reports which experts each layer chose
    for them (``runtime.calibration.ModelRouter``)."""

    spec: ModelSpec

    def route(self, ids: list[int], generated: np.ndarray) -> np.ndarray:
        """Run ``ids`` as one sequence from a fresh state; the routings of its tokens, int64
        ``[2, n_layer, n_expert]``: every token's top-k in every MoE layer, counted on its side
        (``generated[t]``: GENERATED, else PROMPT)."""
        ...

    def take_trace(self) -> np.ndarray:
        """The experts of every token of the last ``route``, ``[T, n_moe, k]`` (MoE layers in
        order); only for a router opened to record them."""
        ...


class TraceSink(Protocol):
    def append(self, ids: np.ndarray, generated: np.ndarray) -> None: ...


@dataclass
class ReplayState:
    """What a checkpoint must hold for a resumed run to end exactly where an uninterrupted one does."""

    counts: np.ndarray  # int64 [2, n_layer, n_expert]
    tokens: list[int] = field(default_factory=lambda: [0, 0])  # per side
    done: list[str] = field(default_factory=list)  # ids of consumed conversations (counted or refused), in order
    conversations: int = 0
    documents: int = 0
    split_windows: int = 0  # conversations longer than --ctx, replayed as several windows
    skipped: Counter[str] = field(default_factory=Counter)
    truncated: bool = False  # the --max-tokens budget cut the last conversation
    trace_tokens: int = 0
    done_len: int | None = None  # set on snapshots: how much of the shared ``done`` list is theirs

    def snapshot(self) -> "ReplayState":
        """A copy consistent at this moment, cheap enough to take after every conversation (the
        growing ``done`` list is shared, cut at its current length)."""
        return replace(self, tokens=list(self.tokens), skipped=Counter(self.skipped), done_len=len(self.done))

    @property
    def total_tokens(self) -> int:
        return int(sum(self.tokens))

    def to_json(self) -> dict[str, Any]:
        done = self.done if self.done_len is None else self.done[: self.done_len]
        return {"counts": self.counts.tolist(), "tokens": list(map(int, self.tokens)), "done": done,
                "conversations": self.conversations, "documents": self.documents,
                "split_windows": self.split_windows, "skipped": dict(self.skipped), "truncated": self.truncated,
                "trace_tokens": self.trace_tokens}

    @classmethod
    def from_json(cls, d: dict[str, Any], shape: tuple[int, int, int]) -> "ReplayState":
        counts = np.asarray(d["counts"], dtype=np.int64)
        if counts.shape != shape:
            raise ValueError(f"counts have shape {counts.shape}, expected {shape}")
        return cls(counts=counts, tokens=[int(x) for x in d["tokens"]], done=[str(x) for x in d["done"]],
                   conversations=int(d["conversations"]), documents=int(d["documents"]),
                   split_windows=int(d["split_windows"]), skipped=Counter(d["skipped"]),
                   truncated=bool(d["truncated"]), trace_tokens=int(d["trace_tokens"]))

    @classmethod
    def empty(cls, spec: ModelSpec) -> "ReplayState":
        return cls(counts=np.zeros((2, spec.n_layer, spec.n_expert), dtype=np.int64))


class Replayer:
    """Runs conversations through ``router`` in windows of ``ctx`` tokens."""

    def __init__(self, router: Router, renderer: ChatRenderer, ctx: int):
        if ctx <= 0:
            raise ValueError("ctx must be positive")
        self.router, self.renderer, self.ctx = router, renderer, ctx
        spec = router.spec
        self.shape = (2, spec.n_layer, spec.n_expert)

    def run_one(self, r: Rendered, trace: TraceSink | None,
                on_tokens: Callable[[int], None] | None = None) -> tuple[np.ndarray, int]:
        """Route one rendered conversation: its counts ``[2, n_layer, n_expert]`` and how many
        windows it took."""
        counts = np.zeros(self.shape, dtype=np.int64)
        windows = 0
        for w0 in range(0, len(r.ids), self.ctx):
            windows += 1
            w = slice(w0, min(w0 + self.ctx, len(r.ids)))
            counts += self.router.route(r.ids[w], r.generated[w])
            if trace is not None:
                trace.append(self.router.take_trace(), r.generated[w])
            if on_tokens is not None:
                on_tokens(w.stop - w.start)
        return counts, windows

    def planned_tokens(self, convs: Iterable[Conversation], max_tokens: int | None = None,
                       on_tokens: Callable[[int], None] | None = None) -> int:
        """How many tokens ``replay`` will count from ``convs``: rendering is cheap next to the
        forward passes, and knowing the total up front gives the progress bar an end and an ETA."""
        n = 0
        for conv in convs:
            r = self.renderer.render_or_reason(conv)
            if not isinstance(r, str):
                n += len(r.ids)
                if on_tokens is not None:
                    on_tokens(len(r.ids))
            if max_tokens is not None and n >= max_tokens:
                return max_tokens
        return n

    def replay(self, convs: Iterable[Conversation], state: ReplayState, *, max_tokens: int | None = None,
               trace: TraceSink | None = None, skip: Iterable[str] = (),
               after_each: Callable[[ReplayState], None] | None = None,
               on_tokens: Callable[[int], None] | None = None) -> ReplayState:
        """Count routings of ``convs`` into ``state`` (which may come from a checkpoint).

        ``skip`` (a checkpoint's done ids) is consumed as a multiset so a conversation that appears
        twice in the corpus is skipped only as often as it was counted. ``after_each`` runs after
        every counted conversation, with ``state`` consistent (the place to checkpoint). ``state.counts``
        is replaced, never modified in place, so a snapshot may share it.
        """
        skip = Counter(skip)
        for conv in _budgeted(convs, state, max_tokens):
            if skip.get(conv.id, 0) > 0:
                skip[conv.id] -= 1
                continue
            r = self.renderer.render_or_reason(conv)
            if isinstance(r, str):
                self._refuse(state, conv, r, after_each)
                continue
            if max_tokens is not None and state.total_tokens + len(r.ids) > max_tokens:
                keep = max_tokens - state.total_tokens
                r = Rendered(r.ids[:keep], r.generated[:keep], r.text)
                state.truncated = True
            counts, windows = self.run_one(r, trace, on_tokens)
            state.split_windows += windows > 1
            n_gen = int(r.generated.sum())
            state.tokens[GENERATED] += n_gen
            state.tokens[PROMPT] += len(r.ids) - n_gen
            state.counts = state.counts + counts
            state.done.append(conv.id)
            if conv.kind == "document":
                state.documents += 1
            else:
                state.conversations += 1
            if trace is not None:
                state.trace_tokens += len(r.ids)
            if after_each is not None:
                after_each(state)
        return state

    @staticmethod
    def _refuse(state: ReplayState, conv: Conversation, reason: str,
                after_each: Callable[[ReplayState], None] | None) -> None:
        """Count a conversation that cannot be replayed; it is consumed like a counted one, so a
        resumed run neither retries nor counts it twice."""
        state.skipped[reason] += 1
        state.done.append(conv.id)
        if after_each is not None:
            after_each(state)


def _budgeted(convs: Iterable[Conversation], state: ReplayState, max_tokens: int | None) -> Iterator[Conversation]:
    for conv in convs:
        if max_tokens is not None and (state.total_tokens >= max_tokens or state.truncated):
            return
        yield conv
