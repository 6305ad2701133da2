"""Decode steps and short prefill calls captured in CUDA graphs and replayed.

An eager decode step of these models launches a few thousand small kernels; the host needs
several times longer to issue them than the GPU needs to run them. Replaying a captured graph
issues the whole step at once. What makes the step capturable:
  - the token id and its position are read from device memory (``ids``, ``pos``), so nothing
    of the step is a Python value that changes between tokens;
  - KV caches are preallocated buffers attended with a position mask, and recurrent states are
    updated in place (``runtime.cache``), so every step reads and writes the same addresses;
  - the expert store serves misses in zero-copy mode: cold experts are read from pinned host
    memory inside the kernel (routings are counted there too), and the store's per-token
    bookkeeping (reading the counts, promoting missed experts into cache slots, rewriting the
    slot table in place) runs on the host while the next replay computes. Stores that copy
    misses on demand (async, sync) need the router's choice on the host mid-step and run eagerly.
A replayed step runs exactly the kernels of an eager step with the same shapes, so outputs are
the same bits either way.

Prefill calls of up to ``PREFILL_GRAPH_TOKENS`` tokens are captured too (``PrefillGraphs``), for
the all-attention models: a 512-token call of the Qwen3-30B shape issues ~750 kernels, which
takes the host longer than the GPU's work. A call is padded to the next
of a few sizes (one graph each, one shared memory pool); its first position and the number of
real tokens are read from device memory. The padding sits after the real tokens, so causal
attention keeps it out of their results, and the expert store counts only their routings.
After a long past (``formats.memory.LONG_PAST_TOKENS``) a session feeds whole chunks eagerly
instead (``runtime.call_plan.CallPlan.call_tokens_at``): there the attention over the past, which a
replay must read its position for, costs more than the launches a graph saves.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from sparkpack.formats.archs import ModelSpec
from sparkpack.formats.memory import PREFILL_GRAPH_TOKENS, short_calls

from . import device_tables
from .cache import Cache, KVCache, RecurrentState, RowStates
from .models.base import Call, MoEModel
from .pinned import REGISTERING

# The sizes a captured prefill call is padded to (the largest is PREFILL_GRAPH_TOKENS): at most
# a third of a call's work is padding from 64 tokens up.
PREFILL_SIZES = (16, 32, 64, 96, 128, 192, 256, 384, PREFILL_GRAPH_TOKENS)


def _kv_layers(cache: Cache) -> list[KVCache]:
    return [la for la in cache.layers if isinstance(la, KVCache)]


def kv_addresses(cache: Cache) -> tuple[int, ...]:
    """Where the KV buffers are: a graph captured on other addresses must be captured again."""
    return tuple(la.k.data_ptr() for la in _kv_layers(cache) if la.k is not None)


def state_addresses(cache: Cache) -> tuple[int, ...]:
    """``kv_addresses`` and where the recurrent states are: a decode step's device tables hold
    them (``runtime.device_tables``), so a graph captured on others must be captured again."""
    return kv_addresses(cache) + tuple(p for la in cache.layers if isinstance(la, RecurrentState) and la.conv is not None
                                       for p in (la.conv.data_ptr(), la.ssm.data_ptr()))


def run_and_capture(call, device: torch.device, stream: torch.cuda.Stream, pool=None
                    ) -> tuple[torch.Tensor, torch.cuda.CUDAGraph, torch.Tensor]:
    """``call()`` run eagerly on the side ``stream`` (as capture wants: warm-up, lazy weights,
    kernel compilation, allocator), then recorded into a graph (in ``pool`` when given) without
    running. Returns the eager result (a copy), the graph and the graph's output tensor. The
    device tables the call's batched kernels read (``runtime.device_tables``: made by the eager
    run) are kept with the graph, which reads them at every replay."""
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        result = call().clone()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with device_tables.kept() as tables, REGISTERING, torch.cuda.graph(graph, pool=pool):  # records; runs nothing
        out = call()
    graph.tables = tables
    return result, graph, out


def capturable(model: MoEModel) -> bool:
    """Whether a decode step of ``model`` can be captured: CUDA, and experts that need no host
    round trip inside the step. ``SPARKPACK_CUDA_GRAPHS=0`` turns capture off (debugging)."""
    if os.environ.get("SPARKPACK_CUDA_GRAPHS", "1") == "0":
        return False
    return model.device.type == "cuda" and model.experts.capturable


class DecodeGraph:
    """Decode steps of one ``Cache``: the first runs eagerly (warm-up: lazy weights, kernel
    compilation, allocator) and is captured; later ones replay. Positions up to the KV buffers'
    capacity are covered; ``step`` returns None past it and the caller decodes eagerly, which
    grows the buffers; the next step then captures again on the new ones."""

    def __init__(self, model: MoEModel, cache: Cache):
        self.model, self.cache = model, cache
        self.ids = torch.zeros(1, dtype=torch.long, device=model.device)
        self.pos = torch.zeros((), dtype=torch.long, device=model.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.replays = 0
        self.captures = 0
        self.captured_on: tuple[int, ...] = ()

    def room(self) -> float:
        return min((la.room for la in _kv_layers(self.cache) if la.k is not None), default=0)

    def step(self, token: int | torch.Tensor) -> torch.Tensor | None:
        """Logits ``[n_vocab]`` after feeding ``token`` at position ``cache.pos``: an int, or a
        one-element id tensor on the device (``Session.decode``: nothing waits for its value)."""
        if self.cache.pos + 1 > self.room():
            return None
        if self.graph is not None and state_addresses(self.cache) != self.captured_on:
            self.graph = None  # eager steps past the room grew the KV buffers: capture again on them
        if isinstance(token, torch.Tensor):
            self.ids.copy_(token.reshape(1), non_blocking=True)
        else:
            self.ids.fill_(token)
        self.pos.fill_(self.cache.pos)
        if self.graph is None:
            logits = self._capture()
        else:
            self.graph.replay()
            self.replays += 1
            logits = self.logits
        self.cache.pos += 1
        self.model.experts.end_step(1, routed=True, defer=True)  # learns from the previous step meanwhile
        return logits[-1].clone()  # the graph's output buffer is rewritten by the next replay

    def _capture(self) -> torch.Tensor:
        dev = self.model.device
        logits, self.graph, self.logits = run_and_capture(
            lambda: self.model.forward(self.ids, self.cache, last_only=True, pos=self.pos), dev, torch.cuda.Stream(dev))
        self.captures += 1
        self.captured_on = state_addresses(self.cache)
        return logits



class VerifyGraphs:
    """Verify steps of one ``Cache`` (``MoEModel.verify_rows``: the last picked token and the
    drafts after it, one batched step), captured in a CUDA graph per row count and replayed, as
    ``DecodeGraph`` does the single step. Why: an eager multi-row step launches a few thousand
    kernels per row block, so it costs many plain captured steps and would eat what drafting
    saves. The ids are copied in from pinned memory and the first position is a device scalar
    (the rows' positions are computed from it inside the graph), so nothing in the replayed
    region is a host value. The graphs share one memory pool (they never overlap). ``step``
    returns None past the KV buffers' room (the caller verifies eagerly, which grows them; the
    graphs then capture again on the new buffers), and a graph is captured again when the
    row-state buffers it copies into change (``Session.verify`` grows them for a longer step)."""

    def __init__(self, model: MoEModel, cache: Cache):
        self.model, self.cache = model, cache
        dev = model.device
        self.pos = torch.zeros((), dtype=torch.long, device=dev)
        self.offsets = torch.arange(0, 64, dtype=torch.long, device=dev)
        # by row count: graph, logits and hidden outputs, ids input, the row-state buffers it copies into
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor,
                                     RowStates | None]] = {}
        self.host = torch.zeros(64, dtype=torch.long, pin_memory=dev.type == "cuda")
        self.pool = None
        self.stream: torch.cuda.Stream | None = None
        self.captured_on: tuple = ()
        self.replays = 0
        self.captures = 0

    def step(self, tokens: list[int], states: RowStates | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Logits ``[n, n_vocab]`` and output-normed rows ``[n, n_embd]`` of ``tokens`` fed at
        ``cache.pos`` (``states``: where the DeltaNet states after each row go)."""
        n = len(tokens)
        room = min((la.room for la in self.cache.layers if isinstance(la, KVCache) and la.k is not None), default=0)
        if n > self.offsets.numel() or self.cache.pos + n > room:
            return None
        on = state_addresses(self.cache)
        if on != self.captured_on:
            self.graphs.clear()  # (new KV buffers: capture again on them)
            self.captured_on = on
        self.host[:n] = torch.tensor(tokens, dtype=torch.long)
        self.pos.fill_(self.cache.pos)
        ran = self.graphs.get(n)
        if ran is not None and ran[4] is not states:  # (new row-state buffers: this one again)
            ran = None
        if ran is None:
            ids = torch.zeros(n, dtype=torch.long, device=self.model.device)
            ids.copy_(self.host[:n], non_blocking=True)
            hidden = torch.empty((n, self.model.spec.n_embd), dtype=self.model.dtype, device=self.model.device)

            def call() -> torch.Tensor:
                logits, h = self.model.verify_rows(ids, self.cache, pos=self.pos + self.offsets[:n], states=states)
                hidden.copy_(h)
                return logits

            if self.stream is None:
                self.stream = torch.cuda.Stream(self.model.device)
            logits, graph, out = run_and_capture(call, self.model.device, self.stream, self.pool)
            self.pool = graph.pool()
            self.graphs[n] = (graph, out, ids, hidden, states)
            self.captures += 1
            rows = hidden.clone()
        else:
            graph, out, ids, hidden, _ = ran
            ids.copy_(self.host[:n], non_blocking=True)
            graph.replay()
            self.replays += 1
            logits, rows = out.clone(), hidden.clone()  # (the buffers are rewritten by the next replay)
        self.cache.pos += n
        self.model.experts.end_step(n, routed=True, defer=True)
        return logits, rows


