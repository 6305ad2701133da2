"""The one-token kernels over the rows of a batched decode step (``runtime.decode_rows``): B rows
in one launch give, row for row, the bits of B one-row launches. The dense GEMV takes a row axis
(the fastest of its grid); the MoE per-pair kernels, norms, SwiGLU, the residual epilogue, the
router and the int8 quantizer run one program per row already, and in a batched step launch as
for one token. CPU: Triton's interpreter on small shapes; a GPU (``SPARKPACK_TEST_DEVICE`` not
needed: these run compiled wherever CUDA is) at the real widths, where the compiled reductions
are what could differ."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from gguf.constants import GGMLQuantizationType as T  # noqa: E402

from sparkpack.runtime.decode_rows import decoding_rows  # noqa: E402
from sparkpack.runtime.kernels import q8dot  # noqa: E402
from sparkpack.runtime.kernels.dense import MAX_SEGMENTS, gemv  # noqa: E402
from sparkpack.runtime.kernels.ffn import ffn_residual_rows, silu_mul_rows  # noqa: E402
from sparkpack.runtime.kernels.moe import GROUPED_MIN_PAIRS, ExpertPools, moe_experts  # noqa: E402
from sparkpack.runtime.kernels.norm import rms_norm_rows  # noqa: E402
from sparkpack.runtime.kernels.router import sigmoid_topk, softmax_topk  # noqa: E402
from sparkpack.runtime.quant_linear import stack  # noqa: E402
from tests.kernel_refs import DEVICE, random_weight, segment  # noqa: E402
from tests.marks import quick_first  # noqa: E402

GPU = DEVICE == "cuda"
B = 5
K = 2048 if GPU else 512  # the activation width (n_embd)


def rows(n: int, width: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def each_alone(fn, *inputs: torch.Tensor) -> torch.Tensor:
    """``fn`` on each row of ``inputs`` alone (outside a batched step), the results stacked."""
    return torch.cat([fn(*(t[b:b + 1] for t in inputs)) for b in range(inputs[0].shape[0])])


@pytest.mark.parametrize("q8", quick_first([True, False]), ids=["int8", "float"])
@pytest.mark.parametrize("dtype", quick_first([torch.float32, torch.bfloat16]), ids=["f32", "bf16"])
def test_gemv_rows_are_each_row_alone(q8: bool, dtype: torch.dtype) -> None:
    """Four bands of four types (K-quants with int8 kernels, a low-bit one, a float band) in one
    launch, at the runtime's default tile, B rows against B launches of one row."""
    n = 96 if GPU else 6
    types = [(T.Q4_K, n + 3), (T.Q6_K, n), (T.Q3_K, n - 1), (T.F32, 5)]
    segs = [(segment(qt, r, K, seed=i)[0], int(qt)) for i, (qt, r) in enumerate(types)]
    x = rows(B, K, 1, dtype)
    width = sum(r for _, r in types)

    def run(x: torch.Tensor) -> torch.Tensor:
        out = torch.full((x.shape[0], width), float("nan"), dtype=dtype, device=DEVICE)
        return gemv(x, segs, out, q8=q8dot.quantize(x) if q8 else None)

    assert torch.equal(run(x), each_alone(run, x))


