"""Decode attention (one new token) in three launches instead of ~50 small torch kernels.

Why: at batch 1 an attention layer's arithmetic between its projections and ``attn_output`` is
tiny (one query row per head against the cached keys), so the torch form's cost is its kernel
count: the q/k RMSNorms (seven launches each), RoPE's cos/sin rebuilt every layer, the rotation
(slices, negation, concatenation), the KV append (``index_copy_`` of keys and values), the GQA
scores over the whole KV buffer, the position mask, the softmax, probabilities times values, the
permute back and the output gate. Three kernels cover all of it:

1. ``qk_norm_rope_append_kernel``: one program per head row (per token, H query rows, then H_kv
   key rows): per-head RMSNorm (statistic in float32), NEOX rope over the first ``rope_dim``
   channels with the angle ``pos * inv_freq`` formed in float32 as ``Rope.cos_sin`` does, then the
   query row is stored to a contiguous ``[H, d]`` and the key row, with the value row as it is, to
   row ``pos`` of the head-major caches (``KVCache``'s ``[H_kv, capacity, d]``). A prefill call
   takes it too, for all its tokens at once (~30 torch launches a layer there), and attends with
   ``runtime.layers.attend_buffers`` (batched GEMMs, as before).
2. ``attend_split_kernel`` (flash-decoding): one program per (kv head, ``split`` positions). The
   ``rep = H / H_kv`` query heads of the kv head are the rows of one tile (padded to 16 for
   ``tl.dot``), so each key and value is read once per kv head, not once per query head. Tiles
   of ``BLOCK_S`` positions feed an online softmax (running max, sum and a float32 accumulator);
   the partial (max, sum, accumulator) goes to float32 scratch. The grid covers the whole buffer
   capacity, so it never depends on the position and a captured CUDA graph replays it at any
   position: programs whose range lies wholly past ``pos`` (or before the sliding window) write
   an empty partial and read no keys or values.
3. ``attend_combine_kernel``: one program per (query head, 32 channels) merges the partials of
   the splits that hold allowed positions (the range follows from ``pos`` and the window, also
   read from memory in a graph), divides by the softmax sum, applies the output gate (sigmoid per
   channel for Qwen3.5/3.6, softplus per head or per channel for Laguna) and stores ``[H * d]``.
   Splitting the channels too keeps the merge from setting the pace on long buffers (one program
   per head read its head's partials alone, serially).

``split`` trades the first kernel's parallelism against the partials to merge; ``decode_split``
picks it from the buffer's capacity and kv heads (the caller's default), and long buffers also
take wider, pipelined tiles (``_split_tiles``): over a long buffer, long splits of pipelined
tiles beat short single-stage ones for every shape tried (BENCHMARKS.md).

4. ``attend_prefill_kernel`` (``attend_prefill``): a prefill call's queries whose first position
   is read from memory, for a prefill step captured in a CUDA graph (``runtime.graph``), where
   neither torch's fused attention nor the sliced buffers of ``attend_buffers`` can be used (both
   need the position on the host). Flash-attention style: one program per (kv head, block of
   tokens), the ``rep`` query heads of each token as rows of the tile (each key and value read
   once per kv head and block), an online softmax over tiles of keys up to the block's last
   position (from the window's start where there is one), the same mask.

A Q8_0 KV cache (``--kv-type q8_0``: int8 codes, one f16 scale per 32 values) is read and
written in place: the first kernel quantizes the new key and value rows by ``runtime.cache``'s
rule, the split kernel expands each tile in registers (code times scale, rounded to the
activation dtype as ``dequantize_q8_0`` rounds), so no expanded copy of the cache is made (the
torch form expands the layer's whole buffer every token).

The three decode kernels take their rows from a table (``KVRows``, ``kv_rows``): per row, its
sequence's key and value buffers (addresses, int64, cast to pointers in the kernel), their rows
and its position (read from device memory). One launch of each serves every row of a batched
decode step (``*_rows``: B sequences at their own positions, or a verify step's rows of one
sequence at consecutive positions, all appended before any attends, each masked to its own
position), one program per (row, head[, split]) running the one-row program on its row; a single
step is a one-row table through the same compiled kernels (the row count is the grid's, and
nothing the batch sets is a specialized argument), so no row's bits can depend on the batch. A
row's split follows from its own buffer (``decode_split``): rows of other splits take a launch
pair per split. Why: a batched step is launch-bound, and a launch per row per layer made B rows
cost nearly B steps (BENCHMARKS.md, issue 46).

A sliding-window layer's ring (``ring=True``, ``runtime.cache.KVCache``: the window and the
longest call's rows, not the whole context) maps position p to row ``p % S`` in all four
kernels. The decode splits then count from the split of ``WINDOW_ALIGN`` positions holding the
window's first, so a ring's partials are those of the whole buffer split at 64 (the same
splits, merged in the same order): the same bits.

The mask is ``runtime.layers.attend_positions``'s (``j <= pos`` and, with a window, ``pos - j < window``),
applied to the loads, so rows past the position may hold anything. ``pos`` is a Python int or a
0-dim integer device tensor: a captured step reads its position from memory, never on the host.
Everything runs in float32 inside, with one rounding to the activation dtype at each output
(and, for bf16/f16 on a GPU, the probabilities rounded to that dtype before they meet the values,
as the torch path does too); the torch path rounds at more places (normed and roped q/k, the
gate), so the two agree to the activation dtype's precision, not bit for bit. The products are
``tl.dot`` tiles: half precision operands with float32 accumulation for bf16/f16 on a GPU,
float32 operands (exact ``ieee`` products, no TF32) for float32 activations and in Triton's
interpreter, which gets bf16 ``tl.dot`` wrong. The torch path stays the reference (CPU, prefill).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sparkpack.formats.memory import WINDOW_ALIGN

from .. import device_tables
from . import pdl
from .pdl import prefetch_l2, wait_prior
from .q8dot import QBLOCK, Int8Rows, as_rows, new_q8, store_q8

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GATE_KINDS = {"none": 0, "sigmoid": 1, "softplus_head": 2, "softplus": 3}
LOG2E = 1.4426950408889634
COMBINE_CHANNELS = 32  # channels per combine program: H programs alone were half as fast at 32k positions
COMBINE_SPLITS = 64  # partials merged per combine step
# A row table's int64 columns (``KVRows``): the key, value, key scale and value scale buffers'
# addresses, their rows S, and the batch row the table row serves.
ROW_FIELDS = tl.constexpr(6)


@triton.jit
def _position(pos, POS_PTR: tl.constexpr):
    """The token's position as int64: read from memory (a captured step) or given by value."""
    if POS_PTR:
        p = tl.load(pos).to(tl.int64)
    else:
        p = pos.to(tl.int64)
    return p


