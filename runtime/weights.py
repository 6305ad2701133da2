"""Tensors of a GGUF as torch tensors: dequantized on request, in the compute dtype and device.

The GGUF stays memory-mapped; nothing is expanded until a model asks for a tensor, and expert
tensors are never expanded whole here (``runtime.experts`` reads single experts' byte ranges).
Shapes come back in torch order, the reverse of GGUF's ``ne`` (so a GGUF matrix ``[n_in, n_out]``
becomes the ``[n_out, n_in]`` weight ``F.linear`` expects).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np
import torch

from sparkpack.formats.errors import FormatError
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.memory import held_as_bytes
from sparkpack.formats.quants import kernels_read

from .dequant import dequantize
from .quant_linear import QuantLinear, linear, stack

if TYPE_CHECKING:
    from .kernels.q8dot import Int8Rows


CHUNK_ELEMENTS = 1 << 24  # dequantize large matrices this many weights at a time


def dequantize_bytes(raw: np.ndarray, qtype: int, shape: tuple[int, ...], device: torch.device | str,
                     dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Expand the raw bytes of a tensor of GGUF shape ``shape`` to a torch tensor (torch order),
    or into ``out`` (a contiguous tensor of that shape, e.g. a band of a stacked matrix).

    Large matrices (the output head, the embeddings: ~500M weights) are expanded a band of rows
    at a time into the final tensor: whole, the float32 temporaries would need several times the
    result's memory, more than a ``--vram`` budget leaves. Blocks never span rows, so the bits
    are the same either way."""
    out_shape = tuple(reversed(shape))
    n_rows = math.prod(shape[1:]) if len(shape) > 1 else 1
    if math.prod(shape) <= CHUNK_ELEMENTS or n_rows < 2:
        t = dequantize(raw, qtype, shape, device, dtype).reshape(out_shape)
        return t if out is None else out.copy_(t)
    flat = raw.reshape(-1) if isinstance(raw, (np.ndarray, torch.Tensor)) else np.frombuffer(raw, dtype=np.uint8)
    row_bytes = flat.shape[0] // n_rows
    whole = out
    out = torch.empty((n_rows, shape[0]), dtype=dtype, device=device) if whole is None else whole.view(n_rows, shape[0])
    step = max(1, CHUNK_ELEMENTS // shape[0])
    for r0 in range(0, n_rows, step):
        r1 = min(n_rows, r0 + step)
        out[r0:r1] = dequantize(flat[r0 * row_bytes: r1 * row_bytes], qtype, (shape[0], r1 - r0), device, dtype)
    return out.reshape(out_shape) if whole is None else whole


def quantizes_dense(device: torch.device, dtype: torch.dtype) -> bool:
    """Where the runtime keeps dense matrices as bytes: on a GPU (the kernels' home); the CPU
    path and float64 references expand them."""
    return device.type == "cuda" and dtype != torch.float64


class Weights:
    """Dense (non-expert) tensors of a model, loaded once on first use and kept: expanded to the
    compute dtype, or with ``quantized`` (the GPU default) the matrices as their GGUF bytes
    (``runtime.quant_linear``), which ``linear``, ``stacked`` and ``embed`` serve.
    ``int8_activations`` (held matrices, one token): the products take the activation as int8,
    the runtime's choice; False keeps it in float (slower, no activation rounding; comparisons)."""

    def __init__(self, gguf: "GGUFModel | PackAsGGUF", device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 quantized: bool = False, int8_activations: bool = True):
        self.gguf = gguf
        self.device = torch.device(device)
        self.dtype = dtype
        self.quantized = quantized
        self.int8_activations = int8_activations
        self._cache: dict[str, torch.Tensor] = {}
        self._lin: dict[str, QuantLinear] = {}

    @property
    def expanded(self) -> Mapping[str, torch.Tensor]:
        """The tensors held expanded to the compute dtype, by name (a stack's by its joined names)."""
        return MappingProxyType(self._cache)

    @property
    def as_stored(self) -> Mapping[str, QuantLinear]:
        """The matrices held as their GGUF bytes, by name (a stack's by its joined names)."""
        return MappingProxyType(self._lin)

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def is_quantized(self, name: str) -> bool:
        info = self.gguf.tensor(name)
        return self.quantized and held_as_bytes(name, info.shape, info.qtype)

    def matrix(self, name: str) -> "torch.Tensor | QuantLinear":
        """A weight to multiply by: its bytes (``QuantLinear``) or the expanded tensor."""
        q = self._lin.get(name)
        if q is not None:
            return q
        if not self.is_quantized(name):
            return self(name)
        info = self.gguf.tensor(name)
        q = self._lin[name] = stack([(info.shape[1], info.qtype, self.gguf.raw(name))], info.shape[0], self.device)
        return q

    def linear(self, x: torch.Tensor, name: str, q8: "Int8Rows | None" = None) -> torch.Tensor:
        """``x @ W^T`` for the weight ``name`` (``q8``: x's int8 form, when its launch made it)."""
        return linear(x, self.matrix(name), q8, self.int8_activations)

    def embed(self, ids: torch.Tensor, name: str = "token_embd.weight") -> torch.Tensor:
        """Rows ``ids`` of an embedding matrix, in the compute dtype."""
        m = self.matrix(name)
        return m.rows_of(ids, self.dtype) if isinstance(m, QuantLinear) else m[ids]

    def __call__(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor, expanded on first use (into ``out`` when given)."""
        t = self._cache.get(name)
        if t is None:
            info = self.gguf.tensor(name)
            t = dequantize_bytes(self.gguf.raw(name), info.qtype, info.shape, self.device, self.dtype, out=out)
            self._cache[name] = t
        elif out is not None:
            t = self._cache[name] = out.copy_(t)  # the old tensor is dropped: ``out`` replaces it
        return t

    def stacked(self, names: tuple[str, ...]) -> "torch.Tensor | QuantLinear":
        """The matrices ``names`` (one input width) as one ``[sum of rows, n_in]`` matrix, so the
        projections of one input run as one GEMM: at batch 1 a launch costs more than its bytes.
        Each name then reads its row band of the stacked matrix, so no second copy is kept. Parts
        not loaded yet are expanded straight into their band: stacking loaded tensors would leave
        their freed blocks reserved by the allocator, which a ``--vram`` budget cannot afford
        (the model stacks its groups at load, ``MoEModel.stack_groups``)."""
        key = "+".join(names)
        t = self._cache.get(key, self._lin.get(key))
        if t is not None:
            return t
        infos = [self.gguf.tensor(n) for n in names]
        # torch order; a vector of the input width (a gate of one output) is one row
        shapes = [tuple(reversed(i.shape)) for i in infos]
        shapes = [(1, *s) if len(s) == 1 else s for s in shapes]
        if any(len(s) != 2 or s[1] != shapes[0][1] for s in shapes):
            raise FormatError(self.gguf.path, f"cannot stack {', '.join(names)}: shapes {[list(s) for s in shapes]}")
        if self.quantized and all(kernels_read(i.qtype) and n not in self._cache for n, i in zip(names, infos)):
            q = self._lin[key] = stack([(s[0], i.qtype, self.gguf.raw(n)) for n, s, i in zip(names, shapes, infos)],
                                       shapes[0][1], self.device)
            row = 0
            for n, (rows, _) in zip(names, shapes):  # each member reads its band of the stacked bytes
                self._lin[n] = q.band(row, row + rows)
                row += rows
            return q
        t = torch.empty((sum(s[0] for s in shapes), shapes[0][1]), dtype=self.dtype, device=self.device)
        row = 0
        for n, (rows, _) in zip(names, shapes):
            self(n, out=t[row: row + rows])
            row += rows
        self._cache[key] = t
        return t

    def preload(self, names) -> None:
        """Load these tensors now (the expert store's budget counts them from the start)."""
        for name in names:
            self.matrix(name)  # as the model reads it: bytes (or a band of a byte stack) or expanded

    def opt(self, name: str) -> torch.Tensor | None:
        return self(name) if self.has(name) else None

    def need(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor that must have ``shape`` (torch order): a clear error instead of a bad matmul."""
        t = self(name)
        if tuple(t.shape) != shape:
            raise FormatError(self.gguf.path, f"tensor {name} has shape {list(t.shape)}, expected {list(shape)}")
        return t


class PackAsGGUF:
    """A ``.sparkpack`` seen through the few ``GGUFModel`` members the runtime and
    ``formats.archs.model_spec`` use (path, arch, metadata, tensor index, non-expert bytes), so
    the model files need not know which container they run from. Experts come through
    ``runtime.experts.GGUFExperts`` (through ``runtime.expert_source.PackExpertSource``)."""

    def __init__(self, pack):
        from sparkpack.formats.gguf_file import TensorInfo

        self.pack = pack
        self.path = pack.path
        self.arch = pack.arch
        self._meta = pack.metadata
        self.tensors = {n: TensorInfo(n, t.shape, t.qtype, -1, t.nbytes) for n, t in pack.tensors.items()}

    def get(self, key: str, default=None):
        return self._meta.get(key, default)

    def tensor(self, name: str):
        try:
            return self.tensors[name]
        except KeyError:
            raise FormatError(self.path, f"missing tensor {name}") from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, checked against the pack's checksum on first use."""
        return self.pack.tensor(name)
