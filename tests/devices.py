"""Which device a test runs on: CUDA where there is one, else the CPU (Triton kernels in the
interpreter)."""
from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def open_model(path, device: str):
    """The model on ``device``: the CPU float32 reference, or on CUDA in bf16 at half residency
    (zero-copy misses, a few cache slots); skips without CUDA."""
    from sparkpack.runtime.models import StoreOptions, load_model

    if device == "cpu":
        return load_model(path)
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return load_model(path, device="cuda", dtype=torch.bfloat16,
                      store=StoreOptions(hot_fraction=0.5, cache_slots=4, miss_mode="zerocopy"))
