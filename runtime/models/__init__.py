"""Model registry: GGUF architecture name -> model class, and ``load_model`` to open a file."""
from __future__ import annotations

import os

import torch

from formats.archs import model_spec
from formats.errors import UnsupportedError
from formats.gguf_file import GGUFModel

from ..experts import ExpertProvider, GGUFExperts, PackExperts
from ..weights import PackSource
from .base import MoEModel
from .laguna import Laguna
from .qwen3moe import Qwen3MoE
from .qwen35moe import Qwen35MoE

MODELS: dict[str, type[MoEModel]] = {m.arch: m for m in (Qwen3MoE, Qwen35MoE, Laguna)}


def load_model(path: str | os.PathLike[str] | GGUFModel, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, expert_cache_bytes: int | None = None) -> MoEModel:
    """Open a GGUF or a .sparkpack directory and build the runtime model of its architecture
    (weights load lazily). ``expert_cache_bytes`` bounds the dequantized experts kept in memory
    (None: keep all)."""
    from formats.sparkpack import Pack, is_pack

    if not isinstance(path, GGUFModel) and is_pack(path):
        source = PackSource(Pack.open(path))
        spec = model_spec(source)  # type: ignore[arg-type]
        experts: ExpertProvider = PackExperts(source, spec, device, dtype, max_bytes=expert_cache_bytes)
        return _model_class(source, spec)(source, spec, device=device, dtype=dtype, experts=experts)  # type: ignore[arg-type]
    gguf = path if isinstance(path, GGUFModel) else GGUFModel(path)
    spec = model_spec(gguf)
    experts = GGUFExperts(gguf, spec, device, dtype, max_bytes=expert_cache_bytes)
    return _model_class(gguf, spec)(gguf, spec, device=device, dtype=dtype, experts=experts)


def _model_class(source, spec) -> type[MoEModel]:
    cls = MODELS.get(spec.arch)
    if cls is None:
        raise UnsupportedError(source.path, f"the runtime has no forward pass for architecture '{spec.arch}' "
                                          f"(supported: {', '.join(MODELS)})")
    return cls


__all__ = ["MODELS", "MoEModel", "load_model"]
