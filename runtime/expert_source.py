"""Where an expert's bytes come from: a GGUF's 3-D expert tensors or a pack's shards.

The store (``runtime.expert_store``) only asks a source for one layer's byte layout (the parts
of an expert, in ``formats.experts.ROLE_ORDER``) and for one expert's bytes; the plain providers
of ``runtime.experts`` read the same byte ranges.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import numpy as np

from sparkpack.formats.archs import ModelSpec
from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.experts import ExpertPart, expert_slices
from sparkpack.formats.gguf_file import GGUFModel


class ExpertSource(Protocol):
    """Where experts' bytes come from: a GGUF's expert tensors or a pack's shards."""

    path: object

    def layout(self, layer: int) -> list[ExpertPart]: ...

    def read(self, layer: int, expert: int, out: np.ndarray) -> None:
        """Fill ``out`` (uint8, the expert's byte count) with the expert's bytes; errors name the file."""
        ...


class GGUFExpertSource:
    """Experts of a plain GGUF: each expert's parts are gathered from the 3-D expert tensors."""

    def __init__(self, gguf: GGUFModel, spec: ModelSpec):
        self.gguf, self.spec, self.path = gguf, spec, gguf.path

    def layout(self, layer: int) -> list[ExpertPart]:
        parts, off = [], 0
        for s in expert_slices(self.gguf, self.spec, layer, 0):
            parts.append(replace(s, offset=off))  # packed one after another in the expert's range
            off += s.nbytes
        return parts

    def read(self, layer: int, expert: int, out: np.ndarray) -> None:
        off = 0
        for s in expert_slices(self.gguf, self.spec, layer, expert):
            self.gguf.read_into(s.offset, out[off: off + s.nbytes])  # not through the map: see read_into
            off += s.nbytes


class PackExpertSource:
    """Experts of a ``.sparkpack``: one contiguous range of the hot shard or of a cold shard,
    checked against its manifest checksum on load (a corrupt shard is named when first needed)."""

    def __init__(self, pack, spec: ModelSpec):
        self.pack, self.spec, self.path = pack, spec, pack.path

    def layout(self, layer: int) -> list[ExpertPart]:
        return sorted(self.pack.parts[layer], key=lambda p: p.offset)

    def read(self, layer: int, expert: int, out: np.ndarray) -> None:
        try:
            data = self.pack.expert_bytes(layer, expert)  # checked against its checksum
        except OSError as e:
            rec = self.pack.expert_record(layer, expert)
            raise SparkpackError(self.pack.path, f"shard {rec.shard} cannot be read ({e.strerror or e})") from None
        out[: data.size] = data
