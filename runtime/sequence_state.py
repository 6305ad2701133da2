"""One sequence's state in host memory: what each kind of layer keeps of a sequence at a position,
copied out of a ``Cache`` and put back into one (``restore``).

Why: a server keeps many conversations (``runtime.conversation_cache``) but computes in one
``Cache``; a conversation switched out is a ``SequenceState`` in host memory or in files, and
switching back in is a few bulk copies instead of its prefill.

The state at a position ``pos`` where the sequence's rows are exact (a fresh session's call ends
there: ``PrefixReuse.exact``) has two parts, and each kind of layer (``LAYER_KINDS``; an
architecture's cache is a list of these layers, ``MoEModel.new_cache``) says which it is in:

- paged: a full-attention layer's rows ``[0, pos)`` in blocks of ``BLOCK_TOKENS`` positions (all
  such layers' rows of a block in one slot of the block pool). A block's rows depend only on the
  tokens up to the end of the call that wrote its last row, so blocks are named by a hash of that
  prefix (``block_keys``) and shared between the states of one conversation's turns and of
  conversations with a common start, as vLLM's prefix caching and SGLang's radix cache share
  pages; a turn copies only blocks no state holds yet.
- own: the rest, per state (one slot of the own pool): a sliding-window ring's ``window - 1``
  rows before ``pos``, a Gated DeltaNet layer's conv window and recurrent matrix after ``pos``.

| layer | part | state at ``pos`` |
| --- | --- | --- |
| full attention ``KVCache`` | paged | keys and values (q8_0: codes and scales) of ``[0, pos)`` |
| sliding-window ring ``KVCache`` | own | the ``window - 1`` rows before ``pos`` (all a later token reads) |
| Gated DeltaNet ``RecurrentState`` | own | the conv window and the recurrent matrix after ``pos`` |

A kind declares ``layout(layer)`` (its tensors' shapes in a slot) and moves them: paged kinds
``copy_out``/``copy_in`` a run of blocks, own kinds ``take``/``put`` a state. A restored state
gives the bits the cache had at ``pos``: rows and states are copied, never recomputed. No global
state: each ``SequenceState`` is one sequence, so several can be held (and later decoded together).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Protocol

import torch

from sparkpack.formats.checksums import PACK_ALGORITHM, new_hasher

from .cache import Cache, KVCache, RecurrentState
from .host_pool import HostBudget, Layout, SlotPool

BLOCK_TOKENS = 512  # positions of a block: sharing granularity, and the rows a turn re-copies at most
RUN_BLOCKS = 8  # blocks per bulk copy (a device temporary of that many blocks of one layer's rows)


class LayerKind(Protocol):
    paged: bool

    def layout(self, layer, block: int) -> Layout | None:
        """The layer's tensors in one slot (a block of ``block`` positions' rows, or its own
        state); None before it holds any."""


class AttentionRows:
    """A full-attention layer: rows ``[0, pos)`` in blocks, each tensor's block ``[H, block, d]``."""

    paged = True

    def layout(self, layer: KVCache, block: int) -> Layout | None:
        if layer.k is None:
            return None
        return [((t.shape[0], block, *t.shape[2:]), t.dtype) for t in layer.state()]

    def copy_out(self, layer: KVCache, row0: int, rows: int, runs: list[torch.Tensor]) -> None:
        """Rows ``[row0, row0 + rows)`` into the host ``runs`` (one ``[k, H, block, d]`` per tensor)."""
        for t, host in zip(layer.state(), runs):
            tmp = t.new_empty(host.shape)
            _blocked(tmp, t, row0, rows, out=True)
            host.copy_(tmp, non_blocking=True)
            if t.is_cuda:
                t.record_stream(torch.cuda.current_stream(t.device))

    def copy_in(self, layer: KVCache, row0: int, rows: int, runs: list[torch.Tensor]) -> None:
        for t, host in zip(layer.state(), runs):
            tmp = host.to(t.device, non_blocking=True)
            _blocked(tmp, t, row0, rows, out=False)


