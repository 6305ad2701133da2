"""Decode attention (one new token) in two launches instead of ~50 small torch kernels.

Why: at batch 1 an attention layer's arithmetic between its projections and ``attn_output`` is
tiny (one query row per head against the cached keys), so the torch form's cost is its kernel
count: the q/k RMSNorms (seven launches each), RoPE's cos/sin rebuilt every layer, the rotation
(slices, negation, concatenation), the KV append (``index_copy_`` of keys and values), the GQA
scores over the whole KV buffer, the position mask, the softmax, probabilities times values, the
permute back and the output gate. Three steps cover all of it, in two launches on buffers of up
to ``FOLD_SPLITS`` splits (the last two folded into one) and three on longer ones:

1. ``_qk_norm_rope_append_kernel``: one program per head row (per token, H query rows, then H_kv
   key rows): per-head RMSNorm (statistic in float32), NEOX rope over the first ``rope_dim``
   channels with the angle ``pos * inv_freq`` formed in float32 as ``Rope.cos_sin`` does, then the
   query row is stored to a contiguous ``[H, d]`` and the key row, with the value row as it is, to
   row ``pos`` of the head-major caches (``KVCache``'s ``[H_kv, capacity, d]``). A prefill call
   takes it too, for all its tokens at once (~30 torch launches a layer there), and attends with
   ``runtime.layers.attend_buffers`` (batched GEMMs, as before).
2. ``_attend_split_kernel`` (flash-decoding): one program per (kv head, ``split`` positions). The
   ``rep = H / H_kv`` query heads of the kv head are the rows of one tile (padded to 16 for
   ``tl.dot``), so each key and value is read once per kv head, not once per query head. Tiles
   of ``BLOCK_S`` positions feed an online softmax (running max, sum and a float32 accumulator);
   the partial (max, sum, accumulator) goes to float32 scratch. The grid covers the whole buffer
   capacity, so it never depends on the position and a captured CUDA graph replays it at any
   position: programs whose range lies wholly past ``pos`` (or before the sliding window) write
   an empty partial and read no keys or values.
3. The merge (``_merge_partials``, ``_finish``) of the partials of the splits that hold allowed
   positions (the range follows from ``pos`` and the window, also read from memory in a graph):
   the max over those splits, then their rescaled sums in split order, elementwise fused
   multiply-adds only, so an output element's bits do not depend on the tile that computes it;
   then the division by the softmax sum, the output gate (sigmoid per channel for Qwen3.5/3.6,
   softplus per head or per channel for Laguna), the store of ``[H * d]`` and, optionally, of its
   int8 form. It runs in one of two places, with the same bits:

   - folded into the split kernel (``_attend_folded_kernel``, one launch): each program, once its
     partial is stored, takes a ticket from its kv head's int32 counter (a CTA barrier, then an
     acq_rel atomic add: the partial is visible GPU-wide before the ticket is). The program that
     draws the last ticket puts the counter back to 0 (a graph replay finds it zero: it is never
     zeroed inside the step, which would be a memset node per layer in the graph) and merges the
     kv head's ``rep`` query heads over all channels, reading the partials past L1.
   - in ``_attend_combine_kernel``, a launch of its own: one program per (query head, 32
     channels). Splitting the channels too keeps the merge from setting the pace on long buffers
     (one program per head read its head's partials alone, serially).

   Why both: on an H100 at batch 1 each launch of the captured decode graph costs ~2-3 us of a
   ~65 us layer, which folding saves. But the folding program reads every used partial of its
   kv head alone, ``rep * d * 4`` bytes a split (4 KiB for Qwen3-30B's 8 heads of 128, 8 KiB for
   Qwen3.6's 8 of 256), at one SM's share of L2 bandwidth (~100 GB/s, so ~40-80 ns a split),
   where the combine kernel spreads them over ``H * d / 32`` programs. Since the graph serves
   every position, the choice goes by the capacity, not the position: folded up to
   ``FOLD_SPLITS`` = 64 splits (4096 positions at split 64), where the merge at the buffer's very
   end (~2.5-5 us estimated) costs about what the launch saves and every earlier position gains;
   two launches beyond, where hundreds of splits (32k and 128k buffers) would take tens of us
   serially. ``attend_decode(fold=...)`` or ``SPARKPACK_ATTN_FOLD=1``/``0`` forces either path
   (benchmarks).

``split`` trades the first kernel's parallelism against the partials to merge. Measured on an
H100 (bf16, CUDA-graph replays of both attention launches, 32 query / 4 kv heads of 128, 3/4 of
the buffer in use): split 64 is best at 4k positions (9 us); at 32k, 256 (28 us against 35 at
64); at 128k, 512 (82 us against 129). The caller picks it from the capacity.

A Q8_0 KV cache (``--kv-type q8_0``: int8 codes, one f16 scale per 32 values) is read and
written in place: the first kernel quantizes the new key and value rows by ``runtime.cache``'s
rule, the split kernel expands each tile in registers (code times scale, rounded to the
activation dtype as ``dequantize_q8_0`` rounds), so no expanded copy of the cache is made (the
torch form expands the layer's whole buffer every token).

The mask is ``runtime.layers._attend``'s (``j <= pos`` and, with a window, ``pos - j < window``),
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

import os

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import prefetch_l2, wait_prior
from .q8dot import QBLOCK, attach, new_q8, store_q8

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GATE_KINDS = {"none": 0, "sigmoid": 1, "softplus_head": 2, "softplus": 3}
LOG2E = 1.4426950408889634
COMBINE_CHANNELS = 32  # channels per combine program: H programs alone were half as fast at 32k positions
COMBINE_SPLITS = 256  # partial maxima per load in a combine program's first pass (8 registers a thread)
COMBINE_UNROLL = 32  # partials a combine program loads at once in its second pass (3 registers each)
FOLD_SPLITS = 64  # the combine is folded into the split kernel up to this many splits (docstring: why)
FOLD_TILE = 8192  # partial elements per unrolled merge step of the folding program (x3 with max and sum)


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


@triton.jit(do_not_specialize=["pos"])
def _qk_norm_rope_append_kernel(q_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, inv_ptr, pos, qo_ptr, kc_ptr, vc_ptr,
                                ks_ptr, vs_ptr, H, H_KV, S, D, HALF, stride_qt, stride_q, stride_kt, stride_k,
                                stride_vt, stride_v, eps, rope_scale,
                                HAS_QN: tl.constexpr, HAS_KN: tl.constexpr, POS_PTR: tl.constexpr,
                                Q8KV: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    t = tl.program_id(0) // (H + H_KV)  # token t of the call, at position pos + t
    r = tl.program_id(0) % (H + H_KV)
    p = _position(pos, POS_PTR) + t
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


def _scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, fill: torch.Tensor) -> tuple:
    """The two scale pointers a kernel takes (any tensor where there are none: never read)."""
    return (k_scale, v_scale) if k_scale is not None else (fill, fill)


def _check_pos(pos: "int | torch.Tensor", S: int, device: torch.device, what: str, T: int = 1) -> bool:
    """Validate ``pos`` (the first of T positions) without reading device memory; True when it is a
    device scalar."""
    if isinstance(pos, torch.Tensor):
        if pos.numel() != 1 or pos.dtype.is_floating_point or pos.dtype.is_complex or pos.dtype == torch.bool \
                or pos.device != device:
            raise ValueError(f"{what}: pos must be an int or a one-element integer tensor on {device}")
        return True
    if not (0 <= int(pos) and int(pos) + T <= S):
        raise ValueError(f"{what}: position {int(pos) + T - 1} is outside the cache (capacity {S})")
    return False


def qk_norm_rope_append(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                        inv_freq: torch.Tensor, rope_scale: float, pos: "int | torch.Tensor",
                        k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> torch.Tensor:
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
    """
    what = "qk_norm_rope_append"
    one = q.dim() == 2
    if one:
        q, k, v = q[None], k[None], v[None]
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or k.shape[2] != q.shape[2] or k.shape[0] != q.shape[0]:
        raise ValueError(f"{what}: expected q [(T,) H, d], k and v [(T,) H_kv, d], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    (T, H, d), H_kv = q.shape, k.shape[1]
    if q.dtype not in ACT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{what}: q, k, v must share one of bf16/f16/f32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError(f"{what}: q, k and v need a contiguous last axis")
    if k_cache.dim() != 3 or k_cache.shape[0] != H_kv or k_cache.shape[2] != d or v_cache.shape != k_cache.shape:
        raise ValueError(f"{what}: caches must be [H_kv={H_kv}, S, d={d}], got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    _check_caches(k_cache, v_cache, k_scale, v_scale, q.dtype, what)
    for w, name in ((q_norm, "q_norm"), (k_norm, "k_norm")):
        if w is not None and (w.numel() != d or not w.is_contiguous() or w.device != q.device):
            raise ValueError(f"{what}: {name} must be a contiguous [d={d}] vector on {q.device}")
    half = inv_freq.numel()
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32 or not inv_freq.is_contiguous() \
            or 2 * half > d or inv_freq.device != q.device:
        raise ValueError(f"{what}: inv_freq must be a contiguous float32 vector of at most d/2={d // 2} "
                         f"frequencies on {q.device}, got {inv_freq.numel()} {inv_freq.dtype}")
    if any(t.device != q.device for t in (k, v, k_cache, v_cache)):
        raise ValueError(f"{what}: all tensors must be on {q.device}")
    S = k_cache.shape[1]
    pos_ptr = _check_pos(pos, S, q.device, what, T)
    out = torch.empty((T, H, d), dtype=q.dtype, device=q.device)
    if T * (H + H_kv) and d:
        block = triton.next_power_of_2(d)
        _qk_norm_rope_append_kernel[(T * (H + H_kv),)](
            q, k, v, q_norm if q_norm is not None else q, k_norm if k_norm is not None else k, inv_freq,
            pos if pos_ptr else int(pos), out, k_cache, v_cache, *_scales(k_scale, v_scale, k_cache), H, H_kv, S,
            d, half, *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], float(eps), float(rope_scale),
            HAS_QN=q_norm is not None, HAS_KN=k_norm is not None, POS_PTR=pos_ptr, Q8KV=k_scale is not None,
            BLOCK_D=block, num_warps=1 if block <= 256 else 4, **pdl.flags(q))
    return out[0] if one else out


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


@triton.jit
def _attend_partial(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, pos, m_ptr, l_ptr, acc_ptr, S, D, REP, NS, window,
                    qk_scale, POS_PTR: tl.constexpr, DOT_FP32: tl.constexpr, Q8KV: tl.constexpr,
                    REP_P2: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, SPLIT: tl.constexpr,
                    PDL: tl.constexpr):
    """Partial softmax of kv head ``kh``'s query heads over positions ``[sp*SPLIT, (sp+1)*SPLIT)``,
    stored at slot ``head * NS + sp`` of the scratch; returns the position. Scores are kept in log2
    units (``qk_scale`` includes log2(e)), so the partial max is too."""
    kh = tl.program_id(0)
    sp = tl.program_id(1)
    p = _position(pos, POS_PTR)  # (set before the step: no kernel of it writes the position)
    lo = sp.to(tl.int64) * SPLIT
    start = tl.maximum(lo, tl.where(window > 0, p - window + 1, 0))  # first allowed position
    hi = tl.minimum(lo + SPLIT, p + 1)  # one past the last
    if start < hi:  # this split's keys and values into L2 while the previous kernel finishes
        kv = kh.to(tl.int64) * S * D
        prefetch_l2(k_ptr + kv + start * D, k_ptr + kv + tl.minimum(hi, S) * D, PDL)
        prefetch_l2(v_ptr + kv + start * D, v_ptr + kv + tl.minimum(hi, S) * D, PDL)
    wait_prior(PDL)
    rows = tl.arange(0, REP_P2)
    rm = rows < REP
    heads = kh * REP + rows
    slot = heads.to(tl.int64) * NS + sp
    if start < hi:
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        q = tl.load(q_ptr + heads[:, None] * D + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0)
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
    return p


@triton.jit(do_not_specialize=["pos"])
def _attend_split_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, pos, m_ptr, l_ptr, acc_ptr, S, D, REP, NS, window,
                         qk_scale, POS_PTR: tl.constexpr, DOT_FP32: tl.constexpr, Q8KV: tl.constexpr,
                         REP_P2: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, SPLIT: tl.constexpr,
                         PDL: tl.constexpr):
    """The partials alone (two-launch path): ``_attend_combine_kernel`` merges them."""
    _attend_partial(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, pos, m_ptr, l_ptr, acc_ptr, S, D, REP, NS, window,
                    qk_scale, POS_PTR, DOT_FP32, Q8KV, REP_P2, BLOCK_D, BLOCK_S, SPLIT, PDL)