def short_prefill_calls(device: torch.device | str, dtype: torch.dtype, spec: ModelSpec, kv_type: str) -> bool:
    """Whether sessions feed prompts in calls of at most ``PREFILL_GRAPH_TOKENS`` tokens: on CUDA
    (where the runtime's kernels run) in half precision, for a model whose every layer is
    attention over a bf16/f16 KV cache (``formats.memory.short_calls``). These are the calls
    ``PrefillGraphs`` pads and captures. It depends on nothing the expert store decides, so the
    ``--vram`` plan (``runtime.residency.memory_target``) knows before the store exists that no
    prefill call's temporaries exceed a short call's, except where the store stages long calls:
    such a session feeds long prompts in longer calls (``runtime.call_plan.CallPlan``), which the
    plan counts where it reserves the staging buffers."""
    return (torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and short_calls(spec, kv_type))


def feeds_short_calls(model: MoEModel, cache: Cache) -> bool:
    """``short_prefill_calls`` for a session of ``model`` over ``cache``."""
    q8 = any(la.q8 for la in _kv_layers(cache))
    return model.kernels and short_prefill_calls(model.device, model.dtype, model.spec, "q8_0" if q8 else "auto")


def prefill_is_padded(model: MoEModel, cache: Cache) -> bool:
    """Whether prefill calls of ``model`` into ``cache`` go through ``PrefillGraphs``: short calls
    (``feeds_short_calls``) and experts that need no host round trip. This does not depend on
    whether graphs are captured: an eager session computes the same padded calls, so turning
    capture off never changes a result."""
    return feeds_short_calls(model, cache) and model.experts.capturable