def _blocked(tmp: torch.Tensor, t: torch.Tensor, row0: int, rows: int, out: bool) -> None:
    """Between ``t``'s rows ``[row0, row0 + rows)`` (``[H, rows, d]``) and ``tmp [k, H, block, d]``
    (whole blocks, then a partial one): ``out`` from ``t`` into ``tmp``, else back."""
    B = tmp.shape[2]
    whole, rest = divmod(rows, B)
    pairs = []
    if whole:
        pairs.append((tmp[:whole].transpose(0, 1), t[:, row0: row0 + whole * B].unflatten(1, (whole, B))))
    if rest:
        pairs.append((tmp[whole, :, :rest], t[:, row0 + whole * B: row0 + rows]))
    for a, b in pairs:
        (a if out else b).copy_(b if out else a)


class WindowRows:
    """A sliding-window layer's ring: the rows of positions ``[pos - window + 1, pos)``, in order."""

    paged = False

    def layout(self, layer: KVCache, block: int) -> Layout | None:
        if layer.k is None:
            return None
        return [((t.shape[0], layer.window - 1, *t.shape[2:]), t.dtype) for t in layer.state()]

    def take(self, layer: KVCache, pos: int, saved: tuple | None, out: list[torch.Tensor]) -> None:
        if saved is not None:  # (StateCheckpoints keeps the window's rows first)
            for h, o in zip(saved, out):
                o.copy_(h)
            return
        first = max(0, pos - layer.window + 1)
        at = torch.arange(first, pos, device=layer.k.device) % layer.rows
        for t, o in zip(layer.state(), out):
            tmp = t.new_empty(o.shape)
            tmp[:, : pos - first] = t[:, at]
            o.copy_(tmp, non_blocking=True)

    def put(self, layer: KVCache, host: list[torch.Tensor], pos: int, device: torch.device, dtype: torch.dtype) -> None:
        d = host[0].shape
        layer.reserve(pos, torch.empty((1, d[0], d[2]), dtype=dtype, device=device))
        first = max(0, pos - layer.window + 1)
        at = torch.arange(first, pos, device=layer.k.device) % layer.rows
        for t, h in zip(layer.state(), host):
            t[:, at] = h.to(t.device, non_blocking=True)[:, : pos - first]
        layer.since = first  # the ring's other rows hold another sequence's positions


class RecurrentRows:
    """A Gated DeltaNet layer: its conv window and recurrent matrix after ``pos`` tokens (only a
    checkpoint has them: the cache's own are overwritten token after token)."""

    paged = False

    def layout(self, layer: RecurrentState, block: int) -> Layout | None:
        return None if layer.conv is None else [(tuple(t.shape), t.dtype) for t in (layer.conv, layer.ssm)]

    def take(self, layer: RecurrentState, pos: int, saved: tuple | None, out: list[torch.Tensor]) -> None:
        if saved is None:
            raise ValueError("a recurrent state is taken from its checkpoint")
        for h, o in zip(saved, out):
            o.copy_(h)

    def put(self, layer: RecurrentState, host: list[torch.Tensor], pos: int, device: torch.device,
            dtype: torch.dtype) -> None:
        if layer.conv is None:
            layer.conv, layer.ssm = (torch.empty(h.shape, dtype=h.dtype, device=device) for h in host)
        layer.conv.copy_(host[0], non_blocking=True)
        layer.ssm.copy_(host[1], non_blocking=True)


def kind_of(layer: KVCache | RecurrentState) -> LayerKind:
    """The one table from a cache layer to what its state is (``LAYER_KINDS``)."""
    if isinstance(layer, RecurrentState):
        return LAYER_KINDS["recurrent"]
    return LAYER_KINDS["window" if layer.ring else "attention"]


LAYER_KINDS: dict[str, LayerKind] = {"attention": AttentionRows(), "window": WindowRows(), "recurrent": RecurrentRows()}


