"""Triton kernels against a float64 reference built from ``gguf.quants.dequantize`` of the same bytes.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported), on tiny shapes. Blocks are random bytes with only the f16 scale fields made finite
(``repack.synth.quant_blocks.random_blocks(any_scales=True)``), so every bit pattern of the packed
codes and sub-block scales (negative Q6_K scales, the high bits of the 6-bit K-quant scales) is
exercised. The interpreter does not see GPU code generation, so one
test also compiles every kernel family for sm_90 with the ptxas bundled in the triton wheel.
"""
from __future__ import annotations

import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

from sparkpack.formats.quants import KERNEL_QTYPES  # noqa: E402
from sparkpack.runtime.kernels.blocks import BLOCK_LAYOUT  # noqa: E402
from sparkpack.runtime.kernels.dense import gemv  # noqa: E402
from sparkpack.runtime.kernels.moe import GROUPED_MIN_PAIRS, ExpertPools, MoELaunch, group_pairs, moe_experts  # noqa: E402
from tests.kernel_refs import (DEVICE, QTYPES, compile_in_subprocess, deltanet_decode, dequant64, pools,  # noqa: E402
                               random_weight, rel_l2)
from tests.marks import quick_first  # noqa: E402

def test_block_table_is_ggufs() -> None:
    """The kernels' types and block sizes are gguf's (one table, ``formats.quants``)."""
    assert BLOCK_LAYOUT == {int(q): GGML_QUANT_SIZES[q] for q in QTYPES}


def test_a_type_outside_the_registry_is_refused_never_another_types_math() -> None:
    """A type the registry does not list stops the kernel's compile (``blocks._unpack``'s last
    branch) and is refused by the pools; the registry and ``_unpack``'s branches are one set
    (checked when ``blocks`` is imported)."""
    from sparkpack.runtime.kernels import blocks
    from sparkpack.runtime.kernels.dense import dequantize_into
    from sparkpack.runtime.kernels.slots import check_pool

    assert blocks.unpack_branches() == set(KERNEL_QTYPES)
    other = T.TQ2_0
    assert int(other) not in KERNEL_QTYPES
    raw = torch.zeros(2, GGML_QUANT_SIZES[other][1], dtype=torch.uint8, device=DEVICE)
    with pytest.raises(Exception) as refused:
        dequantize_into(raw, int(other), 256, torch.empty(2, 256, device=DEVICE))
    # Triton's compiler wraps the static_assert's error (its message is the cause's, not the
    # outer "at line:col" one); the interpreter raises it as is
    chain, e = [], refused.value
    while e is not None and len(chain) < 16:
        chain.append(str(e))
        e = e.__cause__ or e.__context__
    assert any("no branch for this quant type" in m for m in chain), chain
    with pytest.raises(ValueError, match="no Triton kernel"):
        check_pool(raw.view(1, 2, -1), int(other), 256, 2, "gate")


@pytest.mark.parametrize("qtype", quick_first(QTYPES), ids=lambda q: q.name)
def test_every_kernel_type_unpacks_as_gguf_in_the_row_and_tile_dots(qtype: T) -> None:
    """Each type's unpacking through both dots that use it: the one-token dense GEMV (the
    byte-wise ``_row_dot`` for the types without a word kernel) and the grouped MoE's expanded
    tiles (``_tile_dot``), fp32 activations against gguf's dequantizer; 32-block types also get a
    K that ends mid-chunk (one full 256 chunk plus one block)."""
    Ks = (512, 288) if BLOCK_LAYOUT[int(qtype)][0] == 32 else (512,)
    for K in Ks:
        N = 13  # not a multiple of any rows-per-program block
        raw = random_weight(qtype, N, K, seed=int(qtype) * 7 + K)
        x = torch.randn(1, K, generator=torch.Generator().manual_seed(K), dtype=torch.float32)
        out = torch.full((1, N), float("nan"), dtype=torch.float32, device=DEVICE)
        gemv(x.to(DEVICE), [(torch.from_numpy(raw).to(DEVICE), int(qtype))], out)
        assert rel_l2(out, x.double() @ dequant64(raw, qtype, K).T) < 1e-5, (qtype.name, K)
    n_ff, n_exp, n_tok = 256, 2, 3  # the tile dots: gate/up read K = 288 or 512 wide, down n_ff
    K = Ks[-1]
    gate, up = random_weight(qtype, n_ff, K, 61, n_exp), random_weight(qtype, n_ff, K, 62, n_exp)
    down = random_weight(qtype, K, n_ff, 63, n_exp)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n_tok, K, generator=g)
    ids = torch.tensor([[0], [1], [1]])
    wts = torch.rand(n_tok, 1, generator=g)
    slots = [0, 1]
    y = moe_experts(x.to(DEVICE), ids.to(DEVICE), wts.to(DEVICE), torch.tensor(slots, dtype=torch.int32, device=DEVICE),
                    ExpertPools(pools(gate, slots, n_exp), pools(up, slots, n_exp), pools(down, slots, n_exp), qtype,
                                qtype, qtype, n_ff),
                    launch=MoELaunch(grouped=True, sub=False, tiles=(16, 64, 4) if DEVICE == "cpu" else None))
    ref = moe_reference(x.double(), ids, wts, dequant64(gate, qtype, K), dequant64(up, qtype, K),
                        dequant64(down, qtype, n_ff))
    assert rel_l2(y, ref) < 1e-5, qtype.name


@pytest.mark.skipif(DEVICE != "cuda", reason="real shapes: GPU only (minutes in the interpreter)")
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_kernels_at_real_shapes_against_gguf(qtype: T) -> None:
    """The qwen3.6 expert shapes (gate/up 2048 -> 512, down 512 -> 2048) and a dense 2048 -> 4096
    matrix through the dense GEMV (one token) and both MoE paths, bf16 activations as at run
    time, against gguf.quants' dequantization in float64. Bounds: 1e-4 where products accumulate
    the exact weights in fp32, 1e-2 where tl.dot takes bf16 operands."""
    g = torch.Generator().manual_seed(int(qtype))
    for K, N in ((2048, 512), (512, 2048), (2048, 4096)):
        raw = random_weight(qtype, N, K, seed=int(qtype) + K)
        x = torch.randn(1, K, generator=g).to(torch.bfloat16)
        out = torch.empty(1, N, dtype=torch.float32, device=DEVICE)
        gemv(x.to(DEVICE), [(torch.from_numpy(raw).to(DEVICE), int(qtype))], out)
        assert rel_l2(out, x.double() @ dequant64(raw, qtype, K).T) < 1e-4, (K, N)
    n_embd, n_ff, n_exp, topk = 2048, 512, 16, 8
    gate, up = random_weight(qtype, n_ff, n_embd, 51, n_exp), random_weight(qtype, n_ff, n_embd, 52, n_exp)
    down = random_weight(qtype, n_embd, n_ff, 53, n_exp)
    dq = [dequant64(t, qtype, k) for t, k in ((gate, n_embd), (up, n_embd), (down, n_ff))]
    slots = list(range(n_exp))
    for n_tok, grouped, bound in ((1, False, 1e-4), (32, True, 1e-2)):
        x = torch.randn(n_tok, n_embd, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(n_exp, generator=g)[:topk] for _ in range(n_tok)])
        wts = torch.softmax(torch.randn(n_tok, topk, generator=g), -1)
        y = moe_experts(x.to(DEVICE), ids.to(DEVICE), wts.to(DEVICE), torch.tensor(slots, dtype=torch.int32,
                        device=DEVICE), ExpertPools(pools(gate, slots, n_exp), pools(up, slots, n_exp),
                                                    pools(down, slots, n_exp), qtype, qtype, qtype, n_ff),
                        launch=MoELaunch(grouped=grouped))
        assert rel_l2(y, moe_reference(x.double(), ids, wts, *dq)) < bound, (n_tok, grouped)


