"""Quant block math: how many bytes a tensor, an expert, a layer takes in a given GGML type.

The block table comes from gguf-py (``GGML_QUANT_SIZES``) so every type gguf knows is covered;
nothing here is hand-copied from ggml.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_T = GGMLQuantizationType


@dataclass(frozen=True)
class KernelQuant:
    """One block type the runtime's Triton kernels read as stored. ``sub``: elements per scale
    (the sub-block the kernels apply one scale to: 16 or 32); ``offset``: whether a sub-block
    also has an additive term (``w = scale * q - offset``: the K-quants with mins, Q4_1, Q5_1);
    ``grid``: whether its codes index one of gguf's lattice tables (``quant_grids``). Elements
    and bytes per block are gguf's (``GGML_QUANT_SIZES``), never copied here."""

    qtype: int
    sub: int
    offset: bool = False
    grid: bool = False

    @property
    def name(self) -> str:
        return GGMLQuantizationType(self.qtype).name

    @property
    def block(self) -> int:
        return GGML_QUANT_SIZES[GGMLQuantizationType(self.qtype)][0]

    @property
    def type_size(self) -> int:
        return GGML_QUANT_SIZES[GGMLQuantizationType(self.qtype)][1]


# The registry: every block type the kernels read. Adding a type is one entry here plus its
# unpacking helper in runtime/kernels/blocks.py (which refuses to import without one); the tests,
# the expert store, the VRAM plan and the dense weights all read this table.
KERNEL_QUANTS: dict[int, KernelQuant] = {int(k.qtype): k for k in (
    KernelQuant(int(_T.Q4_0), 32), KernelQuant(int(_T.Q4_1), 32, offset=True),
    KernelQuant(int(_T.Q5_0), 32), KernelQuant(int(_T.Q5_1), 32, offset=True),
    KernelQuant(int(_T.Q8_0), 32),
    KernelQuant(int(_T.Q2_K), 16, offset=True), KernelQuant(int(_T.Q3_K), 16),
    KernelQuant(int(_T.Q4_K), 32, offset=True), KernelQuant(int(_T.Q5_K), 32, offset=True),
    KernelQuant(int(_T.Q6_K), 16),
    KernelQuant(int(_T.IQ2_XXS), 32, grid=True), KernelQuant(int(_T.IQ2_XS), 16, grid=True),
    KernelQuant(int(_T.IQ2_S), 16, grid=True), KernelQuant(int(_T.IQ3_XXS), 32, grid=True),
    KernelQuant(int(_T.IQ3_S), 32, grid=True), KernelQuant(int(_T.IQ1_S), 32, grid=True),
    KernelQuant(int(_T.IQ1_M), 16, grid=True),
    KernelQuant(int(_T.IQ4_NL), 32), KernelQuant(int(_T.IQ4_XS), 32), KernelQuant(int(_T.MXFP4), 32),
)}
KERNEL_QTYPES: tuple[int, ...] = tuple(KERNEL_QUANTS)
# The plain float types the dense kernels read as they are: dense matrices of these types and of
# the kernel types stay GGUF bytes on a GPU, which the VRAM plan counts.
FLOAT_QTYPES: tuple[int, ...] = tuple(int(q) for q in (_T.F32, _T.F16, _T.BF16))


def kernels_read(qtype: int) -> bool:
    """Whether the runtime's kernels read this type as stored."""
    return int(qtype) in KERNEL_QUANTS or int(qtype) in FLOAT_QTYPES


def quant_name(qtype: int) -> str:
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type{qtype}"


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