@triton.jit
def _norm_rope(x_ptr, w_ptr, inv_ptr, p, D, HALF, eps, rope_scale, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr):
    """One head row in float32: RMSNorm (when HAS_W), then NEOX rope of its first 2*HALF channels.
    Channel i < HALF pairs with i + HALF; the partner is read again from memory rather than moved
    across registers (the row is in L1 already)."""
    n = tl.arange(0, BLOCK_D)
    m = n < D
    rot = n < 2 * HALF
    first = n < HALF
    mate = tl.where(first, n + HALF, n - HALF)
    x = tl.load(x_ptr + n, mask=m, other=0.0).to(tl.float32)
    xm = tl.load(x_ptr + mate, mask=rot, other=0.0).to(tl.float32)
    if HAS_W:
        r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        x = x * r * tl.load(w_ptr + n, mask=m, other=0.0).to(tl.float32)
        xm = xm * r * tl.load(w_ptr + mate, mask=rot, other=0.0).to(tl.float32)
    angle = p.to(tl.float32) * tl.load(inv_ptr + tl.where(first, n, n - HALF), mask=rot, other=0.0)
    c = tl.cos(angle) * rope_scale
    s = tl.sin(angle) * rope_scale
    return tl.where(rot, x * c + tl.where(first, -xm, xm) * s, x)


