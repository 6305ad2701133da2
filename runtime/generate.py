"""Token generation: prefill the prompt once, then decode one token at a time from the cache.

``Session`` keeps a model's cache together with the tokens it has consumed, so a chat or a server
can send the whole re-rendered conversation each turn and have only what changed computed.
``Session.prompt`` keeps the longest prefix that gives the very bits a fresh session computes:
the rows written by the prefill calls a fresh session makes too, with DeltaNet states restored
from checkpoints taken at those positions (``runtime.cache.StateCheckpoints``), and so are the
windows of sliding-window layers (Laguna) whose rings have wrapped past the position: their
copy is taken where a prompt's exact rows end. Rows written by a
decode step or by a call that started elsewhere are recomputed: the same tokens fed in other
calls differ in the last bits on the CPU (4e-7 on the tiny models), and on a GPU a decode step's
projections even take int8 activations.

Where calls end is a function of the tokens alone, read from the start (``call_end``): a
call ends after ``call_tokens`` tokens, or earlier before a break token (the chat template's
control tokens, where a message starts or ends) once it holds ``call_tokens // 8``. Why: the
next request of a conversation repeats this one's prompt up to about where the reply starts,
and ends in the middle of a fixed-size call; a call that ended before the last message's
control tokens lets it keep all but a few tokens of it (fixed 2048-token calls lose up to a
whole call of it). A schedule that looks only
backwards cuts a prompt and every longer prompt starting with it at the same places, so the
kept rows are those a fresh session computes.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from sparkpack.formats.memory import (LONG_PAST_TOKENS, PREFILL_CHUNK, PREFILL_GRAPH_TOKENS, group_tokens, longest_call,
                                      call_rows)
from sparkpack.formats.profile import SIDES

from .cache import STATE_CHECKPOINTS, RecurrentState, RowStates, StateCheckpoints
from .sequence_state import SequenceState, restore
from .graph import (PREFILL_SIZES, DecodeGraph, PrefillGraphs, VerifyGraphs, capturable, feeds_short_calls,
                    prefill_is_padded, short_prefill_calls)
from .kernels.moe_grouped import tile_calls
from .models.base import Call, MoEModel

if TYPE_CHECKING:
    from .speculative import Speculation

PROMPT, GENERATED = SIDES  # the side of a call's tokens, for placement learning (ExpertProvider.routing_side)


class TokenSampler(Protocol):
    """How ``generate`` draws a token other than greedily (``runtime.sampling.Sampler``).

    ``history_free``: the draw needs no token history, so ``pick(logits)`` (the token id on the
    device, nothing read back; called only then) lets ``Session.decode`` run one step ahead of the
    host. Otherwise ``sample`` is shown the history, one host round trip a token. A drafting
    session (``Session.draft``) also asks ``verify_draft`` (``Sampler.verify_draft``: the
    rejection rule); a sampler without it decodes without drafting."""

    @property
    def history_free(self) -> bool: ...

    def sample(self, logits: torch.Tensor, history: list[int]) -> int: ...

    def pick(self, logits: torch.Tensor) -> torch.Tensor: ...


class TokenConstraint(Protocol):
    """A grammar the generated tokens must follow (``runtime.grammar.GrammarConstraint``):
    ``mask`` the logits before each choice, ``accept`` the token chosen."""

    def mask(self, logits: torch.Tensor) -> torch.Tensor: ...

    def accept(self, token: int) -> None: ...


class StopTokens(Protocol):
    """What ``generate`` reads of a tokenizer (``runtime.tokenizer.GGUFTokenizer``): the ids that
    end a reply."""

    stop_ids: frozenset[int]


@dataclass
class Timing:
    """Wall time of prompt processing (calls with several new tokens) and decode (one token);
    a step that captures the decode graph is counted apart. A step ``Session.decode`` launches
    ahead is timed from one token read to the next, so the consumer's own time between tokens
    (printing, a client) is inside it: the GPU computes meanwhile, and the rate is the one the
    consumer sees."""

    # prefill includes the calls that captured a prefill graph (the first call of each size)
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    capture_seconds: float = 0.0  # the decode steps that captured the CUDA graph (again after KV growth)
    ahead_steps: int = 0  # decode steps launched before the host had read the token they feed


DEFAULT_CTX = 4096


def call_end(ids: list[int], start: int, call_tokens: int, breaks: frozenset[int]) -> int:
    """Where a fresh session's prefill call that starts at ``start`` ends (see the module
    docstring): before the first break token at least ``call_tokens // 8`` tokens in, else after
    ``call_tokens``. Reads only tokens before that end, so a longer ``ids`` agrees; an end past
    ``len(ids)`` is not decided yet (a prompt's last call)."""
    limit = start + call_tokens
    if breaks:
        for q in range(start + max(1, call_tokens // 8), min(limit, len(ids))):
            if ids[q] in breaks:
                return q
    return limit


def shared_len(a: Sequence, b: Sequence, step: int = 1024) -> int:
    """How many items (tokens, or characters of a prompt's text) ``a`` and ``b`` share from the
    start. Compared a slice at a time (in C): one by one in Python, a long conversation costs
    many times more a request."""
    if type(a) is not type(b):  # (a list's slice never equals a tuple's)
        a, b = list(a), list(b)
    n, i = min(len(a), len(b)), 0
    while i < n and a[i:i + step] == b[i:i + step]:
        i += step
    return next((j for j in range(i, min(i + step, n)) if a[j] != b[j]), min(i + step, n))


@dataclass(frozen=True)
class PlannedCall:
    """One prefill call of a ``Session._run``: tokens ``[start, end)`` of the ids fed; ``closes``:
    it ends a fresh session's call (``call_end``); ``keeps``: the rows stay exact up to ``end``
    (a DeltaNet state copy is taken there); ``passed``: call ends decided before it, inside rows
    fed already."""

    start: int
    end: int
    closes: bool
    keeps: bool
    passed: list[int]


class Session:
    """``ctx`` sizes the KV buffers up front (they grow past it, but only up to ``ctx`` is a
    decode step replayed from a CUDA graph). ``graphs`` None: capture decode steps (and, on the
    all-attention models, prefill calls: prompts then go in calls of at most
    ``PREFILL_GRAPH_TOKENS``, padded, see ``runtime.graph.PrefillGraphs``, up to ``long_past``
    and in eager ``prefill_chunk`` calls after it: ``call_tokens_at``) where the model allows
    (CUDA, zero-copy expert store). ``kv_type``: see ``runtime.cache.KVCache``. ``checkpoints``:
    how many DeltaNet state copies ``prompt`` may go back to (models with DeltaNet layers).
    ``breaks``: token ids a call may end before (``GGUFTokenizer.control_ids``; see the module
    docstring); sessions compared bit for bit must have the same."""

    def __init__(self, model: MoEModel, prefill_chunk: int = PREFILL_CHUNK, ctx: int = DEFAULT_CTX,
                 graphs: bool | None = None, kv_type: str = "auto", checkpoints: int = STATE_CHECKPOINTS,
                 breaks: frozenset[int] = frozenset()):
        self.model = model
        self.prefill_chunk = prefill_chunk
        self.use_graphs = capturable(model) if graphs is None else graphs
        self.graph: DecodeGraph | None = None
        self.timing = Timing()
        # Sliding-window rings sized for the longest call: the one the --vram plan counts where
        # calls are short (a GPU in half precision), else (CPU, float32) whole chunks at any context.
        short = model.kernels and short_prefill_calls(model.device, model.dtype, model.spec, kv_type)
        longest = longest_call(model.spec, ctx, kv_type, prefill_chunk) if short else prefill_chunk
        self.cache = model.new_cache(ctx, kv_type, call_rows(longest))
        self.cache_ctx = ctx
        # short prefill calls padded to a few sizes and (with graphs) captured: runtime.graph
        self.prefill = PrefillGraphs(model, self.cache, self.use_graphs) if prefill_is_padded(model, self.cache) else None
        # Calls of at most PREFILL_GRAPH_TOKENS on such models even when the store cannot be
        # captured: the --vram plan counts those calls' temporaries, not prefill_chunk's.
        self.short_calls = feeds_short_calls(model, self.cache)
        # Models whose prefill calls are captured take every prompt in captured calls: replayed
        # 512-token calls are faster than eager 2048-token ones (docs/benchmarks-history.md,
        # session 15). Staging
        # (runtime.expert_staging, partial residency) keeps those calls: a residency must give
        # the all-GPU session's bits, and those come from the 512-token calls (on a GPU staged
        # 2048-token calls on qwen3moe changed tied routings: tests/test_calibrate_replay.py).
        # It runs them eagerly, padded as captured, in groups (``_groups``).
        self.call_tokens = min(prefill_chunk, PREFILL_GRAPH_TOKENS) if self.short_calls else prefill_chunk
        # Except after a long past: there a call takes prefill_chunk tokens and runs eagerly, its
        # attention torch's fused kernel, faster than the captured calls' (LONG_PAST_TOKENS). The
        # switch depends on the position alone, so every residency makes the same calls.
        self.long_past = LONG_PAST_TOKENS if self.short_calls and prefill_chunk > self.call_tokens else None
        self.staged = model.experts.staged_prefill(self.call_tokens)
        self.group_tokens = group_tokens(ctx, self.call_tokens)  # what the --vram plan counts
        self.breaks = breaks
        # DeltaNet states are copied where each call keeps rows exact; rings' windows only where a
        # prompt's exact rows end (per call, Laguna's 512-token calls would each copy 60 MB),
        # earlier positions being in the rings while they last.
        self.recurrent = any(isinstance(la, RecurrentState) for la in self.cache.layers)
        self.checkpoints = StateCheckpoints(checkpoints) if self.recurrent or self.cache.windowed else None
        self.fed: list[int] = []
        # Where a fresh session feeding ``fed`` ends its calls, as far as ``fed`` decides it
        # (``call_end``), from 0; the tokens after the last are in a call still open.
        self.cuts = [0]
        # Rows [0, exact) came from the calls a fresh session feeding ``fed`` makes (whole calls
        # from position 0): what ``prompt`` may keep. Always one of ``cuts``.
        self.exact = 0
        self.reused = 0  # tokens the last ``prompt`` kept instead of computing
        self.marks: frozenset[int] = frozenset()  # the last ``prompt``'s (see there)
        # Speculative decoding (``runtime.speculative``): the drafter and its counts; None: off.
        self.draft: Speculation | None = None
        self.verify_graphs: VerifyGraphs | None = None
        self.row_states: RowStates | None = None  # DeltaNet states after each verify row
        self._verified: tuple[int, int, float] | None = None  # the last verify: start, rows, seconds

    def call_tokens_at(self, start: int) -> int:
        """The tokens of a prompt call that starts at position ``start`` (``call_end`` may end it
        earlier): ``call_tokens``, or ``prefill_chunk`` after a long past (``long_past``)."""
        return self.prefill_chunk if self.long_past is not None and start >= self.long_past else self.call_tokens

    @property
    def longest_call(self) -> int:
        """The most tokens one prompt call of this session holds (eager calls after a long past
        included; padding is ``PrefillGraphs``' business)."""
        return self.prefill_chunk if self.long_past is not None else self.call_tokens

    def warm_up(self) -> float:
        """Run every call shape a first prompt and its reply will use on dummy tokens, then forget
        them; returns the seconds it took. Why: the first call of each shape compiles (or loads)
        its Triton kernels, grows the allocator and captures its CUDA graph, and a user's first
        prompt paid that: a one-shot prompt prefilled far slower than a warm one (BENCHMARKS.md). Padded sessions
        (``PrefillGraphs``) take every padded call size, a whole group of calls where the store
        stages (captured: ``PrefillGraphs.run_group``), then a 37-token call, and where the
        context reaches past ``long_past``, the eager calls after it (every tile shape). Eager
        sessions take calls of every length that picks another tile shape of the grouped MoE
        kernels (``tile_calls``) up to a whole chunk, each once from position 0 and once after a
        past (attention over a past: with a q8_0 KV cache a one-shot prompt ran slower when only
        the first call was warmed) and with a count that is and one that is
        not a multiple of 16 (Triton compiles the two apart): a prompt's calls end at control
        tokens and at its end, so any length comes. Then two decode steps (capture, replay), a
        drafting session's verify step of each row count (captured: ``VerifyGraphs``), and
        the host buffers of every DeltaNet state checkpoint are allocated. The
        expert store's counts and cache admission forget the dummy traffic; results never depend
        on any of it."""
        t0 = time.perf_counter()
        spec = self.model.spec
        room = max(2, self.cache_ctx - 2)
        dummy = torch.randint(0, spec.n_vocab, (2 * room + 128,), generator=torch.Generator().manual_seed(0)).tolist()
        dummy = [t for t in dummy if t not in self.breaks]  # calls of the sizes below, not cut short
        if self.prefill is not None:
            for size in PREFILL_SIZES:
                if size + 1 <= room:
                    self.reset()
                    self.feed(dummy[:size])
        if self.prefill is not None:  # (a staging store runs the same padded calls eagerly)
            if self.staged and self.group_tokens + 1 <= room:  # a whole group: captured
                self.reset()
                self.feed(dummy[:self.group_tokens])
            pairs = [(0, min(room - 1, 37))]
        else:
            chunk = self.call_tokens
            lengths = sorted({*tile_calls(spec.n_expert, spec.n_expert_used, chunk), chunk})
            pairs = []
            for n in lengths:
                even = min(chunk, -(-n // 16) * 16)
                # a whole chunk then a call after it; others: the second call goes on in the first's
                pairs += [(chunk, chunk)] if even == chunk else [(even, even + 1), (even + 1, even)]
        ids: list[int] = []
        for first, second in pairs:
            self.reset()
            ids = []
            for n in (first, second):
                if n > 0 and len(ids) + n + 2 <= room:
                    ids += dummy[len(ids): len(ids) + n]
                    self.feed(ids)
        for _ in range(2):
            ids.append(dummy[len(ids)])
            self.feed(ids)
        if self.draft is not None:  # a verify step of every row count the drafting may take (captured)
            for n in range(1, self.draft.length.max_k + 2):
                if len(self.fed) + n + 1 > room:
                    break
                self.verify(dummy[len(self.fed): len(self.fed) + n])
                self.keep(1)
        if self.long_past is not None and self.long_past + self.prefill_chunk + 2 <= room:
            # the eager calls after a long past: the past fed once, then every call length that
            # picks another MoE tile shape (those too short are padded calls, warmed above) on it
            chunk = self.prefill_chunk
            past = dummy[:self.long_past]
            self.reset()
            self.feed(past)
            for n in sorted({*tile_calls(spec.n_expert, spec.n_expert_used, chunk), chunk}):
                even = min(chunk, -(-n // 16) * 16)
                for m in {even, min(chunk, even + 1)} if even > PREFILL_GRAPH_TOKENS else ():
                    self.prompt(past + dummy[len(past): len(past) + m])  # keeps the past: one call of m
        self.reset()
        if self.checkpoints is not None:
            self.checkpoints.reserve(self.cache)
        self.timing = Timing()
        self.model.experts.forget_traffic()
        return time.perf_counter() - t0

    def reset(self) -> None:
        """Forget the sequence; buffers (and the captured decode step and prefill calls) are kept
        for the next one."""
        self.cache.reset()
        self.fed = []
        self.cuts = [0]
        self.exact = 0
        if self.checkpoints is not None:
            self.checkpoints.discard_after(0)
        if self.draft is not None:
            self.draft.rewind(0)

    def feed(self, ids: list[int], side: str = PROMPT) -> torch.Tensor:
        """Make the cache hold exactly ``ids`` and return the logits of the last one ``[n_vocab]``.
        An extension of the fed tokens computes only the new ones (a decode step, a chat turn);
        anything else goes through ``prompt``. ``side``: whose tokens the new ones are (the
        expert store learns the two sides apart); a decode step feeds ``GENERATED``."""
        if not ids:
            raise ValueError("nothing to feed: empty token list")
        n = len(self.fed)
        if len(ids) > n and ids[:n] == self.fed:
            return self._run(ids, n, graph=True, side=side)
        return self.prompt(ids, side)

    def prompt(self, ids: list[int], side: str = PROMPT, marks: frozenset[int] = frozenset()) -> torch.Tensor:
        """``feed`` for a new request: the logits are the bits of a fresh session's ``feed(ids)``.
        Keeps the longest prefix of the cache that a fresh session would have computed the same
        way (see the module docstring) and computes the rest; ``reused`` says how many tokens.
        ``marks``: positions (call ends) whose states are copied on the way and kept until the
        next prompt, for ``state_at`` (``runtime.conversation_cache``: shared prefixes)."""
        if not ids:
            raise ValueError("nothing to feed: empty token list")
        self.cache.wrote(len(self.fed))
        self.marks = marks
        if self.checkpoints is not None:
            self.checkpoints.protect = set(marks)
        keep = self.reusable(ids)
        if keep != self.cache.pos or keep != len(self.fed):
            if self.checkpoints is not None and (self.recurrent or not self.cache.keeps(keep)):
                self.checkpoints.restore(self.cache, keep)
            else:
                self.cache.rewind(keep)  # KV rows past it are masked, then overwritten
            if self.checkpoints is not None:
                self.checkpoints.discard_after(keep)
            self.fed = self.fed[:keep]
        if self.draft is not None:
            self.draft.rewind(keep)
        self.cuts = [c for c in self.cuts if c <= keep]
        self.exact = keep
        self.reused = keep
        # A fresh session's lone first token is a decode step (captured); any later call is not.
        return self._run(ids, keep, graph=keep == 0, side=side)

    def reusable(self, ids: list[int]) -> int:
        """How many tokens of ``ids`` ``prompt`` would keep now (nothing is changed). A call end
        at the first token that differs counts only if ``ids`` end a call there too: a call that
        ended before a control token may not end where another token stands."""
        common = shared_len(ids, self.fed)
        limit = min(common, len(ids) - 1, self.exact)
        if limit == common and limit in self.cuts and limit > 0:
            before = max(c for c in self.cuts if c < limit)
            if call_end(ids, before, self.call_tokens_at(before), self.breaks) != limit:
                limit -= 1
        return self._restorable(limit)

    def cuts_of(self, ids: list[int]) -> list[int]:
        """Where a fresh session feeding ``ids`` ends its calls before their last token (from 0)."""
        cuts = [0]
        while (end := call_end(ids, cuts[-1], self.call_tokens_at(cuts[-1]), self.breaks)) < len(ids):
            cuts.append(end)
        return cuts

    def state_at(self, pos: int | None = None) -> tuple[list[int], list[int], list | None] | None:
        """What a copy of the sequence's state at ``pos`` (default ``exact``) is taken from: its
        tokens, the call ends within them and the ``StateCheckpoints`` copy there (None: the cache's
        own rows serve); None where the session no longer holds that state (``pos`` not a call end
        no later than ``exact``, or a DeltaNet state or a ring's window without its copy).
        ``runtime.sequence_state`` copies it (``runtime.conversation_cache``: after a request, and
        at the marks of the last ``prompt``)."""
        pos = self.exact if pos is None else pos
        if pos <= 0 or pos > self.exact or pos not in self.cuts:
            return None
        saved = self.checkpoints.saved.get(pos) if self.checkpoints is not None else None
        if saved is None and (self.recurrent or not self.cache.keeps(pos)):
            return None
        if saved is not None and self.model.device.type == "cuda":
            torch.cuda.current_stream(self.model.device).synchronize()  # the copy into ``saved`` landed
        return self.fed[:pos], [c for c in self.cuts if c <= pos], saved

    def resume(self, state: SequenceState) -> None:
        """Make the session hold ``state`` (of this model with this session's options, and the
        cache's device rows no longer needed by copies still running), as if it had prefilled its
        tokens: the next ``prompt`` keeps them where it would have kept them."""
        restore(state, self.cache, self.model.device, self.model.dtype)
        if self.draft is not None:
            self.draft.rewind(0)  # (the drafter never saw these rows: it starts over)
        self.fed = list(state.tokens)
        self.cuts = list(state.cuts)
        self.exact = state.pos
        if self.checkpoints is not None:
            self.checkpoints.discard_after(0)
            if self.recurrent:  # (what ``_restorable`` goes back to)
                self.checkpoints.save(self.cache, state.pos)

    def _restorable(self, limit: int) -> int:
        """The last position at most ``limit`` (at most ``exact``) that ``prompt`` can go back to:
        where a fresh session ends a call with, on DeltaNet models, a state checkpoint, and on
        models with sliding-window rings, a checkpoint or the window still in the rings (0 always
        qualifies)."""
        best = max(c for c in self.cuts if c <= limit)
        if self.checkpoints is None:
            return best
        saved = max((p for p in self.checkpoints.positions if p <= best), default=0)
        if self.recurrent:
            return saved
        # (the cuts ascend, and a ring that holds a cut's window holds every later one's)
        return max(saved, next((c for c in reversed(self.cuts) if c <= best and self.cache.keeps(c)), 0))

    def _run(self, ids: list[int], n: int, graph: bool, side: str) -> torch.Tensor:
        """Feed ``ids[n:]`` (tokens of ``side``) after the ``n`` tokens in the cache; the logits of the last."""
        self.model.experts.routing_side(side)
        t0 = time.perf_counter()
        logits = None
        capturing = False
        collect = self.draft is not None and self.draft.drafter.needs_hidden
        if collect:  # the drafter reads these rows' hidden states: eager calls append them
            self.model.hidden_out = self.draft.pending
        try:
            logits, capturing = self._calls(ids, n, graph and not collect)
        finally:
            self.model.hidden_out = None
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        dt, new = time.perf_counter() - t0, len(ids) - n
        if capturing:  # kept out of the decode rate, which describes the steady state
            self.timing.capture_seconds += dt
        elif new == 1:
            self.timing.decode_tokens += 1
            self.timing.decode_seconds += dt
        else:
            self.timing.prefill_tokens += new
            self.timing.prefill_seconds += dt
        self.fed = list(ids)
        return logits

    def _calls(self, ids: list[int], n: int, graph: bool) -> tuple[torch.Tensor, bool]:
        """``_run``'s calls: the last token's logits, and whether a decode step was captured."""
        logits = None
        capturing = False
        if len(ids) - n == 1 and graph and self.use_graphs:
            if self.graph is None:
                self.graph = DecodeGraph(self.model, self.cache)
            captures = self.graph.captures
            logits = self.graph.step(ids[-1])  # None past the graph's KV room: eager below
            capturing = self.graph.captures > captures
        if logits is None:
            for group in self._groups(self._plan(ids, n)):
                logits = self._grouped(ids, group) if self.staged else None
                if logits is None:
                    for c in group:
                        chunk = ids[c.start:c.end]
                        logits = self.prefill.feed(chunk) if self.prefill is not None else None
                        if logits is None:
                            logits = self.model.forward(chunk, self.cache, last_only=True)[-1]
                        self._ended(c, save=True)
            self._save_windows()
        return logits, capturing

    def verify(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ``tokens`` (the token just picked, then the drafts after it) after the fed ones in
        one verify step (``MoEModel.verify_rows``; captured where decode steps are); returns
        their logits ``[n, n_vocab]``, row i bit for bit the single decode step after
        ``tokens[i]``, and their output-normed rows. ``keep`` then says how many of them stay."""
        self.model.experts.routing_side(GENERATED)
        t0 = time.perf_counter()
        start, n = len(self.fed), len(tokens)
        states = None
        if self.recurrent and n > 1:  # (one row is always kept whole)
            if self.row_states is None or not self.row_states.fits(self.cache, n):
                self.row_states = RowStates(self.cache, max(n - 1, self.row_states.rows if self.row_states else 0))
            states = self.row_states
        out = None
        if self.use_graphs:
            if self.verify_graphs is None:
                self.verify_graphs = VerifyGraphs(self.model, self.cache)
            out = self.verify_graphs.step(tokens, states)
        logits, hidden = out if out is not None else self.model.verify_rows(tokens, self.cache, states=states)
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        self.fed = self.fed + list(tokens)
        self._verified = (start, n, time.perf_counter() - t0)
        return logits, hidden

    def keep(self, k: int) -> None:
        """Keep the first ``k`` tokens of the last ``verify`` and go back exactly to the state
        after them: the DeltaNet states after row ``k - 1`` copied back (``RowStates``), attention
        rows and ring rows past them masked and later overwritten (``Cache.rewind``). The
        ``k`` tokens count as decoded in the verify's time."""
        if self._verified is None:
            raise ValueError("keep: no verify step to keep tokens of")
        start, n, seconds = self._verified
        if not 1 <= k <= n:
            raise ValueError(f"keep: {k} of a verify step of {n} tokens")
        self._verified = None
        if k < n:
            if self.recurrent:
                self.row_states.restore(self.cache, k - 1)
            self.cache.rewind(start + k)
            self.fed = self.fed[:start + k]
        self.timing.decode_tokens += k
        self.timing.decode_seconds += seconds

    def _plan(self, ids: list[int], n: int) -> list["PlannedCall"]:
        """The calls that feed ``ids[n:]``: they end where a fresh session's calls end
        (``call_end``), so rows computed from there are the ones it computes."""
        calls: list[PlannedCall] = []
        passed: list[int] = []
        i, start, exact = n, self.cuts[-1], self.exact
        while i < len(ids):
            cut = call_end(ids, start, self.call_tokens_at(start), self.breaks)
            if cut <= i:  # decided by the new tokens, inside rows fed already (a decode step's)
                passed.append(cut)
                start = cut
                continue
            end = min(len(ids), cut)
            keeps = end == cut and i == exact == start  # a whole call from an exact row: still exact
            calls.append(PlannedCall(i, end, end == cut, keeps, passed))
            passed = []
            if end == cut:
                start = cut
                exact = end if keeps else exact
            i = end
        return calls

    def _ended(self, c: "PlannedCall", save: bool) -> None:
        """The bookkeeping of call ``c`` once it is launched (``save``: copy the DeltaNet states
        where it keeps rows exact; a group copied them layer by layer)."""
        self.cuts += c.passed
        if c.closes:
            self.cuts.append(c.end)
        self.cache.wrote(c.start + self._rows(c))
        if c.keeps:
            self.exact = c.end
            if save and self.recurrent:
                self.checkpoints.save(self.cache)
            elif not self.recurrent and c.end in self.marks and self.checkpoints is not None \
                    and c.end not in self.checkpoints.saved and self.cache.keeps(c.end):
                self.checkpoints.save(self.cache, c.end)  # a ring's window at a mark (a group ends there)

    def _save_windows(self) -> None:
        """Copy the rings' windows where the exact rows end, if not yet copied there and still in
        the rings (models without DeltaNet states; those copy at every call end, windows too).
        Why there: the next request of a conversation repeats the prompt up to about where the
        reply starts, and the reply's tokens may have pushed that window out of the rings."""
        cp = self.checkpoints
        if cp is not None and not self.recurrent and self.exact and self.exact not in cp.saved \
                and self.cache.keeps(self.exact):
            cp.save(self.cache, self.exact)

    def _padded(self, c: "PlannedCall") -> bool:
        """Whether call ``c`` is one ``PrefillGraphs`` pads (else it runs eagerly as it is)."""
        return self.prefill is not None and self.prefill.size(c.end - c.start) is not None

    def _rows(self, c: "PlannedCall") -> int:
        """The rows call ``c`` writes, padding included."""
        return self.prefill.size(c.end - c.start) if self._padded(c) else c.end - c.start

    def _groups(self, calls: list["PlannedCall"]) -> list[list["PlannedCall"]]:
        """``calls`` in groups of at most ``group_tokens`` tokens that run layer by layer, where
        the store stages (one call each elsewhere: a group would only hold more rows); padded
        and eager calls (after a long past) in groups of their own kind."""
        if not self.staged:
            return [[c] for c in calls]
        groups: list[list[PlannedCall]] = []
        for c in calls:
            if groups and self._padded(c) == self._padded(groups[-1][0]) and groups[-1][-1].end not in self.marks \
                    and sum(g.end - g.start for g in groups[-1]) + c.end - c.start <= self.group_tokens:
                groups[-1].append(c)
            else:
                groups.append([c])
        return groups

    def _stages(self, group: list["PlannedCall"]) -> bool:
        """Whether a group of ``group``'s calls stages its cold experts (its rows, padding included)."""
        return self.model.experts.staged_prefill(sum(self._rows(c) for c in group))

    def _grouped(self, ids: list[int], group: list["PlannedCall"]) -> torch.Tensor | None:
        """The logits of ``group``'s last token, its calls run layer by layer
        (``MoEModel.forward_calls``) with the DeltaNet states copied at the ends that keep rows
        exact as each call's block is launched; None when they must run one by one (a call
        ``PrefillGraphs`` would not pad, or too few rows to stage)."""
        if not self._stages(group):
            return None
        chunks = [ids[c.start:c.end] for c in group]
        if self._padded(group[0]):  # (no DeltaNet states: all-attention models)
            # a whole group replays a graph captured in the warm-up (or at its first use)
            logits = self.prefill.run_group(chunks, capture=len(chunks) * self.call_tokens == self.group_tokens)
            if logits is not None:
                for c in group:
                    self._ended(c, save=False)
            return logits
        dev = self.model.device
        calls = [Call(torch.tensor(chunk, dtype=torch.long).to(dev), len(chunk)) for chunk in chunks]
        after = None
        if self.recurrent:
            copies = self.checkpoints.take(self.cache, [c.end for c in group if c.keeps])
            ends = {i: copies[c.end] for i, c in enumerate(group) if c.end in copies}
            if ends:
                def after(i: int, il: int) -> None:
                    if i in ends:
                        self.checkpoints.copy_layer(ends[i], self.cache, il, group[i].end)
        try:
            logits = self.model.forward_calls(calls, self.cache, after)[-1]
        except BaseException:  # (interrupted) the copies taken for this group hold states half copied
            if self.checkpoints is not None:
                self.checkpoints.discard_after(self.exact)
            raise
        for c in group:
            self._ended(c, save=False)
        return logits

    def decode(self, logits: torch.Tensor, n: int, pick: Callable[[torch.Tensor], torch.Tensor],
               seen: list[torch.Tensor] | None = None) -> Iterator[int]:
        """Up to ``n`` tokens after the fed ones, whose last logits are ``logits``; ``pick`` chooses
        each on the device (logits -> a token id tensor, nothing read back). ``seen`` collects the
        logits each token was picked from (benchmarks compare them across residencies).

        Why: read back at once, every token costs a host round trip in which the GPU idles (the
        read, then the launch of the next step). Once the
        decode step is captured, the step that feeds token i is launched from the device copy of
        i before the host reads i, so the GPU always has the next step queued. A token the
        consumer then rejects (a stop token) has been fed already: ``fed`` includes it, as the
        cache does, so a later ``feed`` reuses or resets them as usual. The tokens and logits are
        the bits ``feed`` gives one token at a time (same captured step, same inputs)."""
        on_cuda = logits.is_cuda
        self.model.experts.routing_side(GENERATED)  # the steps launched ahead below too
        host = torch.empty(1, dtype=torch.long, pin_memory=on_cuda)
        stream = torch.cuda.current_stream(logits.device) if on_cuda else None
        last = time.perf_counter()  # when the previous token was read (or a feed returned)
        queued = None  # the timing account of the step launched ahead last time, not yet read
        for i in range(n):
            if seen is not None:
                seen.append(logits)
            token = pick(logits).reshape(1)
            ready = None
            if stream is not None:
                host.copy_(token, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(stream)
            ahead = account = None
            if i + 1 < n and self.graph is not None and self.graph.graph is not None:
                captures = self.graph.captures
                ahead = self.graph.step(token)  # None past the graph's KV room
                if ahead is not None:  # a step that captured again (after KV growth) is no decode step
                    account = "capture" if self.graph.captures != captures else "decode"
            try:
                if ready is not None:
                    ready.synchronize()  # the token, not the step queued behind it
                    tok = int(host[0])
                else:
                    tok = int(token[0])
            except BaseException:  # interrupted with a step fed whose token is unknown: start afresh
                if ahead is not None:
                    self.reset()
                raise
            if queued is not None:  # reading this token waited for the step launched last time
                now = time.perf_counter()
                if queued == "decode":
                    self.timing.decode_tokens += 1
                    self.timing.decode_seconds += now - last
                else:
                    self.timing.capture_seconds += now - last
                last = now
            queued = account
            if ahead is not None:
                self.fed.append(tok)
                self.timing.ahead_steps += 1
            yield tok
            if i + 1 == n:
                return
            if ahead is None:
                logits = self.feed(self.fed + [tok], GENERATED)
                last = time.perf_counter()
            else:
                logits = ahead


def generate(model: MoEModel, tokenizer: StopTokens | None, prompt_ids: list[int], sampler: TokenSampler | None,
             max_new_tokens: int, stop_ids: Iterable[int] | None = None,
             session: Session | None = None) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` tokens after ``prompt_ids``; a stop token ends the stream
    (it is not yielded). ``sampler`` None means greedy (argmax, first index on ties), the
    deterministic mode the exactness tests compare; ``stop_ids`` None takes the tokenizer's.
    Greedy and history-free samplers pick on the device and run one step ahead of the host
    (``Session.decode``); a sampler that needs the history gets it, one host round trip a token."""
    if stop_ids is None:
        stop_ids = tokenizer.stop_ids if tokenizer is not None else ()
    session = session if session is not None else Session(model)
    logits = session.feed(list(prompt_ids))
    yield from continue_tokens(session, logits, sampler, max_new_tokens, stop_ids)


def continue_tokens(session: Session, logits: torch.Tensor, sampler: TokenSampler | None, max_new_tokens: int,
                    stop_ids: Iterable[int], constraint: TokenConstraint | None = None) -> Iterator[int]:
    """``generate`` after the prompt is in ``session`` (``logits``: its last token's), for
    callers that fed it themselves (the server's ``Session.prompt``). ``constraint``: a grammar
    whose mask needs the token before it, so such a reply decodes one token at a time (the same
    bits: a step fed on its own is the step ``decode`` launches ahead). A session that drafts
    (``Session.draft``) decodes through ``runtime.speculative`` (a grammar's replies do not: its
    mask wants each token before the next)."""
    stops = set(int(s) for s in stop_ids)
    history = list(session.fed)
    if session.draft is not None and constraint is None and (sampler is None or hasattr(sampler, "verify_draft")):
        from .speculative import speculative_tokens

        for tok in speculative_tokens(session, logits, max_new_tokens, sampler):
            if tok in stops:
                return
            yield tok
        return
    if constraint is None and (sampler is None or sampler.history_free):
        pick = torch.argmax if sampler is None else sampler.pick
        for tok in session.decode(logits, max_new_tokens, pick):
            if tok in stops:
                return
            yield tok
        return
    for i in range(max_new_tokens):
        if constraint is not None:
            logits = constraint.mask(logits)
        tok = int(torch.argmax(logits)) if sampler is None else int(sampler.sample(logits, history))
        if constraint is not None:
            constraint.accept(tok)
        if tok in stops:
            return
        yield tok
        history.append(tok)
        if i + 1 < max_new_tokens:
            logits = session.feed(history, GENERATED)