# ----------------------------------------------------------------------------- MoE

N_EMBD, N_FF, N_EXPERT, TOPK, N_TOK = 256, 256, 5, 2, 3


def moe_reference(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, gate: torch.Tensor,
                  up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Per-expert float64 loop over tokens and choices on the dequantized expert weights."""
    y = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = gate[e] @ x[t], up[e] @ x[t]
            y[t] += float(wts[t, j]) * (down[e] @ (torch.nn.functional.silu(g) * u))
    return y


@pytest.fixture(scope="module")
def moe_case() -> dict:
    rng = torch.Generator().manual_seed(0)
    x = torch.randn(N_TOK, N_EMBD, generator=rng)
    ids = torch.stack([torch.randperm(N_EXPERT, generator=rng)[:TOPK] for _ in range(N_TOK)]).to(torch.int32)
    wts = torch.rand(N_TOK, TOPK, generator=rng)
    gate = random_weight(T.Q4_K, N_FF, N_EMBD, 1, N_EXPERT)
    up = random_weight(T.Q5_K, N_FF, N_EMBD, 2, N_EXPERT)
    down = random_weight(T.Q6_K, N_EMBD, N_FF, 3, N_EXPERT)
    ref = moe_reference(x.double(), ids, wts, dequant64(gate, T.Q4_K, N_EMBD), dequant64(up, T.Q5_K, N_EMBD),
                        dequant64(down, T.Q6_K, N_FF))
    return dict(x=x, ids=ids, wts=wts, gate=gate, up=up, down=down, ref=ref)


def run_moe(case: dict, slot_of: list[int], n_slots: int, validate: bool = False, grouped: bool = False,
            host: tuple | None = None) -> torch.Tensor:
    out = torch.full((N_TOK, N_EMBD), float("nan"), device=DEVICE)
    return moe_experts(case["x"].to(DEVICE), case["ids"].to(DEVICE), case["wts"].to(DEVICE),
                       torch.tensor(slot_of, dtype=torch.int32, device=DEVICE),
                       ExpertPools(pools(case["gate"], slot_of, n_slots), pools(case["up"], slot_of, n_slots),
                                   pools(case["down"], slot_of, n_slots), T.Q4_K, T.Q5_K, T.Q6_K, N_FF, host=host),
                       validate=validate, out=out,
                       # few programs: the interpreter is slow (a GPU takes the default tiles)
                       launch=MoELaunch(grouped=grouped, block_n=64,
                                        tiles=(16, 128, 4) if grouped and DEVICE == "cpu" else None))


@pytest.mark.parametrize("grouped", quick_first([False, True]), ids=["per-pair", "grouped"])
def test_moe_matches_reference_and_ignores_slot_placement(moe_case: dict, grouped: bool) -> None:
    first = run_moe(moe_case, [0, 1, 2, 3, 4], 5, grouped=grouped)
    assert rel_l2(first, moe_case["ref"]) < 1e-5
    # Same experts in other slots of a larger pool: bit-identical, residency never changes results.
    moved = run_moe(moe_case, [6, 2, 0, 5, 3], 7, grouped=grouped)
    assert torch.equal(first, moved)


@pytest.mark.slow
@pytest.mark.parametrize("types", [(T.Q4_K, T.Q5_K, T.Q6_K), (T.Q6_K, T.Q4_K, T.Q5_K), (T.Q4_K, T.Q4_K, T.Q4_K),
                                   # each low-bit type whole and, beside a type of 16, in halves
                                   (T.IQ2_XXS, T.IQ2_XS, T.IQ3_XXS), (T.IQ3_S, T.IQ2_S, T.IQ1_S),
                                   (T.IQ1_S, T.IQ1_M, T.Q2_K), (T.IQ3_XXS, T.Q3_K, T.IQ3_S),
                                   (T.IQ2_XXS, T.IQ2_XXS, T.IQ2_XXS)],
                         ids=["q4k-q5k-q6k", "q6k-q4k-q5k", "q4k", "iq2xxs-iq2xs-iq3xxs", "iq3s-iq2s-iq1s",
                              "iq1s-iq1m-q2k", "iq3xxs-q3k-iq3s", "iq2xxs"])
def test_grouped_sub_block_kernels_match_the_expanded_ones(types: tuple) -> None:
    """The sub-block kernels (integer codes on the tensor cores, scales after) against the
    reference and the expanded-tile kernels, for each K-quant and low-bit type in each role (with
    a 16-element type beside a 32-element one, the latter's sub-blocks are read in halves of 16;
    the lattice types of 32 also whole). Uneven experts: some blocks padded."""
    gq, uq, dq = types
    rng = torch.Generator().manual_seed(11)
    n_embd, n_ff, n_exp, topk, n_tok = 256, 256, 3, 2, 20  # n_ff: down's K, one super-block
    x = torch.randn(n_tok, n_embd, generator=rng)
    ids = torch.stack([torch.randperm(n_exp, generator=rng)[:topk] for _ in range(n_tok)])
    wts = torch.rand(n_tok, topk, generator=rng)
    gate, up = random_weight(gq, n_ff, n_embd, 51, n_exp), random_weight(uq, n_ff, n_embd, 52, n_exp)
    down = random_weight(dq, n_embd, n_ff, 53, n_exp)
    ref = moe_reference(x.double(), ids, wts, dequant64(gate, gq, n_embd), dequant64(up, uq, n_embd),
                        dequant64(down, dq, n_ff))
    slots = [1, 2, 0]
    args = (x.to(DEVICE), ids.to(DEVICE), wts.to(DEVICE), torch.tensor(slots, dtype=torch.int32, device=DEVICE),
            ExpertPools(pools(gate, slots, n_exp), pools(up, slots, n_exp), pools(down, slots, n_exp), gq, uq, dq, n_ff))
    tiles = (16, 64, 4) if DEVICE == "cpu" else None
    sub = moe_experts(*args, launch=MoELaunch(grouped=True, tiles=tiles))
    tile = moe_experts(*args, launch=MoELaunch(grouped=True, tiles=tiles, sub=False))
    assert rel_l2(sub, ref) < 1e-5 and rel_l2(tile, ref) < 1e-5
    # residency never changes the sub-block kernels' bits
    moved = [0, 3, 1]
    again = moe_experts(args[0], args[1], args[2], torch.tensor(moved, dtype=torch.int32, device=DEVICE),
                        ExpertPools(pools(gate, moved, 4), pools(up, moved, 4), pools(down, moved, 4), gq, uq, dq, n_ff),
                        launch=MoELaunch(grouped=True, tiles=tiles))
    assert torch.equal(again, sub)


@pytest.mark.slow
def test_moe_switches_to_the_grouped_kernels_from_grouped_min_pairs() -> None:
    """The default picks the grouped kernels (and their tiles) from GROUPED_MIN_PAIRS pairs up;
    both give the reference result."""
    rng = torch.Generator().manual_seed(8)
    n_exp, topk = 5, 2
    gate, up = random_weight(T.Q4_K, N_FF, N_EMBD, 31, n_exp), random_weight(T.Q4_K, N_FF, N_EMBD, 32, n_exp)
    down = random_weight(T.Q8_0, N_EMBD, N_FF, 33, n_exp)
    slots = list(range(n_exp))
    for n_tok in (GROUPED_MIN_PAIRS // topk - 1, GROUPED_MIN_PAIRS // topk):
        x = torch.randn(n_tok, N_EMBD, generator=rng)
        ids = torch.stack([torch.randperm(n_exp, generator=rng)[:topk] for _ in range(n_tok)])
        wts = torch.rand(n_tok, topk, generator=rng)
        args = (x.to(DEVICE), ids.to(DEVICE), wts.to(DEVICE), torch.tensor(slots, dtype=torch.int32, device=DEVICE),
                ExpertPools(pools(gate, slots, n_exp), pools(up, slots, n_exp), pools(down, slots, n_exp), T.Q4_K,
                            T.Q4_K, T.Q8_0, N_FF))
        y = moe_experts(*args)
        grouped = n_tok * topk >= GROUPED_MIN_PAIRS
        assert torch.equal(y, moe_experts(*args, launch=MoELaunch(grouped=grouped, block_n=None if grouped else 256)))
        ref = moe_reference(x.double(), ids, wts, dequant64(gate, T.Q4_K, N_EMBD), dequant64(up, T.Q4_K, N_EMBD),
                            dequant64(down, T.Q8_0, N_FF))
        assert rel_l2(y, ref) < 1e-5
    with pytest.raises(ValueError, match="powers of two"):
        moe_experts(*args, launch=MoELaunch(grouped=True, tiles=(8, 32, 4)))


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 tl.dot is wrong in Triton's interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_grouped_moe_half_activations(moe_case: dict, dtype: torch.dtype) -> None:
    """What prefill runs on the GPU: half-precision activations, bf16 tensor-core products."""
    c, slots = moe_case, list(range(N_EXPERT))
    y = moe_experts(c["x"].to(DEVICE, dtype), c["ids"].to(DEVICE), c["wts"].to(DEVICE),
                    torch.tensor(slots, dtype=torch.int32, device=DEVICE),
                    ExpertPools(pools(c["gate"], slots, N_EXPERT), pools(c["up"], slots, N_EXPERT),
                                pools(c["down"], slots, N_EXPERT), T.Q4_K, T.Q5_K, T.Q6_K, N_FF),
                    launch=MoELaunch(grouped=True))
    ref = moe_reference(c["x"].to(dtype).double(), c["ids"], c["wts"], dequant64(c["gate"], T.Q4_K, N_EMBD),
                        dequant64(c["up"], T.Q5_K, N_EMBD), dequant64(c["down"], T.Q6_K, N_FF))
    assert rel_l2(y, ref) < 1e-2


@pytest.mark.parametrize("grouped", [False, True], ids=["per-pair", "grouped"])
def test_moe_iq4_xs_and_mxfp4_experts(grouped: bool) -> None:
    """The lookup-table types (IQ4_XS gate/up, MXFP4 down, as in gpt-oss-style files) through both
    MoE paths."""
    rng = torch.Generator().manual_seed(9)
    n_embd, n_ff, n_exp, topk, n_tok = 256, 64, 3, 2, 4
    x = torch.randn(n_tok, n_embd, generator=rng)
    ids = torch.stack([torch.randperm(n_exp, generator=rng)[:topk] for _ in range(n_tok)])
    wts = torch.rand(n_tok, topk, generator=rng)
    gate, up = random_weight(T.IQ4_XS, n_ff, n_embd, 41, n_exp), random_weight(T.IQ4_XS, n_ff, n_embd, 42, n_exp)
    down = random_weight(T.MXFP4, n_embd, n_ff, 43, n_exp)
    ref = moe_reference(x.double(), ids, wts, dequant64(gate, T.IQ4_XS, n_embd), dequant64(up, T.IQ4_XS, n_embd),
                        dequant64(down, T.MXFP4, n_ff))
    slots = [2, 0, 1]
    y = moe_experts(x.to(DEVICE), ids.to(DEVICE), wts.to(DEVICE), torch.tensor(slots, dtype=torch.int32, device=DEVICE),
                    ExpertPools(pools(gate, slots, n_exp), pools(up, slots, n_exp), pools(down, slots, n_exp),
                                T.IQ4_XS, T.IQ4_XS, T.MXFP4, n_ff),
                    launch=MoELaunch(grouped=grouped, block_n=64, tiles=(16, 64, 4) if grouped and DEVICE == "cpu" else None))
    assert rel_l2(y, ref) < 1e-5


def test_group_pairs_sorts_by_expert_into_padded_blocks() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2]], device=DEVICE)
    counts = torch.tensor([10, 0, 0, 0, 7], dtype=torch.int32, device=DEVICE)
    pairs, block_expert = group_pairs(ids, 5, 2, counts)
    assert counts.tolist() == [12, 1, 1, 4, 7]  # incremented by the routings
    n_blocks = 4 + 5  # ceil(8 pairs / 2) + min(5 experts, 8 pairs): the no-sync worst case
    assert block_expert.tolist() == [0, 1, 2, 3, 3] + [5] * (n_blocks - 5)
    assert pairs.tolist() == [1, 4, 3, -1, 7, -1, 0, 2, 5, 6] + [-1] * (2 * n_blocks - 10)


@pytest.mark.slow
def test_group_pairs_counts_only_the_real_tokens_of_a_padded_call() -> None:
    """A padded prefill call (``count_tokens``, read from the device) places every pair, padding
    included, but counts the routings of its leading real tokens only; over 1024 pairs (more
    than one loop step of the kernel) with the limit inside the second step."""
    rng = np.random.default_rng(3)
    ids = torch.from_numpy(np.stack([rng.choice(64, 8, replace=False) for _ in range(160)])).to(DEVICE)
    whole = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    want_pairs, want_blocks = group_pairs(ids, 64, 16, whole)
    for real in (160, 131, 1):
        counts = torch.zeros(64, dtype=torch.int32, device=DEVICE)
        pairs, blocks = group_pairs(ids, 64, 16, counts, torch.tensor(real, device=DEVICE))
        assert torch.equal(pairs, want_pairs) and torch.equal(blocks, want_blocks)
        assert counts.cpu().tolist() == np.bincount(ids[:real].cpu().numpy().reshape(-1), minlength=64).tolist()
    assert torch.equal(counts.sum(), torch.tensor(8, dtype=torch.int32, device=DEVICE)) and int(whole.sum()) == 1280


@pytest.mark.parametrize("n_expert,block_m,n_tok,k", [(7, 32, 5, 3), pytest.param(256, 16, 300, 8, marks=pytest.mark.slow),
                                                     pytest.param(128, 64, 129, 8, marks=pytest.mark.slow)])
def test_group_pairs_equals_a_stable_sort(n_expert, block_m, n_tok, k) -> None:
    """Against numpy: every expert's pairs in pair order from its padded offset, -1 elsewhere,
    each block's expert; more pairs than one loop step of the kernel (1024) in the first case."""
    rng = np.random.default_rng(n_expert)
    ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(n_tok)])
    pairs, block_expert = group_pairs(torch.from_numpy(ids).to(DEVICE), n_expert, block_m)
    flat = ids.reshape(-1)
    counts = np.bincount(flat, minlength=n_expert)
    padded = -(-counts // block_m) * block_m
    want = np.full(pairs.numel(), -1)
    want_blocks = np.full(block_expert.numel(), n_expert)
    order = np.argsort(flat, kind="stable")
    start = np.concatenate(([0], np.cumsum(padded)[:-1]))
    for e in range(n_expert):
        want[start[e]: start[e] + counts[e]] = order[flat[order] == e]
        want_blocks[start[e] // block_m: (start[e] + padded[e]) // block_m] = e
    assert np.array_equal(pairs.cpu().numpy(), want) and np.array_equal(block_expert.cpu().numpy(), want_blocks)


@pytest.mark.slow
def test_grouped_moe_over_many_tokens_and_a_host_pool() -> None:
    """The prefill kernels on more pairs than one block holds, experts spread over a device and a
    host pool: the reference result, and the same bits as all experts on the device."""
    rng = torch.Generator().manual_seed(7)
    n_embd, n_ff, n_exp, topk, n_tok = 256, 32, 4, 2, 24
    x = torch.randn(n_tok, n_embd, generator=rng)
    ids = torch.stack([torch.randperm(n_exp, generator=rng)[:topk] for _ in range(n_tok)])
    wts = torch.rand(n_tok, topk, generator=rng)
    gate_up = random_weight(T.Q4_K, 2 * n_ff, n_embd, 21, n_exp)
    down = random_weight(T.Q8_0, n_embd, n_ff, 22, n_exp)
    gu = dequant64(gate_up, T.Q4_K, n_embd)
    ref = moe_reference(x.double(), ids, wts, gu[:, :n_ff], gu[:, n_ff:], dequant64(down, T.Q8_0, n_ff))

    def run(table: list[int], dev_of: list[int], host_of: list[int] | None) -> torch.Tensor:
        host = None if host_of is None else (pools(gate_up, host_of, 2), None, pools(down, host_of, 2))
        counts = torch.zeros(n_exp, dtype=torch.int32, device=DEVICE)
        y = moe_experts(x.to(DEVICE), ids.to(DEVICE), wts.to(DEVICE), torch.tensor(table, dtype=torch.int32,
                        device=DEVICE), ExpertPools(pools(gate_up, dev_of, n_exp), None, pools(down, dev_of, n_exp),
                                                    T.Q4_K, None, T.Q8_0, n_ff, host=host),
                        counts=counts, validate=True,
                        launch=MoELaunch(grouped=True, tiles=(16, 64, 4) if DEVICE == "cpu" else None))
        assert torch.equal(counts.cpu(), torch.bincount(ids.reshape(-1), minlength=n_exp).to(torch.int32))
        return y

    all_dev = run([2, 0, 3, 1], [2, 0, 3, 1], None)
    assert rel_l2(all_dev, ref) < 1e-5
    split = run([0, -2, 1, -1], [0, -1, 1, -1], [-1, 1, -1, 0])  # experts 1 and 3 on the host
    assert torch.equal(split, all_dev)


@pytest.mark.slow
def test_moe_counts_routings(moe_case: dict) -> None:
    """The gate/up kernel adds one per (token, choice) to its expert's count (the store's routing
    statistics, no separate launch); the output is unchanged."""
    c = moe_case
    counts = torch.full((N_EXPERT,), 5, dtype=torch.int32, device=DEVICE)
    slot_of = list(range(N_EXPERT))
    y = moe_experts(c["x"].to(DEVICE), c["ids"].to(DEVICE), c["wts"].to(DEVICE),
                    torch.tensor(slot_of, dtype=torch.int32, device=DEVICE),
                    ExpertPools(pools(c["gate"], slot_of, N_EXPERT), pools(c["up"], slot_of, N_EXPERT),
                                pools(c["down"], slot_of, N_EXPERT), T.Q4_K, T.Q5_K, T.Q6_K, N_FF),
                    counts=counts, launch=MoELaunch(block_n=16))
    want = 5 + torch.bincount(c["ids"].reshape(-1), minlength=N_EXPERT)
    assert torch.equal(counts.cpu(), want.to(torch.int32))
    assert torch.equal(y, run_moe(c, slot_of, N_EXPERT))


@pytest.mark.slow
def test_moe_host_pool_gives_identical_bits(moe_case: dict) -> None:
    """Zero-copy residency: experts 1 and 3 live only in a host pool (table entry -(h+1)); the
    result is bit-identical to all experts in the device pool."""
    all_dev = run_moe(moe_case, [0, 1, 2, 3, 4], 5)
    dev_slot = [0, -1, 1, -1, 2]  # device pool slots; -1: not in the device pool
    host_slot = {1: 1, 3: 0}  # host pool slots
    table = [s if s >= 0 else -(host_slot[e] + 1) for e, s in enumerate(dev_slot)]
    host_of = [host_slot.get(e, -1) for e in range(N_EXPERT)]
    c = moe_case
    out = moe_experts(c["x"].to(DEVICE), c["ids"].to(DEVICE), c["wts"].to(DEVICE),
                      torch.tensor(table, dtype=torch.int32, device=DEVICE),
                      ExpertPools(pools(c["gate"], dev_slot, 3), pools(c["up"], dev_slot, 3),
                                  pools(c["down"], dev_slot, 3), T.Q4_K, T.Q5_K, T.Q6_K, N_FF,
                                  host=(pools(c["gate"], host_of, 2), pools(c["up"], host_of, 2),
                                        pools(c["down"], host_of, 2))),
                      validate=True, launch=MoELaunch(block_n=64))
    assert torch.equal(out, all_dev)


@pytest.mark.parametrize("n_ff", quick_first([512, 768]))
@pytest.mark.parametrize("act_q8", quick_first([True, False]), ids=["q8", "float"])
def test_moe_decode_host_pool_gives_identical_bits_at_real_widths(n_ff: int, act_q8: bool) -> None:
    """One token, top-8, Q4_K_M's expert types, the runtime's default launch: half the experts read
    from a host pool give the all-device bits. On a GPU at the real widths (n_ff 768: Qwen3-30B,
    whose down rows of 768 load a partial group of chunks; 512: Qwen3.6 and Laguna), where the
    compiled kernels' reductions are what could differ; on the CPU at a small n_embd."""
    gpu = DEVICE == "cuda"
    n_embd, n_expert, k = (2048, 16, 8) if gpu else (256, 4, 2)
    g = torch.Generator().manual_seed(n_ff)
    x = torch.randn(1, n_embd, generator=g).to(DEVICE)
    ids = torch.randperm(n_expert, generator=g)[:k].view(1, k).to(DEVICE)
    wts = torch.rand(1, k, generator=g).to(DEVICE)
    gate = torch.from_numpy(random_weight(T.Q4_K, n_ff, n_embd, 11, n_expert)).to(DEVICE)
    up = torch.from_numpy(random_weight(T.Q4_K, n_ff, n_embd, 12, n_expert)).to(DEVICE)
    down = torch.from_numpy(random_weight(T.Q6_K, n_embd, n_ff, 13, n_expert)).to(DEVICE)
    table = torch.arange(n_expert, dtype=torch.int32, device=DEVICE)
    host = tuple(p.cpu().pin_memory() if gpu else p.clone() for p in (gate, up, down))
    on_host = torch.tensor([-(e + 1) if e % 2 else e for e in range(n_expert)], dtype=torch.int32, device=DEVICE)
    on_device = ExpertPools(gate, up, down, T.Q4_K, T.Q4_K, T.Q6_K, n_ff)
    dev = moe_experts(x, ids, wts, table, on_device, act_q8=act_q8)
    mixed = moe_experts(x, ids, wts, on_host, replace(on_device, host=host), act_q8=act_q8)
    ref = moe_reference(x.double().cpu(), ids.cpu(), wts.cpu(), dequant64(gate.cpu().numpy(), T.Q4_K, n_embd),
                        dequant64(up.cpu().numpy(), T.Q4_K, n_embd), dequant64(down.cpu().numpy(), T.Q6_K, n_ff))
    assert rel_l2(dev, ref) < (2e-2 if act_q8 else 1e-5)
    assert torch.equal(mixed, dev)


def test_moe_non_resident_expert_is_caught(moe_case: dict) -> None:
    chosen = int(moe_case["ids"][0, 0])
    slot_of = [e if e != chosen else -1 for e in range(N_EXPERT)]
    with pytest.raises(ValueError, match="not resident"):
        run_moe(moe_case, slot_of, N_EXPERT, validate=True)


def test_moe_merged_gate_up_q8_0() -> None:
    """``ffn_gate_up_exps``: one pool of 2*n_ff rows, gate rows first."""
    rng = torch.Generator().manual_seed(5)
    n_embd, n_ff, n_exp = 64, 32, 3  # 32-element blocks allow rows shorter than 256
    x = torch.randn(2, n_embd, generator=rng)
    ids = torch.tensor([[2, 0], [1, 2]], dtype=torch.int64)  # torch.topk's index dtype
    wts = torch.tensor([[0.7, 0.3], [0.4, 0.6]])
    gate_up = random_weight(T.Q8_0, 2 * n_ff, n_embd, 11, n_exp)
    down = random_weight(T.Q8_0, n_embd, n_ff, 12, n_exp)
    gu = dequant64(gate_up, T.Q8_0, n_embd)
    ref = moe_reference(x.double(), ids, wts, gu[:, :n_ff], gu[:, n_ff:], dequant64(down, T.Q8_0, n_ff))
    slot_of = [1, 2, 0]
    y = moe_experts(x.to(DEVICE), ids.to(DEVICE), wts.to(DEVICE), torch.tensor(slot_of, dtype=torch.int32,
                    device=DEVICE), ExpertPools(pools(gate_up, slot_of, 3), None, pools(down, slot_of, 3),
                                                T.Q8_0, None, T.Q8_0, n_ff))
    assert rel_l2(y, ref) < 1e-5


@pytest.mark.parametrize("n_k,d_k,n_v,d_v,K", [(2, 16, 4, 8, 4), (2, 12, 2, 20, 3), (1, 16, 2, 32, 4)])
def test_deltanet_decode_matches_the_torch_form(n_k, d_k, n_v, d_v, K) -> None:
    """Conv window, l2 norms, gates, the delta rule on the state and the gated output norm,
    fused, against the model file's torch form (float64) over a few steps; non-power-of-two
    head sizes exercise the masks. With power-of-two value heads of 32 or more the int8 form of
    the output comes from the same launch: bit for bit ``q8dot.quantize`` of the output."""
    import torch.nn.functional as F

    from sparkpack.runtime.kernels import q8dot
    from sparkpack.runtime.layers import l2_norm, rms_norm
    from sparkpack.runtime.models.qwen35moe import gated_delta_rule

    g = torch.Generator().manual_seed(3)
    C, eps = 2 * n_k * d_k + n_v * d_v, 1e-6
    conv_w, dt, a = torch.randn(C, K, generator=g), torch.randn(n_v, generator=g), -torch.rand(n_v, generator=g)
    norm_w = torch.randn(d_v, generator=g)
    win, state = torch.randn(K - 1, C, generator=g), torch.randn(n_v, d_k, d_v, generator=g) * 0.1
    win64, state64 = win.double(), state.double()
    win, state = win.to(DEVICE), state.to(DEVICE)
    for step in range(3):
        qkv, z = torch.randn(C, generator=g), torch.randn(n_v * d_v, generator=g)
        beta, alpha = torch.randn(n_v, generator=g), torch.randn(n_v, generator=g) * (10 if step == 1 else 1)
        got = deltanet_decode(*(t.to(DEVICE) for t in (qkv, z, beta, alpha, dt, a, conv_w)), win, state,
                              norm_w.to(DEVICE), n_k, d_k, eps, q8=d_v == 32)
        got, *got_q8 = got if d_v == 32 else (got,)
        assert got.shape == (1, n_v * d_v)
        if d_v == 32:
            for fused, own in zip(got_q8[0], q8dot.quantize(got)):
                assert torch.equal(fused.cpu(), own.cpu())
        # the reference, as runtime/models/qwen35moe.py computes it (float64)
        xin = torch.cat((win64, qkv.double()[None]), 0)
        win64 = xin[1:]
        act = F.silu((xin.unfold(0, K, 1) * conv_w.double()).sum(-1))[0]
        kd = n_k * d_k
        q = l2_norm(act[:kd].view(1, n_k, d_k)) * d_k ** -0.5
        k = l2_norm(act[kd:2 * kd].view(1, n_k, d_k))
        v = act[2 * kd:].view(1, n_v, d_v)
        rep = n_v // n_k
        gg = F.softplus(alpha.double() + dt.double()) * a.double()
        o, state64 = gated_delta_rule(q.repeat(1, rep, 1), k.repeat(1, rep, 1), v, gg[None],
                                      torch.sigmoid(beta.double())[None], state64)
        want = (rms_norm(o, norm_w.double(), eps) * F.silu(z.double().view(1, n_v, d_v))).reshape(-1)
        assert rel_l2(got, want) < 1e-5
        assert torch.allclose(win.cpu().double(), win64, atol=1e-6) and rel_l2(state, state64) < 1e-5


@pytest.mark.parametrize("T", [2, 70])
def test_deltanet_prefill_inputs_match_the_torch_form(T) -> None:
    """The prefill glue kernel (conv over the window and the new inputs, SiLU, l2 norms, the
    tiled key heads, the gates) against the model file's torch form in float64; inputs read as
    column bands of one wider projection output; 2 tokens (fewer than the window: it supplies
    the earlier taps) and 70 (more than one block of tokens per program); sizes that are not
    powers of two exercise the masks."""
    import torch.nn.functional as F

    from sparkpack.runtime.kernels.deltanet import deltanet_prefill_inputs
    from sparkpack.runtime.layers import l2_norm

    g = torch.Generator().manual_seed(8)
    n_k, d_k, n_v, d_v, K = 2, 12, 4, 20, 4
    C = 2 * n_k * d_k + n_v * d_v
    proj = torch.randn(T, C + 2 * n_v + 3, generator=g)  # [qkv | beta | alpha | 3 more]
    qkv, beta, alpha = proj[:, :C], proj[:, C:C + n_v], proj[:, C + n_v:C + 2 * n_v] * 4
    conv_w, win = torch.randn(C, K, generator=g), torch.randn(K - 1, C, generator=g)
    dt, a = torch.randn(n_v, generator=g), -torch.rand(n_v, generator=g)
    dev = proj.to(DEVICE)
    got = deltanet_prefill_inputs(dev[:, :C], dev[:, C:C + n_v], dev[:, C + n_v:C + 2 * n_v] * 4, dt.to(DEVICE),
                                  a.to(DEVICE), conv_w.to(DEVICE), win.to(DEVICE), n_k, d_k, n_v)
    xin = torch.cat((win, qkv)).double()
    act = F.silu((xin.unfold(0, K, 1) * conv_w.double()).sum(-1))  # [T, C]
    kd, rep = n_k * d_k, n_v // n_k
    q = (l2_norm(act[:, :kd].reshape(T, n_k, d_k)) * d_k ** -0.5).repeat(1, rep, 1)
    k = l2_norm(act[:, kd:2 * kd].reshape(T, n_k, d_k)).repeat(1, rep, 1)
    v = act[:, 2 * kd:].reshape(T, n_v, d_v)
    gg = F.softplus(alpha.double() + dt.double()) * a.double()
    for out, want in zip(got, (q, k, v, gg, torch.sigmoid(beta.double()))):
        assert out.shape == want.shape and out.dtype == torch.float32 and rel_l2(out, want) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_the_torch_form(dtype) -> None:
    """The DeltaNet output norm ``rms_norm(o, w) * silu(z)`` per value head, z a column band."""
    import torch.nn.functional as F

    from sparkpack.runtime.kernels.deltanet import gated_rms_norm
    from sparkpack.runtime.layers import rms_norm

    g = torch.Generator().manual_seed(9)
    T, n_v, d_v = 70, 3, 20
    o = torch.randn(T, n_v, d_v, generator=g) * 3
    zw = torch.randn(T, n_v * d_v + 5, generator=g).to(dtype)
    w = torch.randn(d_v, generator=g).to(dtype)
    got = gated_rms_norm(o.to(DEVICE), zw.to(DEVICE)[:, 5:], w.to(DEVICE), 1e-6).cpu()
    want = (rms_norm(o.to(dtype), w, 1e-6) * F.silu(zw[:, 5:].view(T, n_v, d_v))).reshape(T, -1)
    assert got.shape == want.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: the interpreter truncates where torch rounds
    assert rel_l2(got.float(), want.double()) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_kernel_matches_the_torch_form(dtype) -> None:
    """Rows of a 2-D tensor and strided per-head rows of a 3-D view (the query half of a fused
    query|gate projection), with and without a weight, N not a power of two."""
    from sparkpack.runtime.kernels.norm import rms_norm_rows
    from sparkpack.runtime.layers import rms_norm

    g = torch.Generator().manual_seed(4)
    x2 = (torch.randn(5, 48, generator=g) * 3).to(dtype)
    qg = torch.randn(3, 4, 2 * 24, generator=g).to(dtype)  # [T, H, query | gate]
    w = torch.randn(48, generator=g).to(dtype)
    cases = [(x2, w), (x2, None), (qg[..., :24], w[:24].contiguous())]
    for x, wt in cases:
        got = rms_norm_rows(x.to(DEVICE), None if wt is None else wt.to(DEVICE), 1e-6).cpu()
        want = rms_norm(x, wt, 1e-6)  # the torch form (x on the CPU)
        assert got.shape == want.shape and got.dtype == dtype
        tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: a one-ulp rounding flip at most
        assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()


@pytest.mark.parametrize("n,k,norm", [(64, 8, True), (48, 3, False)])
def test_softmax_topk_matches_route_softmax(n, k, norm) -> None:
    """Same experts in the same (descending) order as softmax + torch.topk, weights to float32
    round-off; a tie goes to the lower expert id (torch.topk leaves that open); bf16 logits widen
    as the torch form does."""
    from sparkpack.runtime.kernels.router import softmax_topk
    from sparkpack.runtime.layers import route_softmax

    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, n, generator=g) * 3
    logits[2, 7] = logits[2, 11] = logits[2].max() + 1  # a tie for first place
    for x in (logits, logits.to(torch.bfloat16)):
        w, ids = softmax_topk(x.to(DEVICE), k, norm)
        want_w, want_ids = route_softmax(x, k, norm)  # the torch form (x on the CPU)
        assert ids.dtype == torch.int64 and w.dtype == torch.float32
        assert torch.allclose(w.cpu(), want_w, rtol=1e-5, atol=1e-7)
        assert ids[2, :2].tolist() == [7, 11]
        # torch.topk orders equal values either way (bf16 logits tie often): compare in the
        # kernel's order, largest first and the lower id first among equals
        canon = [sorted(zip((-want_w[t]).tolist(), want_ids[t].tolist())) for t in range(len(want_ids))]
        assert ids.cpu().tolist() == [[e for _, e in row] for row in canon]


@pytest.mark.parametrize("with_bias,norm", [(True, True), (False, False)])
def test_sigmoid_topk_matches_route_sigmoid(with_bias, norm) -> None:
    """Laguna's router in one launch: experts chosen on sigmoid + correction bias, weighted by
    the unbiased sigmoids, renormalised, scaled; same experts in the same order as the torch form,
    weights to float32 round-off. The bias really steers the choice (a mutation that drops it
    picks other experts here), and a tie goes to the lower expert id."""
    from sparkpack.runtime.kernels.router import sigmoid_topk
    from sparkpack.runtime.layers import route_sigmoid

    g = torch.Generator().manual_seed(7)
    T, n, k, scale = 5, 64, 8, 2.5
    logits = torch.randn(T, n, generator=g) * 2
    bias = (torch.randn(n, generator=g) * 0.5) if with_bias else None
    logits[3, 9] = logits[3, 21] = 40.0  # both sigmoids round to 1.0: a tie for first place
    if with_bias:
        bias[9] = bias[21] = bias.max() + 1.0
    for x in (logits, logits.to(torch.bfloat16)):
        w, ids = sigmoid_topk(x.to(DEVICE), None if bias is None else bias.to(DEVICE), k, norm, scale)
        want_w, want_ids = route_sigmoid(x, bias, k, norm, scale)  # the torch form (on the CPU)
        assert ids.dtype == torch.int64 and w.dtype == torch.float32
        assert ids[3, :2].tolist() == [9, 21]
        chosen = torch.sigmoid(x.float()) + (bias if bias is not None else 0.0)
        for t in range(T):  # the k largest choices, the lower id first among equals (bf16 ties often)
            canon = sorted(range(n), key=lambda e: (-float(chosen[t, e]), e))[:k]  # noqa: B023
            assert ids[t].cpu().tolist() == canon
            assert sorted(canon) == sorted(want_ids[t].tolist()) or x.dtype == torch.bfloat16
            scores = torch.sigmoid(x[t].float())[canon]
            want = (scores / scores.sum() if norm else scores) * scale
            assert torch.allclose(w[t].cpu(), want, rtol=1e-5, atol=1e-7)
        assert torch.allclose(w.cpu().sum(-1), want_w.sum(-1), rtol=1e-5)
    if with_bias:
        _, unbiased = route_sigmoid(logits, None, k, norm, scale)
        assert not torch.equal(ids.cpu().sort().values, unbiased.sort().values)


# ----------------------------------------------------------------------------- GPU codegen without a GPU

FLOAT_ARGS = ("q_scale", "eps")


def _signature(fn, ptr_types: dict[str, str]) -> dict[str, str]:
    """Triton signature of a kernel: pointers as given, constexprs marked, other ints i32/i64."""
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name.endswith("_ptr") or p.name in ptr_types:
            sig[p.name] = ptr_types.get(p.name, "*u8")
        else:
            sig[p.name] = "i64" if p.name.endswith("slot_bytes") else "fp32" if p.name in FLOAT_ARGS else "i32"
    return sig


def _gemv_groups() -> list[list[int]]:
    """Every registry type once, as the four segments of GEMV launches (the last padded with
    unused segments, as ``dense.gemv`` pads them)."""
    ids = [int(q) for q in QTYPES]
    groups = [ids[i:i + 4] for i in range(0, len(ids), 4)]
    groups[-1] += [-1] * (4 - len(groups[-1]))
    return groups


LOW_SUB_TYPES = (T.Q2_K, T.Q3_K, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M)


def aot_compile_all(arch: int = 90) -> None:
    """Compile every kernel family for sm_``arch`` (PTX -> cubin with the bundled ptxas): catches
    what the interpreter accepts but the compiler rejects. Needs TRITON_INTERPRET unset."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sparkpack.runtime.kernels import deltanet, dense, ffn, moe, moe_grouped, norm, q8dot, router

    target = GPUTarget("cuda", arch, 32)
    jobs = [(dense.dequant_kernel, {"w": "*u8", "ids": "*i64", "out": "*bf16"},
             {"QT": int(q), "HAS_IDS": False, "BR": 4}) for q in QTYPES]  # every type's unpacking
    q8_args = {n: "*i32" if n.endswith("q") else "*fp32" for n in ("xq", "xd", "xs", "hq", "hd", "hs")}
    codes = {"xq": "*i8", "xd": "*fp32", "xs": "*fp32"}  # what q8dot.store_q8 writes
    views = {int(T.Q4_K): "*i32", int(T.Q6_K): "*i16"}  # dense.load_view's word types (others: bytes)
    jobs += [(moe.gate_up_kernel, {"x_ptr": "*fp32", "ids_ptr": "*i64", "slot_ptr": "*i32", "h_ptr": "*fp32",
                                    "count_ptr": "*i32", **q8_args},
              {"GATE_QTYPE": int(T.Q4_K), "UP_QTYPE": int(T.Q4_K), "HAS_HOST": True, "HAS_COUNT": True,
               "BLOCK_N": 4, "ACT_Q8": q8, "ASM": True, "CPI": 8}) for q8 in (False, True)]
    jobs += [(moe.down_kernel, {"h_ptr": "*fp32", "ids_ptr": "*i64", "wts_ptr": "*fp32", "slot_ptr": "*i32",
                                 "part_ptr": "*fp32", **q8_args},
              {"DOWN_QTYPE": int(T.Q6_K), "HAS_HOST": q8, "BLOCK_N": 4, "ACT_Q8": q8, "ASM": True, "CPI": 2})
             for q8 in (False, True)]
    jobs += [(q8dot.quantize_kernel, {"x": "*bf16", "xq": "*i8", "xd": "*fp32", "xs": "*fp32"}, {"BLOCKS": 8}),
             (moe.sum_topk_kernel, {"part_ptr": "*fp32", "y_ptr": "*fp32"}, {"BLOCK": 1024}),
             (moe_grouped.tile_gate_up_kernel, {"x_ptr": "*bf16", "pairs_ptr": "*i32", "block_expert_ptr": "*i64",
                                                 "slot_ptr": "*i32", "h_ptr": "*fp32"},
              {"GATE_QTYPE": int(T.Q4_K), "UP_QTYPE": int(T.Q4_K), "HAS_HOST": True, "DOT_FP32": False,
               "BLOCK_M": 16, "BLOCK_N": 32}),
             (moe_grouped.tile_down_kernel, {"h_ptr": "*fp32", "pairs_ptr": "*i32", "block_expert_ptr": "*i64",
                                              "wts_ptr": "*fp32", "slot_ptr": "*i32", "part_ptr": "*fp32"},
              {"DOWN_QTYPE": int(T.Q6_K), "HAS_HOST": False, "DOT_FP32": False, "BLOCK_M": 64, "BLOCK_N": 32}),
             (moe_grouped.sub_gate_up_kernel, {"x_ptr": "*bf16", "pairs_ptr": "*i32", "block_expert_ptr": "*i64",
                                                "slot_ptr": "*i32", "h_ptr": "*bf16"},
              {"GATE_QTYPE": int(T.Q4_K), "UP_QTYPE": int(T.Q5_K), "HAS_HOST": True, "OPER": 1, "KS": 32,
               "BLOCK_M": 32, "BLOCK_N": 128}),
             (moe_grouped.sub_down_kernel, {"h_ptr": "*fp16", "pairs_ptr": "*i32", "block_expert_ptr": "*i64",
                                             "wts_ptr": "*fp32", "slot_ptr": "*i32", "part_ptr": "*fp32"},
              {"DOWN_QTYPE": int(T.Q6_K), "HAS_HOST": False, "OPER": 2, "KS": 16, "BLOCK_M": 16, "BLOCK_N": 64}),
             (deltanet.conv_kernel, {"x_ptr": "*bf16", "seq_ptr": "*i64", "w_ptr": "*bf16", "out_ptr": "*fp32"},
              {"KM1": 3, "KP2": 4, "BLOCK": 256}),
             *[(deltanet.recurrence_kernel, {"act_ptr": "*fp32", "z_ptr": "*bf16", "beta_ptr": "*bf16",
                                              "alpha_ptr": "*bf16", "dt_ptr": "*bf16", "a_ptr": "*bf16",
                                              "seq_ptr": "*i64", "norm_ptr": "*bf16", "out_ptr": "*bf16", **codes},
                {"D_K": 128, "D_V": 128, "BLOCK_K": 128, "BLOCK_V": 128, "Q8": q8}) for q8 in (False, True)],
             *[(norm.rms_norm_kernel, {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16",
                                        "s_ptr": "*bf16", **codes},
                {"HAS_W": True, "HAS_RES": fused, "Q8": fused, "BLOCK": 2048}) for fused in (False, True)],
             (deltanet.prefill_prep_kernel, {**{n: "*bf16" for n in ("x_ptr", "win_ptr", "w_ptr", "beta_ptr",
                                                                      "alpha_ptr", "dt_ptr", "a_ptr")},
                                               **{n: "*fp32" for n in ("q_ptr", "k_ptr", "v_ptr", "g_ptr", "b_ptr")}},
              {"KM1": 3, "BLOCK_T": 4, "BLOCK_K": 128, "BLOCK_V": 128}),
             (deltanet.chunk_prep_kernel, {n: "*fp32" for n in ("q_ptr", "k_ptr", "v_ptr", "g_ptr", "b_ptr", "qc_ptr",
                                                                 "w_ptr", "u0_ptr", "qk_ptr", "eg_ptr", "kd_ptr",
                                                                 "keep_ptr")},
              {"C": 64, "BS": 16, "BLOCK_K": 128, "BLOCK_V": 128}),
             (deltanet.chunk_state_kernel, {n: "*fp32" for n in ("w_ptr", "q_ptr", "u0_ptr", "qk_ptr", "eg_ptr",
                                                                  "kd_ptr", "keep_ptr", "state_ptr", "out_ptr")},
              {"C": 64, "BLOCK_K": 128, "BLOCK_V": 32}),
             (moe_grouped.group_pairs_kernel, {"ids_ptr": "*i64", "pairs_ptr": "*i32", "block_expert_ptr": "*i64",
                                        "counts_ptr": "*i32", "limit_ptr": "*i64"},
              {"HAS_COUNT": True, "HAS_LIMIT": True, "BLOCK_M": 32, "BLOCK_P": 1024, "BINS": 512}),
             (deltanet.gated_norm_kernel, {"o_ptr": "*fp32", "z_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16"},
              {"BLOCK_R": 4, "BLOCK_V": 128}),
             (ffn.silu_mul_kernel, {"g_ptr": "*bf16", "u_ptr": "*bf16", "y_ptr": "*bf16", **codes},
              {"Q8": True, "BLOCK": 512}),
             (ffn.ffn_residual_kernel, {"x_ptr": "*bf16", "r_ptr": "*fp32", "s_ptr": "*bf16", "g_ptr": "*bf16",
                                         "y_ptr": "*bf16", "w_ptr": "*bf16", "h_ptr": "*bf16", "hq": "*i8",
                                         "hd": "*fp32", "hs": "*fp32"},
              {"HAS_SHARED": True, "HAS_GATE": True, "NORM": True, "Q8": True, "BLOCK": 2048}),
             *[(router.route_topk_kernel, {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "w_ptr": "*fp32",
                                            "ids_ptr": "*i64"},
                {"K": 8, "K_P2": 8, "SIGMOID": sig, "HAS_BIAS": sig, "NORM": True, "BLOCK": 256})
               for sig in (False, True)],
             *[(dense.gemv_kernel, {"x": "*bf16", "y": "*bf16", "w0": "*i16", "w1": "*i32", "w2": "*fp32",
                                     "w3": "*u8", **q8_args},
                {"QT0": int(T.Q6_K), "QT1": int(T.Q4_K), "QT2": int(T.F32), "QT3": int(T.Q8_0), "NSEG": 4, "BN": 8,
                 "CPI": 8 if q8 else 2, "ACT_Q8": q8, "ASM": True}) for q8 in (False, True)],
             (dense.dequant_kernel, {"w": "*u8", "ids": "*i64", "out": "*bf16"},
              {"QT": int(T.Q4_K), "HAS_IDS": True, "BR": 4}),
             # every type's band of the GEMV, float and int8 activations (the int8 words of
             # q8dot.Q8_TYPES, the byte-wise _row_dot of the others): the type dispatch of
             # _segment must fold at compile time for each (Triton 3.6 compiled a jit helper's
             # answer as a runtime branch: another type's code, and its static_assert, for all)
             *[(dense.gemv_kernel, {"x": "*bf16", "y": "*bf16", **q8_args,
                                     **{f"w{i}": views.get(q, "*u8") for i, q in enumerate(group)}},
                {**{f"QT{i}": q for i, q in enumerate(group)}, "NSEG": sum(q >= 0 for q in group), "BN": 2,
                 "CPI": 1, "ACT_Q8": q8, "ASM": True}) for group in _gemv_groups() for q8 in (False, True)],
             (moe.gate_up_kernel, {"x_ptr": "*fp32", "ids_ptr": "*i64", "slot_ptr": "*i32", "h_ptr": "*fp32",
                                    "count_ptr": "*i32", **q8_args},
              {"GATE_QTYPE": int(T.IQ2_S), "UP_QTYPE": int(T.IQ2_S), "HAS_HOST": True, "HAS_COUNT": True,
               "BLOCK_N": 2, "ACT_Q8": True, "ASM": True, "CPI": 8}),
             # the low-bit types' sub-block prefill on bf16 tensor-core operands
             *[(moe_grouped.sub_down_kernel, {"h_ptr": "*bf16", "pairs_ptr": "*i32", "block_expert_ptr": "*i64",
                                               "wts_ptr": "*fp32", "slot_ptr": "*i32", "part_ptr": "*fp32"},
                {"DOWN_QTYPE": int(q), "HAS_HOST": True, "OPER": 1, "KS": 16, "BLOCK_M": 16, "BLOCK_N": 64})
               for q in LOW_SUB_TYPES]]
    for fn, ptrs, consts in jobs:
        kernel = triton.compile(ASTSource(fn, _signature(fn, ptrs), {"PDL": True, **consts}), target=target)
        assert kernel.asm["cubin"], (fn.__name__, consts)
    print("compiled", len(jobs))


def test_kernel_conditions_fold_on_every_triton() -> None:
    """No ``if`` / ``elif`` / conditional expression of a kernel tests a @triton.jit helper's
    return value: Triton 3.6 does not fold those at compile time (3.9 does), so a type dispatch
    written that way compiles every branch there, other types' code and static_asserts included.
    A compile-time condition is an expression of constexprs in the condition itself."""
    import ast
    import importlib
    import inspect
    import pkgutil
    import textwrap

    from triton.runtime.jit import KernelInterface  # JITFunction, and InterpretedFunction under the interpreter

    from sparkpack.runtime import kernels

    def jitted(f: object) -> bool:
        return isinstance(f, KernelInterface) and callable(getattr(f, "fn", None))

    found = []
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for name, fn in vars(module).items():
            if not jitted(fn) or fn.fn.__module__ != module.__name__:
                continue
            for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn.fn)))):
                if isinstance(node, (ast.If, ast.IfExp)):
                    for call in ast.walk(node.test):
                        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and \
                                jitted(fn.fn.__globals__.get(call.func.id)):
                            found.append(f"{info.name}.{name}: {ast.unparse(node.test)}")
    assert not found, found


@pytest.mark.slow
def test_kernels_compile_for_h100() -> None:
    compile_in_subprocess("from tests.test_kernels import aot_compile_all; aot_compile_all()",
                          28 + len(QTYPES) + 2 * len(_gemv_groups()) + len(LOW_SUB_TYPES))


@pytest.mark.parametrize("T,d_k,d_v,chunk", [(150, 16, 24, 64), (40, 20, 16, 16), (64, 32, 32, 32)])
def test_deltanet_chunked_kernels_match_the_torch_forms(T, d_k, d_v, chunk) -> None:
    """The chunked delta rule in two launches (``deltanet_chunked``: per-chunk terms with the
    triangular solve, then the state carried) against the torch chunked form and the token-by-token
    recurrence (float32, a non-zero start state, a partial last chunk, one chunk of exactly 32);
    head sizes that are not powers of two exercise the masks. Strong decays and large betas make
    the solve's off-diagonal blocks matter."""
    from sparkpack.runtime.kernels.deltanet import deltanet_chunked
    from sparkpack.runtime.layers import l2_norm
    from sparkpack.runtime.models.qwen35moe import gated_delta_rule, gated_delta_rule_chunked

    g = torch.Generator().manual_seed(5)
    H = 3
    q, k = l2_norm(torch.randn(T, H, d_k, generator=g)), l2_norm(torch.randn(T, H, d_k, generator=g) + 1.0)
    v, state = torch.randn(T, H, d_v, generator=g), torch.randn(H, d_k, d_v, generator=g)
    decay, beta = -3 * torch.rand(T, H, generator=g), 0.5 + 0.5 * torch.rand(T, H, generator=g)
    o_ref, s_ref = gated_delta_rule_chunked(q, k, v, decay, beta, state, chunk=chunk)
    o_rec, s_rec = gated_delta_rule(q.double(), k.double(), v.double(), decay.double(), beta.double(), state.double())
    s = state.clone().to(DEVICE)
    o = deltanet_chunked(*(t.to(DEVICE) for t in (q, k, v, decay, beta)), s, chunk)
    assert o.shape == (T, H, d_v) and o.is_contiguous()
    assert rel_l2(o.cpu(), o_ref) < 1e-5 and rel_l2(s.cpu(), s_ref) < 1e-5
    assert rel_l2(o.cpu().double(), o_rec) < 1e-5 and rel_l2(s.cpu().double(), s_rec) < 1e-5
    with pytest.raises(ValueError):
        deltanet_chunked(*(t.to(DEVICE) for t in (q, k, v, decay, beta)), s, 24)


def test_tile_calls_cover_every_call_length():
    """The warm-up's call lengths pick every tile shape a call of up to a chunk can pick, one
    length a shape: a prompt's call of any length then finds its kernels compiled."""
    from sparkpack.runtime.kernels.moe_grouped import sub_tiles, tile_tiles, tile_calls

    for n_expert, topk, chunk in ((256, 8, 2048), (128, 8, 512), (64, 4, 100), (256, 8, 8192)):
        def shapes(t: int) -> tuple:
            return sub_tiles(t * topk / n_expert), tile_tiles(t * topk / n_expert)

        calls = tile_calls(n_expert, topk, chunk)
        assert {shapes(t) for t in range(2, chunk + 1)} == {shapes(t) for t in calls}
        assert len(calls) == len({shapes(t) for t in calls}) and max(calls) <= chunk
