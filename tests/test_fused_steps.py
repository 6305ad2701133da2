"""The one-token fusions around the matrix products: RMSNorm with the residual add in front and
the int8 form of its output (``kernels/norm.py``), the shared expert's ``silu(gate) * up`` with its
int8 form, and the MoE block's residual epilogue (``kernels/ffn.py``), each against the torch
forms of ``runtime.layers`` that they replace on the GPU, and the int8 forms against
``q8dot.quantize`` of the fused kernels' own outputs (bit for bit: same rule, same input).
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from sparkpack.runtime.kernels import q8dot  # noqa: E402
from sparkpack.runtime.kernels.ffn import ffn_residual_rows, silu_mul_rows  # noqa: E402
from sparkpack.runtime.kernels.norm import rms_norm_rows  # noqa: E402
from sparkpack.runtime.layers import ffn_residual, rms_norm  # noqa: E402
from tests.devices import DEVICE  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """Equal up to the float32 order of a sum (f32) or a rounding flip of the dtype (bf16; Triton's
    interpreter truncates to bf16 where the GPU rounds, so chains of casts drift further there;
    the float32 cases pin the formulas)."""
    tol = 2e-6 if dtype == torch.float32 else 1e-2 if DEVICE == "cuda" else 4e-2
    return bool((got.float().cpu() - want.float().cpu()).abs().max() <= tol * want.float().abs().max())


def same_q8(got, y: torch.Tensor) -> None:
    want = q8dot.quantize(y)
    assert got is not None and len(got) == 3
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_with_residual_and_int8_form(dtype) -> None:
    """``x + r`` written out as the torch add rounds it, its norm as the torch form, and the
    returned int8 form equal to quantizing that output; a row width that is not a power of two
    (the kernel's block is padded) and several rows."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 96, generator=g) * 4).to(dtype)
    r = torch.randn(3, 96, generator=g).to(dtype)
    w = torch.randn(96, generator=g).to(dtype)
    s, y, yq = rms_norm_rows(x.to(DEVICE), w.to(DEVICE), 1e-6, residual=r.to(DEVICE), q8=True)
    want_s, want_y = rms_norm(x, w, 1e-6, residual=r)  # the torch form on the CPU
    # bit for bit where the cast rounds to nearest (Triton's interpreter truncates to bf16)
    assert torch.equal(s.cpu(), want_s) if dtype == torch.float32 or DEVICE == "cuda" else close(s, want_s, dtype)
    assert y.dtype == dtype and close(y, want_y, dtype)
    same_q8(yq, y)
    plain = rms_norm_rows(x.to(DEVICE), w.to(DEVICE), 1e-6)  # no residual, no int8 form: the rows alone
    assert isinstance(plain, torch.Tensor) and close(plain, rms_norm(x, w, 1e-6), dtype)
    with pytest.raises(ValueError, match="multiple of 32"):
        rms_norm_rows(x[:, :40].contiguous().to(DEVICE), None, 1e-6, q8=True)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_rows(x.to(DEVICE), None, 1e-6, residual=r[:2].to(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_from_column_bands_with_int8_form(dtype) -> None:
    """gate and up read in place as column bands of one stacked projection output (row stride
    wider than the band), more columns than one program's block (the int8 blocks of each
    program land in the right place)."""
    g = torch.Generator().manual_seed(2)
    n = 1024 + 64
    y = (torch.randn(2, 2 * n + 5, generator=g) * 3).to(dtype).to(DEVICE)
    gate, up = y[:, 5:5 + n], y[:, 5 + n:]
    got, got_q8 = silu_mul_rows(gate, up, q8=True)
    want = torch.nn.functional.silu(gate.cpu()) * up.cpu()
    assert got.shape == (2, n) and got.is_contiguous() and close(got, want, dtype)
    same_q8(got_q8, got)
    assert isinstance(silu_mul_rows(gate, up), torch.Tensor)  # no int8 form asked: the rows alone
    with pytest.raises(ValueError):
        silu_mul_rows(gate, up[:, 1:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["gated", "shared", "routed only"])
def test_ffn_residual_matches_the_torch_form(dtype, kind) -> None:
    """``x + routed + sigmoid(g) * shared`` with the routed sum in float32 (the MoE kernels'
    output) rounded first, as the torch form rounds each step; the gate logit a column of a
    wider projection output."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 80, generator=gen).to(dtype)
    routed = torch.randn(2, 80, generator=gen)
    shared = torch.randn(2, 80, generator=gen).to(dtype) if kind != "routed only" else None
    proj = torch.randn(2, 7, generator=gen).to(dtype)
    gate = proj[:, 3:4] if kind == "gated" else None
    want = ffn_residual(x, routed, shared, gate)
    dev = (lambda t: None if t is None else t.to(DEVICE))
    got = ffn_residual_rows(x.to(DEVICE), routed.to(DEVICE), dev(shared),
                            None if gate is None else proj.to(DEVICE)[:, 3:4])
    assert got.dtype == dtype and close(got, want, dtype)
    if shared is not None:  # the shared term is there: dropping it changes the result
        assert not close(got, ffn_residual(x, routed), dtype)
    with pytest.raises(ValueError):
        ffn_residual_rows(x.to(DEVICE), routed[:1].to(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ffn_residual_sums_unsummed_expert_outputs_as_the_moe_kernels_do(dtype) -> None:
    """The k weighted expert outputs ``[T, k, N]`` (``moe_experts(reduce=False)``) summed in the
    epilogue: bit for bit the epilogue of the MoE kernels' own per-token sum (``sum_topk_kernel``,
    the same float32 additions in the same order), on the GPU path and the torch form alike."""
    from sparkpack.runtime.kernels import pdl
    from sparkpack.runtime.kernels.moe import sum_topk_kernel

    gen = torch.Generator().manual_seed(4)
    T, k, N = 3, 8, 80
    x = torch.randn(T, N, generator=gen).to(dtype).to(DEVICE)
    parts = (torch.randn(T, k, N, generator=gen) * torch.logspace(-3, 3, k)[None, :, None]).to(DEVICE)
    shared = torch.randn(T, N, generator=gen).to(dtype).to(DEVICE)
    summed = torch.empty(T, N, device=DEVICE)
    sum_topk_kernel[(T, 1)](parts, summed, k, N, N, BLOCK=128, **pdl.flags(parts))
    got = ffn_residual_rows(x, parts, shared)
    assert torch.equal(got, ffn_residual_rows(x, summed, shared))
    torch_form = ffn_residual(x.cpu(), parts.cpu(), shared.cpu())
    assert close(got, torch_form, dtype) and torch.equal(torch_form, ffn_residual(x.cpu(), summed.cpu(), shared.cpu()))
    assert not torch.equal(got, ffn_residual_rows(x, parts[:, :-1].contiguous(), shared))  # every part counts
    with pytest.raises(ValueError):
        ffn_residual_rows(x, parts[:2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q8", [False, True])
def test_ffn_residual_with_the_next_norm_is_that_norm_bit_for_bit(dtype, q8) -> None:
    """The epilogue that also computes the next block's input norm (``norm=``): the same residual
    row as without it, and the norm (and its int8 form) bit for bit the norm kernel's on that row,
    so a step that takes the fused form cannot differ from one that does not."""
    gen = torch.Generator().manual_seed(6)
    T, k, N = 1, 8, 2048
    x = torch.randn(T, N, generator=gen).to(dtype).to(DEVICE)
    parts = torch.randn(T, k, N, generator=gen).to(DEVICE)
    shared = torch.randn(T, N, generator=gen).to(dtype).to(DEVICE)
    gate = torch.randn(T, 1, generator=gen).to(dtype).to(DEVICE)
    w = (torch.rand(N, generator=gen) + 0.5).to(dtype).to(DEVICE)
    y, h, *hq = ffn_residual_rows(x, parts, shared, gate, norm=(w, 1e-6), q8=q8)
    assert torch.equal(y, ffn_residual_rows(x, parts, shared, gate))
    want = rms_norm_rows(y, w, 1e-6, q8=q8)
    want, *want_q8 = want if q8 else (want,)
    assert h.dtype == dtype and torch.equal(h, want)
    assert len(hq) == len(want_q8) == int(q8)  # the int8 form comes back only when asked for
    if q8:
        same_q8(hq[0], want)
        for a, b in zip(hq[0], want_q8[0]):
            assert torch.equal(a, b)
    with pytest.raises(ValueError):
        ffn_residual_rows(x, parts, shared, gate, q8=True)  # an int8 form needs the norm
