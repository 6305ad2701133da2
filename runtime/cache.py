"""Per-sequence state carried between forward calls: KV caches and DeltaNet recurrent state.

One ``Cache`` per conversation. Attention layers append keys/values; linear-attention layers
replace their conv window and recurrent matrix. ``pos`` is the number of tokens already seen, so a
forward call knows the positions of its new tokens without being told.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from sparkpack.formats.memory import KV_BYTES_PER_VALUE, window_rows

from .pinned import pinned_empty, pinned_like


def prefill_rows(pos0: "int | torch.Tensor", T: int) -> int | None:
    """The KV rows a call of ``T`` tokens from position ``pos0`` can attend to: ``pos0 + T`` for
    several tokens at a known position (a prefill call reads no more); None, the whole buffer, for
    one token or a position held on the device (a captured step, whose shapes must not depend on
    the position)."""
    return pos0 + T if T > 1 and not isinstance(pos0, torch.Tensor) else None


class KVCache:
    """Keys and values of one attention layer in preallocated buffers ``[H_kv, rows, head_dim]``
    whose row ``i`` (of each head) holds position ``i``. Head-major, so each head's keys are one
    contiguous matrix that attention multiplies in place (position-major buffers had to be
    permuted into a copy of the whole buffer, twice per layer and token).

    Attention always runs over the whole buffer with a position mask (rows past the sequence are
    masked out), so a decode step has the same shapes at every position: that is what lets the
    CUDA graph of a step be replayed, and eager and replayed steps run the very same kernels. The
    buffer doubles when a sequence outgrows it (eager calls only; a captured step is given a
    buffer of its full context up front).

    A sliding-window layer (``window > 0``) holds a ring instead: position ``j`` in row
    ``j % rows``, with ``rows`` the window plus the longest call (``formats.memory.window_rows``;
    ``calls``: the most rows one call writes). Why: Laguna's 30 sliding layers of 40 held every
    key of a 128k context, 15 GiB of a 20 GiB cache, to read the last 512 (a ring of 2560 rows
    holds 0.3 GiB). The kernels map positions to rows (``ring``), visiting positions in the
    order the whole buffer would, so a ring gives the whole buffer's bits. Rows of positions a
    window has passed are overwritten: going back to such a position takes a copy of its window
    (``StateCheckpoints``). Until the ring fills, its rows are the positions, as in a buffer.

    ``kv_type="q8_0"`` stores int8 codes with one f16 scale per 32 values (ggml's Q8_0: 34 bytes
    per 32 values instead of 64 in bf16) and expands the layer's buffers for each attention call.
    It halves the cache for long contexts at a small cost in accuracy; ``auto`` keeps keys and
    values in the activations' dtype.
    """

    def __init__(self, capacity: int = 256, kv_type: str = "auto", window: int = 0, calls: int = 1) -> None:
        if kv_type not in KV_TYPES:
            raise ValueError(f"KV cache type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
        self.window = window
        self.ring_rows = window_rows(window, calls) if window > 0 else 0
        self.capacity = capacity if window <= 0 else min(capacity, self.ring_rows)
        self.q8 = kv_type == "q8_0"
        self.k: torch.Tensor | None = None  # int8 codes with q8_0
        self.v: torch.Tensor | None = None
        self.k_scale: torch.Tensor | None = None  # q8_0: f16 [H_kv, capacity, d / 32]
        self.v_scale: torch.Tensor | None = None
        self.dtype: torch.dtype | None = None  # what attention reads (the activations' dtype)
        self.since = 0  # the first position it still holds (grown: ``reserve``; gone back: ``Cache.rewind``)

    @property
    def ring(self) -> bool:
        """Whether positions map to rows modulo the buffer's rows (a sliding-window layer)."""
        return self.window > 0

    @property
    def rows(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    @property
    def room(self) -> float:
        """Positions the buffers take before they must grow (before the first ``reserve``: what it
        allocates): any for a ring at its full size, which wraps."""
        rows = self.rows if self.k is not None else self.capacity
        return math.inf if self.ring and rows >= self.ring_rows else rows

    def fits(self, n: int, call: int = 1) -> bool:
        """Whether ``reserve(n, like, call)`` would leave the buffers as they are."""
        return self.k is not None and self.rows >= (min(n, self._ring_for(call)) if self.ring else n)

    def _ring_for(self, call: int) -> int:
        """The rows a ring needs for calls of up to ``call`` rows (those it was sized for, at least)."""
        return max(self.ring_rows, window_rows(self.window, call))

    def reserve(self, n: int, like: torch.Tensor, call: int = 1) -> None:
        """Make room for positions up to ``n`` written by calls of up to ``call`` rows (buffers
        shaped and typed after ``like [T, H_kv, d]``). A ring grows only when such a call needs
        more rows than it has; once wrapped, it keeps the window before ``n - call`` (the first
        position of the call it grows for): its other rows may hold positions past that of a
        sequence gone back from, which would land on rows of earlier positions."""
        if self.fits(n, call):
            return
        ring = self._ring_for(call) if self.ring else 0
        need = min(n, ring) if self.ring else n
        cap = max(self.capacity, 1)
        while cap < need:
            cap *= 2
        wrapped = self.ring and self.k is not None and self.rows >= self.ring_rows  # positions past rows: modulo
        if self.ring:
            cap = min(cap, ring)
            self.ring_rows = ring
        H, d = like.shape[1], like.shape[2]
        if self.q8 and d % Q8_BLOCK:
            raise ValueError(f"a q8_0 KV cache needs a head size that is a multiple of {Q8_BLOCK}, not {d}")
        grown = [like.new_zeros((H, cap, d), dtype=torch.int8 if self.q8 else like.dtype) for _ in range(2)]
        if self.q8:
            grown += [like.new_zeros((H, cap, d // Q8_BLOCK), dtype=torch.float16) for _ in range(2)]
        old = [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]
        if wrapped:  # the window before the call, each position to its row in the larger ring
            self.since = max(self.since, n - call - self.window + 1)
            at = torch.arange(self.since, max(0, n - call), device=old[0].device)
            for new, prev in zip(grown, old):
                new[:, at % cap] = prev[:, at % prev.shape[1]]
        else:
            for new, prev in zip(grown, old):
                new[:, : prev.shape[1]] = prev
        self.k, self.v = grown[0], grown[1]
        if self.q8:
            self.k_scale, self.v_scale = grown[2], grown[3]
        self.capacity, self.dtype = cap, like.dtype

    def append(self, k: torch.Tensor, v: torch.Tensor, pos0: "int | torch.Tensor") -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys/values ``[T, H_kv, d]`` at positions ``pos0..pos0+T-1`` (``pos0`` an
        int, or a device scalar inside a captured step) and return the whole buffers ``[H_kv, S, d]``
        (with q8_0: expanded to the activations' dtype, a transient of one layer's size)."""
        T = k.shape[0]
        if not isinstance(pos0, torch.Tensor):
            self.reserve(pos0 + T, k, T)
        new = [k.transpose(0, 1), v.transpose(0, 1)]
        dest = [self.k, self.v]
        if self.q8:
            (kq, ks), (vq, vs) = quantize_q8_0(new[0]), quantize_q8_0(new[1])
            new, dest = [kq, vq, ks, vs], dest + [self.k_scale, self.v_scale]
        at = (pos0 + torch.arange(T, device=k.device)) % self.rows if self.ring else None
        for buf, rows in zip(dest, new):
            if at is not None or isinstance(pos0, torch.Tensor):
                buf.index_copy_(1, at if at is not None else pos0 + torch.arange(T, device=k.device), rows)
            else:
                buf[:, pos0: pos0 + T] = rows
        return self.buffers(prefill_rows(pos0, T))

    def buffers(self, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers ``[H_kv, S, d]`` in the activations' dtype (q8_0: expanded, a
        transient of one layer's size); ``rows``: only the rows of positions before it (those a
        prefill call reads), which are the first rows of a buffer and any rows of a ring (all given)."""
        if self.ring:
            rows = None
        k, v = (self.k, self.v) if rows is None else (self.k[:, :rows], self.v[:, :rows])
        if self.q8:
            ks, vs = (self.k_scale, self.v_scale) if rows is None else (self.k_scale[:, :rows], self.v_scale[:, :rows])
            return dequantize_q8_0(k, ks, self.dtype), dequantize_q8_0(v, vs, self.dtype)
        return k, v

    def holds(self, first: int, end: int) -> bool:
        """Whether the rows of positions ``[first, end)`` are still those positions' (a ring keeps
        its last ``rows`` positions before ``end``, from ``since`` on; a buffer keeps every one)."""
        return not self.ring or first >= max(end - self.rows, self.since)

    def state(self) -> list[torch.Tensor]:
        """The tensors a window's copy takes rows of (codes and scales with q8_0)."""
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]


KV_TYPES = tuple(KV_BYTES_PER_VALUE)  # auto: the activations' dtype (bf16 on a GPU); q8_0
Q8_BLOCK = 32


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., d]`` -> int8 codes ``[..., d]`` and f16 scales ``[..., d / 32]``: ggml's Q8_0 rule
    (scale = max |x| / 127 per block of 32, code = round(x / scale)), kept as two tensors so that
    a captured step writes them with plain indexed copies."""
    blocks = x.float().unflatten(-1, (-1, Q8_BLOCK))
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = torch.round(blocks * inv).clamp_(-127, 127).to(torch.int8)
    return codes.flatten(-2), scale.squeeze(-1).to(torch.float16)


def dequantize_q8_0(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    blocks = codes.unflatten(-1, (-1, Q8_BLOCK)).to(torch.float32) * scale.float()[..., None]
    return blocks.flatten(-2).to(dtype)


@dataclass
class RecurrentState:
    """Gated DeltaNet state of one layer: the last ``kernel-1`` conv inputs ``[K-1, C]`` and the
    per-head key->value memory ``[H_v, d_k, d_v]`` (None until the first token; afterwards
    updated in place, so a captured decode step keeps reading the same memory, and the fused
    decode kernels find them by address: ``runtime.device_tables``)."""

    conv: torch.Tensor | None = None
    ssm: torch.Tensor | None = None


@dataclass
class Cache:
    """``high``: one past the last position written since the sequence last went back (padding
    included), as the session tells it (``wrote``). A ring holds its last ``rows`` positions
    before ``high`` from its ``since`` on (``keeps``): going back (``rewind``, or a window copy
    restored: ``StateCheckpoints.restore``) moves ``since`` past the positions whose rows the
    sequence gone back from overwrote."""

    layers: list[KVCache | RecurrentState] = field(default_factory=list)
    pos: int = 0
    high: int = 0

    def reset(self) -> None:
        """Start a new sequence in the same buffers (a captured decode step stays valid): KV rows
        past ``pos`` are masked anyway; recurrent state is zeroed in place."""
        self.pos = self.high = 0
        for layer in self.layers:
            if isinstance(layer, KVCache):
                layer.since = 0
            if isinstance(layer, RecurrentState):
                for t in (layer.conv, layer.ssm):
                    if t is not None:
                        t.zero_()

    def wrote(self, end: int) -> None:
        """Rows up to position ``end`` (exclusive) were written, padding included."""
        self.high = max(self.high, end)

    def rewind(self, pos: int) -> None:
        """Go back to position ``pos`` keeping the rows before it (a buffer's all, a ring's those
        the positions written past ``pos`` did not overwrite). Why ``high`` goes back too: kept as
        the longest sequence's end, it made a ring vouch only for positions near that end, so after
        a long conversation a shorter one never kept its windows (0 tokens reused turn after turn)."""
        end = max(self.high, self.pos)
        for la in self.layers:
            if isinstance(la, KVCache) and la.ring and la.k is not None:
                la.since = min(pos, max(la.since, end - la.rows))
        self.pos = self.high = pos

    @property
    def windowed(self) -> bool:
        """Whether some layer keeps a ring (``KVCache.ring``)."""
        return any(isinstance(la, KVCache) and la.ring for la in self.layers)

    def keeps(self, k: int) -> bool:
        """Whether every ring still holds the window before position ``k <= pos`` (the positions a
        token at ``k`` reads), so the sequence can go back to ``k`` without a copy."""
        end = max(self.high, self.pos)
        for la in self.layers:
            if isinstance(la, KVCache) and la.ring:
                first = max(0, k - la.window + 1)
                if first < k and not la.holds(first, end):
                    return False
        return True



class RowStates:
    """The DeltaNet states after each row of a verify step (``MoEModel.decode_run`` with
    ``states``): row ``i``'s copy is the state a sequence keeps when it keeps the step's first
    ``i + 1`` tokens (``Session.keep``). Device buffers, written inside the step (a captured one
    too: their addresses never change; with the fused kernels by the launch that computes the
    rows, ``runtime.device_tables``), one slot per row but the last (all rows kept: the live
    state is the answer).

    Why copies per row rather than restoring the state from before the step and running the kept
    rows again: a Qwen3.6 state is 30 layers of ``[32, 128, 128]`` float32 (about 60 MB), a copy
    per row a device-to-device copy of that, far less than a second pass of the model over the
    kept rows, which most verify steps would need (a draft is rarely kept whole). Attention rows
    and sliding-window rings need nothing: rows past the kept length are masked, then
    overwritten, and a ring holds a whole call's rows more than its window (``Cache.rewind``)."""

    def __init__(self, cache: "Cache", rows: int):
        self.rows = rows
        self.conv: dict[int, torch.Tensor] = {}
        self.ssm: dict[int, torch.Tensor] = {}
        for il, la in enumerate(cache.layers):
            if isinstance(la, RecurrentState) and la.conv is not None:
                self.conv[il] = la.conv.new_empty((rows, *la.conv.shape))
                self.ssm[il] = la.ssm.new_empty((rows, *la.ssm.shape))

    def fits(self, cache: "Cache", rows: int) -> bool:
        """Whether these buffers serve a step of ``rows`` rows on ``cache``'s states."""
        return rows - 1 <= self.rows and all(
            il in self.conv for il, la in enumerate(cache.layers) if isinstance(la, RecurrentState))

    def save(self, il: int, row: int, state: RecurrentState) -> None:
        """Layer ``il``'s state after row ``row`` of the step (the last row's is not kept)."""
        if row < self.rows:
            self.conv[il][row].copy_(state.conv)
            self.ssm[il][row].copy_(state.ssm)

    def restore(self, cache: "Cache", row: int) -> None:
        """Put the states after row ``row`` back into ``cache``'s own tensors."""
        for il, conv in self.conv.items():
            la = cache.layers[il]
            la.conv.copy_(conv[row])
            la.ssm.copy_(self.ssm[il][row])


# Recurrent-state checkpoints a session keeps by default. A Qwen3.6-35B-A3B one holds 30 DeltaNet
# layers' states, at most 66 MB (formats.memory.recurrent_state_bytes; 4 bytes a value); the
# warm-up allocates the nine buffers they take (one more is saved before the drop), about 0.6 GB
# of pinned host memory.
STATE_CHECKPOINTS = 8


class StateCheckpoints:
    """Copies of a ``Cache``'s recurrent states (and rings' windows) at some positions, to go back
    to one of them.

    Why: a DeltaNet state is overwritten in place token after token, so unlike a KV cache (whose
    position only has to be rewound) it cannot return to an earlier prefix; a request that shares
    a prefix with the previous one restores the copy at or before it and computes from there
    (``runtime.generate.Session.prompt``). A sliding-window layer's ring has the same trouble once
    it has wrapped past a position: its copy is the ``window - 1`` rows before it (Laguna: 30
    layers, 60 MB in bf16). The copies live in host memory (pinned on a GPU, where
    they are copied without the host waiting), so the ``--vram`` plan does not count them. At
    most ``limit`` are kept; past it the one whose loss leaves the smallest gap between its
    neighbours goes (never the newest), so old prefixes stay reachable at a coarser spacing."""

    def __init__(self, limit: int = STATE_CHECKPOINTS):
        self.limit = limit
        self.protect: set[int] = set()  # positions never dropped (a session's marks: ``Session.prompt``)
        self.saved: dict[int, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}
        self._spare: list[list[tuple[torch.Tensor, torch.Tensor] | None]] = []  # host buffers to reuse

    @property
    def positions(self) -> list[int]:
        return sorted(self.saved)

    @property
    def spare(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor] | None], ...]:
        """The host buffers reserved for the next copies (``reserve``)."""
        return tuple(self._spare)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for copy in self.saved.values() for pair in copy if pair is not None for t in pair)

    @property
    def host_bytes(self) -> int:
        """The host memory every copy it holds takes, saved or spare (``reserve``)."""
        return self.nbytes + sum(t.nbytes for copy in self._spare for pair in copy if pair is not None for t in pair)

    def reserve(self, cache: Cache) -> None:
        """Allocate every host buffer the copies can take (``limit + 1``: one more is saved
        before the drop) now, while loading. Why: pinned host memory is slow to allocate, and a
        first long Qwen3.6 prompt saving a copy after each of its calls spent several times
        longer outside its calls than once reserved (bench/turn_profile.py). Nothing is reserved with checkpoints off (``limit``
        0: calibration's sessions) or before the states exist (their shapes are known from the
        first token on)."""
        if self.limit <= 0 or any(isinstance(la, RecurrentState) and la.conv is None
                                  or isinstance(la, KVCache) and la.ring and la.k is None for la in cache.layers):
            return
        while len(self.saved) + len(self._spare) < self.limit + 1:
            self._spare.append(self._new_copy(cache))

    def _new_copy(self, cache: Cache) -> list[tuple[torch.Tensor, ...] | None]:
        return [_host_copy(la) for la in cache.layers]

    def save(self, cache: Cache, pos: int | None = None) -> None:
        """Copy the states as they are at ``pos`` (default ``cache.pos``; a ring's window may be of
        an earlier position it still holds), queued behind the computation on a GPU."""
        pos = cache.pos if pos is None else pos
        for copy in self.take(cache, [pos]).values():
            for il in range(len(cache.layers)):
                self.copy_layer(copy, cache, il, pos)

    def take(self, cache: Cache, positions: list[int]) -> dict[int, list]:
        """Host copies for the states at ``positions`` (ascending, past the saved ones: the ends
        of a group of calls, ``MoEModel.forward_calls``), which the caller fills layer by layer
        (``copy_layer``) as each call's block of a layer is launched. The copies are those saving
        them one after another would keep: what that would drop goes now, or is never taken."""
        if self.limit <= 0:
            return {}
        kept = sorted(self.saved)
        for p in positions:
            if p not in kept:
                kept = sorted(kept + [p])
                if len(kept) > self.limit:
                    kept.remove(_victim(kept, self.protect))
        for p in [p for p in self.saved if p not in kept]:
            self._spare.append(self.saved.pop(p))
        new = {}
        for p in positions:
            if p in kept and p not in self.saved:
                new[p] = self.saved[p] = self._spare.pop() if self._spare else self._new_copy(cache)
        return new

    def copy_layer(self, copy: list, cache: Cache, il: int, pos: int) -> None:
        """Copy layer ``il``'s state (a recurrent one, or a ring's window before ``pos``) into
        ``copy`` from ``take``."""
        layer = cache.layers[il]
        if copy[il] is None:  # a copy taken before the states existed (a fresh session's first call)
            copy[il] = _host_copy(layer)
        if isinstance(layer, RecurrentState) and layer.conv is not None:
            copy[il][0].copy_(layer.conv, non_blocking=True)
            copy[il][1].copy_(layer.ssm, non_blocking=True)
        elif copy[il] is not None:  # a ring
            rows = _window_rows(layer, pos)
            for host, t in zip(copy[il], layer.state()):
                host[:, : rows.numel()].copy_(t[:, rows], non_blocking=True)

    def restore(self, cache: Cache, pos: int) -> None:
        """Put the states saved at ``pos`` back into ``cache``'s own tensors (a captured decode step
        keeps reading them) and set ``cache.pos``; position 0 needs no copy (zero states)."""
        if pos == 0:
            cache.reset()
            return
        for saved, layer in zip(self.saved[pos], cache.layers):
            if saved is None:
                continue
            if isinstance(layer, RecurrentState):
                layer.conv.copy_(saved[0], non_blocking=True)
                layer.ssm.copy_(saved[1], non_blocking=True)
            else:
                rows = _window_rows(layer, pos)
                for host, t in zip(saved, layer.state()):
                    t[:, rows] = host[:, : rows.numel()].to(t.device, non_blocking=True)
        cache.pos = cache.high = pos
        for la in cache.layers:  # the rings' other rows hold another sequence's positions
            if isinstance(la, KVCache) and la.ring:
                la.since = max(0, pos - la.window + 1)

    def discard_after(self, pos: int) -> None:
        """Forget the copies past ``pos`` (the sequence changed there)."""
        for p in [p for p in self.saved if p > pos]:
            self._spare.append(self.saved.pop(p))


