"""The one door through which MoE layers reach their experts: the ``ExpertProvider`` contract.

A MoE block asks ``provider.moe(layer, x, weights, ids)``: "the routed experts' weighted outputs
for these rows". Where the weights live (GPU hot set, host cache, disk) is the provider's
business, so the tiered expert store (``runtime.expert_store``) and calibration's routing tap
(``runtime.calibration``) are providers like the plain ones here; the model and the CUDA-graph code
(``runtime.graph``) call only the methods the contract names. The quantized GGUF bytes stay the
source of truth: the plain providers below read one expert's byte ranges (``formats.experts``)
and dequantize them on first use, keeping the result; ``max_bytes`` bounds how much stays
expanded (least recently used experts are dropped and re-expanded from the bytes when needed
again), which matters for real models: Qwen3-30B's experts are ~115 GiB in float32.
"""
from __future__ import annotations

from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from sparkpack.formats.archs import ModelSpec
from sparkpack.formats.experts import ExpertPart
from sparkpack.formats.gguf_file import GGUFModel

from .decode_rows import each_row
from .layers import swiglu
from .weights import PackAsGGUF, dequantize_bytes

if TYPE_CHECKING:
    from .kernels.q8dot import Int8Rows


class ExpertProvider(Protocol):
    """Everything a model (``runtime.models``) and the graph code (``runtime.graph``) ask of the
    experts. A Protocol, not a base class: a provider that wraps another (calibration's routing
    tap) implements it without inheriting an implementation."""

    @property
    def capturable(self) -> bool:
        """Whether a decode step through this provider can be captured in a CUDA graph: ``moe``
        needs no host round trip (and ``count_real_tokens`` holds for replays)."""
        ...

    def moe(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            q8: "Int8Rows | None" = None) -> torch.Tensor:
        """The chosen experts' weighted outputs for ``x [T, n_embd]``, ``weights/ids [T, k]``, for
        ``layers.ffn_residual`` to add: ``[T, n_embd]`` summed in x's dtype, or, where a fused
        kernel runs, the k outputs of each token unsummed in float32 ``[T, k, n_embd]``. ``q8``:
        x's int8 form when the launch that wrote x made it (``kernels/q8dot.py``)."""
        ...

    def staged_prefill(self, n_tokens: int) -> bool:
        """Whether an eager call (or a group of calls, ``stage_calls``) of ``n_tokens`` tokens
        copies each layer's cold experts to the device in bulk (``runtime.expert_staging``): then a
        session runs its prompts' calls eagerly, in groups (``runtime.call_plan.CallPlan.groups``)."""
        ...

    def stage_calls(self, n_tokens: int | None) -> None:
        """The next calls, ``n_tokens`` tokens in all, run layer by layer as one group
        (``MoEModel.forward_calls``) until None: where ``staged_prefill(n_tokens)``, each layer's
        cold experts are copied once for all of them, padded calls included."""
        ...

    def count_real_tokens(self, real: torch.Tensor | None) -> None:
        """A padded call (``runtime.graph.PrefillGraphs``) begins: until it ends (None), only the
        routings of its first ``real`` tokens (a device scalar) count, padding must not teach
        placement."""
        ...

    def routing_side(self, side: str) -> None:
        """The next calls run tokens of ``side``: "prompt" (what a request sends) or "generated"
        (what the model writes). A provider that learns placement keeps the two apart
        (``formats.profile``); ``runtime.generate.Session`` says which before each call."""
        ...

    def end_step(self, n_tokens: int, routed: bool | None = None, defer: bool = False) -> None:
        """After a forward call of ``n_tokens`` tokens (``routed``: whether MoE layers ran, which a
        replayed graph cannot tell the provider; ``defer``: a replayed call, learn from it at the
        next ``end_step``, while the device computes)."""
        ...

    def forget_traffic(self) -> None:
        """Forget routing statistics gathered so far (a session's warm-up tokens)."""
        ...


class PlainProvider(ExpertProvider):
    """The contract for providers that compute experts one by one through their ``forward``: the
    weighted sum in routing order (``routed_sum``), in x's dtype. Nothing to capture, count, learn
    between tokens or forget."""

    capturable = False

    def staged_prefill(self, n_tokens: int) -> bool:
        return False

    @abstractmethod
    def forward(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU output ``[n, n_embd]`` of one expert for rows ``x [n, n_embd]`` (each provider's own)."""

    def moe(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            q8: "Int8Rows | None" = None) -> torch.Tensor:
        return routed_sum(x, weights, ids, lambda e, rows: self.forward(layer, e, rows))

    def stage_calls(self, n_tokens: int | None) -> None:
        pass

    def count_real_tokens(self, real: torch.Tensor | None) -> None:
        pass

    def routing_side(self, side: str) -> None:
        pass

    def end_step(self, n_tokens: int, routed: bool | None = None, defer: bool = False) -> None:
        pass

    def forget_traffic(self) -> None:
        pass


class GGUFExperts(PlainProvider):
    """Experts dequantized per (layer, expert) on first use, from a GGUF's expert tensors or a
    ``.sparkpack``'s expert ranges (read through the store's sources, ``runtime.expert_source``:
    a pack's ranges are checked against their checksums)."""

    def __init__(self, gguf: GGUFModel | PackAsGGUF, spec: ModelSpec, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, max_bytes: int | None = None):
        from .expert_source import GGUFExpertSource, PackExpertSource

        self.source = PackExpertSource(gguf.pack, spec) if isinstance(gguf, PackAsGGUF) else GGUFExpertSource(gguf, spec)
        self.spec = spec
        self.device, self.dtype = torch.device(device), dtype
        self.max_bytes = max_bytes
        self.cached_bytes = 0
        self._cache: OrderedDict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = OrderedDict()

    def weights(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(gate [ff, embd], up [ff, embd], down [embd, ff])`` of one expert."""
        key = (layer, expert)
        w = self._cache.get(key)
        if w is not None:
            self._cache.move_to_end(key)
            return w
        layout = self.source.layout(layer)
        raw = np.empty(max(p.offset + p.nbytes for p in layout), dtype=np.uint8)
        self.source.read(layer, expert, raw)
        w = expert_weights(layout, raw, self.device, self.dtype)
        self._cache[key] = w
        self.cached_bytes += _nbytes(w)
        while self.max_bytes is not None and self.cached_bytes > self.max_bytes and len(self._cache) > 1:
            self.cached_bytes -= _nbytes(self._cache.popitem(last=False)[1])
        return w

    def forward(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, *self.weights(layer, expert))


def expert_weights(parts: list[ExpertPart], raw, device: torch.device, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(gate, up, down)`` of one expert expanded from its bytes ``raw`` (its contiguous range,
    numpy or torch, laid out as ``parts`` say)."""
    w = {p.role: dequantize_bytes(raw[p.offset: p.offset + p.nbytes], p.qtype, p.shape, device, dtype)
         for p in parts}
    if "gate_up" in w:  # merged tensor: gate rows first, then up rows
        gate, up = w["gate_up"].chunk(2, dim=0)
    else:
        gate, up = w["gate"], w["up"]
    return gate, up, w["down"]


def _nbytes(tensors: tuple[torch.Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def routed_sum(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
               expert_forward: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``sum_j w[t,j] * expert_{ids[t,j]}(x_t)``, experts in increasing id order: the order (and so
    the rounding) depends only on the routing, never on where an expert's weights live."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        rows, slot = torch.nonzero(ids == e, as_tuple=True)
        y = each_row(lambda r: expert_forward(e, r), x[rows]) * weights[rows, slot, None].to(x.dtype)
        out.index_add_(0, rows, y)
    return out
