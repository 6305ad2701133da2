"""Qwen3.5/3.6 MoE (GGUF ``qwen35moe``): Gated DeltaNet linear-attention layers with a gated full
attention layer every ``full_attention_interval``; every layer MoE (softmax top-k renormalised)
plus a shared expert behind a sigmoid gate.

What the converter changed, which this file relies on: every ``1 + w`` RMSNorm weight is stored
with the 1 added (the DeltaNet output norm is a plain ``w`` norm and stays as is); ``A_log`` is
stored as ``ssm_a = -exp(A_log)``; the conv kernel is squeezed to ``[C, K]``; and the DeltaNet
value heads are reordered from grouped-by-key-head to tiled order, so value head ``h`` reads key
head ``h % n_k_heads`` (not ``h // ratio`` as in transformers). Within this reordered basis the
math is transformers' recurrent gated delta rule.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sparkpack.formats.archs import LINEAR
from sparkpack.formats.memory import DELTANET_CHUNK

from .. import device_tables
from ..cache import Cache, RecurrentState
from ..layers import Normed, Rope, Rows, cat_rows, l2_norm, rms_norm, rope_inv_freq, route_softmax, wide
from .base import Batch, MoEModel

if TYPE_CHECKING:
    from .qwen35moe_mtp import MTPHead


CHUNK = DELTANET_CHUNK  # tokens per block of the chunked prefill (formats.memory plans its temporaries)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrent form, one token at a time: ``q, k [T, H, dk]``, ``v [T, H, dv]``, ``g, beta [T, H]``,
    ``state [H, dk, dv]``. Returns outputs ``[T, H, dv]`` and the new state. The reference form,
    used for decode and short prefills; longer prefills use the chunked form below."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        kv_mem = (state * k[t][:, :, None]).sum(-2)  # [H, dv]
        delta = (v[t] - kv_mem) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = (state * q[t][:, :, None]).sum(-2)
    return out, state


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor, chunk: int = CHUNK
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence, ``chunk`` tokens per step (for prefill): equal outputs up to round-off.

    Within a chunk with start state S0 and cumulative log-decay G, the recurrent updates
    u_t = beta_t (v_t - S'_t k_t) form a unit lower-triangular system
    (I + A) U = beta (V - e^G (K S0)),  A[t,s] = beta_t e^(G_t - G_s) k_t.k_s  (s < t),
    so U = U0 - W S0 with U0 = (I + A)^-1 beta V and W = (I + A)^-1 beta e^G K, neither of which
    depends on the state: they (and the masked Q K^T) are computed for all chunks at once, and
    only the state is carried chunk to chunk: O = e^G (Q S0) + tril(Q K^T e^(G_t - G_s)) U, end
    state e^(G_last) S0 + K^T (e^(G_last - G) U). Shapes as in ``gated_delta_rule``; the input
    is padded to whole chunks with tokens that change nothing (k = v = beta = g = 0). The torch
    reference of ``kernels.deltanet.deltanet_chunked`` (the GPU prefill's two launches).
    """
    T, H = q.shape[:2]
    n = -(-T // chunk)
    pad = n * chunk - T

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [H, n, chunk, ...]
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, 0, 0, pad))
        return t.reshape(n, chunk, H, *t.shape[2:]).transpose(0, 2).transpose(1, 2)

    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    bc = chunks(beta)[..., None]  # [H, n, C, 1]
    G = chunks(g).cumsum(-1)  # [H, n, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(causal, G[..., :, None] - G[..., None, :], float("-inf")).exp()  # 0 above diagonal
    A = (bc * decay * (kc @ kc.transpose(-1, -2))).tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    eG = G.exp()[..., None]
    UW = torch.linalg.solve_triangular(eye + A, torch.cat((bc * vc, bc * eG * kc), -1), upper=False,
                                       unitriangular=True)
    U0, W = UW[..., :vc.shape[-1]], UW[..., vc.shape[-1]:]
    QK = (qc @ kc.transpose(-1, -2)) * decay
    last = G[..., -1:]  # [H, n, 1]
    kdec = kc * (last - G).exp()[..., None]  # [H, n, C, dk]
    keep = last.exp()[..., None]  # [H, n, 1, 1]
    WQ = torch.cat((W, qc), -2)  # one product with the state gives W S0 and Q S0
    kdec_t = kdec.transpose(-1, -2)
    out = torch.empty_like(vc)
    for i in range(n):
        P = WQ[:, i] @ state  # [H, 2C, dv]
        U = U0[:, i] - P[:, :chunk]
        out[:, i] = torch.baddbmm(eG[:, i] * P[:, chunk:], QK[:, i], U)
        state = torch.baddbmm(keep[:, i] * state, kdec_t[:, i], U)
    return out.transpose(1, 2).transpose(0, 2).reshape(n * chunk, H, -1)[:T], state


