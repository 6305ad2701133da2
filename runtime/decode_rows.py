"""Whether the rows of the current forward call are one-token decode steps of different sequences
(``MoEModel.decode_batch``) rather than consecutive tokens of one sequence (a prefill call).

Why: the kernels of a decode step and of a prefill call differ (the dense GEMV against a
dequantized cuBLAS GEMM, the per-pair MoE kernels against the grouped ones, the int8 form of an
activation written by the launch that wrote it or not), and the code chose between them on
``T == 1``. A sequence's logits must not depend on whether it decodes alone or beside others, so
a batched step makes every such choice as a single step does, for each of its rows: each choice
asks ``one_token_rows(T)``, and the kernels then run their one-row program once per row (batch
invariance by construction: no row's reduction order depends on the batch). The flag is a
context variable set for the length of one batched call (``decoding_rows``).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch

_ROWS: ContextVar[bool] = ContextVar("decode_rows", default=False)


def active() -> bool:
    """Whether the current call's rows are independent one-token steps."""
    return _ROWS.get()


def one_token_rows(rows: int) -> bool:
    """Whether ``rows`` activation rows take the one-token (decode) path: one row, or any number
    of rows of a batched decode step."""
    return rows == 1 or _ROWS.get()


@contextlib.contextmanager
def decoding_rows() -> Iterator[None]:
    """The calls inside compute rows that are independent one-token steps."""
    token = _ROWS.set(True)
    try:
        yield
    finally:
        _ROWS.reset(token)


def each_row(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)``, or in a batched step ``fn`` of each row of ``x`` alone, concatenated: for the
    torch forms (the CPU reference) of products whose reduction order may depend on the row count
    (a GEMM picks its kernel by shape, a GEMV is not a GEMM of one row)."""
    if not _ROWS.get() or x.shape[0] <= 1:
        return fn(x)
    return torch.cat([fn(r) for r in x.split(1)])