@triton.jit
def _store_row(c_ptr, s_ptr, row, y, inside, D, Q8KV: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store one head row ``y`` (float32, already rounded to the activation dtype) at element
    ``row`` of a cache: as it is, or as Q8_0 codes with one f16 scale per 32 (``s_ptr``; the rule
    of ``runtime.cache.quantize_q8_0``: scale = max|x| / 127, code = round half to even)."""
    n = tl.arange(0, BLOCK_D)
    width = tl.where(inside, D, 0)  # a position past the buffer writes nothing
    ok = n < width
    if Q8KV:
        blocks = tl.reshape(y, [BLOCK_D // 32, 32])
        scale = tl.max(tl.abs(blocks), axis=1) / 127.0
        inv = tl.where(scale > 0, 1.0 / tl.where(scale > 0, scale, 1.0), 0.0)
        v = blocks * inv[:, None]
        r = tl.floor(v + 0.5)
        r = tl.where(((r - v) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0), r - 1.0, r)  # ties to even
        code = tl.reshape(tl.minimum(tl.maximum(r, -127.0), 127.0), [BLOCK_D])
        tl.store(c_ptr + row + n, code.to(tl.int8), mask=ok)
        b = tl.arange(0, BLOCK_D // 32)
        tl.store(s_ptr + row // 32 + b, scale.to(s_ptr.dtype.element_ty), mask=b * 32 < width)
    else:
        tl.store(c_ptr + row + n, y.to(c_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _kv_row(tab_ptr, r, act_ptr, Q8KV: tl.constexpr):
    """Row ``r`` of a row table (``KVRows.table``): its key and value buffers as pointers (int8
    codes, with f16 scale pointers, for a Q8_0 cache; else the activations' dtype, ``act_ptr``'s),
    the buffers' rows S and the row's batch row (its query, position, gate and output)."""
    e = tab_ptr + r.to(tl.int64) * ROW_FIELDS
    kc = tl.multiple_of(tl.load(e), 16)  # (torch's allocations are aligned: vectorized loads)
    vc = tl.multiple_of(tl.load(e + 1), 16)
    if Q8KV:
        kc = kc.to(tl.pointer_type(tl.int8))
        vc = vc.to(tl.pointer_type(tl.int8))
    else:
        kc = kc.to(tl.pointer_type(act_ptr.dtype.element_ty))
        vc = vc.to(tl.pointer_type(act_ptr.dtype.element_ty))
    ks = tl.multiple_of(tl.load(e + 2), 16).to(tl.pointer_type(tl.float16))
    vs = tl.multiple_of(tl.load(e + 3), 16).to(tl.pointer_type(tl.float16))
    return kc, vc, ks, vs, tl.load(e + 4), tl.load(e + 5)


@triton.jit(do_not_specialize=["T", "pos_stride"])
def qk_norm_rope_append_kernel(q_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, inv_ptr, tab_ptr, pos_ptr, pos_stride, qo_ptr,
                                T, H, H_KV, D, HALF, stride_qt, stride_q, stride_kt, stride_k,
                                stride_vt, stride_v, eps, rope_scale,
                                HAS_QN: tl.constexpr, HAS_KN: tl.constexpr,
                                Q8KV: tl.constexpr, RING: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    t = tl.program_id(0) // (H + H_KV)  # token t of the call: the (t % T)-th of table row t // T
    r = tl.program_id(0) % (H + H_KV)
    kc_ptr, vc_ptr, ks_ptr, vs_ptr, S, row = _kv_row(tab_ptr, t // T, qo_ptr, Q8KV)
    p = tl.load(pos_ptr + row * pos_stride).to(tl.int64) + t % T
    n = tl.arange(0, BLOCK_D)
    m = n < D
    if r < H:
        y = _norm_rope(q_ptr + t.to(tl.int64) * stride_qt + r.to(tl.int64) * stride_q, qn_ptr, inv_ptr, p, D, HALF,
                       eps, rope_scale, HAS_QN, BLOCK_D)
        tl.store(qo_ptr + (t.to(tl.int64) * H + r) * D + n, y.to(qo_ptr.dtype.element_ty), mask=m)
    else:
        j = (r - H).to(tl.int64)
        y = _norm_rope(k_ptr + t.to(tl.int64) * stride_kt + j * stride_k, kn_ptr, inv_ptr, p, D, HALF, eps,
                       rope_scale, HAS_KN, BLOCK_D)
        if RING:  # a sliding-window layer's ring: position p in row p % S
            row = (j * S + p % S) * D
            inside = p >= 0
        else:
            row = (j * S + p) * D
            inside = (p >= 0) & (p < S)
        act = qo_ptr.dtype.element_ty  # Q8_0 quantizes k as the activations hold it
        _store_row(kc_ptr, ks_ptr, row, y.to(act).to(tl.float32), inside, D, Q8KV, BLOCK_D)
        v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + j * stride_v + n, mask=m, other=0.0).to(tl.float32)
        _store_row(vc_ptr, vs_ptr, row, v, inside, D, Q8KV, BLOCK_D)


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                  v_scale: torch.Tensor | None, act: torch.dtype, what: str) -> None:
    """Caches in the activations' dtype, or a Q8_0 cache's int8 codes with f16 scales per 32."""
    tensors = [k_cache, v_cache]
    if (k_scale is None) != (v_scale is None):
        raise ValueError(f"{what}: give both Q8_0 scale tensors or neither")
    if k_scale is None:
        if k_cache.dtype != act or v_cache.dtype != act:
            raise ValueError(f"{what}: caches must be in the activations' dtype ({act}), or Q8_0 codes with scales")
    else:
        H_kv, S, d = k_cache.shape
        if k_cache.dtype != torch.int8 or v_cache.dtype != torch.int8 or d % 32:
            raise ValueError(f"{what}: a Q8_0 cache holds int8 codes of a head size that is a multiple of 32")
        for s in (k_scale, v_scale):
            if s.shape != (H_kv, S, d // 32) or s.dtype != torch.float16 or s.device != k_cache.device:
                raise ValueError(f"{what}: Q8_0 scales must be f16 [{H_kv}, {S}, {d // 32}] beside the codes")
        tensors += [k_scale, v_scale]
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError(f"{what}: caches (and scales) must be contiguous")


class KVRows(NamedTuple):
    """The rows of one call of the decode kernels over KV caches: a batched decode step's sequences
    (one token each; any caches, a cache repeated at consecutive positions: a verify step's rows),
    or one sequence's call of T tokens. What a kernel reads per row is on the device: the
    buffers' addresses and rows in a table (``table``, made once per content by
    ``runtime.device_tables``), the positions in ``pos``. The host keeps what picks the launch:
    the buffers' rows (the grid, the split) and their common shape and type. Why a table rather
    than a launch per row: a batched step is launch-bound, and B rows cost B launches a layer."""

    entries: tuple[tuple[int, int, int, int, int], ...]  # per row: k, v, k scale, v scale addresses; rows S
    pos: torch.Tensor  # integer [B] on the device: each row's (first) position, any stride
    H_kv: int
    d: int
    dtype: torch.dtype  # the buffers' (int8 codes with Q8_0)
    q8: bool
    ring: bool  # sliding-window rings (position p in row p % S)
    wraps: tuple[bool, ...] = ()  # per row: its tokens pass the end of its buffer (known for int positions only)

    def table(self, rows: "Sequence[int] | range") -> torch.Tensor:
        """The int64 table ``[len(rows), ROW_FIELDS]`` of these rows (batch rows ``rows``)."""
        return device_tables.table(tuple((*self.entries[b], b) for b in rows), self.pos.device)


def kv_rows(caches: "Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]",
            pos: "Sequence[int | torch.Tensor] | torch.Tensor", ring: bool = False, T: int = 1,
            what: str = "kv_rows") -> KVRows:
    """``KVRows`` of row b's ``(k_cache, v_cache, k_scale, v_scale)`` (``[H_kv, S_b, d]`` each,
    contiguous; Q8_0 codes with f16 scales ``[H_kv, S_b, d / 32]``, or None, None: one kind for all
    rows) at position ``pos[b]``: ints, one-element integer device tensors (a captured step's,
    read at each replay), or one integer device tensor ``[B]``. ``T``: the tokens of each row
    (checked against S for int positions; a ring takes any position)."""
    if not len(caches) or (isinstance(pos, torch.Tensor) and pos.dim() != 1) or len(pos) != len(caches):
        raise ValueError(f"{what}: one position per row, and at least one row")
    k0 = caches[0][0]
    if k0.dim() != 3:
        raise ValueError(f"{what}: caches must be [H_kv, S, d], got {tuple(k0.shape)}")
    H_kv, _, d = k0.shape
    q8 = caches[0][2] is not None
    entries = []
    for k_cache, v_cache, k_scale, v_scale in caches:
        if k_cache.dim() != 3 or k_cache.shape[0] != H_kv or k_cache.shape[2] != d or v_cache.shape != k_cache.shape:
            raise ValueError(f"{what}: every row's caches must be [H_kv={H_kv}, S, d={d}], got "
                             f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
        if (k_scale is not None) != q8 or k_cache.dtype != k0.dtype or k_cache.device != k0.device:
            raise ValueError(f"{what}: every row's caches must be of one type and device")
        _check_caches(k_cache, v_cache, k_scale, v_scale, k0.dtype, what)
        ks, vs = _scales(k_scale, v_scale, k_cache)
        addresses = (k_cache.data_ptr(), v_cache.data_ptr(), ks.data_ptr(), vs.data_ptr())
        if any(a % 16 for a in addresses):  # (the kernels promise the compiler 16-byte aligned buffers)
            raise ValueError(f"{what}: KV buffers must start 16-byte aligned (fresh tensors do)")
        entries.append((*addresses, k_cache.shape[1]))
    wraps = tuple(not isinstance(p, torch.Tensor) and int(p) + T > e[4] for p, e in zip(pos, entries)) \
        if not isinstance(pos, torch.Tensor) else ()
    return KVRows(tuple(entries), _positions(pos, [e[4] for e in entries], k0.device, T, ring, what), H_kv, d,
                  k0.dtype, q8, ring, wraps)


def _scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, fill: torch.Tensor) -> tuple:
    """The two scale pointers a kernel takes (any tensor where there are none: never read)."""
    return (k_scale, v_scale) if k_scale is not None else (fill, fill)


def _positions(pos: "Sequence[int | torch.Tensor] | torch.Tensor", S: list[int], device: torch.device, T: int,
               ring: bool, what: str) -> torch.Tensor:
    """The rows' positions as one integer device tensor ``[B]`` without reading device memory: ints
    through a memoized table (one small copy per step), device scalars as the one tensor they are
    views of where they are (a captured step's inputs: no launch), else stacked."""
    def integer(t: torch.Tensor) -> bool:
        return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool) and t.device == device

    if isinstance(pos, torch.Tensor):
        if not integer(pos):
            raise ValueError(f"{what}: positions must be integers on {device}")
        return pos
    if not any(isinstance(p, torch.Tensor) for p in pos):
        for p, s in zip(pos, S):
            if not (0 <= int(p) and (ring or int(p) + T <= s)):
                raise ValueError(f"{what}: position {int(p) + T - 1} is outside the cache (capacity {s})")
        return device_tables.table(tuple(int(p) for p in pos), device)
    if not all(isinstance(p, torch.Tensor) and p.numel() == 1 and integer(p) for p in pos):
        raise ValueError(f"{what}: pos must be ints or one-element integer tensors on {device}")
    p0 = pos[0].reshape(())
    if len(pos) == 1:
        return p0.reshape(1)
    size = p0.element_size()
    step = (pos[1].data_ptr() - p0.data_ptr()) // size
    if step >= 0 and all(p.dtype == p0.dtype and p.untyped_storage().data_ptr() == p0.untyped_storage().data_ptr()
                         and p.data_ptr() == p0.data_ptr() + b * step * size for b, p in enumerate(pos)):
        return p0.as_strided((len(pos),), (step,))
    return torch.stack([p.reshape(()) for p in pos])


