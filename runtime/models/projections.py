"""A model's dense projections: one weight's GEMM, or several projections of one input stacked
into one GEMM, and a dense layer's SwiGLU MLP built from them.

Why a part of its own: which projections stack (``MoEModel.STACKS``) is an arch's choice, but
how a stacked GEMM is run and split back, on a decode row's int8 form where its launch made one,
is the same for every arch and for the loader that stacks the matrices
(``runtime.models.load_model``, ``stack_groups``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..layers import Rows, silu_mul
from ..quant_linear import QuantLinear, linear
from ..weights import Weights


class Projections:
    """Projections over the weights ``w``; ``stacks``: the groups of one input that run as one
    GEMM (per layer, the members the file has, when at least two do)."""

    def __init__(self, w: Weights, stacks: tuple[tuple[str, ...], ...]):
        self.w, self.stacks = w, stacks

    def linear(self, h: Rows, name: str) -> torch.Tensor:
        """``h @ W^T`` for the weight ``name``, on h's int8 form where its launch made it."""
        return self.w.linear(h.x, name, h.q8)

    def project(self, h: Rows, prefix: str, *names: str) -> list[torch.Tensor]:
        """The projections ``prefix + name + ".weight"`` of ``h``, as one GEMM over their stacked
        matrices (``Weights.stacked``; ``names`` one of ``stacks``), split back into one output
        per name."""
        full = tuple(f"{prefix}{n}.weight" for n in names)
        stacked = self.w.stacked(full)
        sizes = stacked.sizes if isinstance(stacked, QuantLinear) else [self.w(n).shape[0] for n in full]
        return list(linear(h.x, stacked, h.q8, self.w.int8_activations).split(sizes, dim=-1))

    def present(self, h: Rows, prefix: str, group: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """``project`` over the members of ``group`` (one of ``stacks``) this layer has, by name."""
        names = [n for n in group if self.w.has(f"{prefix}{n}.weight")]
        if len(names) == 1:
            return {names[0]: self.linear(h, f"{prefix}{names[0]}.weight")}
        return dict(zip(names, self.project(h, prefix, *names)))

    def mlp(self, h: Rows, prefix: str) -> torch.Tensor:
        """A dense layer's SwiGLU MLP ``ffn_{gate,up,down}``, gate and up as one GEMM
        (``(ffn_gate, ffn_up)`` must be one of ``stacks``)."""
        gate, up = self.project(h, prefix, "ffn_gate", "ffn_up")
        return self.linear(silu_mul(gate, up), f"{prefix}ffn_down.weight")

    def groups(self, layers: Sequence[int]) -> list[tuple[str, ...]]:
        """The ``stacks`` groups of ``layers`` as stacked: the members the file has, two or more
        (full tensor names)."""
        out = []
        for il in layers:
            for group in self.stacks:
                full = tuple(n for n in (f"blk.{il}.{m}.weight" for m in group) if self.w.has(n))
                if len(full) >= 2:
                    out.append(full)
        return out
