"""Random valid quantized weights and their float64 references, for the kernel tests.

Blocks are random bytes with only the f16 scale fields made finite
(``repack.synth.quant_blocks.random_blocks(any_scales=True)``), so every bit pattern of the packed
codes and sub-block scales occurs; the reference is gguf's numpy dequantizer of the same bytes.
The types come from the registry (``formats.quants.KERNEL_QUANTS``): a type added there is tested."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize

from sparkpack.formats.quants import FLOAT_QTYPES, KERNEL_QTYPES
from sparkpack.repack.synth.quant_blocks import make_rng, random_blocks
from tests.devices import DEVICE
from tests.paths import REPO

QTYPES = [T(q) for q in KERNEL_QTYPES]          # every block type the kernels read
FLOAT_TYPES = [T(q) for q in FLOAT_QTYPES]      # and the float types the dense kernels read as stored


def random_weight(qtype: T, rows: int, K: int, seed: int, *lead: int) -> np.ndarray:
    """uint8 ``[*lead, rows, row_bytes]`` of random valid blocks, every scale pattern occurring."""
    from gguf.constants import GGML_QUANT_SIZES

    n_rows = int(np.prod(lead, dtype=np.int64)) * rows
    raw = random_blocks(qtype, n_rows * K // GGML_QUANT_SIZES[qtype][0], 0.02, make_rng(seed), any_scales=True)
    return raw.reshape(*lead, rows, -1)


def dequant64(raw: np.ndarray, qtype: T, K: int) -> torch.Tensor:
    """The reference weights: gguf's numpy dequantizer, as float64 ``[..., rows, K]``."""
    w = dequantize(raw.reshape(-1, raw.shape[-1]), qtype).reshape(*raw.shape[:-1], K)
    return torch.from_numpy(w.astype(np.float64))


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    got = got.double().cpu()
    assert torch.isfinite(got).all(), "non-finite output (poisoned entry left unwritten?)"
    return float((got - ref).norm() / ref.norm())


def segment(qtype: T, rows: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw uint8 rows on the device, float64 reference weights) for one band of a dense matrix."""
    if qtype in (T.F32, T.F16, T.BF16):
        dt = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[qtype]
        w = torch.randn(rows, K, generator=torch.Generator().manual_seed(seed)).to(dt)
        return w.view(torch.uint8).reshape(rows, -1).to(DEVICE), w.double()
    raw = random_weight(qtype, rows, K, seed)
    return torch.from_numpy(raw).to(DEVICE), dequant64(raw, qtype, K)


def pools(experts: np.ndarray, slot_of: list[int], n_slots: int) -> torch.Tensor:
    """Place expert e's bytes at slot ``slot_of[e]`` of a garbage-filled pool (unused slots must
    never be read)."""
    pool = np.full((n_slots, *experts.shape[1:]), 0xFF, dtype=np.uint8)
    for e, s in enumerate(slot_of):
        if s >= 0:
            pool[s] = experts[e]
    return torch.from_numpy(pool).to(DEVICE)


def compile_in_subprocess(call: str, count: int) -> None:
    """Run ``call`` (a ``from tests... import f; f()`` line that prints "compiled N") with Triton's
    compiler rather than its interpreter, in a fresh process (Triton fixes the mode at import)."""
    import triton

    if not (os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))):
        pytest.skip("this triton install has no CUDA backend (ptxas)")
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", call], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and f"compiled {count}" in proc.stdout, proc.stderr[-3000:]


def deltanet_decode(qkv: torch.Tensor, z: torch.Tensor, beta: torch.Tensor, alpha: torch.Tensor,
                    dt_bias: torch.Tensor, a: torch.Tensor, conv_w: torch.Tensor, conv_win: torch.Tensor,
                    state: torch.Tensor, norm_w: torch.Tensor, n_k: int, d_k: int, eps: float,
                    q8: bool = False) -> "torch.Tensor | tuple":
    """The fused DeltaNet decode step for one token of one sequence (the model's single step: a
    launch of ``deltanet_rows`` with a table of one row, made here where the model takes its own
    from ``runtime.device_tables``): ``qkv [C]``, ``z [n_v * d_v]``, ``beta``, ``alpha [n_v]``, the window
    ``conv_win [K-1, C]`` and ``state [n_v, d_k, d_v]`` float32 (contiguous, updated in place).
    Returns one row ``[1, n_v * d_v]`` (with ``q8`` also its int8 form)."""
    n_v, dk, d_v = state.shape
    C = qkv.numel()
    if dk != d_k or conv_win.shape != (conv_w.shape[1] - 1, C) or conv_win.dtype != qkv.dtype \
            or state.dtype != torch.float32 or not (conv_win.is_contiguous() and state.is_contiguous()):
        raise ValueError("DeltaNet decode: a contiguous window [K-1, C] of the input's type and float32 state")
    from sparkpack.runtime.kernels.deltanet import deltanet_rows, sequence_row

    table = torch.tensor([sequence_row(conv_win, state, 0, 1)], dtype=torch.int64).to(qkv.device)
    return deltanet_rows(qkv.reshape(1, C), z.reshape(1, -1), beta.reshape(1, -1), alpha.reshape(1, -1), dt_bias, a,
                         conv_w, table, norm_w, n_k, d_k, d_v, eps, q8)
