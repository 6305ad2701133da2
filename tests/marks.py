"""The quick run (``python -m pytest -m "not slow"``) keeps the first cases of a heavy
parametrization, so it still runs every module's code on one arch or one type; the full suite
(what CI runs) runs them all."""
from __future__ import annotations

from collections.abc import Iterable

import pytest
from _pytest.mark import ParameterSet


def quick_first(values: Iterable, keep: int = 1) -> list:
    """``values`` of one argument (or a fixture's params) with all but the first ``keep`` marked slow."""
    out = []
    for i, v in enumerate(values):
        if i < keep:
            out.append(v)
        elif isinstance(v, ParameterSet):
            out.append(pytest.param(*v.values, marks=(*v.marks, pytest.mark.slow), id=v.id))
        else:
            out.append(pytest.param(v, marks=pytest.mark.slow))
    return out
