"""Small int64 tables on the device that a batched kernel reads its rows from (each row's buffer
addresses, its position), made once per content and kept alive by the CUDA graphs that read them.

Why: one launch of a kernel for all rows of a batched decode step needs, per row, where that
row's sequence keeps its state (a KV buffer's address, its size), and those differ per row and
per layer. The kernel reads them from a table (``kernels/attention.py``). Building the table on
every call would cost a host-to-device copy per layer; but its content only changes when a buffer
grows, so tables are memoized by their content: an eager step finds every layer's table made,
and a step captured in a CUDA graph finds the one its eager warm-up run made (no copy can be
issued while capturing). A captured graph reads the table's memory at every replay, long after
the memo may have dropped it, so a capture keeps what it used (``kept``: ``graph.run_and_capture``
holds the list beside its graph).
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from contextvars import ContextVar

import torch

MEMO_TABLES = 4096  # tables kept by content: a few per layer and set of sequences, one per eager step's positions
_MEMO: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_MADE = [0]
_KEPT: ContextVar[list[torch.Tensor] | None] = ContextVar("device_tables_kept", default=None)


def table(values: tuple, device: torch.device) -> torch.Tensor:
    """The int64 tensor of ``values`` (a tuple of ints, or of equal-length tuples of ints: one row
    each) on ``device``, made at most once per content (one small copy, which does not make the
    host wait for the device)."""
    key = (device, values)
    t = _MEMO.get(key)
    if t is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a device table must be made before a CUDA graph capture (its eager run makes it)")
        host = torch.tensor(values, dtype=torch.int64)
        t = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
        _MEMO[key] = t
        _MADE[0] += 1
        if len(_MEMO) > MEMO_TABLES:
            _MEMO.popitem(last=False)  # (the oldest; a graph that reads it keeps it)
    else:
        _MEMO.move_to_end(key)
    kept = _KEPT.get()
    if kept is not None:
        kept.append(t)
    return t


def made() -> int:
    """How many tables were made so far (a step that finds all of its tables makes none)."""
    return _MADE[0]


@contextlib.contextmanager
def kept() -> Iterator[list[torch.Tensor]]:
    """Collect every table handed out inside (what a captured graph will read at each replay)."""
    tables: list[torch.Tensor] = []
    token = _KEPT.set(tables)
    try:
        yield tables
    finally:
        _KEPT.reset(token)