def sequences(caches: Sequence[Cache]) -> list[tuple[Cache, int, int]]:
    """A step's rows (one cache each) as sequences: each cache with its first row and row count
    (a verify's rows are one cache at consecutive positions; a batched step's, one row per cache)."""
    out: list[tuple[Cache, int, int]] = []
    for row, c in enumerate(caches):
        if out and out[-1][0] is c:
            out[-1] = (c, out[-1][1], out[-1][2] + 1)
        elif any(o[0] is c for o in out):
            raise ValueError("a batched step's rows of one sequence must be consecutive")
        else:
            out.append((c, row, 1))
    return out


class Qwen35MoE(MoEModel):
    arch = "qwen35moe"
    ffn_norm = "post_attention_norm"
    # the MoE input feeds the router, the shared expert's gate and its gate/up: one GEMM
    FFN_IN = ("ffn_gate_inp", "ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp")
    STACKS = (("attn_q", "attn_k", "attn_v"), ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"), FFN_IN)
    topk_of_logits = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        rope = self.spec.rope
        self.rope = Rope(rope.dim, rope_inv_freq(rope.freq_base, rope.dim), 1.0, rope.sections)
        d = self.spec.deltanet
        self.kernel, self.n_k, self.d_k, self.n_v, self.d_v = d.conv_kernel, d.n_k, d.d_k, d.n_v, d.d_v
        self.norm_topk = self.spec.norm_topk
        self._mtp: "MTPHead | None" = None

    def load_mtp(self) -> "MTPHead":
        """The file's multi-token-prediction head (``qwen35moe_mtp``), its weights loaded on the
        first call: only a run that drafts pays their memory. A file without one is one error."""
        if self._mtp is None:
            from .qwen35moe_mtp import MTPHead

            self._mtp = MTPHead(self)
            self._mtp.preload()
        return self._mtp

    def block(self, il: int, x: torch.Tensor, cache: "Cache | Batch", pos0: "int | torch.Tensor", pre: Normed | None
              ) -> tuple[torch.Tensor, Normed | None]:
        h = self.norm(x, f"blk.{il}.attn_norm.weight", pre)
        if self.spec.layers[il].attention == LINEAR:
            a = self.delta_net(il, h, cache)
        else:
            a = self.attn(il, h, cache, pos0)
        x, h = self.add_norm(x, a, f"blk.{il}.post_attention_norm.weight")
        return self.ffn(il, h, x)

    def attn(self, il: int, h: Rows, cache: "Cache | Batch", pos0: "int | torch.Tensor") -> torch.Tensor:
        p, d, T = f"blk.{il}.", self.spec.head_dim, h.x.shape[0]
        qg, k, v = self.proj.project(h, p, "attn_q", "attn_k", "attn_v")
        qg = qg.view(T, -1, 2 * d)  # per head: [query | gate]
        q, gate = qg[..., :d], qg[..., d:]
        k, v = k.view(T, -1, d), v.view(T, -1, d)
        o = self.attend(il, q, k, v, cache, pos0, self.rope, gate=gate, gate_kind="sigmoid")
        return self.linear(o, p + "attn_output.weight")

    def delta_net(self, il: int, h: Rows, cache: "Cache | Batch") -> torch.Tensor:
        """The Gated DeltaNet block on its normed input: the projections, the recurrence over the
        layer's state, the output projection. One-token rows (a decode step, a batched step's
        rows, a verify's) take the fused decode kernels in one launch for all (``delta_net_rows``);
        the torch form (``delta_rule``) runs a batched step's rows one at a time, each on its
        sequence's state."""
        p, T = f"blk.{il}.", h.x.shape[0]
        qkv, z, beta, alpha = self.proj.project(h, p, "attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")  # qkv [T, C]
        z = z.view(T, self.n_v, self.d_v)
        if self.kernels and qkv.dtype != torch.float64 and (T == 1 or isinstance(cache, Batch)):
            o = self.delta_net_rows(il, qkv, z, beta, alpha, cache)
        elif isinstance(cache, Batch):
            rows = []
            for b, c in enumerate(cache.caches):
                rows.append(self.delta_rule(il, qkv[b:b + 1], z[b:b + 1], beta[b:b + 1], alpha[b:b + 1], c.layers[il]))
                if cache.states is not None:  # a verify step: the state each kept length leaves
                    cache.states.save(il, b, c.layers[il])
            o = cat_rows(rows)
        else:
            o = self.delta_rule(il, qkv, z, beta, alpha, cache.layers[il])
        return self.linear(o, p + "ssm_out.weight")

    def recurrent(self, st: RecurrentState, qkv: torch.Tensor) -> RecurrentState:
        """``st`` with its tensors, allocated on the first token (then updated in place: see
        ``RecurrentState``) in ``qkv``'s type and device."""
        if st.conv is None:
            st.conv = qkv.new_zeros(self.kernel - 1, qkv.shape[1])
            # the recurrent state accumulates over the whole sequence: keep it in >= float32
            st.ssm = wide(qkv.new_zeros(self.n_v, self.d_k, self.d_v))
        return st

    def delta_rule(self, il: int, qkv: torch.Tensor, z: torch.Tensor, beta: torch.Tensor, alpha: torch.Tensor,
                   st: RecurrentState) -> Rows:
        """One sequence's DeltaNet from its projections (``qkv [T, C]``, ``z [T, n_v, d_v]``, beta
        and alpha ``[T, n_v]``) over its state ``st`` (updated): the gated normed output rows
        ``[T, n_v * d_v]`` that ``ssm_out`` projects."""
        p, w, T = f"blk.{il}.", self.w, qkv.shape[0]
        self.recurrent(st, qkv)
        if self.kernels and qkv.dtype != torch.float64:
            return self.delta_net_prefill(il, qkv, z, beta, alpha, st)
        beta = torch.sigmoid(beta)
        g = F.softplus(alpha + w(p + "ssm_dt.bias")) * w(p + "ssm_a")

        # causal depthwise conv over [previous K-1 inputs ; new inputs], then SiLU
        conv_w = w(p + "ssm_conv1d.weight")  # [C, K]
        xin = torch.cat((st.conv, qkv), dim=0)
        st.conv.copy_(xin[xin.shape[0] - (self.kernel - 1):])  # in place: see RecurrentState
        qkv = F.silu((xin.unfold(0, self.kernel, 1) * conv_w).sum(-1))  # [T, C]

        kd = self.n_k * self.d_k
        q = qkv[:, :kd].reshape(T, self.n_k, self.d_k)
        k = qkv[:, kd:2 * kd].reshape(T, self.n_k, self.d_k)
        v = qkv[:, 2 * kd:].reshape(T, self.n_v, self.d_v)
        q = l2_norm(q) * self.d_k ** -0.5
        k = l2_norm(k)
        rep = self.n_v // self.n_k
        q, k = q.repeat(1, rep, 1), k.repeat(1, rep, 1)  # tiled: value head h uses key head h % n_k
        q, k, v, g, beta = (wide(t) for t in (q, k, v, g, beta))
        if T > CHUNK:
            o, state = gated_delta_rule_chunked(q, k, v, g, beta, st.ssm)
        else:
            o, state = gated_delta_rule(q, k, v, g, beta, st.ssm)
        st.ssm.copy_(state)
        o = rms_norm(o.to(qkv.dtype), w(p + "ssm_norm.weight"), self.eps) * F.silu(z)
        return Rows(o.reshape(T, -1))

    def route_logits(self, il: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route_softmax(logits, self.spec.n_expert_used, self.norm_topk)

    def delta_net_rows(self, il: int, qkv: torch.Tensor, z: torch.Tensor, beta: torch.Tensor, alpha: torch.Tensor,
                       cache: "Cache | Batch") -> Rows:
        """``delta_rule`` for one-token rows with the fused Triton decode step (``kernels/deltanet.py``):
        the same math as the torch form below the projections, two launches for all of a step's
        rows, each sequence's taken in order on its state (a verify's, with ``Batch.states``, also
        copied after each row), from the step's table of sequences (``sequence_row``s, made once per content:
        ``runtime.device_tables``)."""
        from ..kernels import q8dot
        from ..kernels.deltanet import deltanet_rows, sequence_row

        p, w, T = f"blk.{il}.", self.w, qkv.shape[0]
        caches, saved = (cache.caches, cache.states) if isinstance(cache, Batch) else ((cache,), None)
        seqs = sequences(caches)
        if saved is not None and len(seqs) != 1:
            raise ValueError("the states after each row are kept for a verify of one sequence")
        keep = None if saved is None else (saved.conv[il], saved.ssm[il])
        rows = []
        for c, first, n in seqs:
            st = self.recurrent(c.layers[il], qkv)
            rows.append(tuple(sequence_row(st.conv, st.ssm, first, n, keep)))
        table = device_tables.table(tuple(rows), self.device)
        q8 = q8dot.wanted(T, self.d_v) and self.d_v & (self.d_v - 1) == 0  # a head's blocks, whole
        o = deltanet_rows(qkv, z.reshape(T, -1), beta, alpha, w(p + "ssm_dt.bias"), w(p + "ssm_a"),
                          w(p + "ssm_conv1d.weight"), table, w(p + "ssm_norm.weight"),
                          self.n_k, self.d_k, self.d_v, self.eps, q8=q8)
        return Rows(*o) if q8 else Rows(o)

    def delta_net_prefill(self, il: int, qkv: torch.Tensor, z: torch.Tensor, beta: torch.Tensor,
                          alpha: torch.Tensor, st: RecurrentState) -> Rows:
        """``delta_rule`` for several tokens with the Triton kernels (``kernels/deltanet.py``): the
        conv, norms and gates in one launch, the chunked delta rule in two (its state updated in
        place), the gated output norm in one; a prefill call issues its launches from Python, so
        each torch kernel saved is host time saved."""
        from ..kernels.deltanet import deltanet_chunked, deltanet_prefill_inputs, gated_rms_norm

        p, w, T, keep = f"blk.{il}.", self.w, qkv.shape[0], self.kernel - 1
        q, k, v, g, b = deltanet_prefill_inputs(qkv, beta, alpha, w(p + "ssm_dt.bias"), w(p + "ssm_a"),
                                                w(p + "ssm_conv1d.weight"), st.conv, self.n_k, self.d_k, self.n_v)
        st.conv.copy_(qkv[T - keep:] if T >= keep else torch.cat((st.conv, qkv))[-keep:])  # after the read above
        o = deltanet_chunked(q, k, v, g, b, st.ssm, CHUNK)
        return Rows(gated_rms_norm(o, z.reshape(T, -1), w(p + "ssm_norm.weight"), self.eps))
