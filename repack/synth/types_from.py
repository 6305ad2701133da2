"""The per-tensor types of a real GGUF, for a synthetic file of the same shapes.

Why: dynamic quants (unsloth's UD-IQ2_XXS, UD-IQ2_M...) pick each tensor's type by their own
measurements, not llama-quant.cpp's rules, so no mix name reproduces them; their header does.
Only the header is read (the file is memory-mapped, its weights never touched).
"""
from __future__ import annotations

import os

from gguf.constants import GGMLQuantizationType as T

from sparkpack.formats.errors import FormatError, shown
from sparkpack.formats.gguf_file import GGUFModel

from .tensors import TensorPlan


def types_from(path: str | os.PathLike[str], plans: list[TensorPlan]) -> tuple[list[T], int | None]:
    """The type of each planned tensor in the GGUF at ``path`` (same name, same shape), and the
    file's ``general.file_type``; a tensor it lacks or holds in another shape is an error."""
    real = GGUFModel(path)
    types = []
    for t in plans:
        info = real.tensors.get(t.name)
        if info is None:
            raise FormatError(path, f"has no tensor {shown(t.name)}: not a file of the preset's model")
        if tuple(info.shape) != tuple(t.shape):
            raise FormatError(path, f"tensor {shown(t.name)} is {list(info.shape)}, the preset's is {list(t.shape)}")
        types.append(T(info.qtype))
    file_type = real.get("general.file_type")
    return types, int(file_type) if file_type is not None else None
