"""Steps whose rows are one-token decode steps: one token of each of several sequences (a
batched decode step) or K consecutive tokens of one sequence (a draft's verification).

Why a part of its own: such a step goes through the model's blocks like a call, but with a
``Batch`` where one sequence's cache goes, every weight-reading product taking its one-row
program per row (``runtime.decode_rows``), attention and DeltaNet each row on its own sequence's
state (on the kernels one launch for all rows, a single step being the same launch with one row),
so each row is bit for bit its single step. ``MoEModel`` composes it (``MoEModel.rows``) and keeps its method names.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..cache import Cache, RowStates
from ..decode_rows import decoding_rows

if TYPE_CHECKING:
    from .base import MoEModel


@dataclass(frozen=True)
class Batch:
    """The rows of a batched decode step (``MoEModel.decode_batch``, ``decode_run``), passed to
    the blocks where one sequence's cache goes: each row's cache and the position of its token.
    What reads per-sequence state (attention, DeltaNet) takes each row on its sequence's state, in
    row order (rows of one sequence at consecutive positions: one after another on its state): the
    torch forms row by row, the kernels in one launch for all rows (``runtime.device_tables``)."""

    caches: tuple[Cache, ...]
    pos: tuple[int | torch.Tensor, ...]  # device scalars in a captured step (``runtime.graph.VerifyGraphs``)
    states: RowStates | None = None  # DeltaNet states kept after each row (a verify step: ``decode_run``)


class RowSteps:
    """The row steps of ``model`` (its blocks, embedding and head)."""

    def __init__(self, model: MoEModel):
        self.model = model

    @torch.no_grad()
    def decode_batch(self, ids: Sequence[int] | torch.Tensor, caches: Sequence[Cache]) -> torch.Tensor:
        """Logits ``[B, n_vocab]`` of one new token for each of B sequences: ``ids[b]`` appended to
        ``caches[b]`` (each its own sequence, at its own position). Row b is bit for bit what
        ``forward([ids[b]], caches[b])`` gives alone: every product that reads weights runs its
        one-token program once per row (``runtime.decode_rows``; on a GPU the rows of one weight
        tile next to each other, so the weights are read from memory about once for the batch),
        and attention and DeltaNet run on each sequence's own state (one launch for all rows). The expert store serves the
        batch at once: the union of its routed experts per layer, each miss read once."""
        if len(caches) != len(ids) or len({id(c) for c in caches}) != len(caches) or not len(caches):
            raise ValueError("decode_batch: one token and one distinct cache per sequence")
        logits = self.decode_rows(ids, Batch(tuple(caches), tuple(c.pos for c in caches)))[0]
        for c in caches:
            c.pos += 1
        return logits

    @torch.no_grad()
    def decode_run(self, ids: Sequence[int] | torch.Tensor, cache: Cache) -> torch.Tensor:
        """Logits ``[K, n_vocab]`` of K consecutive tokens of one sequence appended to ``cache``,
        row i bit for bit what the i-th of K single steps (``forward([ids[i]], cache)``) gives: a
        batched step whose rows are the same sequence at consecutive positions, so attention and
        DeltaNet take them one after another on the one state. What a drafted run's verification
        needs (the logits of the step that would have produced each token), at the cost of one
        read of the weights and of each missed expert for the K tokens."""
        return self.verify_rows(ids, cache)[0]

    @torch.no_grad()
    def verify_rows(self, ids: Sequence[int] | torch.Tensor, cache: Cache, pos: torch.Tensor | None = None,
                    states: RowStates | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``decode_run``'s logits and the output-normed hidden rows ``[K, n_embd]`` they come
        from (what ``forward_hidden`` gives; an MTP drafter reads them). ``states``: the DeltaNet
        states after each row are copied there (``runtime.cache.RowStates``), so the sequence can
        keep fewer rows. ``pos`` (device positions ``[K]``, with ``cache``'s KV buffers reserved
        past them): a step captured in a CUDA graph (``runtime.graph.VerifyGraphs``), which
        touches nothing on the host; the caller then advances ``cache.pos`` and the store."""
        if not len(ids):
            raise ValueError("decode_run: no tokens")
        at = tuple(cache.pos + i for i in range(len(ids))) if pos is None else tuple(pos.unbind())
        logits, hidden = self.decode_rows(ids, Batch((cache,) * len(ids), at, states), step=pos is None)
        if pos is None:
            cache.pos += len(ids)
        return logits, hidden

    def decode_rows(self, ids: Sequence[int] | torch.Tensor, batch: Batch, step: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits of ``batch``'s rows (one token each, ``ids``), every row a one-token step, and
        their output-normed rows; ``step``: tell the store the step is over (a captured one's
        caller does, after the replay)."""
        m = self.model
        ids = torch.as_tensor(ids, dtype=torch.long, device=m.device).reshape(-1)
        logits, hidden = self.rows(ids, batch)
        if step:
            m.experts.end_step(len(ids))
        return logits, hidden

    @torch.no_grad()
    def rows_logits(self, ids: torch.Tensor, caches: Sequence[Cache], pos: Sequence[int | torch.Tensor]
                    ) -> torch.Tensor:
        """``decode_rows``' logits at positions ``pos`` (one per cache), leaving the positions and
        the store's ``end_step`` to the caller: with ``ids`` and ``pos`` on the device nothing here
        touches the host, so a batched step can be captured in a CUDA graph
        (``runtime.graph.BatchGraphs``), as ``forward`` with ``pos`` leaves them to ``DecodeGraph``."""
        return self.rows(ids, Batch(tuple(caches), tuple(pos)))[0]

    def rows(self, ids: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and output-normed rows of ``batch``'s rows ``ids`` (``head``'s two products,
        without recording the rows for a drafter: ``verify_rows`` returns them)."""
        m = self.model
        with decoding_rows():
            x = m.w.embed(ids)
            pre = None
            for il in range(m.spec.n_layer):
                x, pre = m.block(il, x, batch, 0, pre)
            h = m.norm(x, "output_norm.weight", pre)
            logits = m.linear(h, m.output_name())
        return logits, h.x
