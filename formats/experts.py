"""Byte ranges of single experts inside 3-D GGUF expert tensors.

GGUF stores expert tensors with the expert index as the slowest axis (ne = [n_embd, n_ff, n_expert]
for gate/up, [n_ff, n_embd, n_expert] for down), so expert e of a layer is one contiguous byte
range of each tensor. Placement, packing and streaming all reduce to these ranges.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .archs import ModelSpec
from .gguf_file import GGUFModel

ROLE_ORDER = ("gate", "up", "gate_up", "down")


@dataclass(frozen=True)
class ExpertPart:
    """One tensor's block of one expert: the one description of "an expert's part in its byte
    range" that GGUF reading, packs and the runtime's store share. ``offset`` is where the block
    starts: in the GGUF file for ``expert_slices``, inside the expert's contiguous range for a
    pack's manifest (``formats.pack_manifest``) and the store's layouts (``runtime.expert_source``)."""

    role: str  # gate | up | gate_up | down
    tensor: str
    qtype: int
    shape: tuple[int, int]  # GGUF order (n_in, n_out) of one expert's matrix
    offset: int
    nbytes: int


def expert_slices(model: GGUFModel, spec: ModelSpec, layer: int, expert: int) -> list[ExpertPart]:
    """Where the bytes of expert ``expert`` of MoE layer ``layer`` live, one range per tensor."""
    if layer not in spec.expert_tensors:
        raise KeyError(f"layer {layer} has no experts")
    if not 0 <= expert < spec.n_expert:
        raise IndexError(f"expert {expert} out of range (0..{spec.n_expert - 1})")
    out = []
    for role in ROLE_ORDER:
        name = spec.expert_tensors[layer].get(role)
        if name is None:
            continue
        t = model.tensors[name]
        per = t.nbytes // spec.n_expert
        out.append(ExpertPart(role, name, t.qtype, (t.shape[0], t.shape[1]), t.offset + expert * per, per))
    return out


def expert_bytes(model: GGUFModel, spec: ModelSpec, layer: int, expert: int) -> list[np.ndarray]:
    """Zero-copy views of the expert's bytes, in ``expert_slices`` order."""
    return [model.bytes_at(s.offset, s.nbytes) for s in expert_slices(model, spec, layer, expert)]


def expert_nbytes(model: GGUFModel, spec: ModelSpec, layer: int) -> int:
    """Bytes of one expert of ``layer`` (all its tensors)."""
    return sum(model.tensors[n].nbytes for n in spec.expert_tensors[layer].values()) // spec.n_expert


def expert_tensor_names(spec: ModelSpec) -> set[str]:
    return {n for roles in spec.expert_tensors.values() for n in roles.values()}