def _victim(pos: list[int], protect: set[int] = frozenset()) -> int:
    """Which of the saved positions ``pos`` (ascending, more than allowed) goes: an interior one
    not in ``protect``, scored by the gap its removal leaves (the first of two or fewer)."""
    free = [i for i in range(1, len(pos) - 1) if pos[i] not in protect]
    if not free:
        return pos[0]
    return pos[min(free, key=lambda i: pos[i + 1] - pos[i - 1])]


def _host_like(t: torch.Tensor) -> torch.Tensor:
    return pinned_like(t, pin=t.is_cuda)


def _host_copy(layer: KVCache | RecurrentState) -> tuple[torch.Tensor, ...] | None:
    """Host buffers for one layer's state: a recurrent one, or ``window - 1`` rows of each of a
    ring's tensors; None for a layer with none (yet)."""
    if isinstance(layer, RecurrentState):
        return None if layer.conv is None else (_host_like(layer.conv), _host_like(layer.ssm))
    if not layer.ring or layer.k is None:
        return None
    return tuple(pinned_empty(t.shape[0] * (layer.window - 1) * math.prod(t.shape[2:]) * t.element_size(), t.is_cuda)
                 .view(t.dtype).view(t.shape[0], layer.window - 1, *t.shape[2:]) for t in layer.state())


def _window_rows(layer: KVCache, pos: int) -> torch.Tensor:
    """The ring rows of the positions a token at ``pos`` reads before itself."""
    return torch.arange(max(0, pos - layer.window + 1), pos, device=layer.k.device) % layer.rows