class PrefillGraphs:
    """Prefill calls of up to ``PREFILL_GRAPH_TOKENS`` tokens into one ``Cache``, each padded to
    the next of ``PREFILL_SIZES``. With ``capture`` the first call of a size runs eagerly and is
    captured, later ones replay; without it every call runs eagerly (the same kernels, the same
    bits). The KV buffers are grown to hold the padding before a call; a growth drops the
    captured graphs, which capture again on the new buffers. A call whose padding alone would
    grow them is left to the caller's eager (unpadded) path, so near the end of ``ctx`` a
    prompt's bits can depend on ``ctx``.

    Consecutive calls (a long prompt's pieces) queue on the device without waiting for each
    other: the ids go through two pinned staging buffers and the store learns each call's
    counts while the next one runs (``end_step(defer=True)``, as a decode step does)."""

    def __init__(self, model: MoEModel, cache: Cache, capture: bool = True):
        self.model, self.cache, self.capture = model, cache, capture
        dev = model.device
        self.ids = torch.zeros(PREFILL_GRAPH_TOKENS, dtype=torch.long, device=dev)
        # the host side of the ids copy, two in turn, each reused once its last copy is done
        pin = dev.type == "cuda"
        self.staging = [torch.zeros(PREFILL_GRAPH_TOKENS, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.staged: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self.pos = torch.zeros((), dtype=torch.long, device=dev)
        self.real = torch.zeros((), dtype=torch.long, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # groups of whole calls by their count: graph, output, inputs (ids, positions, counts)
        self.groups: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.pool = None  # one memory pool for all sizes: calls never overlap
        self.stream: torch.cuda.Stream | None = None
        self.captured_on: tuple[int, ...] = ()
        self.replays = 0
        self.captures = 0

    @staticmethod
    def size(n: int) -> int | None:
        """The padded size of an ``n``-token call, or None when it is not captured."""
        if n < 2:
            return None
        return next((s for s in PREFILL_SIZES if s >= n), None)

    def feed(self, ids: list[int]) -> torch.Tensor | None:
        """Logits ``[n_vocab]`` of the last of ``ids`` fed at ``cache.pos``, or None for a call the
        caller runs eagerly: a length that is not captured, or padding that would grow the KV
        buffers. The logits are a device tensor the next call may still be computing behind."""
        n = len(ids)
        size = self._reserve(self.cache.pos, n)
        if size is None:
            return None
        self._check_addresses()
        self._stage(ids, size)
        self.pos.fill_(self.cache.pos)
        self.real.fill_(n)
        ran = self.graphs.get(size)
        if ran is not None:
            ran[0].replay()
            self.replays += 1
            logits = ran[1]
        else:
            logits = self._run(size)
        self.cache.pos += n
        self.model.experts.end_step(n, routed=True, defer=True)  # learned from while the next call runs
        return logits[-1].clone()  # the graph's output buffer is rewritten by the next replay

    def run_group(self, chunks: list[list[int]], capture: bool) -> torch.Tensor | None:
        """Logits ``[n_vocab]`` of the last of consecutive ``chunks`` fed at ``cache.pos`` as one
        group of the padded calls ``feed`` would make of them (``MoEModel.forward_calls``: a
        staging store copies each layer's cold experts once for the group), the KV buffers
        reserved as ``feed`` reserves them; None when ``feed`` would leave one of them to the
        caller's unpadded path. Each call has its own ids, position and count on the device.
        ``capture`` (whole calls only): the group is replayed from a CUDA graph, captured the
        first time with its copies (eagerly run calls are launch-bound)."""
        pos, sizes = self.cache.pos, []
        for ids in chunks:
            size = self._reserve(pos, len(ids))
            if size is None:
                return None
            sizes.append(size)
            pos += len(ids)
        self._check_addresses()
        flat = [t for ids, size in zip(chunks, sizes) for t in ids + [ids[-1]] * (size - len(ids))]
        starts = [self.cache.pos + sum(len(c) for c in chunks[:i]) for i in range(len(chunks))]
        host = torch.tensor(flat + starts + [len(c) for c in chunks], dtype=torch.long)
        capture = capture and self.capture and all(s == len(c) == PREFILL_GRAPH_TOKENS for c, s in zip(chunks, sizes))
        k, n = len(chunks), pos - self.cache.pos
        ran = self.groups.get(k) if capture else None
        inputs = ran[2] if ran is not None else torch.empty(host.numel(), dtype=torch.long, device=self.model.device)
        inputs.copy_(host.pin_memory() if inputs.is_cuda else host, non_blocking=True)
        calls, at = [], 0
        for i, (ids, size) in enumerate(zip(chunks, sizes)):
            calls.append(Call(inputs[at: at + size], len(ids), inputs[len(flat) + i], inputs[len(flat) + k + i]))
            at += size
        rows = sum(sizes)
        if ran is not None:
            self.model.experts.stage_calls(rows)  # (counts the replay's copies)
            ran[0].replay()
            self.model.experts.stage_calls(None)
            self.replays += 1
            logits = ran[1]
        elif capture:
            if self.stream is None:
                self.stream = torch.cuda.Stream(self.model.device)
            logits, graph, out = run_and_capture(lambda: self.model.forward_calls(calls, self.cache), self.model.device,
                                                 self.stream, self.pool)
            self.pool = graph.pool()
            self.groups[k] = (graph, out, inputs)
            self.captures += 1
        else:
            logits = self.model.forward_calls(calls, self.cache)
        self.cache.pos += n
        self.model.experts.end_step(n, routed=True, defer=True)  # learned from while the next call runs
        return logits[-1].clone()

    def _reserve(self, pos: int, n: int) -> int | None:
        """The padded size of an ``n``-token call at ``pos`` with the KV buffers reserved for it,
        or None for a call run eagerly: a length that is not captured, or padding that would grow
        the buffers past what the call itself needs."""
        size = self.size(n)
        room = min(la.room for la in _kv_layers(self.cache))
        if size is None or (pos + n <= room < pos + size):
            return None
        self.model.reserve_kv(self.cache, pos + size, size)
        return size

    def _check_addresses(self) -> None:
        """Grown KV buffers: the graphs captured on the old ones are captured again, in a new pool
        (the old one went with its last graph: capturing into a pool no graph holds any more trips
        an assertion in torch's allocator)."""
        addresses = kv_addresses(self.cache)
        if addresses != self.captured_on:
            self.graphs.clear()
            self.groups.clear()
            self.pool = None
            self.captured_on = addresses

    def _stage(self, ids: list[int], size: int) -> None:
        """The call's ids (padded with its last one: any real id) into ``self.ids`` without a host
        wait: a pageable copy would wait for the previous call to finish."""
        host = self.staging[self.turn]
        if self.staged[self.turn] is not None:
            self.staged[self.turn].synchronize()  # its copy two calls ago (long done)
        n = len(ids)
        host[:n] = torch.tensor(ids, dtype=torch.long)
        host[n:size] = ids[-1]
        self.ids[:size].copy_(host[:size], non_blocking=True)
        if self.ids.is_cuda:
            self.staged[self.turn] = torch.cuda.Event()
            self.staged[self.turn].record()
        self.turn ^= 1

    def _call(self, size: int) -> torch.Tensor:
        return self.model.forward(self.ids[:size], self.cache, last_only=True, pos=self.pos, real=self.real)

    def _run(self, size: int) -> torch.Tensor:
        """The call eagerly; with ``capture``, on a side stream (as capture wants) and then recorded."""
        if not self.capture:
            return self._call(size)
        dev = self.model.device
        if self.stream is None:  # one side stream for every warm-up run: cuBLAS keeps a workspace per stream
            self.stream = torch.cuda.Stream(dev)
        logits, graph, out = run_and_capture(lambda: self._call(size), dev, self.stream, self.pool)
        self.pool = graph.pool()
        self.graphs[size] = (graph, out)
        self.captures += 1
        return logits


class BatchGraphs:
    """Batched decode steps (``MoEModel.rows_logits``: one token of each of several sequences) of
    fixed sets of caches, one CUDA graph per set: a ``--parallel`` server's sessions keep their
    caches, so the sets that decode together are few (its subsets, in the order the caller keeps
    them: ``server.running.RunningList`` orders the rows by session). A set's first step runs
    eagerly and is captured, later ones replay. The token ids and positions are read from device
    memory (one position per row: the sequences are at different positions), so a step is the
    kernels of the eager batched step, which gives each row its sequence's single step bit for
    bit (``runtime.decode_rows``).

    Before a step every cache is grown as an eager step at its position grows it (``reserve_kv``
    at ``pos + 1``: the same sizes at the same positions as a session's own steps); a graph
    captured on buffers that have since grown is captured again on the new ones. The store
    learns from a step's routings, every row's, while the next step computes (``end_step(defer=
    True)``, as ``DecodeGraph``). All graphs share one memory pool: steps never overlap, and each
    step's logits are copied out before the next. Without ``capture`` (the CPU, tests) the same
    step runs eagerly from the same ids buffer, its positions host ints (``decode_batch``'s step)."""

    def __init__(self, model: MoEModel, capture: bool = True):
        self.model, self.capture = model, capture
        # per set (its caches' ids): graph, logits buffer, ids + positions buffer, the addresses of
        # the states it reads (``state_addresses``)
        self.graphs: dict[tuple[int, ...], tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None, torch.Tensor,
                                                 tuple[tuple[int, ...], ...]]] = {}
        self.pool = None
        self.stream: torch.cuda.Stream | None = None
        self.captures = 0
        self.replays = 0

    def step(self, tokens: Sequence[int] | torch.Tensor, caches: Sequence[Cache]) -> torch.Tensor:
        """The logits ``[B, n_vocab]`` of ``tokens[b]`` fed at ``caches[b].pos`` (distinct caches),
        each cache advanced by one. ``tokens``: ints, or an id tensor on the device, whose values
        nothing here waits for (the ``--parallel`` engine launches a step before it reads the
        tokens it feeds); then nothing waits for the device, as ``DecodeGraph.step``."""
        if len(tokens) != len(caches) or len({id(c) for c in caches}) != len(caches) or not caches:
            raise ValueError("BatchGraphs.step: one token and one distinct cache per sequence")
        for c in caches:
            self.model.reserve_kv(c, c.pos + 1)
        key = tuple(id(c) for c in caches)
        on = tuple(state_addresses(c) for c in caches)
        graph, out, inputs, captured_on = self.graphs.get(key) or (None, None, None, ())
        if inputs is None or captured_on != on:
            graph = None
            self.graphs.pop(key, None)
            if not self.graphs:
                self.pool = None  # (a pool no graph holds any more cannot be captured into: see PrefillGraphs)
            inputs = torch.zeros(2 * len(caches), dtype=torch.long, device=self.model.device)
        n = len(caches)
        if isinstance(tokens, torch.Tensor):  # on the device, in stream order; the positions as fills
            inputs[:n].copy_(tokens.reshape(n), non_blocking=True)
            for b, c in enumerate(caches):
                inputs[n + b].fill_(c.pos)
        else:
            inputs.copy_(torch.tensor([*tokens, *(c.pos for c in caches)], dtype=torch.long))
        # (eagerly, the positions go in as ints: the CPU's torch attention over a ring gathers the
        # rows of a known position, and a device one reads every row, in another order)
        at = tuple(inputs[n + b] for b in range(n)) if self.capture else tuple(c.pos for c in caches)
        if graph is not None:
            graph.replay()
            self.replays += 1
            logits = out
        else:
            if self.capture:
                dev = self.model.device
                if self.stream is None:
                    self.stream = torch.cuda.Stream(dev)
                logits, graph, out = run_and_capture(lambda: self.model.rows_logits(inputs[:n], caches, at), dev,
                                                     self.stream, self.pool)
                self.pool = graph.pool()
                self.captures += 1
            else:
                logits = self.model.rows_logits(inputs[:n], caches, at)
            on = tuple(state_addresses(c) for c in caches)  # (a fresh cache's recurrent states are made by that run)
        self.graphs[key] = (graph, out, inputs, on)
        for c in caches:
            c.pos += 1
        self.model.experts.end_step(n, routed=True, defer=True)  # learns from the previous step meanwhile
        return logits.clone()  # a graph's output buffer is rewritten by its next replay
