"""Qwen3 MoE (GGUF ``qwen3moe``, Qwen3-30B-A3B): pre-norm GQA attention with per-head q/k RMSNorm
and NEOX rope over the whole head, then a softmax top-k MoE (renormalised), no shared expert."""
from __future__ import annotations

import torch

from ..cache import Cache
from ..layers import Rope, Rows, rope_inv_freq, route_softmax
from .base import Batch, MoEModel


class Qwen3MoE(MoEModel):
    arch = "qwen3moe"
    STACKS = (("attn_q", "attn_k", "attn_v"),)
    topk_of_logits = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        rope = self.spec.rope
        self.rope = Rope(rope.dim, rope_inv_freq(rope.freq_base, rope.dim))
        self.norm_topk = self.spec.norm_topk

    def attn(self, il: int, h: Rows, cache: "Cache | Batch", pos0: "int | torch.Tensor") -> torch.Tensor:
        p, d, T = f"blk.{il}.", self.spec.head_dim, h.x.shape[0]
        q, k, v = (t.view(T, -1, d) for t in self.proj.project(h, p, "attn_q", "attn_k", "attn_v"))
        return self.linear(self.attend(il, q, k, v, cache, pos0, self.rope), p + "attn_output.weight")

    def route_logits(self, il: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route_softmax(logits, self.spec.n_expert_used, self.norm_topk)
