"""Dense projections held as their GGUF bytes on the device (``Weights(quantized=True)``).

Why: the dense weights are read once per decoded token; kept as Q4_K/Q6_K bytes they are about a
third of their bf16 size, in VRAM (room for experts under a ``--vram`` budget) and in the bytes a
token reads. One token takes the GEMV kernel (``kernels/dense.py``) straight from the bytes; more
tokens (prefill) expand a band of rows at a time into a transient scratch and use cuBLAS, since a
prefill call reuses each weight for hundreds of tokens. The one-token product quantizes its input
to int8 first when a band has an int8 kernel (``kernels/q8dot.py``, Q4_K/Q6_K and the low-bit types): faster
GEMVs for all but the smallest groups.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F

from sparkpack.formats.memory import DEQUANT_SCRATCH_ELEMENTS

from .decode_rows import each_row, one_token_rows
from .kernels import q8dot
from .kernels.dense import MAX_SEGMENTS, dequantize_into, gemv, row_bytes


class QuantLinear:
    """One matrix, or several of one input width stacked by rows (their outputs side by side):
    ``segments`` are row bands of one GGML type each (adjacent members of one type share a band),
    ``sizes`` the rows of each member in order."""

    def __init__(self, segments: list[tuple[torch.Tensor, int]], sizes: list[int], K: int):
        self.segments, self.sizes, self.K = segments, sizes, K
        self.rows = sum(sizes)
        self.int8_bands = any(qt in q8dot.Q8_TYPES for _, qt in segments)  # bands with an int8 kernel

    def band(self, r0: int, r1: int) -> "QuantLinear":
        """Rows ``r0:r1`` (inside one segment) as a matrix of their own, sharing the bytes."""
        at = 0
        for raw, qt in self.segments:
            if at <= r0 and r1 <= at + raw.shape[0]:
                return QuantLinear([(raw[r0 - at:r1 - at], qt)], [r1 - r0], self.K)
            at += raw.shape[0]
        raise ValueError(f"rows {r0}:{r1} cross a type boundary")

    def __call__(self, x: torch.Tensor, q8: q8dot.Int8Rows | None = None, int8: bool = True) -> torch.Tensor:
        """``x [T, K]`` -> ``[T, rows]`` in x's dtype. One token, or the rows of a batched decode
        step (``decode_rows``), takes the GEMV; with ``int8`` it goes through the int8
        products where a band has them, on ``q8`` (x's int8 form, when the launch that wrote x
        made it) or on x quantized here."""
        x = x.contiguous()
        if one_token_rows(x.shape[0]):  # (several: a batched decode step's rows, each as alone)
            out = torch.empty(x.shape[0], self.rows, dtype=x.dtype, device=x.device)
            if not (self.int8_bands and int8):
                q8 = None
            elif q8 is None:
                q8 = q8dot.quantize(x)
            for i in range(0, len(self.segments), MAX_SEGMENTS):
                part = self.segments[i:i + MAX_SEGMENTS]
                c0 = sum(r.shape[0] for r, _ in self.segments[:i])
                gemv(x, part, out[:, c0:c0 + sum(r.shape[0] for r, _ in part)], q8=q8)
            return out
        band = max(1, DEQUANT_SCRATCH_ELEMENTS // self.K)
        if self.rows <= band:  # the whole stack expanded at once: one product straight into the output
            w = torch.empty(self.rows, self.K, dtype=x.dtype, device=x.device)
            r0 = 0
            for raw, qt in self.segments:
                dequantize_into(raw, qt, self.K, w[r0:r0 + raw.shape[0]])
                r0 += raw.shape[0]
            return F.linear(x, w)
        scratch = torch.empty(min(band, max(r.shape[0] for r, _ in self.segments)), self.K, dtype=x.dtype,
                              device=x.device)
        out = torch.empty(x.shape[0], self.rows, dtype=x.dtype, device=x.device)
        col = 0
        for raw, qt in self.segments:
            for r0 in range(0, raw.shape[0], band):
                r1 = min(raw.shape[0], r0 + band)
                w = dequantize_into(raw[r0:r1], qt, self.K, scratch[:r1 - r0])
                out[:, col + r0:col + r1] = F.linear(x, w)
            col += raw.shape[0]
        return out

    def rows_of(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` expanded (an embedding lookup); a single-segment matrix only."""
        (raw, qt), = self.segments
        out = torch.empty(ids.numel(), self.K, dtype=dtype, device=raw.device)
        return dequantize_into(raw, qt, self.K, out, ids=ids.reshape(-1))


def stack(parts: list[tuple[int, int, object]], K: int, device: torch.device) -> QuantLinear:
    """A ``QuantLinear`` over matrices given as ``(rows, qtype, raw bytes)`` in order: members of
    one type next to each other are copied into one band, the rest start new bands."""
    groups: list[list[tuple[int, int, object]]] = []
    for p in parts:
        if groups and groups[-1][0][1] == p[1]:
            groups[-1].append(p)
        else:
            groups.append([p])
    segments = []
    for g in groups:
        qt = int(g[0][1])
        raw = torch.empty(sum(r for r, _, _ in g), row_bytes(qt, K), dtype=torch.uint8, device=device)
        at = 0
        for rows, _, data in g:
            with warnings.catch_warnings():  # read-only mmapped bytes: only read, copied to the device
                warnings.simplefilter("ignore", UserWarning)
                src = data if isinstance(data, torch.Tensor) else torch.from_numpy(np.asarray(data))
            raw[at:at + rows].copy_(src.reshape(rows, -1))
            at += rows
        segments.append((raw, qt))
    return QuantLinear(segments, [r for r, _, _ in parts], K)


def linear(x: torch.Tensor, w: "torch.Tensor | QuantLinear", q8: q8dot.Int8Rows | None = None,
           int8: bool = True) -> torch.Tensor:
    """``F.linear`` for a dense weight (a batched decode step's rows one at a time:
    ``decode_rows.each_row``) or a ``QuantLinear`` (``q8``, ``int8``: as it takes them)."""
    if isinstance(w, QuantLinear):
        return w(x, q8, int8)
    return each_row(lambda rows: F.linear(rows, w), x)