@triton.jit
def _softplus(x):
    """torch's softplus (threshold 20) with an accurate log1p: log(w) * u / (w - 1), w = 1 + u."""
    u = tl.exp(tl.minimum(x, 20.0))
    w = 1.0 + u
    log1p = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def _used_splits(p, window, SPLIT: tl.constexpr):
    """The first and last split holding an allowed position (every split between them holds some)."""
    return tl.maximum(tl.where(window > 0, p - window + 1, 0), 0) // SPLIT, p // SPLIT


@triton.jit
def _merge_partials(m_ptr, l_ptr, acc_ptr, slot0, rm, d, dm, sp_first, sp_last, D, ROWS: tl.constexpr,
                    COLS: tl.constexpr, BLOCK_SP: tl.constexpr, UNROLL: tl.constexpr):
    """Merge the partials of splits ``sp_first..sp_last`` for the rows (query heads) whose first
    scratch slot is ``slot0 [ROWS]`` (masked by ``rm``), channels ``d [COLS]`` (masked by ``dm``):
    the max over the splits first, then the rescaled sums in split order, one fused multiply-add
    per split and element. Returns the unnormalised output and the softmax sum, both
    ``[ROWS, COLS]`` (the sum is the same in every channel of a row).

    Every operation after the max (which is exact in any order) is elementwise, so each output
    element is the same chain of roundings whatever the tile's shape and layout: the folded
    kernel (all heads of a kv head, all channels) and the combine kernel (one head, 32 channels)
    give the same bits. ``UNROLL`` splits are loaded before their sums (memory-level parallelism;
    a masked split adds fma(0, 0, x) = x, exactly, so the unroll never changes a bit either).
    Each split's max and sum are loaded broadcast over the channels, in the partial tile's own
    layout: as ``[ROWS]`` vectors they were moved into it through shared memory, with two
    barriers per split that kept the loads of the next splits from being issued early.
    Loads bypass L1 (``.cg``): in the folded kernel the partials were written by other programs."""
    sb = tl.arange(0, BLOCK_SP)
    mx = tl.full([ROWS, BLOCK_SP], float("-inf"), dtype=tl.float32)
    for c in range(sp_first, sp_last + 1, BLOCK_SP):
        mx = tl.maximum(mx, tl.load(m_ptr + slot0[:, None] + c + sb[None, :],
                                    mask=rm[:, None] & (c + sb <= sp_last)[None, :], other=float("-inf"),
                                    cache_modifier=".cg"))
    m_all = tl.where(rm, tl.max(mx, axis=1), 0.0)[:, None]  # (0 for masked rows: weights 0, not NaN)
    l_sum = tl.zeros([ROWS, COLS], dtype=tl.float32)
    acc = tl.zeros([ROWS, COLS], dtype=tl.float32)
    for c in range(sp_first, sp_last + 1, UNROLL):
        for u in tl.static_range(UNROLL):
            ok = tl.where(c + u <= sp_last, rm, False)[:, None]  # (rm & a scalar: int32 in the interpreter)
            slot = (slot0 + c + u)[:, None]
            row = tl.broadcast_to(slot, (ROWS, COLS))
            ms = tl.load(m_ptr + row, mask=ok, other=float("-inf"), cache_modifier=".cg")
            ls = tl.load(l_ptr + row, mask=ok, other=0.0, cache_modifier=".cg")
            part = tl.load(acc_ptr + slot * D + d[None, :], mask=ok & dm[None, :], other=0.0, cache_modifier=".cg")
            w = tl.exp2(ms - m_all)
            l_sum = tl.fma(w, ls, l_sum)
            acc = tl.fma(w, part, acc)
    return acc, l_sum


