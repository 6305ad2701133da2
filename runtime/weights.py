"""Tensors of a GGUF as torch tensors: dequantized on request, in the compute dtype and device.

The GGUF stays memory-mapped; nothing is expanded until a model asks for a tensor, and expert
tensors are never expanded whole here (``runtime.experts`` reads single experts' byte ranges).
Shapes come back in torch order, the reverse of GGUF's ``ne`` (so a GGUF matrix ``[n_in, n_out]``
becomes the ``[n_out, n_in]`` weight ``F.linear`` expects).
"""
from __future__ import annotations

import numpy as np
import torch

from formats.errors import FormatError
from formats.gguf_file import GGUFModel

from .dequant import dequantize


def dequantize_bytes(raw: np.ndarray, qtype: int, shape: tuple[int, ...], device: torch.device | str,
                     dtype: torch.dtype) -> torch.Tensor:
    """Expand the raw bytes of a tensor of GGUF shape ``shape`` to a torch tensor (torch order)."""
    return dequantize(raw, qtype, shape, device, dtype).reshape(tuple(reversed(shape)))


class Weights:
    """Dense (non-expert) tensors of a model, dequantized once on first use and kept."""

    def __init__(self, gguf: "GGUFModel | PackSource", device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.gguf = gguf
        self.device = torch.device(device)
        self.dtype = dtype
        self._cache: dict[str, torch.Tensor] = {}

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def __call__(self, name: str) -> torch.Tensor:
        t = self._cache.get(name)
        if t is None:
            info = self.gguf.tensor(name)
            t = dequantize_bytes(self.gguf.raw(name), info.qtype, info.shape, self.device, self.dtype)
            self._cache[name] = t
        return t

    def opt(self, name: str) -> torch.Tensor | None:
        return self(name) if self.has(name) else None

    def need(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor that must have ``shape`` (torch order): a clear error instead of a bad matmul."""
        t = self(name)
        if tuple(t.shape) != shape:
            raise FormatError(self.gguf.path, f"tensor {name} has shape {list(t.shape)}, expected {list(shape)}")
        return t


class PackSource:
    """A ``.sparkpack`` seen through the few ``GGUFModel`` members the runtime and
    ``formats.archs.model_spec`` use (path, arch, metadata, tensor index, non-expert bytes), so
    the model files need not know which container they run from. Experts come through
    ``runtime.experts.PackExperts``."""

    def __init__(self, pack):
        from formats.gguf_file import TensorInfo

        self.pack = pack
        self.path = pack.path
        self.arch = pack.arch
        self._meta = pack.manifest.get("metadata", {})
        self.tensors = {n: TensorInfo(n, tuple(int(d) for d in t["shape"]), int(t["qtype"]), -1, int(t["nbytes"]))
                        for n, t in pack.tensors.items()}

    def get(self, key: str, default=None):
        return self._meta.get(key, default)

    def tensor(self, name: str):
        try:
            return self.tensors[name]
        except KeyError:
            raise FormatError(self.path, f"missing tensor {name}") from None

    def raw(self, name: str) -> np.ndarray:
        return self.pack.tensor(name)