def truncatable(cache: Cache) -> bool:
    """Whether a state at ``pos`` also gives the state at any earlier exact position (full
    attention only: its rows are a prefix; a ring's window or a recurrent state is not)."""
    return all(isinstance(la, KVCache) and not la.ring for la in cache.layers)


@dataclass
class StatePools:
    """Where a cache's states live in host memory: the block pool (its paged layers' rows of
    ``block`` positions, in layer order) and the own pool (the other layers'); ``items``: per
    layer, its first tensor's index in its pool's layout and how many it has."""

    block: int
    blocks: SlotPool | None
    own: SlotPool | None
    items: list[tuple[int, int] | None]

    def block_tensors(self, il: int, slot: int, n: int) -> list[torch.Tensor]:
        j, k = self.items[il]
        return [self.blocks.run(slot, n, j + i) for i in range(k)]

    def own_tensors(self, il: int, slot: int) -> list[torch.Tensor]:
        j, k = self.items[il]
        return [self.own.tensor(slot, j + i) for i in range(k)]


def state_pools(cache: Cache, budget: HostBudget, pin: bool, block: int = BLOCK_TOKENS,
                known: tuple[Layout, Layout] | None = None) -> StatePools | None:
    """The pools for ``cache``'s states, or None while some layer holds nothing yet (the shapes
    are known from the first token on) unless ``known`` gives the two pools' layouts (a
    restarted server's, from its files)."""
    paged: Layout = []
    own: Layout = []
    items: list[tuple[int, int] | None] = []
    for la in cache.layers:
        kind = kind_of(la)
        lay = kind.layout(la, block)
        if lay is None and known is None:
            return None
        where = paged if kind.paged else own
        n = len(lay) if lay is not None else 2 if isinstance(la, RecurrentState) else 4 if la.q8 else 2
        items.append((len(where), n))
        where += lay if lay is not None else [None] * n
    if known is not None:
        if [len(paged), len(own)] != [len(known[0]), len(known[1])]:
            return None
        paged, own = known
    return StatePools(block, SlotPool(paged, budget, pin) if paged else None,
                      SlotPool(own, budget, pin) if own else None, items)


