"""Architecture registry: GGUF ``general.architecture`` -> module that builds a ``ModelSpec``."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import UnsupportedError
from . import laguna, qwen3moe, qwen35moe
from .base import DENSE, FULL, LINEAR, MOE, SLIDING, ArchModule, LayerKind, ModelSpec
from .shapes import check_shapes

if TYPE_CHECKING:
    from ..gguf_file import GGUFModel

ARCHS: dict[str, ArchModule] = {a.ARCH.name: a.ARCH for a in (qwen35moe, laguna, qwen3moe)}


def model_spec(model: "GGUFModel") -> ModelSpec:
    """``build_spec``, then every tensor the arch reads checked against the shape the spec implies."""
    spec = build_spec(model)
    check_shapes(spec, model.tensors, ARCHS[spec.arch].tensors(spec), model.path)
    return spec


def build_spec(model: "GGUFModel") -> ModelSpec:
    """The spec of an opened GGUF (or anything with its ``path``, ``arch``, ``get`` and
    ``tensors``) from its metadata and expert tensors; unknown or non-MoE architectures and bad
    hyperparameters are each one clear error."""
    arch = model.arch
    entry = ARCHS.get(arch)
    if entry is None:
        raise UnsupportedError(
            model.path,
            f"architecture '{arch}' is not a mixture-of-experts model sparkpack supports "
            f"(supported: {', '.join(ARCHS)})",
        )
    return entry.build(model)


__all__ = ["ARCHS", "model_spec", "build_spec", "ModelSpec", "LayerKind", "FULL", "SLIDING", "LINEAR", "MOE", "DENSE"]