@triton.jit
def _finish(acc, l_sum, heads, rm, d, dm, c0, gate_ptr, out_ptr, xq, xd, xs, D, K, stride_g, GATE: tl.constexpr,
            Q8: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Divide by the softmax sum, apply the output gate, store rows ``heads`` x channels ``d``
    (``d = c0 + arange(COLS)``) of the output ``[K = H * D]`` and, with ``Q8``, their int8 form
    (D a multiple of 32, so each 32 channels of the tile are one block, whole or wholly masked)."""
    ok = rm[:, None] & dm[None, :]
    o = acc / tl.where(ok, l_sum, 1.0)
    hg = heads.to(tl.int64) * stride_g
    if GATE == 1:  # sigmoid per channel
        g = tl.load(gate_ptr + hg[:, None] + d[None, :], mask=ok, other=0.0).to(tl.float32)
        o = o / (1.0 + tl.exp(-g))
    elif GATE == 2:  # softplus, one scalar per head
        o = o * _softplus(tl.load(gate_ptr + hg, mask=rm, other=0.0).to(tl.float32))[:, None]
    elif GATE == 3:  # softplus per channel
        g = tl.load(gate_ptr + hg[:, None] + d[None, :], mask=ok, other=0.0).to(tl.float32)
        o = o * _softplus(g)
    o = o.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + heads[:, None] * D + d[None, :], o, mask=ok)
    if Q8:
        j = tl.arange(0, COLS // 32)
        blk = (heads[:, None] * D + c0 + j[None, :] * 32) // 32
        blk = tl.where(rm[:, None] & (c0 + j[None, :] * 32 < D), blk, K // 32)  # past K: store_q8 masks it
        store_q8(tl.reshape(o.to(tl.float32), [ROWS * (COLS // 32), 32]), tl.reshape(blk, [ROWS * (COLS // 32)]),
                 K, xq, xd, xs)


@triton.jit(do_not_specialize=["pos"])
def _attend_combine_kernel(m_ptr, l_ptr, acc_ptr, gate_ptr, out_ptr, xq, xd, xs, pos, D, NS, window, stride_g,
                           POS_PTR: tl.constexpr, SPLIT: tl.constexpr, GATE: tl.constexpr,
                           BLOCK_SP: tl.constexpr, BLOCK_C: tl.constexpr, UNROLL: tl.constexpr, Q8: tl.constexpr,
                           PDL: tl.constexpr):
    """Query head ``h``, channels ``[c * BLOCK_C, (c+1) * BLOCK_C)``: merge the partials of the
    splits holding allowed positions (``_merge_partials``), divide, gate, store."""
    wait_prior(PDL)
    h = tl.program_id(0)
    p = _position(pos, POS_PTR)
    sp_first, sp_last = _used_splits(p, window, SPLIT)
    heads = h + tl.arange(0, 1)
    rm = heads >= 0
    c0 = tl.program_id(1) * BLOCK_C
    d = c0 + tl.arange(0, BLOCK_C)
    dm = d < D
    acc, l_sum = _merge_partials(m_ptr, l_ptr, acc_ptr, heads.to(tl.int64) * NS, rm, d, dm, sp_first, sp_last, D,
                                 1, BLOCK_C, BLOCK_SP, UNROLL)
    _finish(acc, l_sum, heads, rm, d, dm, c0, gate_ptr, out_ptr, xq, xd, xs, D, tl.num_programs(0) * D, stride_g,
            GATE, Q8, 1, BLOCK_C)


@triton.jit(do_not_specialize=["pos"])
def _attend_folded_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, pos, m_ptr, l_ptr, acc_ptr, cnt_ptr, gate_ptr,
                          out_ptr, xq, xd, xs, S, D, REP, NS, window, qk_scale, stride_g,
                          POS_PTR: tl.constexpr, DOT_FP32: tl.constexpr, Q8KV: tl.constexpr, REP_P2: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, SPLIT: tl.constexpr, GATE: tl.constexpr,
                          Q8: tl.constexpr, REP_C: tl.constexpr, BLOCK_SP: tl.constexpr, UNROLL: tl.constexpr,
                          PDL: tl.constexpr):
    """The split kernel with the combine folded in: each program stores its partial and takes a
    ticket on kv head ``kh``'s counter; the one drawing the last ticket merges the partials of
    all ``REP`` query heads of ``kh`` over all channels, as ``_attend_combine_kernel`` does (same
    helpers, same order of operations: the same bits), and puts the counter back to 0."""
    p = _attend_partial(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, pos, m_ptr, l_ptr, acc_ptr, S, D, REP, NS, window,
                        qk_scale, POS_PTR, DOT_FP32, Q8KV, REP_P2, BLOCK_D, BLOCK_S, SPLIT, PDL)
    kh = tl.program_id(0)
    # Every thread's stores of the partial are issued before the ticket: the barrier orders them
    # before the (single-thread) atomic, whose release makes them visible GPU-wide to the program
    # that acquires the last ticket.
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr + kh, 1, sem="acq_rel")
    if ticket == NS - 1:  # every other program of kh has stored its partial: merge them
        tl.store(cnt_ptr + kh, 0)  # (no program of kh touches it again in this launch)
        rows = tl.arange(0, REP_C)
        rm = rows < REP
        heads = kh * REP + rows
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        sp_first, sp_last = _used_splits(p, window, SPLIT)
        acc, l_sum = _merge_partials(m_ptr, l_ptr, acc_ptr, heads.to(tl.int64) * NS, rm, d, dm, sp_first, sp_last,
                                     D, REP_C, BLOCK_D, BLOCK_SP, UNROLL)
        _finish(acc, l_sum, heads, rm, d, dm, 0, gate_ptr, out_ptr, xq, xd, xs, D, tl.num_programs(0) * REP * D,
                stride_g, GATE, Q8, REP_C, BLOCK_D)


# The folded kernel's counters: one int32 per kv head, per device, zero between launches (the
# program that draws a head's last ticket puts it back to 0). One buffer serves every layer and
# call: kernels of one stream run one after another (with PDL too: a kernel touches memory only
# after its predecessor has completed), so no two launches ever count on it at once; a decode
# step, eager or replayed from a CUDA graph, is one stream (attention on two streams of one device
# at once would share the counters: the runtime never does that). Allocated once, outside any capture
# (zeroing it inside a step would be a memset node per layer in the graph); a larger one
# replaces it only outside a capture, and the old one is kept alive for graphs that point at it.
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def _counters(device: torch.device, n: int) -> torch.Tensor | None:
    """A zeroed int32 buffer of at least ``n`` counters on ``device``, or None while a CUDA graph
    is being captured and none is there yet (the caller then takes the two-launch path)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if buf is not None:
            _RETIRED.append(buf)
        buf = _COUNTERS[device] = torch.zeros(max(n, 256), dtype=torch.int32, device=device)
    return buf


def _fold_wanted(fold: bool | None, n_split: int) -> bool:
    """The argument, else ``SPARKPACK_ATTN_FOLD`` (1: always fold, 0: never), else the capacity."""
    if fold is None:
        env = os.environ.get("SPARKPACK_ATTN_FOLD", "")
        fold = env == "1" if env in ("0", "1") else n_split <= FOLD_SPLITS
    return fold


def attend_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: "int | torch.Tensor",
                  window: int = 0, gate: torch.Tensor | None = None, gate_kind: str = "none",
                  split: int = 64, q8: bool = False, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, fold: bool | None = None) -> torch.Tensor:
    """One query token's GQA attention over the cache rows ``j <= pos`` (and ``pos - j < window``
    when ``window > 0``), times the optional output gate, in one launch (combine folded into the
    split kernel) or two (split, then combine).

    q ``[H, d]`` contiguous (``qk_norm_rope_append``'s output); caches ``[H_kv, S, d]`` contiguous
    in q's dtype, S the whole capacity (rows past ``pos`` are masked, whatever they hold); query
    head h reads kv head ``h // (H / H_kv)``. ``pos``: an int or a 0-dim integer device tensor.
    ``gate_kind``: ``"none"``; ``"sigmoid"`` (``gate [H, d]``, out *= sigmoid per channel);
    ``"softplus_head"`` (``gate [H]``, out *= softplus per head); ``"softplus"`` (``gate [H, d]``
    per channel). A ``[H, d]`` gate needs a contiguous last axis, any row stride. ``split``:
    positions per program of the first kernel, a multiple of 16. Returns one row ``[1, H * d]`` in
    q's dtype (``attn_output``'s input); ``q8`` (d a multiple of 32) attaches its int8 form
    (``q8dot.attach``), computed where the output is. With ``k_scale``/``v_scale`` the caches are
    a Q8_0 cache's int8 codes and f16 scales, read as such (each tile expanded in registers, no
    expanded copy of the cache).

    ``fold``: True merges the partials in the split kernel (the last program of each kv head),
    False in a combine launch of their own; both give the same bits. None (the default) takes
    ``SPARKPACK_ATTN_FOLD`` when it is 1 or 0 (benchmarks force a path with it), else folds when
    the capacity has at most ``FOLD_SPLITS`` splits (``ceil(S / split)``; the module docstring
    says why). The choice depends on shapes only, never on the position, so a captured graph
    stays valid at every position.
    """
    what = "attend_decode"
    if q.dim() != 2 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape or k_cache.shape[2] != q.shape[1]:
        raise ValueError(f"{what}: expected q [H, d] and caches [H_kv, S, d], got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    (H, d), (H_kv, S, _) = q.shape, k_cache.shape
    if H_kv == 0 or H % H_kv or d == 0 or S == 0:
        raise ValueError(f"{what}: {H} query heads cannot share {H_kv} kv heads (or an empty shape)")
    if q.dtype not in ACT_DTYPES:
        raise ValueError(f"{what}: q must be bf16, f16 or f32, got {q.dtype}")
    _check_caches(k_cache, v_cache, k_scale, v_scale, q.dtype, what)
    if not q.is_contiguous():
        raise ValueError(f"{what}: q must be contiguous")
    if k_cache.device != q.device or v_cache.device != q.device:
        raise ValueError(f"{what}: all tensors must be on {q.device}")
    if split < 16 or split % 16:
        raise ValueError(f"{what}: split must be a positive multiple of 16, got {split}")
    if window < 0:
        raise ValueError(f"{what}: window must be >= 0, got {window}")
    if gate_kind not in GATE_KINDS:
        raise ValueError(f"{what}: gate_kind must be one of {', '.join(GATE_KINDS)}, got {gate_kind!r}")
    if (gate is None) != (gate_kind == "none"):
        raise ValueError(f"{what}: gate_kind {gate_kind!r} and gate {'None' if gate is None else 'given'} disagree")
    if gate is not None:
        want = (H,) if gate_kind == "softplus_head" else (H, d)
        if tuple(gate.shape) != want or (len(want) == 2 and gate.stride(-1) != 1) \
                or not gate.dtype.is_floating_point or gate.device != q.device:
            raise ValueError(f"{what}: a {gate_kind!r} gate must be a float {list(want)} on {q.device} "
                             f"with a contiguous last axis, got {tuple(gate.shape)} {gate.dtype}")
    if q8 and d % QBLOCK:
        raise ValueError(f"{what}: an int8 output needs a head size that is a multiple of {QBLOCK}, got {d}")
    pos_ptr = _check_pos(pos, S, q.device, what)
    p = pos if pos_ptr else int(pos)
    rep = H // H_kv
    n_split = triton.cdiv(S, split)
    block_d = max(16, triton.next_power_of_2(d))
    block_s = 64 if split % 64 == 0 else 32 if split % 32 == 0 else 16
    m = torch.empty(H * n_split, dtype=torch.float32, device=q.device)
    l_ = torch.empty(H * n_split, dtype=torch.float32, device=q.device)
    acc = torch.empty(H * n_split * d, dtype=torch.float32, device=q.device)
    out = torch.empty(1, H * d, dtype=q.dtype, device=q.device)
    codes = new_q8(1, H * d, q.device) if q8 else (out, out, out)
    gate_args = (gate if gate is not None else q, gate.stride(0) if gate is not None else 0)
    # Triton's interpreter gets bf16 tl.dot wrong (see tests/test_kernels.py): off the GPU the
    # products run in fp32 whatever the activations' dtype.
    fp32 = q.dtype == torch.float32 or not q.is_cuda
    split_consts = dict(POS_PTR=pos_ptr, DOT_FP32=fp32, Q8KV=k_scale is not None,
                        REP_P2=max(16, triton.next_power_of_2(rep)), BLOCK_D=block_d, BLOCK_S=block_s, SPLIT=split)
    counters = _counters(q.device, H_kv) if _fold_wanted(fold, n_split) else None
    # num_stages=1: at split 64 a program has one tile, and deeper software pipelines only
    # multiply shared memory (float32 at d=256 would not fit in an H100's 227 KiB at three).
    if counters is not None:
        rep_c = triton.next_power_of_2(rep)
        _attend_folded_kernel[(H_kv, n_split)](
            q, k_cache, v_cache, *_scales(k_scale, v_scale, k_cache), p, m, l_, acc, counters, gate_args[0], out,
            *codes, S, d, rep, n_split, int(window), d ** -0.5 * LOG2E, gate_args[1], **split_consts,
            GATE=GATE_KINDS[gate_kind], Q8=q8, REP_C=rep_c, BLOCK_SP=FOLD_SPLITS,
            UNROLL=max(1, min(16, FOLD_TILE // (rep_c * block_d))), num_warps=4, num_stages=1, **pdl.flags(q))
    else:
        _attend_split_kernel[(H_kv, n_split)](
            q, k_cache, v_cache, *_scales(k_scale, v_scale, k_cache), p, m, l_, acc, S, d, rep, n_split,
            int(window), d ** -0.5 * LOG2E, **split_consts, num_warps=4, num_stages=1, **pdl.flags(q))
        block_c = min(block_d, COMBINE_CHANNELS)
        _attend_combine_kernel[(H, triton.cdiv(d, block_c))](
            m, l_, acc, gate_args[0], out, *codes, p, d, n_split, int(window), gate_args[1],
            POS_PTR=pos_ptr, SPLIT=split, GATE=GATE_KINDS[gate_kind], BLOCK_SP=COMBINE_SPLITS,
            BLOCK_C=block_c, UNROLL=COMBINE_UNROLL, Q8=q8, num_warps=1, **pdl.flags(m))
    return attach(out, codes) if q8 else out
