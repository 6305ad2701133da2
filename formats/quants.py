"""Quant block math: how many bytes a tensor, an expert, a layer takes in a given GGML type.

The block table comes from gguf-py (``GGML_QUANT_SIZES``) so every type gguf knows is covered;
nothing here is hand-copied from ggml.
"""
from __future__ import annotations

from collections.abc import Sequence

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_T = GGMLQuantizationType
# The block types the runtime's Triton kernels read as stored (each has an unpacking helper in
# runtime/kernels/blocks.py), and the plain float types its dense kernels read as they are:
# dense matrices of these types stay GGUF bytes on a GPU, which the VRAM plan counts.
KERNEL_QTYPES: tuple[int, ...] = tuple(int(q) for q in (_T.Q4_0, _T.Q5_0, _T.Q8_0, _T.Q4_K, _T.Q5_K, _T.Q6_K,
                                                        _T.IQ4_XS, _T.MXFP4))
FLOAT_QTYPES: tuple[int, ...] = tuple(int(q) for q in (_T.F32, _T.F16, _T.BF16))


def kernels_read(qtype: int) -> bool:
    """Whether the runtime's kernels read this type as stored."""
    return int(qtype) in KERNEL_QTYPES or int(qtype) in FLOAT_QTYPES


def quant_name(qtype: int) -> str:
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type{qtype}"


def quant_type(name: str | int) -> GGMLQuantizationType:
    """Parse 'Q4_K', 'q8_0', 'F16' or a numeric id."""
    if isinstance(name, int):
        return GGMLQuantizationType(name)
    try:
        return GGMLQuantizationType[name.upper()]
    except KeyError:
        known = ", ".join(t.name for t in GGML_QUANT_SIZES)
        raise ValueError(f"unknown quant type {name!r} (known: {known})") from None


def block_size(qtype: int) -> int:
    """Elements per block (1 for plain float/int types)."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0]


def type_size(qtype: int) -> int:
    """Bytes per block."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][1]


def row_nbytes(n_cols: int, qtype: int) -> int:
    """Bytes of one row of ``n_cols`` elements (ne[0]); rows must hold whole blocks."""
    bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    if n_cols % bs:
        raise ValueError(f"row of {n_cols} elements is not a whole number of {quant_name(qtype)} blocks ({bs})")
    return n_cols // bs * ts


def tensor_nbytes(shape: Sequence[int], qtype: int) -> int:
    """Bytes of a tensor with GGUF shape ``shape`` (ne[0] first)."""
    n_rows = 1
    for d in shape[1:]:
        n_rows *= int(d)
    return row_nbytes(int(shape[0]), qtype) * n_rows if shape else 0


def fits_blocks(n_cols: int, qtype: int) -> bool:
    return n_cols % block_size(qtype) == 0