def test_quant_linear_rows_in_a_batched_step() -> None:
    """More bands than one launch takes (``MAX_SEGMENTS``): the later launches write column bands
    of a wider output (rows strided), each row still its own launch's bits."""
    n = 64 if GPU else 4
    parts = [(n + i, qt, segment(qt, n + i, K, seed=10 + i)[0].cpu())
             for i, qt in enumerate([T.Q4_K, T.Q6_K] * (MAX_SEGMENTS // 2 + 1))]
    lin = stack(parts, K, torch.device(DEVICE))
    assert len(lin.segments) > MAX_SEGMENTS
    x = rows(B, K, 2)
    with decoding_rows():
        got = lin(x)
    assert torch.equal(got, each_alone(lin, x))


@pytest.mark.slow
@pytest.mark.parametrize("act_q8", [True, False], ids=["int8", "float"])
def test_moe_tokens_of_a_batched_step_are_each_alone(act_q8: bool) -> None:
    """Top-k experts of a batched step's tokens through the per-pair kernels with one token's
    launch (as many pairs as a prefill call would take to the grouped kernels), half the experts
    read from a host pool, the routing counts those of the batch's tokens."""
    n_embd, n_ff, n_expert, k = (2048, 512, 16, 8) if GPU else (256, 256, 6, 2)
    n = GROUPED_MIN_PAIRS // k + 1  # enough tokens that a prefill call of them would be grouped
    g = torch.Generator().manual_seed(3)
    x = rows(n, n_embd, 4)
    ids = torch.stack([torch.randperm(n_expert, generator=g)[:k] for _ in range(n)]).to(DEVICE)
    ids[1] = ids[0]  # two tokens routed alike: their pairs read the same experts
    wts = torch.rand(n, k, generator=g).to(DEVICE)
    gate = torch.from_numpy(random_weight(T.Q4_K, n_ff, n_embd, 11, n_expert)).to(DEVICE)
    up = torch.from_numpy(random_weight(T.Q4_K, n_ff, n_embd, 12, n_expert)).to(DEVICE)
    down = torch.from_numpy(random_weight(T.Q6_K, n_embd, n_ff, 13, n_expert)).to(DEVICE)
    host = tuple(p.cpu().pin_memory() if GPU else p.clone() for p in (gate, up, down))
    table = torch.tensor([-(e + 1) if e % 2 else e for e in range(n_expert)], dtype=torch.int32, device=DEVICE)
    pools = ExpertPools(gate, up, down, T.Q4_K, T.Q4_K, T.Q6_K, n_ff, host=host)

    def run(x, ids, wts, counts=None):
        return moe_experts(x, ids, wts, table, pools, act_q8=act_q8, counts=counts)

    counts = torch.zeros(n_expert, dtype=torch.int32, device=DEVICE)
    with decoding_rows():
        got = run(x, ids, wts, counts)
    assert torch.equal(got, each_alone(run, x, ids, wts))
    assert torch.equal(counts.cpu(), torch.bincount(ids.reshape(-1).cpu(), minlength=n_expert).to(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_row_kernels_of_a_batched_step_are_each_alone(dtype: torch.dtype) -> None:
    """The norm with its residual add, SwiGLU and the residual epilogue with the next norm, each
    with the int8 form of its rows (written for one row, and for a batched step's rows), the
    quantizer and both routers: B rows against B one-row launches, every output."""
    n_embd, n_ff, n_expert, k = (2048, 512, 128, 8) if GPU else (256, 64, 16, 4)
    x, r, w = rows(B, n_embd, 5, dtype), rows(B, n_embd, 6, dtype), rows(1, n_embd, 7, dtype)[0]
    gate, up = rows(B, n_ff, 8, dtype), rows(B, n_ff, 9, dtype)
    routed, shared, sg = rows(B * k, n_embd, 10).view(B, k, n_embd), rows(B, n_embd, 11, dtype), rows(B, 1, 12, dtype)
    logits, bias = rows(B, n_expert, 13), rows(1, n_expert, 14)[0]

    def flat(out) -> list[torch.Tensor]:
        out = out if isinstance(out, tuple) else (out,)
        return [t for o in out for t in (o if isinstance(o, tuple) else (o,))]

    cases = [
        (lambda x, r: rms_norm_rows(x, w, 1e-6, r, q8dot.wanted(x.shape[0], n_embd)), (x, r)),
        (lambda g, u: silu_mul_rows(g, u, q8dot.wanted(g.shape[0], n_ff)), (gate, up)),
        (lambda x, p, s, sg: ffn_residual_rows(x, p, s, sg, (w, 1e-6), q8dot.wanted(x.shape[0], n_embd)),
         (x, routed, shared, sg)),
        (lambda x: tuple(q8dot.quantize(x)), (x,)),
        (lambda lg: softmax_topk(lg, k, True), (logits,)),
        (lambda lg: sigmoid_topk(lg, bias, k, True, 2.5), (logits,)),
    ]
    for fn, inputs in cases:
        with decoding_rows():
            got = flat(fn(*inputs))
        alone = [flat(fn(*(t[b:b + 1] for t in inputs))) for b in range(B)]
        assert len(got) == len(alone[0])
        for i, g in enumerate(got):
            assert torch.equal(g, torch.cat([a[i] for a in alone])), (fn, i)