def blocks_of(pos: int, block: int) -> int:
    return -(-pos // block)


def block_keys(key: str, tokens: list[int] | tuple[int, ...], cuts: list[int] | tuple[int, ...],
               block: int = BLOCK_TOKENS) -> list[str]:
    """The names of the blocks of a state of ``tokens`` (their number is the position, one of
    ``cuts``, the call ends): block ``i`` is named by a hash of ``key`` (the model's) and the tokens
    up to the first call end at or past its last row, the prefix its rows depend on."""
    pos = len(tokens)
    ends = sorted(c for c in set(cuts) | {pos} if 0 < c <= pos)
    h = new_hasher(PACK_ALGORITHM)
    h.update(key.encode())
    digest, at, names, e = {}, 0, [], 0
    for i in range(blocks_of(pos, block)):
        last = min((i + 1) * block, pos)
        while ends[e] < last:
            e += 1
        end = ends[e]
        if end not in digest:
            h.update(memoryview(torch.tensor(tokens[at:end], dtype=torch.int64).numpy()))
            at = end
            digest[end] = h.hexdigest()
        names.append(f"{digest[end]}-{i}-{last - i * block}")
    return names


@dataclass
class SequenceState:
    """The state of one sequence after ``tokens`` (the position is their number): ``blocks``, the
    slots of its blocks in ``pools.blocks`` (block ``i`` holds rows ``[i * pools.block, ...)``),
    ``own`` its slot in ``pools.own`` (None: no such layers). ``cuts``: where a fresh session's calls
    end within ``tokens`` (``PrefixReuse.cuts``), the positions a truncatable state can be cut back to.
    ``ready``: events of the copies out of the device still running (a side stream's)."""

    tokens: tuple[int, ...]
    cuts: tuple[int, ...]
    blocks: list[int]
    own: int | None
    pools: StatePools
    ready: list = field(default_factory=list, repr=False)

    @property
    def pos(self) -> int:
        return len(self.tokens)

    def cut(self, pos: int) -> "SequenceState":
        """A truncatable state (``truncatable``) cut back to ``pos``, one of its cuts."""
        blocks = self.blocks[:blocks_of(pos, self.pools.block)]
        return SequenceState(self.tokens[:pos], tuple(c for c in self.cuts if c <= pos), blocks, self.own, self.pools,
                             self.ready)


class Copier:
    """Copies out of the device on a side stream of its own (on a GPU), ordered after the work
    queued so far; ``event`` marks their end. On the CPU the copies are done when it returns."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.device = device

    @contextlib.contextmanager
    def side(self):
        if self.stream is None:
            yield None
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield self.stream

    def event(self):
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


def copy_blocks_out(cache: Cache, pools: StatePools, pairs: list[tuple[int, int]], pos: int) -> None:
    """Copy blocks of the cache's rows (before ``pos``) into slots: ``pairs`` (block index, slot),
    ascending; consecutive blocks in consecutive slots go in one copy per tensor."""
    for il, la in enumerate(cache.layers):
        kind = kind_of(la)
        if kind.paged:
            for b0, s0, n in _runs(pools.blocks, pairs):
                row0 = b0 * pools.block
                kind.copy_out(la, row0, min(n * pools.block, pos - row0), pools.block_tensors(il, s0, n))


def take_own(cache: Cache, pools: StatePools, slot: int, pos: int, saved: list | None) -> None:
    """The layers' own states at ``pos`` into ``slot`` (``saved``: the ``StateCheckpoints`` copy
    there, for recurrent states and rings that moved past it)."""
    for il, la in enumerate(cache.layers):
        kind = kind_of(la)
        if not kind.paged:
            kind.take(la, pos, saved[il] if saved is not None else None, pools.own_tensors(il, slot))


def _runs(pool: SlotPool, pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first block, first slot, length) of runs of consecutive blocks in consecutive slots."""
    out: list[tuple[int, int, int]] = []
    for b, s in pairs:
        if out and out[-1][0] + out[-1][2] == b and out[-1][1] + out[-1][2] == s and s % pool.per_slab \
                and out[-1][2] < RUN_BLOCKS:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((b, s, 1))
    return out


def restore(state: SequenceState, cache: Cache, device: torch.device, dtype: torch.dtype) -> None:
    """Put ``state`` into ``cache``'s own buffers and set its position: the cache then holds what
    it held when ``state`` was taken (rows past it are masked, and a ring vouches only for the
    restored window). On a GPU the copies are queued behind those out of the device that filled
    the slots; the host does not wait. ``dtype``: the activations' (what attention reads)."""
    if device.type == "cuda":
        for event in state.ready:
            torch.cuda.current_stream(device).wait_event(event)
    cache.reset()
    pos, pools = state.pos, state.pools
    pairs = list(enumerate(state.blocks))
    for il, la in enumerate(cache.layers):
        kind = kind_of(la)
        if kind.paged:
            j, _ = pools.items[il]
            shape, _ = pools.blocks.layout[j]
            like = torch.empty((1, shape[0], shape[2]), dtype=dtype, device=device)
            la.reserve(pos, like)
            for b0, s0, n in _runs(pools.blocks, pairs):
                row0 = b0 * pools.block
                kind.copy_in(la, row0, min(n * pools.block, pos - row0), pools.block_tensors(il, s0, n))
        elif state.own is not None:
            kind.put(la, pools.own_tensors(il, state.own), pos, device, dtype)
    cache.pos = cache.high = pos
    for la in cache.layers:
        if isinstance(la, KVCache) and la.ring:
            la.since = max(0, pos - la.window + 1)



