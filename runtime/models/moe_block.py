"""The MoE block every arch shares: the router's and the shared expert's projections of the
block's input in one GEMM, the routed experts, the shared expert behind its gate, and the
epilogue that adds them into the residual stream (on a one-token GPU step, norming the next
block's input in the same launch).

Why a part of its own: the archs differ only in their router (``MoEModel.route_logits``) and in
which of these tensors the file has (``MoEModel.FFN_IN``); the rest was one copy per model file.
A model composes one (``MoEModel.moe_block``) and passes per call its experts (the trunk's, or an
MTP head's), its router and whether its kernels run (``MoEModel.kernels``, which tests switch).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..decode_rows import one_token_rows
from ..experts import ExpertProvider
from ..layers import Normed, Rows, ffn_residual, ffn_residual_and_norm, silu_mul
from .projections import Projections

Router = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (il, logits) -> (weights, ids)


class MoEBlock:
    """The MoE blocks of a model of ``n_layer`` layers over ``proj``'s weights; ``ffn_in``: the
    projections of a block's input, one GEMM when several (the router first)."""

    def __init__(self, proj: Projections, eps: float, n_layer: int, ffn_in: tuple[str, ...]):
        self.proj, self.w, self.eps = proj, proj.w, eps
        self.n_layer, self.ffn_in = n_layer, ffn_in

    def __call__(self, il: int, h: Rows, x: torch.Tensor, experts: ExpertProvider, route: Router, *,
                 kernels: bool) -> tuple[torch.Tensor, Normed | None]:
        """The residual stream ``x`` after layer ``il``'s MoE block on its normed input ``h``: the
        routed experts, a shared expert where the file has one (behind a sigmoid gate where it has
        that too), added in one epilogue launch (``epilogue``)."""
        p = f"blk.{il}."
        y = self.proj.present(h, p, self.ffn_in)
        routed = experts.moe(il, h.x, *route(il, y["ffn_gate_inp"]), h.q8)
        shared = gate = None
        if "ffn_up_shexp" in y:
            shared = self.proj.linear(silu_mul(y["ffn_gate_shexp"], y["ffn_up_shexp"]), p + "ffn_down_shexp.weight")
            gate = y.get("ffn_gate_inp_shexp")
        return self.epilogue(il, x, routed, shared, gate, kernels=kernels)

    def epilogue(self, il: int, x: torch.Tensor, routed: torch.Tensor, shared: torch.Tensor | None = None,
                 gate: torch.Tensor | None = None, *, kernels: bool) -> tuple[torch.Tensor, Normed | None]:
        """Layer ``il``'s FFN output added into the residual stream (``layers.ffn_residual``); a
        one-token GPU step also norms the next block's input in the same launch (``next_norm``)."""
        nxt = self.next_norm(il, x, kernels=kernels)
        if nxt is None:
            return ffn_residual(x, routed, shared, gate), None
        return ffn_residual_and_norm(x, routed, shared, gate, nxt)

    def next_norm(self, il: int, x: torch.Tensor, *, kernels: bool) -> tuple[torch.Tensor, float] | None:
        """For layer ``il``'s epilogue on ``x``: the norm that opens the next block (the output norm
        after the last), when a one-token GPU step can compute it in the same launch."""
        if not (kernels and one_token_rows(x.shape[0])):
            return None
        return self.w(f"blk.{il + 1}.attn_norm.weight" if il + 1 < self.n_layer else "output_norm.weight"), self.eps
