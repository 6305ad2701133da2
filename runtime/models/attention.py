"""The one attention entry of every architecture: from a block's raw q/k/v projections to
``attn_output``'s input, through the Triton kernels where they run, else through the torch form
that is their reference.

Why a part of its own (llama.cpp's ``build_attn`` is the model): each arch writes only its
projections and how its gate looks; the q/k norms, rope, the KV append, the choice between the
kernels and torch, and a batched decode step's rows (one launch of each kernel for all of them,
or in the torch form one sequence at a time) live here once.
A model composes one (``MoEModel.attention``) and says per call whether its kernels run
(``MoEModel.kernels``, which tests switch).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..cache import Cache, KVCache, prefill_rows
from ..layers import (Rope, Rows, attend_buffers, attention, cat_rows, causal_sdpa_after, fused_sdpa_runs,
                      output_gate, positions, rms_norm)
from ..weights import Weights

if TYPE_CHECKING:
    from ..kernels.attention import KVRows
    from .base import Batch


class Attention:
    """Attention over the weights ``w`` (the q/k norms ``blk.N.attn_{q,k}_norm``), RMSNorm epsilon ``eps``."""

    def __init__(self, w: Weights, eps: float):
        self.w, self.eps = w, eps

    def __call__(self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: "Cache | Batch",
                 pos0: "int | torch.Tensor", rope: Rope, window: int = 0, gate: torch.Tensor | None = None,
                 gate_kind: str = "none", *, kernels: bool) -> Rows:
        """Attention of layer ``il`` from the raw projections (``q [T, H, d]``, k and v
        ``[T, H_kv, d]``, ``gate`` as ``layers.output_gate`` takes it): the q/k RMSNorms, rope,
        the KV append and the gated attention, as ``attn_output``'s input ``[T, H * d]``. The
        kernels (``step``) where ``kernels`` and they run, else the torch form (the reference); a
        batched decode step's sequences (a ``Batch``) one at a time, each over its own cache at
        its position: with the kernels, one launch of each for all rows (``rows_step``)."""
        if not isinstance(cache, Cache):  # a Batch
            o = self.rows_step(il, q, k, v, cache, rope, window, gate, gate_kind) if kernels else None
            if o is not None:
                return o
            return cat_rows([self(il, q[b:b + 1], k[b:b + 1], v[b:b + 1], c, at, rope, window,
                                  None if gate is None else gate[b:b + 1], gate_kind, kernels=kernels)
                             for b, (c, at) in enumerate(zip(cache.caches, cache.pos))])
        o = self.step(il, q, k, v, cache, pos0, rope, window, gate, gate_kind) if kernels else None
        if o is not None:
            return o
        p, w, T = f"blk.{il}.", self.w, q.shape[0]
        q = rms_norm(q, w(p + "attn_q_norm.weight"), self.eps)
        k = rms_norm(k, w(p + "attn_k_norm.weight"), self.eps)
        cos, sin = rope.cos_sin(positions(pos0, T, q.device), q.dtype)
        q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        o = attention(q, k, v, cache.layers[il], pos0, window)  # [T, H, d]
        return Rows(output_gate(o, gate, gate_kind).reshape(T, -1))

    def step(self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: Cache,
             pos0: "int | torch.Tensor", rope: Rope, window: int = 0, gate: torch.Tensor | None = None,
             gate_kind: str = "none") -> Rows | None:
        """Attention from the raw projections (``q [T, H, d]``, k and v ``[T, H_kv, d]``) with the
        Triton kernels of ``kernels/attention.py``, returning ``attn_output``'s input ``[T, H * d]``
        (with one decode row's int8 form), or None where the torch form runs instead (not a KV
        layer, float64).
        The q/k RMSNorms, rope and the KV append are one launch for any T; one token then attends
        in two more (split and combine, the output gate included); several tokens (prefill)
        attend and take the gate in torch: from position 0 with torch's fused causal attention
        (``layers.attend_buffers``), after a past with its lower-right form
        (``layers.causal_sdpa_after``) where no sliding window clips the past, else (a window, a
        Q8_0 cache) with one launch of ``attention.attend_prefill``, which also serves a call whose
        position is on the device (a padded call, ``runtime.graph.PrefillGraphs``). A Q8_0
        KV cache is written as codes (and, decoding, read as codes). Gate kinds as
        ``attention.attend_decode`` takes them."""
        kv = cache.layers[il] if cache is not None else None
        if not (isinstance(kv, KVCache) and q.dtype in (torch.bfloat16, torch.float16, torch.float32)):
            return None
        from ..kernels.attention import attend_prefill

        T, H, d = q.shape
        if not isinstance(pos0, torch.Tensor):
            kv.reserve(pos0 + T, k, T)
        qr, rows = self._append(il, q, k, v, [kv], [pos0], rope, T)
        if T > 1:
            # After a past (a long prompt's later chunks, a chat's next turn) the unfused form
            # scored in pieces (~10 launches) over a past that grows with the prompt: a long
            # prompt prefills faster with attend_prefill.
            if not kv.q8 and isinstance(pos0, int) and pos0 > 0 and window <= 0 and fused_sdpa_runs(qr):
                o = causal_sdpa_after(qr, kv.k[:, : pos0 + T], kv.v[:, : pos0 + T])
            elif not kv.q8 and (isinstance(pos0, torch.Tensor) or pos0 > 0):
                o = attend_prefill(qr, kv.k, kv.v, pos0, window, kv.ring)
            elif kv.q8 and not isinstance(pos0, torch.Tensor) and pos0 > 0:  # the rows it reads, expanded
                o = attend_prefill(qr, *kv.buffers(pos0 + T), pos0, window, kv.ring)
            else:
                o = attend_buffers(qr, *kv.buffers(prefill_rows(pos0, T)), pos0, window, kv.ring)
            return Rows(output_gate(o, gate, gate_kind).reshape(T, H * d))
        return self._attend(qr, rows, window, gate, gate_kind)

    def rows_step(self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: "Batch", rope: Rope,
                  window: int = 0, gate: torch.Tensor | None = None, gate_kind: str = "none") -> Rows | None:
        """``step`` for a batched decode step's rows (``q [B, H, d]``, one token of row b at
        ``batch.pos[b]`` over ``batch.caches[b]``), one launch of each kernel for all rows: every
        row's keys and values appended first (rows of one sequence at consecutive positions: a
        verify step), then each row attends over its own cache up to its own position. Row b is
        bit for bit its sequence's single step: the same kernels, a row's program reading only
        its own row. None where the torch form runs instead."""
        layers = [c.layers[il] for c in batch.caches]
        if not (all(isinstance(kv, KVCache) for kv in layers)
                and q.dtype in (torch.bfloat16, torch.float16, torch.float32)):
            return None
        if not any(isinstance(p, torch.Tensor) for p in batch.pos):  # (a captured step's caller reserved them)
            ends: dict[int, tuple[KVCache, int, int]] = {}
            for kv, p in zip(layers, batch.pos):
                _, end, n = ends.get(id(kv), (kv, 0, 0))
                ends[id(kv)] = (kv, max(end, p + 1), n + 1)
            for kv, end, n in ends.values():  # (each as its rows' single steps grow it; a ring for the n rows)
                kv.reserve(end, k, n)
        qr, rows = self._append(il, q, k, v, layers, list(batch.pos), rope, 1)
        return self._attend(qr, rows, window, gate, gate_kind)

    def _append(self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layers: list[KVCache],
                pos: list, rope: Rope, T: int) -> tuple[torch.Tensor, "KVRows"]:
        """The q/k norms, rope and KV append of rows of T tokens over ``layers`` (one launch), and
        the rows' ``KVRows`` for attending."""
        from ..kernels.attention import kv_rows, qk_norm_rope_append_rows

        p = f"blk.{il}."
        rows = kv_rows([(kv.k, kv.v, kv.k_scale, kv.v_scale) for kv in layers], pos, layers[0].ring, T)
        qr = qk_norm_rope_append_rows(q, k, v, self.w.opt(p + "attn_q_norm.weight"),
                                      self.w.opt(p + "attn_k_norm.weight"), self.eps, rope.inv_on(q.device),
                                      rope.scale, rows)
        return qr, rows

    @staticmethod
    def _attend(qr: torch.Tensor, rows: "KVRows", window: int, gate: torch.Tensor | None, gate_kind: str) -> Rows:
        """One-token rows' attention over their caches, gated (two launches), as ``attn_output``
        takes it (with its int8 form where the products read one)."""
        from ..kernels import q8dot
        from ..kernels.attention import attend_decode_rows

        q8 = q8dot.wanted(qr.shape[0], qr.shape[2])
        o = attend_decode_rows(qr, rows, window, gate, gate_kind, q8=q8)
        return Rows(*o) if q8 else Rows(o)