def _check_pos(pos: "int | torch.Tensor", S: int, device: torch.device, what: str, T: int = 1,
               ring: bool = False) -> bool:
    """Validate ``pos`` (the first of T positions) without reading device memory; True when it is a
    device scalar. A ring takes any position."""
    if isinstance(pos, torch.Tensor):
        if pos.numel() != 1 or pos.dtype.is_floating_point or pos.dtype.is_complex or pos.dtype == torch.bool \
                or pos.device != device:
            raise ValueError(f"{what}: pos must be an int or a one-element integer tensor on {device}")
        return True
    if not (0 <= int(pos) and (ring or int(pos) + T <= S)):
        raise ValueError(f"{what}: position {int(pos) + T - 1} is outside the cache (capacity {S})")
    return False


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, what: str) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or k.shape[2] != q.shape[2] or k.shape[0] != q.shape[0]:
        raise ValueError(f"{what}: expected q [(T,) H, d], k and v [(T,) H_kv, d], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in ACT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{what}: q, k, v must share one of bf16/f16/f32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError(f"{what}: q, k and v need a contiguous last axis")


def qk_norm_rope_append(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                        inv_freq: torch.Tensor, rope_scale: float, pos: "int | torch.Tensor",
                        k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None, ring: bool = False) -> torch.Tensor:
    """The new tokens' q/k RMSNorm, rope and KV append in one launch.

    q ``[H, d]``, k and v ``[H_kv, d]`` for one token, or ``[T, H, d]`` / ``[T, H_kv, d]`` for T
    tokens at positions ``pos .. pos+T-1``: contiguous last axis, any other strides (q may be the
    query half of a per-head [query | gate] projection); bf16, f16 or f32, all alike. ``q_norm`` and
    ``k_norm``: per-head RMSNorm weights ``[d]``, or None for no norm at all. ``inv_freq``: the
    float32 rope frequencies (``rope_dim / 2`` of them; channels past ``rope_dim`` pass through),
    ``rope_scale`` multiplies cos and sin. ``pos``: an int or a 0-dim integer device tensor.
    Writes k (normed, roped) and v to row ``pos`` of ``k_cache``/``v_cache`` ``[H_kv, S, d]``
    (contiguous, the activation dtype) and returns the normed, roped q, contiguous, shaped as q.
    With ``k_scale``/``v_scale`` (f16 ``[H_kv, S, d / 32]``) the caches are a Q8_0 cache's int8
    codes (``runtime.cache.KVCache(kv_type="q8_0")``): the rows are quantized as it quantizes them.
    ``ring``: the caches are a sliding-window layer's ring (position p in row ``p % S``).
    A one-row ``qk_norm_rope_append_rows``: the same launch as a batched step's.
    """
    what = "qk_norm_rope_append"
    one = q.dim() == 2
    if one:
        q, k, v = q[None], k[None], v[None]
    _check_qkv(q, k, v, what)
    # (kv_rows checks the caches and the position; the rows' call, the shapes against q's)
    rows = kv_rows([(k_cache, v_cache, k_scale, v_scale)], [pos], ring, q.shape[0], what)
    out = qk_norm_rope_append_rows(q, k, v, q_norm, k_norm, eps, inv_freq, rope_scale, rows)
    return out[0] if one else out


def qk_norm_rope_append_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                             inv_freq: torch.Tensor, rope_scale: float, rows: KVRows) -> torch.Tensor:
    """``qk_norm_rope_append`` of the rows of ``rows`` in one launch: q ``[N, H, d]``, k and v
    ``[N, H_kv, d]``, N = R * T for R rows of T tokens each (token t of row b at position
    ``rows.pos[b] + t``, written to row b's caches). A batched decode step's rows: T = 1, one
    token of each; rows of one cache at consecutive positions are all written before any attends
    (``attend_decode_rows`` masks each row's later ones)."""
    what = "qk_norm_rope_append"
    _check_qkv(q, k, v, what)
    (N, H, d), H_kv, R = q.shape, k.shape[1], len(rows.entries)
    if H_kv != rows.H_kv or d != rows.d or N % R:
        raise ValueError(f"{what}: {N} tokens of [H_kv={H_kv}, d={d}] do not fill {R} rows of caches "
                         f"[{rows.H_kv}, S, {rows.d}]")
    if not rows.q8 and rows.dtype != q.dtype:
        raise ValueError(f"{what}: caches must be in the activations' dtype ({q.dtype}), or Q8_0 codes with scales")
    for w, name in ((q_norm, "q_norm"), (k_norm, "k_norm")):
        if w is not None and (w.numel() != d or not w.is_contiguous() or w.device != q.device):
            raise ValueError(f"{what}: {name} must be a contiguous [d={d}] vector on {q.device}")
    half = inv_freq.numel()
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32 or not inv_freq.is_contiguous() \
            or 2 * half > d or inv_freq.device != q.device:
        raise ValueError(f"{what}: inv_freq must be a contiguous float32 vector of at most d/2={d // 2} "
                         f"frequencies on {q.device}, got {inv_freq.numel()} {inv_freq.dtype}")
    if any(t.device != q.device for t in (k, v, rows.pos)):
        raise ValueError(f"{what}: all tensors must be on {q.device}")
    out = torch.empty((N, H, d), dtype=q.dtype, device=q.device)
    if N * (H + H_kv) and d:
        block = triton.next_power_of_2(d)
        qk_norm_rope_append_kernel[(N * (H + H_kv),)](
            q, k, v, q_norm if q_norm is not None else q, k_norm if k_norm is not None else k, inv_freq,
            rows.table(range(R)), rows.pos, rows.pos.stride(0), out, N // R, H, H_kv, d, half, *q.stride()[:2],
            *k.stride()[:2], *v.stride()[:2], float(eps), float(rope_scale),
            HAS_QN=q_norm is not None, HAS_KN=k_norm is not None, Q8KV=rows.q8,
            RING=rows.ring, BLOCK_D=block, num_warps=1 if block <= 256 else 4, **pdl.flags(q))
    return out


