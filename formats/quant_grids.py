"""gguf's lattice and sign tables of the IQ types, in one byte table the kernels index.

Why one place: the IQ types store, per group of 4 or 8 weights, an index into a fixed lattice
(``iq2xxs_grid``, ``iq3s_grid``, ``iq1s_grid`` ... in ggml) and a 7-bit index into ``ksigns``.
The kernels, the torch dequantizer and the synthetic-file writer must all read the same tables,
and those are gguf-py's (``gguf.quants``, which matches ggml bit for bit): they are unpacked from
there at import, never retyped.

``GRID_TABLE`` is every table back to back as bytes (the IQ1 lattice's -1/0/1 as int8 two's
complement); ``GRID_AT[name]`` is where each starts and ``GRID_WIDTH[name]`` the values per entry.
"""
from __future__ import annotations

import numpy as np
from gguf import quants as gq


def _lattice(cls: type) -> np.ndarray:
    """One IQ type's grid as ``[entries, width]`` int values (gguf stores it 2 or 3 bits a value)."""
    cls.init_grid()
    return np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape).astype(np.int16)


KSIGNS = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8)
LATTICES: dict[str, np.ndarray] = {
    "ksigns": KSIGNS.reshape(-1, 1).astype(np.int16),
    "iq2xxs": _lattice(gq.IQ2_XXS), "iq2xs": _lattice(gq.IQ2_XS), "iq2s": _lattice(gq.IQ2_S),
    "iq3xxs": _lattice(gq.IQ3_XXS), "iq3s": _lattice(gq.IQ3_S), "iq1s": _lattice(gq.IQ1_S),
}
GRID_WIDTH: dict[str, int] = {k: v.shape[1] for k, v in LATTICES.items()}
GRID_AT: dict[str, int] = {}
_parts, _at = [], 0
for _name, _grid in LATTICES.items():
    GRID_AT[_name] = _at
    _parts.append(_grid.reshape(-1).astype(np.int8 if _grid.min() < 0 else np.uint8).view(np.uint8))
    _at += _grid.size
GRID_TABLE: np.ndarray = np.concatenate(_parts)
GRID_TABLE.setflags(write=False)
IQ1_DELTA = float(gq.IQ1_S.delta)
