"""The device tables a DeltaNet decode launch finds its sequences in (``kernels.deltanet.deltanet_rows``):
per layer, each sequence's conv window and recurrent state (their addresses), its rows in the
step, and where a verify copies the states after each row (``runtime.cache.RowStates``).

Why tables are kept rather than made for each step: a step captured in a CUDA graph reads its
table from the address it was captured with, and making one is a host-to-device copy, which a
capture cannot hold; eagerly, a copy per layer and step would be a host wait each. A table holds
addresses, which stay valid because a ``RecurrentState``'s tensors are allocated once and then
only updated in place (a reset zeroes them; a checkpoint, a kept verify row or a conversation's
saved state is copied into them: ``runtime.cache``, ``runtime.sequence_state``); ``StateTable.layer``
checks that on every eager use. A table is filled layer by layer on its first step (the states of
a fresh cache are allocated by the layer that first runs on them), so a captured step's warm-up
run fills what the capture then reads. ``StateTables`` keeps one per set of sequences (and
row-state buffers) for as long as they live: it holds them by weak reference, and a graph that
replays a table keeps it itself (``runtime.graph.BatchGraphs``).
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from .cache import Cache, RecurrentState, RowStates


def sequences(caches: Sequence[Cache]) -> list[tuple[Cache, int, int]]:
    """A step's rows (one cache each) as sequences: each cache with its first row and row count
    (a verify's rows are one cache at consecutive positions; a batched step's, one row per cache)."""
    out: list[tuple[Cache, int, int]] = []
    for row, c in enumerate(caches):
        if out and out[-1][0] is c:
            out[-1] = (c, out[-1][1], out[-1][2] + 1)
        elif any(o[0] is c for o in out):
            raise ValueError("a batched step's rows of one sequence must be consecutive")
        else:
            out.append((c, row, 1))
    return out


class StateTable:
    """The table of one set of sequences: ``[n_layer, sequences, SEQUENCE_COLUMNS]`` int64 on the
    device, a layer's rows written on its first use."""

    def __init__(self, n_layer: int, rows: list[tuple[int, int]], device: torch.device):
        from .kernels.deltanet import SEQUENCE_COLUMNS

        self.rows = rows  # (first row, row count) per sequence
        self.table = torch.zeros(n_layer, len(rows), SEQUENCE_COLUMNS, dtype=torch.int64, device=device)
        self.filled: list[list[list[int]] | None] = [None] * n_layer

    def layer(self, il: int, states: Sequence[RecurrentState], saved: RowStates | None) -> torch.Tensor:
        """Layer ``il``'s table for the sequences' ``states`` (``saved``: the buffers a verify's
        states after each row go to)."""
        from .kernels.deltanet import sequence_row

        rows = [sequence_row(st.conv, st.ssm, first, n, None if saved is None else (saved.conv[il], saved.ssm[il]))
                for st, (first, n) in zip(states, self.rows)]
        if self.filled[il] is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("a DeltaNet table is filled by the step's warm-up run, not inside its capture")
            self.table[il].copy_(torch.tensor(rows, dtype=torch.int64))
            self.filled[il] = rows
        elif self.filled[il] != rows:
            raise RuntimeError(f"layer {il}: a DeltaNet state moved after its table was made (states are "
                               "allocated once and updated in place)")
        return self.table[il]


class StateTables:
    """One ``StateTable`` per set of sequences (the caches of a step's rows, in order) and
    row-state buffers, while they live."""

    def __init__(self, n_layer: int, device: torch.device):
        self.n_layer, self.device = n_layer, device
        self._tables: dict[tuple, tuple[list[weakref.ref], StateTable]] = {}

    def __len__(self) -> int:
        return len(self._tables)

    def get(self, caches: Sequence[Cache], saved: RowStates | None = None) -> StateTable:
        """The table of a step whose rows are ``caches`` (``saved``: its row-state buffers, a verify
        of one sequence)."""
        seqs = sequences(caches)
        if saved is not None and len(seqs) != 1:
            raise ValueError("the states after each row are kept for a verify of one sequence")
        owners: list[object] = [c for c, _, _ in seqs] + ([saved] if saved is not None else [])
        key = (tuple((id(c), first, n) for c, first, n in seqs), id(saved))
        hit = self._tables.get(key)
        if hit is not None and all(r() is o for r, o in zip(hit[0], owners)):
            return hit[1]
        table = StateTable(self.n_layer, [(first, n) for _, first, n in seqs], self.device)

        def gone(_: weakref.ref, key: tuple = key, table: StateTable = table) -> None:
            if self._tables.get(key, (None, None))[1] is table:
                del self._tables[key]

        self._tables[key] = ([weakref.ref(o, gone) for o in owners], table)
        return table
