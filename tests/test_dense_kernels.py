"""The dense-projection kernels (``runtime.kernels.dense``) against gguf's dequantizer in float64.

CPU runs use Triton's interpreter on small shapes; on a GPU the same tests run at the model's
real widths too. Weights are random valid blocks (``repack.synth.quant_blocks.random_blocks(any_scales=True)``),
so every code and scale bit pattern occurs.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from gguf.constants import GGMLQuantizationType as T  # noqa: E402

from sparkpack.runtime.kernels.dense import dequantize_into, gemv  # noqa: E402
from tests.kernel_refs import DEVICE, rel_l2, segment  # noqa: E402


@pytest.mark.parametrize("tile", [None, (2, 1)], ids=["default", "2rows"])
@pytest.mark.parametrize("K", [512, 768])
def test_gemv_segments_of_mixed_types(K: int, tile) -> None:
    """Four row bands of four types in one launch, each written to its own column band (with 2
    rows per program, 5 and 3 rows leave a partial last program)."""
    types = [(T.Q4_K, 6), (T.Q6_K, 5), (T.F32, 3), (T.Q8_0, 4)]
    segs = [segment(qt, rows, K, seed=i) for i, (qt, rows) in enumerate(types)]
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    out = torch.full((1, sum(r for _, r in types)), float("nan"), device=DEVICE)
    gemv(x, [(raw, int(qt)) for (raw, _), (qt, _) in zip(segs, types)], out, tile=tile)
    ref = x.double().cpu() @ torch.cat([w for _, w in segs]).T
    assert rel_l2(out, ref) < 1e-6


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.F16, T.BF16, T.Q5_K, T.IQ4_XS], ids=lambda q: q.name)
def test_gemv_each_type_alone_with_bf16_output(qtype: T) -> None:
    raw, w = segment(qtype, 9, 512, seed=int(qtype))
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    out = torch.zeros(1, 9, dtype=torch.bfloat16, device=DEVICE)
    gemv(x, [(raw, int(qtype))], out)
    assert rel_l2(out.float(), x.double().cpu() @ w.T) < 1e-2  # bf16 output (the interpreter truncates)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.F32], ids=lambda q: q.name)
def test_dequantize_into_all_rows_and_gathered_rows(qtype: T) -> None:
    raw, w = segment(qtype, 7, 512, seed=3)
    out = torch.full((7, 512), float("nan"), device=DEVICE)
    dequantize_into(raw, int(qtype), 512, out)
    assert torch.allclose(out.double().cpu(), w, rtol=1e-6, atol=1e-6)
    ids = torch.tensor([5, 0, 5, 2], device=DEVICE)
    got = torch.full((4, 512), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    dequantize_into(raw, int(qtype), 512, got, ids=ids)  # bf16 on store (the interpreter truncates)
    assert torch.allclose(got.double().cpu(), w[ids.cpu()], rtol=1e-2, atol=1e-6)


def test_gemv_rejects_bad_segments() -> None:
    raw, _ = segment(T.Q4_K, 4, 512, seed=0)
    x = torch.zeros(1, 512, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous uint8"):
        gemv(x, [(raw[:, :100], int(T.Q4_K))], torch.zeros(1, 4, device=DEVICE))
    with pytest.raises(ValueError, match="out must be"):
        gemv(x, [(raw, int(T.Q4_K))], torch.zeros(1, 5, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous rows"):
        gemv(torch.zeros(512, 2, device=DEVICE).T, [(raw, int(T.Q4_K))], torch.zeros(2, 4, device=DEVICE))
    with pytest.raises(ValueError, match="out must be"):  # one output row per activation row
        gemv(torch.zeros(2, 512, device=DEVICE), [(raw, int(T.Q4_K))], torch.zeros(1, 4, device=DEVICE))
    with pytest.raises(ValueError, match="segments per launch"):
        gemv(x, [(raw, int(T.Q4_K))] * 5, torch.zeros(1, 20, device=DEVICE))
