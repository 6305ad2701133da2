"""Every call shape a session's first prompt and reply will use, run once on dummy tokens.

Why: the first call of each shape compiles (or loads) its Triton kernels, grows the allocator and
captures its CUDA graph, and a user's first prompt paid that: a one-shot prompt prefilled far
slower than a warm one (BENCHMARKS.md). ``Session.warm_up`` runs ``run_call_shapes`` and then
forgets the sequence, its timing and the expert store's dummy traffic: results never depend on
any of it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from sparkpack.formats.memory import PREFILL_GRAPH_TOKENS

from .call_plan import CallPlan
from .graph import PREFILL_SIZES, PrefillGraphs
from .kernels.moe_grouped import tile_calls
from .models.base import MoEModel

if TYPE_CHECKING:
    from .speculative import Speculation


class Warmable(Protocol):
    """What the warm-up reads of a session (``runtime.generate.Session``): its model and schedule,
    whether its short calls are padded (``prefill``), its context, the ways it takes tokens, and a
    drafting session's drafter and verify steps."""

    model: MoEModel
    plan: CallPlan
    prefill: PrefillGraphs | None
    cache_ctx: int
    fed: list[int]
    draft: Speculation | None

    def reset(self) -> None: ...

    def feed(self, ids: list[int]) -> torch.Tensor: ...

    def prompt(self, ids: list[int]) -> torch.Tensor: ...

    def verify(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def keep(self, k: int) -> None: ...


def run_call_shapes(session: Warmable) -> None:
    """Feed ``session`` every call shape it will run. Padded sessions (``PrefillGraphs``) take
    every padded call size, a whole group of calls where the store stages (captured:
    ``PrefillGraphs.run_group``), then a 37-token call, and where the context reaches past
    ``long_past``, the eager calls after it (every tile shape). Eager sessions take calls of
    every length that picks another tile shape of the grouped MoE kernels (``tile_calls``) up to
    a whole chunk, each once from position 0 and once after a past (attention over a past: with
    a q8_0 KV cache a one-shot prompt ran slower when only the first call was warmed) and with a
    count that is and one that is not a multiple of 16 (Triton compiles the two apart): a
    prompt's calls end at control tokens and at its end, so any length comes. Then two decode
    steps (capture, replay) and a drafting session's verify step of each row count (captured:
    ``VerifyGraphs``). The session is left holding dummy tokens."""
    spec, plan = session.model.spec, session.plan
    room = max(2, session.cache_ctx - 2)
    dummy = torch.randint(0, spec.n_vocab, (2 * room + 128,), generator=torch.Generator().manual_seed(0)).tolist()
    dummy = [t for t in dummy if t not in plan.breaks]  # calls of the sizes below, not cut short
    if session.prefill is not None:
        for size in PREFILL_SIZES:
            if size + 1 <= room:
                session.reset()
                session.feed(dummy[:size])
    if session.prefill is not None:  # (a staging store runs the same padded calls eagerly)
        if plan.staged and plan.group_tokens + 1 <= room:  # a whole group: captured
            session.reset()
            session.feed(dummy[:plan.group_tokens])
        pairs = [(0, min(room - 1, 37))]
    else:
        chunk = plan.call_tokens
        lengths = sorted({*tile_calls(spec.n_expert, spec.n_expert_used, chunk), chunk})
        pairs = []
        for n in lengths:
            even = min(chunk, -(-n // 16) * 16)
            # a whole chunk then a call after it; others: the second call goes on in the first's
            pairs += [(chunk, chunk)] if even == chunk else [(even, even + 1), (even + 1, even)]
    ids: list[int] = []
    for first, second in pairs:
        session.reset()
        ids = []
        for n in (first, second):
            if n > 0 and len(ids) + n + 2 <= room:
                ids += dummy[len(ids): len(ids) + n]
                session.feed(ids)
    for _ in range(2):
        ids.append(dummy[len(ids)])
        session.feed(ids)
    if session.draft is not None:  # a verify step of every row count the drafting may take (captured)
        for n in range(1, session.draft.length.max_k + 2):
            if len(session.fed) + n + 1 > room:
                break
            session.verify(dummy[len(session.fed): len(session.fed) + n])
            session.keep(1)
    if plan.long_past is not None and plan.long_past + plan.prefill_chunk + 2 <= room:
        # the eager calls after a long past: the past fed once, then every call length that
        # picks another MoE tile shape (those too short are padded calls, warmed above) on it
        chunk = plan.prefill_chunk
        past = dummy[:plan.long_past]
        session.reset()
        session.feed(past)
        for n in sorted({*tile_calls(spec.n_expert, spec.n_expert_used, chunk), chunk}):
            even = min(chunk, -(-n // 16) * 16)
            for m in {even, min(chunk, even + 1)} if even > PREFILL_GRAPH_TOKENS else ():
                session.prompt(past + dummy[len(past): len(past) + m])  # keeps the past: one call of m
