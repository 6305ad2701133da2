"""Token generation: prefill the prompt once, then decode one token at a time from the cache.

``Session`` keeps a model's cache together with the tokens it has consumed, so a chat can send the
whole re-rendered conversation each turn and only the new suffix is computed (the cache, DeltaNet
state included, can only grow, so anything that is not an extension starts a fresh cache).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from sparkpack.formats.memory import PREFILL_CHUNK, PREFILL_GRAPH_TOKENS

from .graph import PREFILL_SIZES, DecodeGraph, PrefillGraphs, capturable, feeds_short_calls, prefill_is_padded
from .models.base import MoEModel


class TokenSampler(Protocol):
    """A sampler may also offer ``history_free`` (True) and ``pick(logits) -> tensor`` (the
    token id on the device, nothing read back): ``generate`` then decodes one step ahead of the
    host (``Session.decode``)."""

    def sample(self, logits: torch.Tensor, history: list[int]) -> int: ...


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
    ``PREFILL_GRAPH_TOKENS``, padded, see ``runtime.graph.PrefillGraphs``) where the model allows
    (CUDA, zero-copy expert store). ``kv_type``: see ``runtime.cache.KVCache``."""

    def __init__(self, model: MoEModel, prefill_chunk: int = PREFILL_CHUNK, ctx: int = DEFAULT_CTX,
                 graphs: bool | None = None, kv_type: str = "auto"):
        self.model = model
        self.prefill_chunk = prefill_chunk
        self.use_graphs = capturable(model) if graphs is None else graphs
        self.graph: DecodeGraph | None = None
        self.timing = Timing()
        self.cache = model.new_cache(ctx, kv_type)
        self.cache_ctx = ctx
        # short prefill calls padded to a few sizes and (with graphs) captured: runtime.graph
        self.prefill = PrefillGraphs(model, self.cache, self.use_graphs) if prefill_is_padded(model, self.cache) else None
        # Calls of at most PREFILL_GRAPH_TOKENS on such models even when the store cannot be
        # captured: the --vram plan counts those calls' temporaries, not prefill_chunk's.
        self.short_calls = feeds_short_calls(model, self.cache)
        self.fed: list[int] = []

    def warm_up(self) -> float:
        """Run every call shape a first prompt and its reply will use on dummy tokens, then forget
        them; returns the seconds it took. Why: the first call of each shape compiles (or loads)
        its Triton kernels, grows the allocator and captures its CUDA graph, and a user's first
        prompt paid that: on the GPU machine a one-shot 8192-token prompt of the Qwen3.6 shape
        prefilled at ~4000 tok/s against ~10000 warm (BENCHMARKS.md). Shapes: a full prefill
        chunk and a short one after it (eager sessions; a count that is not a multiple of 16 is
        another kernel variant), or every padded call size (``PrefillGraphs``), then two decode
        steps (capture, replay). The expert store's counts and cache admission forget the dummy
        traffic; results never depend on any of it."""
        t0 = time.perf_counter()
        n_vocab = self.model.spec.n_vocab
        room = max(2, self.cache_ctx - 2)
        dummy = torch.randint(0, n_vocab, (room + 64,), generator=torch.Generator().manual_seed(0)).tolist()
        if self.prefill is not None:
            for size in PREFILL_SIZES:
                if size + 1 <= room:
                    self.reset()
                    self.feed(dummy[:size])
            sizes = [min(room - 1, 37)]
        else:
            sizes = [min(self.prefill_chunk, room - 38), 37]
        self.reset()
        ids: list[int] = []
        for n in sizes:
            if n > 0 and len(ids) + n + 2 <= room:
                ids += dummy[len(ids): len(ids) + n]
                self.feed(ids)
        for _ in range(2):
            ids.append(dummy[len(ids)])
            self.feed(ids)
        self.reset()
        self.timing = Timing()
        self.model.experts.forget_traffic()
        return time.perf_counter() - t0

    def reset(self) -> None:
        """Forget the sequence; buffers (and the captured decode step and prefill calls) are kept
        for the next one."""
        self.cache.reset()
        self.fed = []

    def feed(self, ids: list[int]) -> torch.Tensor:
        """Make the cache hold exactly ``ids`` and return the logits of the last one ``[n_vocab]``."""
        if not ids:
            raise ValueError("nothing to feed: empty token list")
        n = len(self.fed)
        if len(ids) <= n or ids[:n] != self.fed:
            self.reset()
            n = 0
        t0 = time.perf_counter()
        logits = None
        capturing = False
        if len(ids) - n == 1 and self.use_graphs:
            if self.graph is None:
                self.graph = DecodeGraph(self.model, self.cache)
            captures = self.graph.captures
            logits = self.graph.step(ids[-1])  # None past the graph's KV room: eager below
            capturing = self.graph.captures > captures
        if logits is None:
            # Models whose prefill calls are captured take every prompt in captured calls: on the
            # GPU machine a 4096-token Qwen3-30B prompt went 1.7x faster in replayed 512-token
            # calls than in eager 2048-token ones (BENCHMARKS.md, session 15).
            step = min(self.prefill_chunk, PREFILL_GRAPH_TOKENS) if self.short_calls else self.prefill_chunk
            for i in range(n, len(ids), step):
                chunk = ids[i: i + step]
                logits = self.prefill.feed(chunk) if self.prefill is not None else None
                if logits is None:
                    logits = self.model.forward(chunk, self.cache, last_only=True)[-1]
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

    def decode(self, logits: torch.Tensor, n: int, pick: Callable[[torch.Tensor], torch.Tensor],
               seen: list[torch.Tensor] | None = None) -> Iterator[int]:
        """Up to ``n`` tokens after the fed ones, whose last logits are ``logits``; ``pick`` chooses
        each on the device (logits -> a token id tensor, nothing read back). ``seen`` collects the
        logits each token was picked from (benchmarks compare them across residencies).

        Why: read back at once, every token costs a host round trip in which the GPU idles (the
        read, then the launch of the next step: ~0.2 ms of a ~3 ms step on the H100). Once the
        decode step is captured, the step that feeds token i is launched from the device copy of
        i before the host reads i, so the GPU always has the next step queued. A token the
        consumer then rejects (a stop token) has been fed already: ``fed`` includes it, as the
        cache does, so a later ``feed`` reuses or resets them as usual. The tokens and logits are
        the bits ``feed`` gives one token at a time (same captured step, same inputs)."""
        on_cuda = logits.is_cuda
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
                logits = self.feed(self.fed + [tok])
                last = time.perf_counter()
            else:
                logits = ahead


