"""Gated DeltaNet kernels: the decode step (one token) in two launches instead of ~45 small torch
kernels, and a prefill call's layer in four (the torch form: ~80).

Why: at batch 1 a DeltaNet layer's arithmetic is tiny (a 128x128 state per value head), so the
torch form's cost is its kernel count: concatenations, norms, exp/softplus/sigmoid, six
broadcast products and reductions over the state, the gated output norm, each a separate launch
and memory pass. Two kernels cover everything between the input projections and ``ssm_out``:

1. ``conv_kernel``: the causal depthwise conv over the last ``K-1`` inputs plus the new one,
   SiLU, and the conv window shifted in place. One program per (sequence, block of channels)
   (each channel's window is read and rewritten by the same program).
2. ``recurrence_kernel``: one program per (sequence, value head): l2-normalise its q and k (key
   head ``h % n_k``, the converter's tiled order), beta = sigmoid, g = softplus(alpha + dt_bias)
   * a, then the delta rule on the head's ``[d_k, d_v]`` float32 state (decay, read, correct,
   read out; written back after the sequence's last row) and the gated RMSNorm of the output
   times SiLU(z); with ``q8``, also the int8 form of its output blocks for ``ssm_out``'s int8
   product (``q8dot.store_q8``).

Both take the rows of a batched step (``deltanet_rows``; issue 46): a decode step is bound by
latency, not arithmetic, so a launch per sequence made B sequences cost nearly B steps' DeltaNet.
The sequences come from a small device table (``sequence_row``: per sequence its window's and
state's addresses, its first row and row count, and where the states after each row go for a
verify that may keep fewer rows: ``runtime.cache.RowStates``); each program runs its sequence's
rows in order (a verify's rows are consecutive tokens of one sequence), each row exactly one
token's math. A single step is the same launch with a table of one sequence of one row, so a
row's bits cannot depend on the batch.

Everything runs in float32 between the two bf16/f32 boundaries (projections in, ``ssm_out``
input out); the torch path (``runtime.models.qwen35moe``) rounds to the activation dtype in a
few places, so the two agree to that dtype's precision, not bit for bit. The torch path stays the
reference (CPU, prefill).

3. ``chunk_state_kernel`` (prefill): the chunked form (``gated_delta_rule_chunked``) computes
   everything that does not depend on the state for all chunks at once, then carries the state
   from chunk to chunk: three small products per chunk, about seven torch launches each, so a
   512-token prompt cost ~1700 launches over 30 layers and the host, not the GPU, set the pace.
   One program per (value head, block of state columns) keeps its state block in registers and
   walks the chunks in order. Its products run as three-pass TF32 (``tf32x3``: float32-level
   accuracy on the tensor cores; plain float32 FMA products ran out of registers and made a
   2048-token chunk slower than the torch loop), so the fused and torch forms agree to float32
   round-off. Row-major inputs keep its loads coalesced.
   ``chunk_prep_kernel`` builds its inputs, one program per (value head, chunk): the cumulative
   decays, the masked K K^T and Q K^T, and the solve of the chunk's unit lower-triangular system
   (I + A) X = I, by forward substitution inside blocks of 16 rows (16 steps for all blocks at
   once) and then block by block, every step a small ``tl.dot``; the torch form of the same
   terms is ~40 launches, a batched trsm among them (``deltanet_chunked``).
4. ``prefill_prep_kernel`` (prefill): the conv over the window and the call's inputs, SiLU, the
   l2 norms, the tiled key heads and the gates, for blocks of tokens of one value head, straight
   into the float32 tensors the chunked form takes (the torch form is ~35 launches a layer).
5. ``gated_norm_kernel`` (prefill): the output's per-head RMSNorm times SiLU(z), with the torch
   form's rounding points (six launches there).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import wait_prior
from .q8dot import QBLOCK, Int8Rows, as_rows, new_q8, store_q8


@triton.jit
def _sequence(seq_ptr, s, x_ptr):
    """Sequence ``s`` of a decode launch's table (``sequence_row``: one int64 row of
    ``SEQUENCE_COLUMNS`` each): its conv window (``x_ptr``'s type) and recurrent state (float32),
    its first row in the launch and its row count, and where the states after each of its first
    ``saves`` rows are copied (windows, states: one after another). A table is written only by
    host copies before the steps that read it (``runtime.device_tables``), so a kernel may read it
    before ``wait_prior``, as it may the decode position (``pdl``)."""
    row = seq_ptr + s.to(tl.int64) * 8
    win = tl.load(row).to(tl.pointer_type(x_ptr.dtype.element_ty))
    state = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    save_win = tl.load(row + 4).to(tl.pointer_type(x_ptr.dtype.element_ty))
    save_state = tl.load(row + 5).to(tl.pointer_type(tl.float32))
    return win, state, tl.load(row + 2), tl.load(row + 3), save_win, save_state, tl.load(row + 6)


@triton.jit
def conv_kernel(x_ptr, seq_ptr, w_ptr, out_ptr, C, stride_x, KM1: tl.constexpr, KP2: tl.constexpr,
                BLOCK: tl.constexpr, PDL: tl.constexpr):
    # (the table before the wait: no kernel writes it, so its load overlaps the previous kernel's tail)
    win_ptr, _, first, count, save_ptr, _, saves = _sequence(seq_ptr, tl.program_id(0), x_ptr)
    wait_prior(PDL)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < C
    r = tl.arange(0, KP2)[:, None]  # window rows (KP2: KM1 rounded up to a power of two)
    rm = (r < KM1) & m[None, :]
    w = tl.load(w_ptr + c[None, :] * (KM1 + 1) + r, mask=rm, other=0.0).to(tl.float32)
    w_new = tl.load(w_ptr + c * (KM1 + 1) + KM1, mask=m, other=0.0).to(tl.float32)
    for t in range(count):  # the sequence's rows in order, each on the window the row before left
        row = first + t  # (int64: the table's)
        # every load before any store: one memory round trip (interleaved, each store waited for the
        # load before it, as the window rows alias)
        x = tl.load(x_ptr + row * stride_x + c, mask=m, other=0.0)
        win = tl.load(win_ptr + r * C + c[None, :], mask=rm, other=0.0)
        acc = tl.sum(win.to(tl.float32) * w, axis=0) + x.to(tl.float32) * w_new
        tl.debug_barrier()  # a row may be loaded and overwritten by different threads: all loads first
        tl.store(win_ptr + (r - 1) * C + c[None, :], win, mask=rm & (r >= 1))  # shift: row j takes row j+1
        tl.store(win_ptr + (KM1 - 1) * C + c, x.to(win_ptr.dtype.element_ty), mask=m)  # the new input last
        tl.store(out_ptr + row * C + c, acc / (1.0 + tl.exp(-acc)), mask=m)
        if t < saves:  # the window after this row, for a sequence that may keep only this far
            at = save_ptr + (row - first) * KM1 * C
            tl.store(at + (r - 1) * C + c[None, :], win, mask=rm & (r >= 1))
            tl.store(at + (KM1 - 1) * C + c, x.to(win_ptr.dtype.element_ty), mask=m)
        tl.debug_barrier()  # the next row reads what this one wrote, maybe in other threads


@triton.jit
def _gates(b_raw, alpha, dt, a):
    """The delta rule's gates from their projections: beta = sigmoid(b_raw), g = softplus(alpha +
    dt) * a (torch's softplus, threshold 20)."""
    beta = 1.0 / (1.0 + tl.exp(-b_raw))
    pre = alpha + dt
    return beta, tl.where(pre > 20.0, pre, tl.log(1.0 + tl.exp(tl.minimum(pre, 20.0)))) * a


@triton.jit
def recurrence_kernel(act_ptr, z_ptr, beta_ptr, alpha_ptr, dt_ptr, a_ptr, seq_ptr, norm_ptr, out_ptr,
                      xq, xd, xs, N_K, N_V, stride_z, stride_b, stride_a, q_scale, eps, D_K: tl.constexpr, D_V: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, Q8: tl.constexpr, PDL: tl.constexpr):
    _, state_ptr, first, count, _, save_ptr, saves = _sequence(seq_ptr, tl.program_id(0), z_ptr)  # (as conv_kernel)
    wait_prior(PDL)
    h = tl.program_id(1)
    kh = h % N_K
    i = tl.arange(0, BLOCK_K)
    j = tl.arange(0, BLOCK_V)
    mi, mj = i < D_K, j < D_V
    kd = N_K * D_K
    C = 2 * kd + N_V * D_V  # a row of the conv's output
    width = N_V * D_V  # a row of the output
    dt = tl.load(dt_ptr + h).to(tl.float32)
    a = tl.load(a_ptr + h).to(tl.float32)
    norm = tl.load(norm_ptr + j, mask=mj, other=0.0).to(tl.float32)
    # The state stays in registers from row to row. What keeps that from spilling: the head's
    # matrix addressed from a scalar base with int32 offsets, and the head sizes known at compile
    # time (offsets fold into the instructions, masks of whole heads vanish).
    head = h.to(tl.int64) * D_K * D_V
    offs = i[:, None] * D_V + j[None, :]
    mm = mi[:, None] & mj[None, :]
    s = tl.load(state_ptr + head + offs, mask=mm, other=0.0)
    for t in range(count):  # the sequence's rows in order
        row = first + t  # (int64: the table's)
        act = act_ptr + row * C
        q = tl.load(act + kh * D_K + i, mask=mi, other=0.0)
        k = tl.load(act + kd + kh * D_K + i, mask=mi, other=0.0)
        v = tl.load(act + 2 * kd + h * D_V + j, mask=mj, other=0.0)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale  # l2 norm: eps inside the rsqrt
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        beta, g = _gates(tl.load(beta_ptr + row * stride_b + h).to(tl.float32),
                         tl.load(alpha_ptr + row * stride_a + h).to(tl.float32), dt, a)
        s = s * tl.exp(g)
        kv = tl.sum(s * k[:, None], axis=0)  # [d_v]
        delta = (v - kv) * beta
        s = s + k[:, None] * delta[None, :]
        if t < saves:  # the state after this row, for a sequence that may keep only this far
            tl.store(save_ptr + ((row - first) * N_V * D_K * D_V + head) + offs, s, mask=mm)
        o = tl.sum(s * q[:, None], axis=0)

        o = o * tl.rsqrt(tl.sum(o * o, axis=0) / D_V + eps) * norm
        z = tl.load(z_ptr + row * stride_z + h * D_V + j, mask=mj, other=0.0).to(tl.float32)
        o = (o * (z / (1.0 + tl.exp(-z)))).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * width + h * D_V + j, o, mask=mj)
        if Q8:  # the head's blocks of the int8 form ssm_out's product reads (D_V == BLOCK_V here)
            store_q8(tl.reshape(o.to(tl.float32), [BLOCK_V // 32, 32]), h * (BLOCK_V // 32) + tl.arange(0, BLOCK_V // 32),
                     width, xq + row * width, xd + row * (width // 32), xs + row * (width // 16))
    tl.store(state_ptr + head + offs, s, mask=mm)


# Warps of a (sequence, value head) program. 16 spill less across the row loop (ptxas -v for
# sm_90) but made the kernel several times slower on the device, one step and batched steps alike
# (fewer programs resident per SM): 8, as before the row loop (BENCHMARKS.md, issue 46).
RECURRENCE_WARPS = 8
SEQUENCE_COLUMNS = 8  # int64 per sequence (7 used): 64 bytes, so a layer's rows of a table stay aligned


def sequence_row(win: torch.Tensor, state: torch.Tensor, first: int, rows: int,
                 saved: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[int]:
    """One sequence's row of a decode launch's table (``_sequence`` reads it): its conv window
    ``[K-1, C]`` and state ``[n_v, d_k, d_v]`` (their addresses: the launch updates them in place),
    its ``rows`` consecutive rows from row ``first`` of the launch; ``saved``: buffers ``[n, K-1,
    C]`` and ``[n, n_v, d_k, d_v]`` that take the window and state after each of its first ``n``
    rows (``runtime.cache.RowStates``)."""
    if saved is None:
        return [win.data_ptr(), state.data_ptr(), first, rows, 0, 0, 0, 0]
    sw, ss = saved
    if sw.shape[1:] != win.shape or ss.shape[1:] != state.shape or sw.shape[0] != ss.shape[0] \
            or sw.dtype != win.dtype or ss.dtype != state.dtype or not (sw.is_contiguous() and ss.is_contiguous()):
        raise ValueError("DeltaNet decode: the buffers for the states after each row must be contiguous "
                         "[n, *window] and [n, *state] of their types")
    return [win.data_ptr(), state.data_ptr(), first, rows, sw.data_ptr(), ss.data_ptr(), sw.shape[0], 0]


def deltanet_rows(qkv: torch.Tensor, z: torch.Tensor, beta: torch.Tensor, alpha: torch.Tensor,
                  dt_bias: torch.Tensor, a: torch.Tensor, conv_w: torch.Tensor, sequences: torch.Tensor,
                  norm_w: torch.Tensor, n_k: int, d_k: int, d_v: int, eps: float, q8: bool = False
                  ) -> "torch.Tensor | tuple[torch.Tensor, Int8Rows]":
    """One-token decode steps of a Gated DeltaNet layer, from its projections to ``ssm_out``'s
    input, for the rows of a batched step: every sequence of ``sequences`` (a device table,
    ``[n, SEQUENCE_COLUMNS]`` int64 of ``sequence_row``s) takes its rows one after another on its
    own conv window and state (updated in place). Two launches for all rows: one program per
    (sequence, block of channels) for the conv, one per (sequence, value head) for the rest,
    each running its sequence's rows in order with exactly one token's math, so a row's bits are
    those of its step alone (a single step is the same launch with a table of one sequence of one
    row: the same compiled kernels, the counts read at run time).

    qkv: ``[T, C]`` conv inputs (q | k | v channels, ``C = 2 n_k d_k + n_v d_v``); z ``[T, n_v
    * d_v]``; beta, alpha: ``[T, n_v]`` (pre-sigmoid / pre-softplus projections): unit inner
    stride, any row stride (column bands of the stacked projection); dt_bias, a: ``[n_v]`` (``a``
    = -exp(A_log), as the GGUF stores it); conv_w ``[C, K]``; norm_w ``[d_v]``. Each sequence's
    window is ``[K-1, C]`` in qkv's dtype and its state ``[n_v, d_k, d_v]`` float32, contiguous
    (``sequence_row`` takes them). Returns rows ``[T, n_v * d_v]`` in ``z``'s dtype (``ssm_out``'s
    input); ``q8`` (d_v a power of two >= 32): also their int8 form, ``(out, Int8Rows)``, computed
    per head in the same launch.
    """
    T, C = qkv.shape
    n_v = beta.shape[1]
    K = conv_w.shape[1]
    if K < 2 or C != 2 * n_k * d_k + n_v * d_v or z.shape != (T, n_v * d_v) or alpha.shape != (T, n_v) \
            or beta.shape[0] != T or conv_w.shape[0] != C or not conv_w.is_contiguous() \
            or any(t.stride(-1) != 1 for t in (qkv, z, beta, alpha)):
        raise ValueError("DeltaNet decode: inconsistent shapes or strides")
    if sequences.dtype != torch.int64 or sequences.dim() != 2 or sequences.shape[1] != SEQUENCE_COLUMNS \
            or not sequences.is_contiguous():
        raise ValueError(f"DeltaNet decode: the sequence table must be a contiguous int64 [n, {SEQUENCE_COLUMNS}]")
    if q8 and (d_v < QBLOCK or d_v & (d_v - 1)):
        raise ValueError(f"DeltaNet decode: an int8 output needs a power-of-two value head size >= {QBLOCK}, got {d_v}")
    n = sequences.shape[0]
    act = torch.empty(T, C, dtype=torch.float32, device=qkv.device)
    block = 256  # many programs, each a short latency chain
    conv_kernel[(n, triton.cdiv(C, block))](qkv, sequences, conv_w, act, C, qkv.stride(0), KM1=K - 1,
                                            KP2=triton.next_power_of_2(K - 1), BLOCK=block, num_warps=2,
                                            **pdl.flags(qkv))
    out = torch.empty(T, n_v * d_v, dtype=z.dtype, device=z.device)
    codes = new_q8(T, n_v * d_v, z.device) if q8 else (out, out, out)
    recurrence_kernel[(n, n_v)](act, z, beta, alpha, dt_bias, a, sequences, norm_w, out, *codes, n_k, n_v,
                                z.stride(0), beta.stride(0), alpha.stride(0), d_k ** -0.5, eps, D_K=d_k, D_V=d_v,
                                BLOCK_K=triton.next_power_of_2(d_k), BLOCK_V=triton.next_power_of_2(d_v), Q8=q8,
                                num_warps=RECURRENCE_WARPS, **pdl.flags(act))
    return (out, as_rows(codes)) if q8 else out


@triton.jit(do_not_specialize=["n_chunks"])
def chunk_state_kernel(w_ptr, q_ptr, u0_ptr, qk_ptr, eg_ptr, kd_ptr, keep_ptr, state_ptr, out_ptr,
                        n_chunks, D_K, D_V,
                        sw_h, sw_n, sw_r, sw_c, sq_h, sq_n, sq_r, sq_c, su_h, su_n, su_r, su_c,
                        sqk_h, sqk_n, sqk_r, sqk_c, skd_h, skd_n, skd_r, skd_c, seg_h, seg_n, seg_r,
                        skp_h, skp_n, so_h, so_n, so_r,
                        C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    h = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    r = tl.arange(0, C)
    i = tl.arange(0, BLOCK_K)
    mi, mj = i < D_K, j < D_V
    s_offs = h * D_K * D_V + i[:, None] * D_V + j[None, :]
    ms = mi[:, None] & mj[None, :]
    S = tl.load(state_ptr + s_offs, mask=ms, other=0.0)
    for n in range(n_chunks):
        W = tl.load(w_ptr + h * sw_h + n * sw_n + r[:, None] * sw_r + i[None, :] * sw_c, mask=mi[None, :], other=0.0)
        U = tl.load(u0_ptr + h * su_h + n * su_n + r[:, None] * su_r + j[None, :] * su_c, mask=mj[None, :], other=0.0)
        U = U - tl.dot(W, S, input_precision="tf32x3")  # U = U0 - W S0
        Q = tl.load(q_ptr + h * sq_h + n * sq_n + r[:, None] * sq_r + i[None, :] * sq_c, mask=mi[None, :], other=0.0)
        QK = tl.load(qk_ptr + h * sqk_h + n * sqk_n + r[:, None] * sqk_r + r[None, :] * sqk_c)
        eg = tl.load(eg_ptr + h * seg_h + n * seg_n + r * seg_r)
        O = eg[:, None] * tl.dot(Q, S, input_precision="tf32x3") + tl.dot(QK, U, input_precision="tf32x3")
        tl.store(out_ptr + h * so_h + n * so_n + r[:, None] * so_r + j[None, :], O, mask=mj[None, :])
        KdT = tl.load(kd_ptr + h * skd_h + n * skd_n + r[None, :] * skd_r + i[:, None] * skd_c, mask=mi[:, None],
                      other=0.0)
        S = tl.load(keep_ptr + h * skp_h + n * skp_n) * S + tl.dot(KdT, U, input_precision="tf32x3")
    tl.store(state_ptr + s_offs, S, mask=ms)


@triton.jit(do_not_specialize=["T"])
def chunk_prep_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, qc_ptr, w_ptr, u0_ptr, qk_ptr, eg_ptr, kd_ptr, keep_ptr,
                       T, H, D_K, D_V, C: tl.constexpr, BS: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    """One (value head, chunk): everything of the chunked form that does not depend on the state.
    Rows past T are the padding tokens that change nothing (k = v = beta = g = 0)."""
    wait_prior(PDL)
    h, c = tl.program_id(0), tl.program_id(1)
    r = tl.arange(0, C)
    t = c * C + r
    tm = t < T
    i, j = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_V)
    mk, mv = tm[:, None] & (i < D_K)[None, :], tm[:, None] & (j < D_V)[None, :]
    row = t.to(tl.int64) * H + h
    out = (h.to(tl.int64) * tl.num_programs(1) + c) * C + r  # row of the [H, n, C, .] outputs
    g = tl.load(g_ptr + row, mask=tm, other=0.0)
    beta = tl.load(b_ptr + row, mask=tm, other=0.0)
    G = tl.cumsum(g, axis=0)
    eg = tl.exp(G)
    lower = r[:, None] > r[None, :]
    decay = tl.exp(tl.where(lower | (r[:, None] == r[None, :]), G[:, None] - G[None, :], float("-inf")))
    k = tl.load(k_ptr + row[:, None] * D_K + i[None, :], mask=mk, other=0.0)
    A = tl.where(lower, beta[:, None] * decay * tl.dot(k, tl.trans(k), input_precision="tf32x3"), 0.0)
    # X = (I + A)^-1, A strictly lower: forward substitution inside blocks of BS rows (BS steps,
    # the rows of every block at once), then block by block: X_a = X_aa (I_a - sum_b<a A_ab X_b).
    eye = (r[:, None] == r[None, :]).to(tl.float32)
    blk = r // BS
    X = eye
    diag = tl.where(blk[:, None] == blk[None, :], A, 0.0)
    for s in tl.static_range(1, BS):
        sel = (r % BS == s)[:, None]
        X = tl.where(sel, eye - tl.dot(tl.where(sel, diag, 0.0), X, input_precision="tf32x3"), X)
    inv_diag = X
    off = tl.where(blk[:, None] > blk[None, :], A, 0.0)
    for a in tl.static_range(1, C // BS):
        sel = (blk == a)[:, None]
        R = tl.dot(tl.where(sel, off, 0.0), X, input_precision="tf32x3")
        X = tl.where(sel, tl.dot(inv_diag, tl.where(sel, eye - R, 0.0), input_precision="tf32x3"), X)
    W = tl.dot(X, (beta * eg)[:, None] * k, input_precision="tf32x3")
    last = tl.sum(tl.where(r == C - 1, G, 0.0), axis=0)
    tl.store(w_ptr + out[:, None] * D_K + i[None, :], W, mask=(i < D_K)[None, :])
    tl.store(kd_ptr + out[:, None] * D_K + i[None, :], k * tl.exp(last - G)[:, None], mask=(i < D_K)[None, :])
    q = tl.load(q_ptr + row[:, None] * D_K + i[None, :], mask=mk, other=0.0)
    tl.store(qc_ptr + out[:, None] * D_K + i[None, :], q, mask=(i < D_K)[None, :])
    QK = tl.dot(q, tl.trans(k), input_precision="tf32x3") * decay
    tl.store(qk_ptr + out[:, None] * C + r[None, :], QK)
    v = tl.load(v_ptr + row[:, None] * D_V + j[None, :], mask=mv, other=0.0)
    U0 = tl.dot(X, beta[:, None] * v, input_precision="tf32x3")
    tl.store(u0_ptr + out[:, None] * D_V + j[None, :], U0, mask=(j < D_V)[None, :])
    tl.store(eg_ptr + out, eg)
    tl.store(keep_ptr + h.to(tl.int64) * tl.num_programs(1) + c, tl.exp(last))


def deltanet_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, chunk: int) -> torch.Tensor:
    """The chunked delta rule (``runtime.models.qwen35moe.gated_delta_rule_chunked``'s math) in two
    launches: one program per (head, chunk) builds the chunk's state-free terms, including the
    solve of its unit lower-triangular system (the torch form: ~40 launches, a batched trsm among
    them), then ``chunk_state_kernel`` carries the state from chunk to chunk. ``q, k [T, H, d_k]``, ``v [T, H, d_v]``,
    ``g, beta [T, H]``: float32 contiguous (``deltanet_prefill_inputs``' outputs); ``state [H, d_k,
    d_v]`` float32 contiguous, updated in place; ``chunk`` a power of two >= 16. Returns the
    outputs ``[T, H, d_v]`` float32 contiguous (a prefix of a buffer padded to whole chunks)."""
    T, H, d_k = q.shape
    d_v = v.shape[-1]
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in (q, k, v, g, beta)) or k.shape != q.shape \
            or v.shape[:2] != (T, H) or g.shape != (T, H) or beta.shape != (T, H) or chunk < 16 or chunk & (chunk - 1):
        raise ValueError("DeltaNet chunked: float32 contiguous q, k [T, H, d_k], v [T, H, d_v], g, beta [T, H] "
                         "and a power-of-two chunk >= 16")
    if state.shape != (H, d_k, d_v) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("DeltaNet chunked: the state must be a contiguous float32 [H, d_k, d_v]")
    n = triton.cdiv(T, chunk)
    f32 = dict(dtype=torch.float32, device=q.device)
    Qc, W, Kd = (torch.empty(H, n, chunk, d_k, **f32) for _ in range(3))
    U0, QK = torch.empty(H, n, chunk, d_v, **f32), torch.empty(H, n, chunk, chunk, **f32)
    eG, keep = torch.empty(H, n, chunk, **f32), torch.empty(H, n, **f32)
    o = torch.empty(n * chunk, H, d_v, **f32)
    if T:
        chunk_prep_kernel[(H, n)](q, k, v, g, beta, Qc, W, U0, QK, eG, Kd, keep, T, H, d_k, d_v, C=chunk,
                                   BS=16, BLOCK_K=max(16, triton.next_power_of_2(d_k)),
                                   BLOCK_V=max(16, triton.next_power_of_2(d_v)), num_warps=8, **pdl.flags(q))
        # per (head, chunk): U = U0 - W S, output eG * (Q S) + QK U (written token-major into o),
        # then S = keep * S + Kd^T U
        out = o.view(n, chunk, H, d_v).permute(2, 0, 1, 3)  # [H, n, C, d_v] over the token-major buffer
        mats = (W, Qc, U0, QK, Kd)
        strides = [st for t in mats for st in t.stride()] + list(eG.stride()) + list(keep.stride()) \
            + list(out.stride()[:3])
        block_v = max(16, min(32, triton.next_power_of_2(d_v)))
        chunk_state_kernel[(H, triton.cdiv(d_v, block_v))](W, Qc, U0, QK, eG, Kd, keep, state, out, n, d_k, d_v,
                                                            *strides, C=chunk,
                                                            BLOCK_K=max(16, triton.next_power_of_2(d_k)),
                                                            BLOCK_V=block_v, num_warps=8, num_stages=1, **pdl.flags(W))
    return o[:T]


# ----------------------------------------------------------------------------- prefill glue
# A program takes BLOCK_T tokens of one value head (one token per program would be T * n_v
# programs, which Triton's interpreter runs one by one).

@triton.jit
def _conv_rows(x_ptr, win_ptr, w_ptr, t, tm, c, m, C, stride_x, KM1: tl.constexpr):
    """SiLU of the causal depthwise conv at tokens ``t [BT]`` for channels ``c [BC]``: taps over
    the inputs ``t-KM1 .. t``, those before the call read from the window (row ``KM1 + s`` for
    input ``s < 0``). Returns ``[BT, BC]`` float32."""
    acc = tl.zeros([t.shape[0], c.shape[0]], dtype=tl.float32)
    ok = tm[:, None] & m[None, :]
    for tap in tl.static_range(KM1 + 1):
        s = (t - KM1 + tap)[:, None]
        cur = tl.load(x_ptr + tl.maximum(s, 0).to(tl.int64) * stride_x + c[None, :], mask=ok & (s >= 0), other=0.0)
        row = tl.minimum(tl.maximum(KM1 + s, 0), KM1 - 1)
        old = tl.load(win_ptr + row * C + c[None, :], mask=ok & (s < 0), other=0.0)
        w = tl.load(w_ptr + c * (KM1 + 1) + tap, mask=m, other=0.0).to(tl.float32)
        acc += w[None, :] * (cur.to(tl.float32) + old.to(tl.float32))
    return acc / (1.0 + tl.exp(-acc))


@triton.jit(do_not_specialize=["T"])
def prefill_prep_kernel(x_ptr, win_ptr, w_ptr, beta_ptr, alpha_ptr, dt_ptr, a_ptr, q_ptr, k_ptr, v_ptr, g_ptr,
                         b_ptr, T, C, N_K, N_V, D_K, D_V, stride_x, stride_b, stride_a, q_scale,
                         KM1: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                         PDL: tl.constexpr):
    wait_prior(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    h = tl.program_id(1)
    kh = h % N_K  # the converter's tiled order
    i = tl.arange(0, BLOCK_K)
    j = tl.arange(0, BLOCK_V)
    mi, mj = i < D_K, j < D_V
    kd = N_K * D_K
    q = _conv_rows(x_ptr, win_ptr, w_ptr, t, tm, kh * D_K + i, mi, C, stride_x, KM1)
    k = _conv_rows(x_ptr, win_ptr, w_ptr, t, tm, kd + kh * D_K + i, mi, C, stride_x, KM1)
    v = _conv_rows(x_ptr, win_ptr, w_ptr, t, tm, 2 * kd + h * D_V + j, mj, C, stride_x, KM1)
    q = q * tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6)[:, None] * q_scale  # l2 norms, as the decode step
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
    beta, g = _gates(tl.load(beta_ptr + t * stride_b + h, mask=tm, other=0.0).to(tl.float32),
                     tl.load(alpha_ptr + t * stride_a + h, mask=tm, other=0.0).to(tl.float32),
                     tl.load(dt_ptr + h).to(tl.float32), tl.load(a_ptr + h).to(tl.float32))
    row = t.to(tl.int64) * N_V + h
    tl.store(q_ptr + row[:, None] * D_K + i[None, :], q, mask=tm[:, None] & mi[None, :])
    tl.store(k_ptr + row[:, None] * D_K + i[None, :], k, mask=tm[:, None] & mi[None, :])
    tl.store(v_ptr + row[:, None] * D_V + j[None, :], v, mask=tm[:, None] & mj[None, :])
    tl.store(g_ptr + row, g, mask=tm)
    tl.store(b_ptr + row, beta, mask=tm)


def deltanet_prefill_inputs(qkv: torch.Tensor, beta: torch.Tensor, alpha: torch.Tensor, dt_bias: torch.Tensor,
                            a: torch.Tensor, conv_w: torch.Tensor, conv_win: torch.Tensor, n_k: int, d_k: int,
                            n_v: int) -> tuple[torch.Tensor, ...]:
    """What the chunked delta rule takes, for ``T`` tokens, in one launch instead of ~35 torch
    kernels (a prefill call is host-bound: docs/benchmarks-history.md): the causal conv over the window and the
    new inputs with SiLU, q and k l2-normalised (q scaled by ``d_k ** -0.5``) and tiled to the
    value heads (value head ``h`` reads key head ``h % n_k``), beta = sigmoid, g = softplus(alpha +
    dt_bias) * a. ``qkv [T, C]``, ``beta``/``alpha [T, n_v]``: unit inner stride, any row stride
    (column bands of the stacked projection). Returns float32 ``q, k [T, n_v, d_k]``, ``v [T, n_v,
    d_v]``, ``g, beta [T, n_v]``. The window is only read; the caller shifts it afterwards.
    """
    T, C = qkv.shape
    K = conv_w.shape[1]
    d_v = (C - 2 * n_k * d_k) // n_v
    if K < 2 or C != 2 * n_k * d_k + n_v * d_v or conv_win.shape != (K - 1, C) or beta.shape != (T, n_v) \
            or alpha.shape != (T, n_v) or not (conv_w.is_contiguous() and conv_win.is_contiguous()) \
            or any(t.stride(-1) != 1 for t in (qkv, beta, alpha)):
        raise ValueError("DeltaNet prefill: inconsistent shapes or strides")
    f32 = dict(dtype=torch.float32, device=qkv.device)
    q, k = torch.empty(T, n_v, d_k, **f32), torch.empty(T, n_v, d_k, **f32)
    v, g, b = torch.empty(T, n_v, d_v, **f32), torch.empty(T, n_v, **f32), torch.empty(T, n_v, **f32)
    bt = 4 if qkv.is_cuda else 64
    if T:
        prefill_prep_kernel[(triton.cdiv(T, bt), n_v)](
            qkv, conv_win, conv_w, beta, alpha, dt_bias, a, q, k, v, g, b, T, C, n_k, n_v, d_k, d_v, qkv.stride(0),
            beta.stride(0), alpha.stride(0), d_k ** -0.5, KM1=K - 1, BLOCK_T=bt,
            BLOCK_K=triton.next_power_of_2(d_k), BLOCK_V=triton.next_power_of_2(d_v), num_warps=4, **pdl.flags(qkv))
    return q, k, v, g, b


@triton.jit(do_not_specialize=["R"])
def gated_norm_kernel(o_ptr, z_ptr, w_ptr, y_ptr, R, N_V, D_V, stride_z, eps,
                       BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # rows (token, value head)
    j = tl.arange(0, BLOCK_V)
    m = (r < R)[:, None] & (j < D_V)[None, :]
    t, h = r // N_V, r % N_V
    dt = y_ptr.dtype.element_ty
    o = tl.load(o_ptr + r.to(tl.int64)[:, None] * D_V + j[None, :], mask=m, other=0.0).to(dt).to(tl.float32)
    y = (o * tl.rsqrt(tl.sum(o * o, axis=1) / D_V + eps)[:, None]).to(dt).to(tl.float32)
    y = (y * tl.load(w_ptr + j, mask=j < D_V, other=0.0).to(tl.float32)[None, :]).to(dt).to(tl.float32)
    z = tl.load(z_ptr + t.to(tl.int64)[:, None] * stride_z + (h * D_V)[:, None] + j[None, :], mask=m,
                other=0.0).to(tl.float32)
    gate = (z / (1.0 + tl.exp(-z))).to(dt).to(tl.float32)
    tl.store(y_ptr + r.to(tl.int64)[:, None] * D_V + j[None, :], (y * gate).to(dt), mask=m)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The DeltaNet output ``rms_norm(o, weight) * silu(z)`` per value head, in one launch (the
    torch form is six): ``o [T, n_v, d_v]`` float32 contiguous, ``z [T, n_v * d_v]`` with unit inner
    stride (a column band), ``weight [d_v]``. Rounds where the torch form rounds (o, the norm, the
    weighted norm and silu(z) to z's dtype). Returns ``[T, n_v * d_v]`` in z's dtype."""
    T, n_v, d_v = o.shape
    if not o.is_contiguous() or z.shape != (T, n_v * d_v) or z.stride(-1) != 1 or weight.numel() != d_v:
        raise ValueError("DeltaNet gated norm: inconsistent shapes or strides")
    y = torch.empty(T, n_v * d_v, dtype=z.dtype, device=z.device)
    br = 4 if z.is_cuda else 64
    if T:
        gated_norm_kernel[(triton.cdiv(T * n_v, br),)](o, z, weight, y, T * n_v, n_v, d_v, z.stride(0), eps,
                                                        BLOCK_R=br, BLOCK_V=triton.next_power_of_2(d_v), num_warps=4,
                                                        **pdl.flags(o))
    return y
