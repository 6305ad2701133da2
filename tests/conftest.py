"""Shared fixtures. Helpers append their own fixtures here; keep each one small."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def synth_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make(arch, quant="Q8_0", skew=0.0, seed=0) -> Path``: a tiny synthetic GGUF, written once
    per argument tuple per session (treat it as read-only)."""
    from repack.synth import write_synthetic

    cache: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("synth")

    def make(arch: str, quant: str = "Q8_0", skew: float | str = 0.0, seed: int = 0) -> Path:
        key = (arch, quant, skew, seed)
        if key not in cache:
            cache[key] = write_synthetic(root / f"{arch}-{quant}-{skew}-{seed}.gguf", arch, "tiny", quant,
                                         seed=seed, skew=skew)
        return cache[key]

    return make
