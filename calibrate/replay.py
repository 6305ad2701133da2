"""Replay rendered conversations through the model and count which experts the router picks.

Counting happens where routing decisions pass: every MoE layer asks its expert provider for
``moe(layer, x, weights, ids)`` (the contract ``runtime.experts.ExpertProvider``), so wrapping the
model's provider is enough; the model code knows nothing about calibration. Counts accumulate on the
model's device and are copied out once per conversation, so they cost no per-layer sync.

Each conversation starts from a fresh cache (it is an independent request), so its counts do not
depend on what was replayed before it. That is what makes ``--resume`` exact: skipping the
conversations a checkpoint already counted and adding the rest gives the uninterrupted totals.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch

from .conversation import Conversation
from .render import ChatRenderer, Rendered, RenderError

PROMPT, GENERATED = 0, 1


class TraceSink(Protocol):
    def append(self, ids: np.ndarray, generated: np.ndarray) -> None: ...


class RoutingCounter:
    """An expert provider (``runtime.experts.ExpertProvider``) around another: counts routings per
    (side, layer, expert), then hands every call to the provider it wraps."""

    def __init__(self, inner: Any, n_layer: int, n_expert: int, moe_layers: list[int],
                 device: torch.device | str = "cpu", record: bool = False):
        self.inner = inner
        self.n_layer, self.n_expert = n_layer, n_expert
        self.moe_index = {il: j for j, il in enumerate(moe_layers)}
        self.counts = torch.zeros(2 * n_layer * n_expert, dtype=torch.int64, device=device)
        self.side: torch.Tensor | None = None  # int64 [T] of the chunk being run: PROMPT / GENERATED
        self.record = record
        self.chunk_ids: dict[int, torch.Tensor] = {}

    @property
    def capturable(self) -> bool:
        return self.inner.capturable

    def moe(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, q8: Any = None
            ) -> torch.Tensor:
        self.observe_routing(layer, ids)
        return self.inner.moe(layer, x, weights, ids, q8)

    def staged_prefill(self, n_tokens: int) -> bool:
        return self.inner.staged_prefill(n_tokens)

    def count_real_tokens(self, real: torch.Tensor | None) -> None:
        self.inner.count_real_tokens(real)

    def end_step(self, n_tokens: int, routed: bool | None = None, defer: bool = False) -> None:
        self.inner.end_step(n_tokens, routed, defer)

    def forget_traffic(self) -> None:
        self.inner.forget_traffic()

    def observe_routing(self, layer: int, ids: torch.Tensor) -> None:
        """Count one MoE layer's routings ``ids [T, k]`` on the side each token is from."""
        if self.side is None:
            raise RuntimeError("RoutingCounter.side must be set before a forward pass")
        side = self.side.to(ids.device)
        flat = (side[:, None] * self.n_layer + layer) * self.n_expert + ids
        self.counts.index_add_(0, flat.reshape(-1), torch.ones(flat.numel(), dtype=torch.int64,
                                                                device=self.counts.device))
        if self.record:
            self.chunk_ids[layer] = ids.detach()

    def totals(self) -> np.ndarray:
        """Counts so far as int64 ``[2, n_layer, n_expert]`` (PROMPT, GENERATED)."""
        return self.counts.view(2, self.n_layer, self.n_expert).cpu().numpy().copy()

    def take_chunk(self) -> np.ndarray:
        """The recorded ids of the last chunk as ``[T, n_moe, k]`` (MoE layers in order)."""
        layers = sorted(self.chunk_ids, key=self.moe_index.__getitem__)
        out = torch.stack([self.chunk_ids[il] for il in layers], dim=1).cpu().numpy()
        self.chunk_ids = {}
        return out


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


class Replayer:
    """Runs conversations through ``model`` in windows of ``ctx`` tokens and prefill chunks of ``chunk``."""

    def __init__(self, model: Any, renderer: ChatRenderer, ctx: int, chunk: int, record: bool = False):
        if ctx <= 0 or chunk <= 0:
            raise ValueError("ctx and chunk must be positive")
        spec = model.spec
        self.model, self.renderer = model, renderer
        self.ctx, self.chunk = ctx, chunk
        self.counter = RoutingCounter(model.experts, spec.n_layer, spec.n_expert, spec.moe_layers,
                                      model.device, record=record)
        model.experts = self.counter

    def run_one(self, r: Rendered, trace: TraceSink | None) -> int:
        """Forward one rendered conversation; returns how many windows it took."""
        ids = torch.tensor(r.ids, dtype=torch.long)
        side = torch.as_tensor(r.generated.astype(np.int64))
        windows = 0
        for w0 in range(0, len(r.ids), self.ctx):
            windows += 1
            cache = self.model.new_cache()
            w1 = min(w0 + self.ctx, len(r.ids))
            for c0 in range(w0, w1, self.chunk):
                c1 = min(c0 + self.chunk, w1)
                self.counter.side = side[c0:c1].to(self.model.device)
                self.model.forward(ids[c0:c1], cache)
                if trace is not None:
                    trace.append(self.counter.take_chunk(), r.generated[c0:c1])
        return windows

    def render(self, conv: Conversation) -> Rendered | str:
        """The conversation's tokens, or why it cannot be replayed."""
        try:
            r = self.renderer.render(conv)
        except RenderError as e:
            return f"template refused: {str(e)[:80]}"
        return r if r.ids else "empty after rendering"

    def planned_tokens(self, convs: Iterable[Conversation], max_tokens: int | None = None,
                       on_tokens: Callable[[int], None] | None = None) -> int:
        """How many tokens ``replay`` will count from ``convs``: rendering is cheap next to the
        forward passes, and knowing the total up front gives the progress bar an end and an ETA."""
        n = 0
        for conv in convs:
            r = self.render(conv)
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
        self.counter.counts.copy_(torch.from_numpy(state.counts.reshape(-1)))
        for conv in _budgeted(convs, state, max_tokens):
            if skip.get(conv.id, 0) > 0:
                skip[conv.id] -= 1
                continue
            r = self.render(conv)
            if isinstance(r, str):
                self._refuse(state, conv, r, after_each)
                continue
            if max_tokens is not None and state.total_tokens + len(r.ids) > max_tokens:
                keep = max_tokens - state.total_tokens
                r = Rendered(r.ids[:keep], r.generated[:keep], r.text)
                state.truncated = True
            windows = self.run_one(r, trace)
            state.split_windows += windows > 1
            n_gen = int(r.generated.sum())
            state.tokens[GENERATED] += n_gen
            state.tokens[PROMPT] += len(r.ids) - n_gen
            state.counts = self.counter.totals()
            state.done.append(conv.id)
            if conv.kind == "document":
                state.documents += 1
            else:
                state.conversations += 1
            if trace is not None:
                state.trace_tokens += len(r.ids)
            if on_tokens is not None:
                on_tokens(len(r.ids))
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
