"""Laguna (GGUF ``laguna``, Laguna XS.2): pre-norm GQA attention with q/k RMSNorm, per-layer head
counts and a softplus output gate (one scalar per head, or per channel when the gate tensor is
that wide), full layers (``il % 4 == 0``) and sliding-window layers with their own rope base and
rotary width (YaRN on full layers when the file says so); a leading dense MLP block, then MoE with
a sigmoid router + score-correction bias, renormalised, times ``expert_weights_scale``, plus an
always-on shared expert."""
from __future__ import annotations

import torch

from sparkpack.formats.archs import DENSE, SLIDING

from ..cache import Cache
from ..layers import Normed, Rope, Rows, rope_inv_freq, route_sigmoid, yarn_rope
from .base import Batch, MoEModel


class Laguna(MoEModel):
    arch = "laguna"
    # the MoE input feeds the router and the shared expert's gate/up: one GEMM
    FFN_IN = ("ffn_gate_inp", "ffn_gate_shexp", "ffn_up_shexp")
    STACKS = (("attn_q", "attn_k", "attn_v", "attn_gate"), ("ffn_gate", "ffn_up"), FFN_IN)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.window = self.spec.sliding_window
        swa, full = self.spec.rope_swa, self.spec.rope
        self.rope_swa = Rope(swa.dim, rope_inv_freq(swa.freq_base, swa.dim))
        yarn = self.spec.yarn  # read and checked by the spec (formats/archs/laguna.py)
        if yarn:
            self.rope_full = yarn_rope(full.freq_base, full.dim, yarn.factor, yarn.original_context_length,
                                       yarn.beta_fast, yarn.beta_slow, yarn.attn_factor)
        else:
            self.rope_full = Rope(full.dim, rope_inv_freq(full.freq_base, full.dim))
        self.scale = float(self.spec.expert_weights_scale)
        self.norm_topk = self.spec.norm_topk

    def attn(self, il: int, h: Rows, cache: "Cache | Batch", pos0: "int | torch.Tensor") -> torch.Tensor:
        p, d, T = f"blk.{il}.", self.spec.head_dim, h.x.shape[0]
        swa = self.spec.layers[il].attention == SLIDING
        q, k, v, gate = self.proj.project(h, p, "attn_q", "attn_k", "attn_v", "attn_gate")
        q, k, v = q.view(T, -1, d), k.view(T, -1, d), v.view(T, -1, d)
        per_head = gate.shape[-1] == q.shape[1]  # one gate per head, or one per channel
        gate, kind = (gate, "softplus_head") if per_head else (gate.view(T, -1, d), "softplus")
        o = self.attend(il, q, k, v, cache, pos0, self.rope_swa if swa else self.rope_full, self.window if swa else 0,
                        gate, kind)
        return self.linear(o, p + "attn_output.weight")

    def route_logits(self, il: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bias = self.w.opt(f"blk.{il}.exp_probs_b.bias")
        return route_sigmoid(logits, bias, self.spec.n_expert_used, self.norm_topk, self.scale)

    def ffn(self, il: int, h: Rows, x: torch.Tensor) -> tuple[torch.Tensor, Normed | None]:
        """The residual stream ``x`` after the FFN block on its normed input ``h``: the dense
        layers' SwiGLU MLP, or the MoE block."""
        if self.spec.layers[il].ffn == DENSE:
            return self.moe_block.epilogue(il, x, self.proj.mlp(h, f"blk.{il}."), kernels=self.kernels)
        return super().ffn(il, h, x)