def generate(model: MoEModel, tokenizer: object | None, prompt_ids: list[int], sampler: TokenSampler | None,
             max_new_tokens: int, stop_ids: Iterable[int] | None = None,
             session: Session | None = None) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` tokens after ``prompt_ids``; a stop token ends the stream
    (it is not yielded). ``sampler`` None means greedy (argmax, first index on ties), the
    deterministic mode the exactness tests compare; ``stop_ids`` None takes the tokenizer's.
    Greedy and history-free samplers pick on the device and run one step ahead of the host
    (``Session.decode``); a sampler that needs the history gets it, one host round trip a token."""
    if stop_ids is None:
        stop_ids = getattr(tokenizer, "stop_ids", ()) if tokenizer is not None else ()
    stops = set(int(s) for s in stop_ids)
    session = session if session is not None else Session(model)
    history = list(prompt_ids)
    logits = session.feed(history)
    if sampler is None or getattr(sampler, "history_free", False):
        pick = torch.argmax if sampler is None else sampler.pick
        for tok in session.decode(logits, max_new_tokens, pick):
            if tok in stops:
                return
            yield tok
        return
    for i in range(max_new_tokens):
        tok = int(sampler.sample(logits, history))
        if tok in stops:
            return
        yield tok
        history.append(tok)
        if i + 1 < max_new_tokens:
            logits = session.feed(history)
