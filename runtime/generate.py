"""Token generation: prefill the prompt once, then decode one token at a time from the cache.

``Session`` executes one sequence: it keeps a model's cache together with the tokens it has
consumed, so a chat or a server can send the whole re-rendered conversation each turn and have
only what changed computed. It runs the calls its ``CallPlan`` cuts a prompt into
(``runtime.call_plan``: where calls end, which run together), replaying CUDA graphs where the
model allows (``runtime.graph``); ``PrefixReuse`` (``runtime.prefix_reuse``) says how much of
the cache a new prompt keeps and holds the state copies that let it go back; ``runtime.warm_up``
runs every call shape once before serving, and ``runtime.decode_ahead`` queues each decode step
before the host reads the token it feeds.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from sparkpack.formats.memory import PREFILL_CHUNK, call_rows, longest_call
from sparkpack.formats.profile import SIDES

from .cache import STATE_CHECKPOINTS, RowStates
from .call_plan import CallPlan, PlannedCall
from .decode_ahead import decode_ahead
from .graph import DecodeGraph, PrefillGraphs, VerifyGraphs, capturable, prefill_is_padded, short_prefill_calls
from .models.base import Call, MoEModel
from .prefix_reuse import PrefixReuse
from .sequence_state import SequenceState
from .warm_up import run_call_shapes

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


class Session:
    """``ctx`` sizes the KV buffers up front (they grow past it, but only up to ``ctx`` is a
    decode step replayed from a CUDA graph). ``graphs`` None: capture decode steps (and, on the
    all-attention models, prefill calls: prompts then go in calls of at most
    ``PREFILL_GRAPH_TOKENS``, padded, see ``runtime.graph.PrefillGraphs``, up to ``long_past``
    and in eager ``prefill_chunk`` calls after it: ``CallPlan.call_tokens_at``) where the model
    allows (CUDA, zero-copy expert store). ``kv_type``: see ``runtime.cache.KVCache``.
    ``checkpoints``: how many DeltaNet state copies ``prompt`` may go back to (models with
    DeltaNet layers). ``breaks``: token ids a call may end before (``GGUFTokenizer.control_ids``;
    ``runtime.call_plan``); sessions compared bit for bit must have the same."""

    def __init__(self, model: MoEModel, prefill_chunk: int = PREFILL_CHUNK, ctx: int = DEFAULT_CTX,
                 graphs: bool | None = None, kv_type: str = "auto", checkpoints: int = STATE_CHECKPOINTS,
                 breaks: frozenset[int] = frozenset()):
        self.model = model
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
        self.plan = CallPlan(model, self.cache, self.prefill is not None, prefill_chunk, ctx, breaks)
        self.reuse = PrefixReuse(self.cache, self.plan, model.device, model.dtype, checkpoints)
        self.fed: list[int] = []
        self.reused = 0  # tokens the last ``prompt`` kept instead of computing
        # Speculative decoding (``runtime.speculative``): the drafter and its counts; None: off.
        self.draft: Speculation | None = None
        self.verify_graphs: VerifyGraphs | None = None
        self.row_states: RowStates | None = None  # DeltaNet states after each verify row
        self._verified: tuple[int, int, float] | None = None  # the last verify: start, rows, seconds

    def warm_up(self) -> float:
        """Run every call shape a first prompt and its reply will use on dummy tokens
        (``runtime.warm_up``), then forget them; returns the seconds it took. The host buffers of
        every DeltaNet state checkpoint are allocated, and the expert store's counts and cache
        admission forget the dummy traffic."""
        t0 = time.perf_counter()
        run_call_shapes(self)
        self.reset()
        if self.reuse.checkpoints is not None:
            self.reuse.checkpoints.reserve(self.cache)
        self.timing = Timing()
        self.model.experts.forget_traffic()
        return time.perf_counter() - t0

    @property
    def checkpoint_bytes(self) -> int:
        """The host memory its state checkpoints take (``StateCheckpoints``; 0 without)."""
        return self.reuse.checkpoints.host_bytes if self.reuse.checkpoints is not None else 0

    def reset(self) -> None:
        """Forget the sequence; buffers (and the captured decode step and prefill calls) are kept
        for the next one."""
        self.cache.reset()
        self.fed = []
        self.reuse.forget()
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
        way (``runtime.prefix_reuse``) and computes the rest; ``reused`` says how many tokens.
        ``marks``: positions (call ends) whose states are copied on the way and kept until the
        next prompt, for ``state_at`` (``runtime.conversation_cache``: shared prefixes)."""
        feed = self.start_prompt(ids, side, marks)
        feed.advance()
        return feed.logits

    def reusable(self, ids: list[int]) -> int:
        """How many tokens of ``ids`` ``prompt`` would keep now (``PrefixReuse.reusable``)."""
        return self.reuse.reusable(ids, self.fed)

    def cuts_of(self, ids: list[int]) -> list[int]:
        """Where a fresh session feeding ``ids`` ends its calls before their last token (from 0)."""
        return self.plan.cuts_of(ids)

    def state_at(self, pos: int | None = None) -> tuple[list[int], list[int], list | None] | None:
        """What a copy of the sequence's state at ``pos`` is taken from (``PrefixReuse.state_at``)."""
        return self.reuse.state_at(self.fed, pos)

    def resume(self, state: SequenceState) -> None:
        """Make the session hold ``state`` (of this model with this session's options, and the
        cache's device rows no longer needed by copies still running), as if it had prefilled its
        tokens: the next ``prompt`` keeps them where it would have kept them."""
        self.reuse.resume(state)
        self.fed = list(state.tokens)
        if self.draft is not None:
            self.draft.start_at(state.pos)

    def start_prompt(self, ids: list[int], side: str = PROMPT, marks: frozenset[int] = frozenset()) -> PromptFeed:
        """``prompt`` to be run a few calls at a time (``PromptFeed.advance``): the prefix is kept
        now (``reused``), nothing is computed yet."""
        if not ids:
            raise ValueError("nothing to feed: empty token list")
        keep = self.reuse.start(ids, self.fed, marks)
        self.fed = self.fed[:keep]
        if self.draft is not None:
            self.draft.rewind(keep)
        self.reused = keep
        # A fresh session's lone first token is a decode step (captured); any later call is not.
        return PromptFeed(self, ids, keep, graph=keep == 0, side=side)

    def _run(self, ids: list[int], n: int, graph: bool, side: str) -> torch.Tensor:
        """Feed ``ids[n:]`` (tokens of ``side``) after the ``n`` tokens in the cache; the logits of the last."""
        feed = PromptFeed(self, ids, n, graph, side)
        feed.advance()
        return feed.logits

    def verify(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ``tokens`` (the token just picked, then the drafts after it) after the fed ones in
        one verify step (``MoEModel.verify_rows``; captured where decode steps are); returns
        their logits ``[n, n_vocab]``, row i bit for bit the single decode step after
        ``tokens[i]``, and their output-normed rows. ``keep`` then says how many of them stay."""
        self.model.experts.routing_side(GENERATED)
        t0 = time.perf_counter()
        start, n = len(self.fed), len(tokens)
        states = None
        if self.reuse.recurrent and n > 1:  # (one row is always kept whole)
            if self.row_states is None or not self.row_states.fits(self.cache, n):
                # sized for the drafting's longest step at once (a graph captured on them stays valid)
                most = max(n - 1, self.draft.length.max_k if self.draft is not None else 0)
                self.row_states = RowStates(self.cache, max(most, self.row_states.rows if self.row_states else 0))
            states = self.row_states
        out = None
        if self.use_graphs:
            if self.verify_graphs is None:
                self.verify_graphs = VerifyGraphs(self.model, self.cache)
            out = self.verify_graphs.step(tokens, states)
        logits, hidden = out if out is not None else self.model.verify_rows(tokens, self.cache, states=states)
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        self.fed.extend(tokens)
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
            if self.reuse.recurrent:
                self.row_states.restore(self.cache, k - 1)
            self.cache.rewind(start + k)
            del self.fed[start + k:]
        self.timing.decode_tokens += k
        self.timing.decode_seconds += seconds

    def _grouped(self, ids: list[int], group: list[PlannedCall]) -> torch.Tensor | None:
        """The logits of ``group``'s last token, its calls run layer by layer
        (``MoEModel.forward_calls``) with the DeltaNet states copied at the ends that keep rows
        exact as each call's block is launched; None when they must run one by one (a call
        ``PrefillGraphs`` would not pad, or too few rows to stage)."""
        if not self.plan.stages(group):
            return None
        chunks = [ids[c.start:c.end] for c in group]
        if self.plan.padded(group[0]):  # (no DeltaNet states: all-attention models)
            # a whole group replays a graph captured in the warm-up (or at its first use)
            whole = len(chunks) * self.plan.call_tokens == self.plan.group_tokens
            logits = self.prefill.run_group(chunks, capture=whole)
            if logits is not None:
                for c in group:
                    self.reuse.ended(c, save=False)
            return logits
        dev = self.model.device
        calls = [Call(torch.tensor(chunk, dtype=torch.long).to(dev), len(chunk)) for chunk in chunks]
        after = self.reuse.copies_during(group)
        try:
            logits = self.model.forward_calls(calls, self.cache, after)[-1]
        except BaseException:
            self.reuse.interrupted()
            raise
        for c in group:
            self.reuse.ended(c, save=False)
        return logits

    def decode(self, logits: torch.Tensor, n: int, pick: Callable[[torch.Tensor], torch.Tensor],
               seen: list[torch.Tensor] | None = None) -> Iterator[int]:
        """Up to ``n`` tokens after the fed ones, whose last logits are ``logits``, each step
        launched before the host reads the token it feeds (``runtime.decode_ahead``); ``pick``
        chooses each on the device, ``seen`` collects the logits each was picked from."""
        return decode_ahead(self, logits, n, pick, seen)


class PromptFeed:
    """One feed of a ``Session`` (``start_prompt``, or ``feed`` and ``prompt`` at once) run a few
    of its call groups at a time (``advance``), so that a server can put other sequences' decode
    steps between them (``runtime.server.parallel``: chunked prefill). The calls and groups are
    those a one-shot feed runs, in its order (``CallPlan.calls``, fixed when the feed starts), a
    staged group whole: where a feed pauses changes when its calls run, never what they compute.
    Between advances the session holds the tokens fed so far (``fed``): a feed given up midway (a
    client gone) leaves the state of a shorter prompt, whose exact rows a later prompt keeps."""

    def __init__(self, session: Session, ids: list[int], n: int, graph: bool, side: str):
        self.session, self.ids, self.side = session, ids, side
        self.pos = n  # tokens in the cache
        self.logits: torch.Tensor | None = None  # the last token's, once done
        self.done = False
        self._new = len(ids) - n  # one: a decode step's time, more: a prefill's
        self._collect = session.draft is not None and session.draft.drafter.needs_hidden
        self._graph = graph and not self._collect
        # The call groups left; None: not planned yet (a lone token may take the captured decode step).
        self._groups: list[list[PlannedCall]] | None = None
        self._eager = False  # calls were planned (not a captured decode step): rings' windows copied at the end
        if not self._captured_step():
            self._plan()

    def _captured_step(self) -> bool:
        return self._graph and self._new == 1 and self.session.use_graphs

    def _plan(self) -> None:
        s = self.session
        self._eager = True
        self._groups = s.plan.groups(s.plan.calls(self.ids, self.pos, s.reuse.cuts[-1], s.reuse.exact), s.reuse.marks)

    @property
    def left(self) -> int:
        """Tokens not fed yet."""
        return len(self.ids) - self.pos

    @property
    def next_tokens(self) -> int:
        """The tokens the next ``advance`` feeds at least (its first group's)."""
        if not self._groups:
            return self.left
        return self._groups[0][-1].end - self._groups[0][0].start

    def advance(self, budget: int | None = None) -> int:
        """Run call groups while their tokens fit in ``budget`` (always one; None: all that are
        left) and return how many tokens were fed; ``done`` and ``logits`` say when it is over."""
        s = self.session
        if self.done:
            return 0
        s.model.experts.routing_side(self.side)
        if self._collect:  # the drafter reads these rows' hidden states: eager calls append them
            s.model.hidden_out = s.draft.pending
        t0, start, capturing = time.perf_counter(), self.pos, False
        try:
            if self._groups is None:  # a lone token: the captured decode step
                if s.graph is None:
                    s.graph = DecodeGraph(s.model, s.cache)
                captures = s.graph.captures
                self.logits = s.graph.step(self.ids[-1])  # None past the graph's KV room: eager calls
                capturing = s.graph.captures > captures
                if self.logits is None:
                    self._plan()
                else:
                    self.pos, self._groups = len(self.ids), []
            while self._groups and (self.pos == start or budget is None or self.pos - start + self.next_tokens <= budget):
                self.logits = self._run_group(self._groups.pop(0))
        finally:
            s.model.hidden_out = None
        if s.model.device.type == "cuda":
            torch.cuda.synchronize(s.model.device)
        self.done = not self._groups
        if self.done and self._eager:
            s.reuse.save_windows()
        self._account(time.perf_counter() - t0, self.pos - start, capturing)
        s.fed = list(self.ids) if self.done else self.ids[:self.pos]
        return self.pos - start

    def _run_group(self, group: list[PlannedCall]) -> torch.Tensor:
        """The logits of ``group``'s last token (staged together where the plan stages, else call by call)."""
        s, ids = self.session, self.ids
        logits = s._grouped(ids, group) if s.plan.staged else None
        if logits is None:
            for c in group:
                chunk = ids[c.start:c.end]
                logits = s.prefill.feed(chunk) if s.prefill is not None else None
                if logits is None:
                    logits = s.model.forward(chunk, s.cache, last_only=True)[-1]
                s.reuse.ended(c, save=True)
        self.pos = group[-1].end
        return logits

    def _account(self, seconds: float, tokens: int, capturing: bool) -> None:
        """The advance's time in the session's ``Timing``: a lone token is a decode step (or a
        capture, kept out of the decode rate, which describes the steady state), more a prefill."""
        timing = self.session.timing
        if capturing:
            timing.capture_seconds += seconds
        elif self._new == 1:
            timing.decode_tokens += 1
            timing.decode_seconds += seconds
        else:
            timing.prefill_tokens += tokens
            timing.prefill_seconds += seconds


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


def device_pick(sampler: TokenSampler | None, constraint: TokenConstraint | None
                ) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The pick that needs nothing of the host (greedy, or a history-free sampler's), which a
    decode loop may run on the device a step ahead; None when a token needs the host first (a
    grammar's mask, a sampler that reads the history)."""
    if constraint is None and (sampler is None or sampler.history_free):
        return torch.argmax if sampler is None else sampler.pick
    return None


def choose_token(logits: torch.Tensor, sampler: TokenSampler | None, constraint: TokenConstraint | None,
                 history: list[int]) -> int:
    """The next token of a reply from its last ``logits`` ``[n_vocab]``, as every decode loop
    chooses it (``continue_tokens``; the ``--parallel`` engine per sequence, so that a batched
    reply is the serial one): ``device_pick``'s, else the grammar's mask (the token then accepted
    by it) and the sampler's draw given ``history``."""
    pick = device_pick(sampler, constraint)
    if pick is not None:
        return int(pick(logits).reshape(-1)[0])
    if constraint is not None:
        logits = constraint.mask(logits)
    tok = int(torch.argmax(logits)) if sampler is None else int(sampler.sample(logits, history))
    if constraint is not None:
        constraint.accept(tok)
    return tok


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
    pick = device_pick(sampler, constraint)
    if pick is not None:
        for tok in session.decode(logits, max_new_tokens, pick):
            if tok in stops:
                return
            yield tok
        return
    for i in range(max_new_tokens):
        tok = choose_token(logits, sampler, constraint, history)
        if tok in stops:
            return
        yield tok
        history.append(tok)
        if i + 1 < max_new_tokens:
            logits = session.feed(history, GENERATED)
