"""Where a store's experts go, decided before a byte moves: which layers' experts the fused
kernel reads, the device pool's layout (hot experts, then the cache slots), the cold experts'
layout, whether they all fit in host RAM, and so which miss strategy runs.

Why apart from the store (``runtime.expert_store``): these are pure decisions over the model's
expert byte ranges and the run's budgets, with the warnings a user sees about them; the store
then fills the pools and wires its parts from one ``StoreLayout``.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sparkpack.formats.archs import ModelSpec
from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.memory import SLOT_ALIGN

from .expert_misses import STRATEGIES
from .expert_pools import PoolLayout, layout_pool
from .expert_source import ExpertSource
from .expert_tables import ExpertLayer, expert_layers

MODES = ("auto", *STRATEGIES)


@dataclass(frozen=True)
class StoreLayout:
    """``hot``: bool ``[n_layer, n_expert]``, MoE layers only. ``layer_nbytes``: one expert's bytes
    per layer (0: not a MoE layer). ``device``: the device pool (hot experts each at its layer's
    size, then the cache slots at the largest); ``cold``: every cold expert packed the same way.
    Slots start at multiples of ``SLOT_ALIGN``, the pools' unit: the plan (``formats.placement``)
    counts exactly these bytes. ``mode``: the miss strategy, "auto" resolved."""

    moe_layers: list[int]
    hot: np.ndarray
    layers: dict[int, ExpertLayer]
    layer_nbytes: np.ndarray
    device: PoolLayout
    cold: PoolLayout
    n_cold: int
    host_all: bool  # every cold expert fits in host RAM
    mode: str

    @property
    def fused_all(self) -> bool:
        """Every layer on the fused kernel."""
        return all(la.fused for la in self.layers.values())

    @property
    def nbytes(self) -> dict[int, int]:
        return {il: la.nbytes for il, la in self.layers.items()}


def store_layout(source: ExpertSource, spec: ModelSpec, on_cuda: bool, hot: np.ndarray, cache_slots: int,
                 mode: str, host_bytes: int | None, fused: bool | None,
                 warn: Callable[[str], None]) -> StoreLayout:
    """The layout of a store of ``source``'s experts (arguments as ``ExpertStore`` takes them).
    Warns when some layers' quant types have no kernel or the cold experts do not fit in
    ``host_bytes``; a SparkpackError naming the file when ``mode`` cannot run."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    moe_layers = list(spec.moe_layers)
    hot = np.asarray(hot, dtype=bool).copy()
    moe = np.zeros_like(hot)
    moe[moe_layers] = True
    hot &= moe
    want_fused = fused if fused is not None else on_cuda
    layers, slow = expert_layers(source, moe_layers, want_fused)
    if want_fused and slow:
        warn(f"{_name(source.path)}: experts in {', '.join(sorted(slow))} have no Triton kernel; their "
             f"layers dequantize each expert on use (slower, and decode steps are not captured in CUDA graphs)")
    layer_nbytes = np.zeros(spec.n_layer, dtype=np.int64)
    layer_nbytes[list(layers)] = [la.nbytes for la in layers.values()]
    units = {il: -(-la.nbytes // SLOT_ALIGN) for il, la in layers.items()}
    n_cold = int((moe & ~hot).sum())
    device = layout_pool(hot, units, SLOT_ALIGN, max(0, min(int(cache_slots), n_cold)))
    cold = layout_pool(moe & ~hot, units, SLOT_ALIGN)
    host_all = host_bytes is None or cold.nbytes <= host_bytes
    if not host_all:
        warn(f"host RAM budget {_gib(host_bytes)} is too small for {_gib(cold.nbytes)} of cold experts: "
             f"misses are read from {_name(source.path)} through a {_gib(host_bytes)} host cache (disk tier, slower)")
    fused_all = all(la.fused for la in layers.values())
    if mode == "auto":
        mode = "zerocopy" if (on_cuda and host_all and fused_all) else "async"
    if mode == "zerocopy" and not host_all:
        raise SparkpackError(source.path, "zero-copy streaming needs every cold expert in host memory; "
                                          "raise the host RAM budget or use --miss-mode async")
    return StoreLayout(moe_layers, hot, layers, layer_nbytes, device, cold, n_cold, host_all, mode)


def _gib(n: int | None) -> str:
    n = n or 0
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 else f"{n / 1024**2:.1f} MiB"


def _name(path) -> str:
    return os.path.basename(str(path))