@triton.jit
def _kv_tile(c_ptr, s_ptr, off, soff, mask, act_ptr, Q8KV: tl.constexpr):
    """A tile of cached keys or values in the activations' dtype (``act_ptr``'s): loaded as is, or
    Q8_0 codes times their f16 scales (``off`` / ``soff``: element and scale offsets), rounded
    as ``runtime.cache.dequantize_q8_0`` rounds."""
    if Q8KV:
        codes = tl.load(c_ptr + off, mask=mask, other=0).to(tl.float32)
        t = (codes * tl.load(s_ptr + soff, mask=mask, other=0.0).to(tl.float32)).to(act_ptr.dtype.element_ty)
    else:
        t = tl.load(c_ptr + off, mask=mask, other=0.0)
    return t


@triton.jit(do_not_specialize=["NS", "pos_stride"])
def attend_split_kernel(q_ptr, tab_ptr, pos_ptr, pos_stride, m_ptr, l_ptr, acc_ptr, H_KV, D, REP, NS, window,
                         qk_scale, DOT_FP32: tl.constexpr, Q8KV: tl.constexpr,
                         RING: tl.constexpr, REP_P2: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                         SPLIT: tl.constexpr, PDL: tl.constexpr):
    """Partial softmax of table row ``r``'s kv head ``kh``'s query heads over positions
    ``[sp*SPLIT, (sp+1)*SPLIT)`` (a ring: counted from the window's first split, ``_first_split``).
    Scores are kept in log2 units (``qk_scale`` includes log2(e)), so the partial max is too.
    (Splits past a row's own buffer, where the grid covers a longer row's: empty partials.)"""
    r = tl.program_id(0) // H_KV
    kh = tl.program_id(0) % H_KV
    sp = tl.program_id(1)
    k_ptr, v_ptr, ks_ptr, vs_ptr, S, row = _kv_row(tab_ptr, r, q_ptr, Q8KV)  # (no kernel of the step writes these)
    p = tl.load(pos_ptr + row * pos_stride).to(tl.int64)  # (set before the step: no kernel of it writes it)
    first = tl.where(window > 0, p - window + 1, 0)
    lo = (_first_split(first, SPLIT, RING) + sp.to(tl.int64)) * SPLIT
    start = tl.maximum(lo, first)  # first allowed position
    hi = tl.minimum(lo + SPLIT, p + 1)  # one past the last
    if start < hi:  # this split's keys and values into L2 while the previous kernel finishes
        kv = kh.to(tl.int64) * S * D
        r0 = start % S if RING else start
        r1 = tl.minimum(r0 + hi - start, S)  # (a ring's split may wrap: its tail is not prefetched)
        prefetch_l2(k_ptr + kv + r0 * D, k_ptr + kv + r1 * D, PDL)
        prefetch_l2(v_ptr + kv + r0 * D, v_ptr + kv + r1 * D, PDL)
    wait_prior(PDL)
    rows = tl.arange(0, REP_P2)
    rm = rows < REP
    heads = kh * REP + rows
    slot = (r.to(tl.int64) * H_KV * REP + heads) * NS + sp
    if start < hi:
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        q = tl.load(q_ptr + (row * H_KV * REP + heads)[:, None] * D + d[None, :], mask=rm[:, None] & dm[None, :],
                    other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        k_base = k_ptr + kh.to(tl.int64) * S * D
        v_base = v_ptr + kh.to(tl.int64) * S * D
        ks_base = ks_ptr + kh.to(tl.int64) * S * (D // 32)  # Q8_0 scales (never read otherwise)
        vs_base = vs_ptr + kh.to(tl.int64) * S * (D // 32)
        m_i = tl.full([REP_P2], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([REP_P2], dtype=tl.float32)
        acc = tl.zeros([REP_P2, BLOCK_D], dtype=tl.float32)
        for t in range(lo + (start - lo) // BLOCK_S * BLOCK_S, hi, BLOCK_S):  # every tile holds an allowed row
            j = t + tl.arange(0, BLOCK_S)
            jm = (j >= start) & (j < hi)
            if RING:
                j = j % S  # rows from here on
            kt = _kv_tile(k_base, ks_base, j[None, :] * D + d[:, None], j[None, :] * (D // 32) + d[:, None] // 32,
                          dm[:, None] & jm[None, :], q_ptr, Q8KV)
            if DOT_FP32:
                s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
            else:
                s = tl.dot(q, kt)
            s = tl.where(jm[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            pr = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            vt = _kv_tile(v_base, vs_base, j[:, None] * D + d[None, :], j[:, None] * (D // 32) + d[None, :] // 32,
                          jm[:, None] & dm[None, :], q_ptr, Q8KV)
            if DOT_FP32:
                acc = acc * alpha[:, None] + tl.dot(pr, vt.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(pr.to(vt.dtype), vt)
            m_i = m_new
        tl.store(m_ptr + slot, m_i, mask=rm)
        tl.store(l_ptr + slot, l_i, mask=rm)
        tl.store(acc_ptr + slot[:, None] * D + d[None, :], acc, mask=rm[:, None] & dm[None, :])
    else:  # nothing allowed here: an empty partial, no key or value read
        tl.store(m_ptr + slot, tl.full([REP_P2], float("-inf"), dtype=tl.float32), mask=rm)
        tl.store(l_ptr + slot, tl.zeros([REP_P2], dtype=tl.float32), mask=rm)


@triton.jit
def _first_split(first, SPLIT: tl.constexpr, RING: tl.constexpr):
    """The split whose partial goes to slot 0: the one holding the window's first position ``first``
    in a ring (whose ``S / SPLIT`` splits cover a window wherever it lies), else split 0 (the
    buffer's splits are its rows')."""
    if RING:
        f = tl.maximum(first, 0) // SPLIT
    else:
        f = first * 0
    return f


@triton.jit
def _softplus(x):
    """torch's softplus (threshold 20) with an accurate log1p: log(w) * u / (w - 1), w = 1 + u."""
    u = tl.exp(tl.minimum(x, 20.0))
    w = 1.0 + u
    log1p = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
    return tl.where(x > 20.0, x, log1p)


@triton.jit(do_not_specialize=["NS", "pos_stride"])
def attend_combine_kernel(m_ptr, l_ptr, acc_ptr, gate_ptr, out_ptr, xq, xd, xs, tab_ptr, pos_ptr, pos_stride, H, D,
                           NS, window, stride_gb, stride_g,
                           SPLIT: tl.constexpr, RING: tl.constexpr, GATE: tl.constexpr,
                           BLOCK_SP: tl.constexpr, BLOCK_C: tl.constexpr, Q8: tl.constexpr, PDL: tl.constexpr):
    """Table row ``r``'s query head ``h``, channels ``[c * BLOCK_C, (c+1) * BLOCK_C)``: merge the
    partials of the splits holding allowed positions (max first, then the rescaled sums), divide,
    gate, store to the row's batch row."""
    wait_prior(PDL)
    r = tl.program_id(0) // H
    h = tl.program_id(0) % H
    row = tl.load(tab_ptr + r.to(tl.int64) * ROW_FIELDS + 5)  # its batch row
    p = tl.load(pos_ptr + row * pos_stride).to(tl.int64)
    first = tl.where(window > 0, p - window + 1, 0)
    shift = _first_split(first, SPLIT, RING)  # (a ring's slots start at the window's first split)
    sp_first = tl.maximum(first, 0) // SPLIT - shift
    sp_last = p // SPLIT - shift
    base = (r.to(tl.int64) * H + h) * NS
    b = tl.arange(0, BLOCK_SP)
    d = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    dm = d < D
    mx = tl.full([BLOCK_SP], float("-inf"), dtype=tl.float32)
    for c in range(sp_first, sp_last + 1, BLOCK_SP):
        mx = tl.maximum(mx, tl.load(m_ptr + base + c + b, mask=c + b <= sp_last, other=float("-inf")))
    m_all = tl.max(mx, axis=0)
    l_sum = tl.zeros([BLOCK_SP], dtype=tl.float32)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for c in range(sp_first, sp_last + 1, BLOCK_SP):
        sm = c + b <= sp_last
        w = tl.exp2(tl.load(m_ptr + base + c + b, mask=sm, other=float("-inf")) - m_all)
        l_sum += w * tl.load(l_ptr + base + c + b, mask=sm, other=0.0)
        part = tl.load(acc_ptr + (base + c + b)[:, None] * D + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
        acc += tl.sum(part * w[:, None], axis=0)
    o = acc / tl.sum(l_sum, axis=0)
    g_row = gate_ptr + row * stride_gb + h.to(tl.int64) * stride_g
    if GATE == 1:  # sigmoid per channel
        g = tl.load(g_row + d, mask=dm, other=0.0).to(tl.float32)
        o = o / (1.0 + tl.exp(-g))
    elif GATE == 2:  # softplus, one scalar per head
        o = o * _softplus(tl.load(g_row).to(tl.float32))
    elif GATE == 3:  # softplus per channel
        g = tl.load(g_row + d, mask=dm, other=0.0).to(tl.float32)
        o = o * _softplus(g)
    o = o.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (row * H + h) * D + d, o, mask=dm)
    if Q8:  # BLOCK_C == 32 and D % 32 == 0: this program's channels are one block of the int8 form
        blk = (h * D + tl.program_id(1) * BLOCK_C) // 32 + tl.arange(0, 1)
        K = H * D
        store_q8(tl.reshape(o.to(tl.float32), [1, BLOCK_C]), blk, K, xq + row * K, xd + row * (K // 32),
                 xs + row * (K // 16))


def decode_split(S: int, n_kv: int, q8: bool = False) -> int:
    """Positions per program of ``attend_decode``'s first kernel over a buffer of ``S`` positions
    with ``n_kv`` kv heads. Up to 8192 positions, 64 (a program per tile, the best at short
    buffers). Beyond, about 128 programs in all (one per SM), in powers of two from 256 to 2048:
    the best split for each shape tried (Qwen3.6, Qwen3-30B and Laguna kv heads at 8k, 32k and
    131k positions), since fewer, longer programs stream their keys in deeper pipelines and leave
    fewer partials to merge. A Q8_0 cache (``q8``) takes 256 in single-stage tiles
    (``_split_tiles``): expanding codes in registers, the long pipelined splits decoded slower
    than single-stage ones, and single-stage 256 was close to the best split at long buffers
    (BENCHMARKS.md)."""
    if S <= 8192:
        return 64
    if q8:
        return 256
    return max(256, min(2048, 1 << ((S * n_kv // 128).bit_length() - 1)))


def _split_tiles(split: int, block_d: int, fp32: bool, q8: bool = False) -> tuple[int, int]:
    """``(BLOCK_S, num_stages)`` of the split kernel. A split of one or a few tiles gains nothing
    from a software pipeline, which only multiplies shared memory (float32 at d=256 would not fit
    in a GPU's shared memory at three stages), so short splits keep single-stage tiles of 64 or less.
    Half precision splits of 256 or more take three stages of 128 positions (64 at d=256, where
    128 would not fit): faster on long buffers (``decode_split``); not over a Q8_0 cache,
    whose tiles expand codes in registers."""
    if fp32 or q8 or split < 256:
        return (64 if split % 64 == 0 else 32 if split % 32 == 0 else 16), 1
    return (128 if block_d <= 128 else 64), 3


def attend_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: "int | torch.Tensor",
                  window: int = 0, gate: torch.Tensor | None = None, gate_kind: str = "none",
                  split: int | None = None, q8: bool = False, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, ring: bool = False
                  ) -> "torch.Tensor | tuple[torch.Tensor, Int8Rows]":
    """One query token's GQA attention over the cache rows ``j <= pos`` (and ``pos - j < window``
    when ``window > 0``), times the optional output gate, in two launches.

    q ``[H, d]`` contiguous (``qk_norm_rope_append``'s output); caches ``[H_kv, S, d]`` contiguous
    in q's dtype, S the whole capacity (rows past ``pos`` are masked, whatever they hold); query
    head h reads kv head ``h // (H / H_kv)``. ``pos``: an int or a 0-dim integer device tensor.
    ``gate_kind``: ``"none"``; ``"sigmoid"`` (``gate [H, d]``, out *= sigmoid per channel);
    ``"softplus_head"`` (``gate [H]``, out *= softplus per head); ``"softplus"`` (``gate [H, d]``
    per channel). A ``[H, d]`` gate needs a contiguous last axis, any row stride. ``split``:
    positions per program of the first kernel, a multiple of 16 (None: ``decode_split``'s).
    Returns one row ``[1, H * d]`` in q's dtype (``attn_output``'s input); ``q8`` (d a multiple
    of 32): also its int8 form, ``(out, Int8Rows)``, computed by the combine kernel: one block of
    32 channels per program.
    With ``k_scale``/``v_scale`` the caches are a Q8_0 cache's int8 codes and f16 scales, read as
    such (each tile expanded in registers, no expanded copy of the cache).
    ``ring``: the caches are a sliding-window layer's ring (``runtime.cache.KVCache``: position p
    in row ``p % S``, S at least ``window + split - 1`` once positions pass it); the split is then
    ``WINDOW_ALIGN``'s, counted from the window's first, so the partials merge in the order of the
    whole buffer's and give its bits.
    A one-row ``attend_decode_rows``: the same launches as a batched step's.
    """
    what = "attend_decode"
    if q.dim() != 2 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape or k_cache.shape[2] != q.shape[1]:
        raise ValueError(f"{what}: expected q [H, d] and caches [H_kv, S, d], got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    rows = kv_rows([(k_cache, v_cache, k_scale, v_scale)], [pos], ring, 1, what)
    return attend_decode_rows(q[None], rows, window, None if gate is None else gate[None], gate_kind, split, q8)


def attend_decode_rows(q: torch.Tensor, rows: KVRows, window: int = 0, gate: torch.Tensor | None = None,
                       gate_kind: str = "none", split: int | None = None, q8: bool = False
                       ) -> "torch.Tensor | tuple[torch.Tensor, Int8Rows]":
    """``attend_decode`` of B rows, each one query token over its own row of ``rows`` (its caches
    and position), in two launches for all of them: q ``[B, H, d]`` contiguous
    (``qk_norm_rope_append_rows``' output), ``gate`` ``[B, H, d]`` (or ``[B, H]`` per head) with
    a contiguous last axis. Returns ``[B, H * d]`` (and its int8 form with ``q8``), row b bit for
    bit what row b gives alone: each program runs the one-row program on its row, and a row's
    split follows from its own buffer (``decode_split``), never from the batch. Rows whose
    splits differ (buffers of other sizes past 8192 positions) take one launch pair per split."""
    what = "attend_decode"
    if q.dim() != 3 or q.shape[0] != len(rows.entries) or q.shape[2] != rows.d:
        raise ValueError(f"{what}: expected q [B={len(rows.entries)}, H, d={rows.d}], got {tuple(q.shape)}")
    (B, H, d), H_kv = q.shape, rows.H_kv
    if H_kv == 0 or H % H_kv or d == 0 or any(e[4] == 0 for e in rows.entries):
        raise ValueError(f"{what}: {H} query heads cannot share {H_kv} kv heads (or an empty shape)")
    if q.dtype not in ACT_DTYPES:
        raise ValueError(f"{what}: q must be bf16, f16 or f32, got {q.dtype}")
    if not rows.q8 and rows.dtype != q.dtype:
        raise ValueError(f"{what}: caches must be in the activations' dtype ({q.dtype}), or Q8_0 codes with scales")
    if not q.is_contiguous():
        raise ValueError(f"{what}: q must be contiguous")
    if rows.pos.device != q.device:
        raise ValueError(f"{what}: all tensors must be on {q.device}")
    if split is not None and (split < 16 or split % 16):
        raise ValueError(f"{what}: split must be a positive multiple of 16, got {split}")
    if window < 0 or (rows.ring and window == 0):
        raise ValueError(f"{what}: window must be >= 0 (> 0 in a ring), got {window}")
    if gate_kind not in GATE_KINDS:
        raise ValueError(f"{what}: gate_kind must be one of {', '.join(GATE_KINDS)}, got {gate_kind!r}")
    if (gate is None) != (gate_kind == "none"):
        raise ValueError(f"{what}: gate_kind {gate_kind!r} and gate {'None' if gate is None else 'given'} disagree")
    if gate is not None:
        want = (B, H) if gate_kind == "softplus_head" else (B, H, d)
        if tuple(gate.shape) != want or (len(want) == 3 and gate.stride(-1) != 1) \
                or not gate.dtype.is_floating_point or gate.device != q.device:
            raise ValueError(f"{what}: a {gate_kind!r} gate must be a float {list(want[1:])} per row on {q.device} "
                             f"with a contiguous last axis, got {tuple(gate.shape)} {gate.dtype}")
    if q8 and d % QBLOCK:
        raise ValueError(f"{what}: an int8 output needs a head size that is a multiple of {QBLOCK}, got {d}")
    if rows.ring:  # a ring's rows of one sequence are all written before any attends: once they wrap
        # around its end, the window of the first must survive the last's write (positions on the
        # device, a captured step's: not known here, as for one sequence's call)
        for key in {e[0] for e, w in zip(rows.entries, rows.wraps) if w}:
            n, S = sum(e[0] == key for e in rows.entries), next(e[4] for e in rows.entries if e[0] == key)
            if S < window + n - 1:
                raise ValueError(f"{what}: a ring of {S} rows cannot take {n} rows of one sequence past a window "
                                 f"of {window}")
    rep = H // H_kv
    block_d = max(16, triton.next_power_of_2(d))
    # Triton's interpreter gets bf16 tl.dot wrong (see tests/test_kernels.py): off the GPU the
    # products run in fp32 whatever the activations' dtype.
    fp32 = q.dtype == torch.float32 or not q.is_cuda
    out = torch.empty(B, H * d, dtype=q.dtype, device=q.device)
    block_c = min(block_d, COMBINE_CHANNELS)
    codes = new_q8(B, H * d, q.device) if q8 else (out, out, out)
    gate_strides = (0, 0) if gate is None else gate.stride()[:2]
    by_split: dict[int, list[int]] = {}
    for b, e in enumerate(rows.entries):
        by_split.setdefault((WINDOW_ALIGN if rows.ring else decode_split(e[4], H_kv, rows.q8))
                            if split is None else split, []).append(b)
    for sp, group in by_split.items():
        table = rows.table(group)
        n_split = max(triton.cdiv(rows.entries[b][4], sp) for b in group)
        R = len(group)
        m = torch.empty(R * H * n_split, dtype=torch.float32, device=q.device)
        l_ = torch.empty(R * H * n_split, dtype=torch.float32, device=q.device)
        acc = torch.empty(R * H * n_split * d, dtype=torch.float32, device=q.device)
        block_s, stages = _split_tiles(sp, block_d, fp32, rows.q8)
        attend_split_kernel[(R * H_kv, n_split)](
            q, table, rows.pos, rows.pos.stride(0), m, l_, acc, H_kv, d, rep, n_split, int(window),
            d ** -0.5 * LOG2E, DOT_FP32=fp32, Q8KV=rows.q8, RING=rows.ring,
            REP_P2=max(16, triton.next_power_of_2(rep)), BLOCK_D=block_d,
            BLOCK_S=block_s, SPLIT=sp, num_warps=4, num_stages=stages, **pdl.flags(q))
        attend_combine_kernel[(R * H, triton.cdiv(d, block_c))](
            m, l_, acc, gate if gate is not None else q, out, *codes, table, rows.pos, rows.pos.stride(0), H, d,
            n_split, int(window), *gate_strides, SPLIT=sp, RING=rows.ring, GATE=GATE_KINDS[gate_kind],
            BLOCK_SP=COMBINE_SPLITS, BLOCK_C=block_c, Q8=q8, num_warps=4, **pdl.flags(m))
    return (out, as_rows(codes)) if q8 else out


@triton.jit(do_not_specialize=["pos", "T"])
def attend_prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, pos, T, S, D, H, REP, window, qk_scale,
                           POS_PTR: tl.constexpr, DOT_FP32: tl.constexpr, RING: tl.constexpr, REP_P2: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    """Tokens ``[tb * BLOCK_T, (tb+1) * BLOCK_T)`` of kv head ``kh``: rows ``t * REP_P2 + r`` are
    token t's query head ``kh * REP + r``. Scores in log2 units (``qk_scale`` includes log2(e))."""
    wait_prior(PDL)
    kh = tl.program_id(0)
    tb = tl.program_id(1)
    p = _position(pos, POS_PTR)
    rows = tl.arange(0, BLOCK_T * REP_P2)
    t = tb * BLOCK_T + rows // REP_P2
    r = rows % REP_P2
    rm = (t < T) & (r < REP)
    qpos = p + t  # each row's position (int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q_off = (t.to(tl.int64) * H + kh * REP + r)[:, None] * D + d[None, :]
    q = tl.load(q_ptr + q_off, mask=rm[:, None] & dm[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    t_last = tl.minimum(tb * BLOCK_T + BLOCK_T, T) - 1
    hi = p + t_last + 1  # one past the block's last visible key
    if not RING:
        hi = tl.minimum(hi, S)
    start = tl.maximum(tl.where(window > 0, p + tb * BLOCK_T - window + 1, 0), 0)
    k_base = k_ptr + kh.to(tl.int64) * S * D
    v_base = v_ptr + kh.to(tl.int64) * S * D
    m_i = tl.full([BLOCK_T * REP_P2], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_T * REP_P2], dtype=tl.float32)
    acc = tl.zeros([BLOCK_T * REP_P2, BLOCK_D], dtype=tl.float32)
    for j0 in range(start // BLOCK_S * BLOCK_S, hi, BLOCK_S):
        j = j0 + tl.arange(0, BLOCK_S)
        jm = (j >= start) & (j < hi)
        jr = j % S if RING else j  # (a ring: position j in row j % S)
        kt = tl.load(k_base + jr[None, :] * D + d[:, None], mask=dm[:, None] & jm[None, :], other=0.0)
        if DOT_FP32:
            s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        ok = jm[None, :] & (j[None, :] <= qpos[:, None])
        if window > 0:
            ok = ok & (qpos[:, None] - j[None, :] < window)
        s = tl.where(ok, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet stays empty
        alpha = tl.exp2(m_i - m_use)
        pr = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        vt = tl.load(v_base + jr[:, None] * D + d[None, :], mask=jm[:, None] & dm[None, :], other=0.0)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(pr, vt.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(pr.to(vt.dtype), vt)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # (rows past T or rep: never stored)
    tl.store(out_ptr + q_off, o.to(out_ptr.dtype.element_ty), mask=rm[:, None] & dm[None, :])


def attend_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: "int | torch.Tensor",
                   window: int = 0, ring: bool = False) -> torch.Tensor:
    """Causal GQA attention of the T queries ``q [T, H, d]`` at positions ``pos .. pos+T-1`` over
    the cache rows ``j <= position`` (and ``position - j < window`` when ``window > 0``): the keys
    of those positions must already be written (``qk_norm_rope_append``). Caches ``[H_kv, S, d]``
    contiguous in q's dtype, the whole capacity; ``pos`` an int or a 0-dim integer device tensor
    (then ``pos + T <= S`` is the caller's promise). ``ring``: a sliding-window layer's ring
    (position p in row ``p % S``; S at least ``window + T - 1`` once positions pass it, so the
    call's rows overwrite none its queries read). Returns ``[T, H, d]`` in q's dtype, one launch."""
    what = "attend_prefill"
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape or k_cache.shape[2] != q.shape[2]:
        raise ValueError(f"{what}: expected q [T, H, d] and caches [H_kv, S, d], got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    (T, H, d), (H_kv, S, _) = q.shape, k_cache.shape
    if H_kv == 0 or H % H_kv or d == 0 or S == 0:
        raise ValueError(f"{what}: {H} query heads cannot share {H_kv} kv heads (or an empty shape)")
    if q.dtype not in ACT_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"{what}: q and the caches must share one of bf16/f16/f32, got {q.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")
    if not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{what}: q and the caches must be contiguous")
    if k_cache.device != q.device or v_cache.device != q.device:
        raise ValueError(f"{what}: all tensors must be on {q.device}")
    if window < 0 or (ring and window == 0):
        raise ValueError(f"{what}: window must be >= 0 (> 0 in a ring), got {window}")
    pos_ptr = _check_pos(pos, S, q.device, what, T, ring)
    if ring and not pos_ptr and int(pos) + T > S and S < window + T - 1:
        raise ValueError(f"{what}: a ring of {S} rows cannot take {T} tokens past a window of {window}")
    out = torch.empty_like(q)
    if T == 0:
        return out
    rep = H // H_kv
    rep_p2 = triton.next_power_of_2(rep)
    block_t = max(1, 64 // rep_p2) if d > 128 else max(1, 128 // rep_p2)  # 64-128 rows a tile
    block_d = max(16, triton.next_power_of_2(d))
    fp32 = q.dtype == torch.float32 or not q.is_cuda  # (the interpreter gets bf16 tl.dot wrong)
    attend_prefill_kernel[(H_kv, triton.cdiv(T, block_t))](
        q, k_cache, v_cache, out, pos if pos_ptr else int(pos), T, S, d, H, rep, int(window), d ** -0.5 * LOG2E,
        POS_PTR=pos_ptr, DOT_FP32=fp32, RING=ring, REP_P2=rep_p2, BLOCK_T=block_t, BLOCK_D=block_d,
        BLOCK_S=64 if d <= 128 else 32, num_warps=8 if block_t * rep_p2 >= 128 else 4, **pdl.flags(q))
    return out
