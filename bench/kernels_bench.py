"""Bandwidth and correctness of the quantized Triton kernels at real decode shapes (CUDA only).

Decode is bound by the weight bytes each token reads, so the figure of merit is achieved GB/s
(weights + activations + outputs) against the device's own copy bandwidth, measured here with
the same timer. Every case is also checked against dequantize-then-matmul in fp32 at the same
shape, so a fast wrong kernel cannot pass.

    python bench/kernels_bench.py                    # everything below at its defaults
    python bench/kernels_bench.py --only moe --block-n 0 2 4 8   # sweep rows per program (0 = default)
    python bench/kernels_bench.py --only prefill --moe-tiles 16,32,4 64,64,8   # grouped MoE tiles
    python bench/kernels_bench.py --only dense --gemv-tiles 4,4 8,4 2,2   # one-token dense GEMV
    python bench/kernels_bench.py --only dense --act q8 --gemv-rows 1 2 4   # the GEMV of a batched step
    python bench/kernels_bench.py --only moe dense --act float q8   # float vs int8 activations
    python bench/kernels_bench.py --only moe prefill --moe-types IQ2_S,IQ2_S IQ2_XXS,Q2_K IQ3_XXS,IQ3_XXS
    python bench/kernels_bench.py --only attention --attn-buffers 4096 32768   # decode attention
    python bench/kernels_bench.py --only attention --attn-buffers 8256 32848 131152 --attn-splits 256 512 1024 2048
    python bench/kernels_bench.py --only prefill-attention --prefill-tokens 2048 --prefill-past 0 16384 32768
    python bench/kernels_bench.py --only deltanet --prefill-tokens 2048   # DeltaNet prefill kernels

Blocks come from ``repack.synth.quant_blocks.random_blocks`` (every scale pattern occurs) and the
references from ``runtime.dequant`` (gguf's arithmetic, on the GPU). Exits 1 if any case is
outside its error bound.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from sparkpack.repack.synth.quant_blocks import make_rng, random_blocks
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from sparkpack.formats.quants import quant_name
from sparkpack.runtime.dequant import FLOAT_DTYPES, dequantize
from sparkpack.runtime.kernels import blocks, dense
from sparkpack.runtime.kernels.moe import ExpertPools, MoELaunch, moe_experts
from sparkpack.runtime.kernels.q8dot import quantize

_SEEDS = itertools.count()


def random_rows(qtype: int, rows: int, K: int) -> torch.Tensor:
    """uint8 ``[rows, row_bytes]`` of random valid blocks (weights of RMS ~0.02) on the GPU."""
    raw = random_blocks(qtype, rows * K // GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0], 0.02, make_rng(next(_SEEDS)), any_scales=True)
    return torch.from_numpy(raw.reshape(rows, -1)).cuda()


def dequantize_rows(raw: torch.Tensor, qtype: int, K: int) -> torch.Tensor:
    """uint8 rows ``[..., row_bytes]`` of ``K`` elements each -> float32 ``[..., K]`` (the references)."""
    lead = tuple(raw.shape[:-1])
    return dequantize(raw, qtype, (K, raw[..., 0].numel())).reshape(*lead, K)


def median_ms(fn) -> float:
    """Device time of one call, replayed from a CUDA graph as the decode step runs it: timing the
    Python calls themselves would time the host (a small kernel's launch path is longer than its
    run), which a fast host hides one day and a slow one shows the next."""
    fn()  # compile outside the capture
    return float(do_bench_cudagraph(fn, rep=100, return_mode="median"))


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy (read + write bytes) with the same timer as the kernels."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / ms / 1e6


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def moe_types(pair: str) -> tuple[int, int]:
    """``--moe-types`` entry GATE_UP,DOWN (GGML names) -> their ids."""
    gate, down = pair.split(",")
    return int(GGMLQuantizationType[gate.upper()]), int(GGMLQuantizationType[down.upper()])


def bench_moe(args: argparse.Namespace, copy_gbs: float, gen: torch.Generator, gq: int, dq: int) -> bool:
    """One decode token (T=1, top-8) through pools of 128 slots: gate/up of type ``gq`` (Q4_K by
    default), down ``dq`` (Q6_K)."""
    n_embd, n_ff, n_slots, topk = 2048, args.moe_ff, 128, 8
    gate = random_rows(gq, n_slots * n_ff, n_embd).reshape(n_slots, n_ff, -1)
    up = random_rows(gq, n_slots * n_ff, n_embd).reshape(n_slots, n_ff, -1)
    down = random_rows(dq, n_slots * n_embd, n_ff).reshape(n_slots, n_embd, -1)
    ok = True
    for T, bn, nw, act, cpi in [(T, bn, nw, a, c) for T in args.moe_tokens for bn in args.block_n
                                for nw in args.warps for a in args.act
                                for c in (args.moe_cpi if a == "q8" else args.moe_cpi[:1])]:  # float: no cpi
        q8 = act == "q8"
        x = torch.randn(T, n_embd, device="cuda", generator=gen)
        ids = torch.stack([torch.randperm(n_slots, device="cuda", generator=gen)[:topk] for _ in range(T)])
        ids = ids.to(torch.int32)
        wts = torch.softmax(torch.randn(T, topk, device="cuda", generator=gen), dim=-1)
        slots = torch.arange(n_slots, dtype=torch.int32, device="cuda")
        y = torch.empty(T, n_embd, device="cuda")
        launch = MoELaunch(block_n=bn or None, num_warps=nw or None, cpi=cpi)
        run = lambda: moe_experts(x, ids, wts, slots, ExpertPools(gate, up, down, gq, gq, dq, n_ff),  # noqa: E731
                                  act_q8=q8, out=y, launch=launch)
        ms = median_ms(run)
        run()
        ref = torch.zeros(T, n_embd, device="cuda", dtype=torch.float64)
        for t in range(T):
            for j in range(topk):
                e = int(ids[t, j])
                g = dequantize_rows(gate[e], gq, n_embd) @ x[t]
                u = dequantize_rows(up[e], gq, n_embd) @ x[t]
                ref[t] += wts[t, j] * (dequantize_rows(down[e], dq, n_ff) @ (torch.nn.functional.silu(g) * u))
        err = rel_l2(y, ref)
        # residency must not change results: move every expert to another slot, expect equal bits
        perm = torch.randperm(n_slots, device="cuda", generator=gen)
        moved = moe_experts(x, ids, wts, perm.to(torch.int32),
                            ExpertPools(gate[perm.argsort()], up[perm.argsort()], down[perm.argsort()], gq, gq, dq, n_ff),
                            act_q8=q8, launch=launch)
        same = torch.equal(moved, y)
        used = torch.unique(ids).numel()
        nbytes = used * (gate[0].numel() + up[0].numel() + down[0].numel())
        gbs = nbytes / ms / 1e6
        good = err < (2e-2 if q8 else 1e-4) and same  # int8 activations: their rounding
        ok &= good
        print(f"moe {quant_name(gq)}/{quant_name(dq)} T={T:2d} top{topk} n_ff={n_ff} bn={bn} warps={nw} {act:5} cpi={cpi}: {ms * 1e3:8.1f} us  {gbs:6.0f} GB/s ({100 * gbs / copy_gbs:3.0f}% "
              f"of copy)  rel-L2 {err:.2e}  slot-invariant {same}{'' if good else '  FAIL'}")
    return ok


def bench_moe_prefill(args: argparse.Namespace, gen: torch.Generator, gq: int, dq: int) -> bool:
    """Prefill-sized MoE (T tokens, top-8 of ``--moe-experts`` experts of ``--moe-ff`` rows: gate/up
    of type ``gq``, down ``dq``; qwen3.6: 256 x 512, qwen3-30b: 128 x 768): the per-pair decode
    kernels against the grouped kernels: the expanded-tile ones and the sub-block ones (and their
    tile shapes)."""
    n_embd, n_ff, n_exp, topk = 2048, args.moe_ff, args.moe_experts, 8
    gate = random_rows(gq, n_exp * n_ff, n_embd).reshape(n_exp, n_ff, -1)
    up = random_rows(gq, n_exp * n_ff, n_embd).reshape(n_exp, n_ff, -1)
    down = random_rows(dq, n_exp * n_embd, n_ff).reshape(n_exp, n_embd, -1)
    slots = torch.arange(n_exp, dtype=torch.int32, device="cuda")
    tiles = [None] + [tuple(int(v) for v in t.split(",")) for t in args.moe_tiles]
    ok = True
    for T in args.prefill_tokens:
        x = torch.randn(T, n_embd, device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.topk(torch.rand(T, n_exp, device="cuda", generator=gen), topk, dim=-1).indices
        wts = torch.softmax(torch.randn(T, topk, device="cuda", generator=gen), dim=-1)
        ref = torch.zeros(T, n_embd, device="cuda")
        for e in torch.unique(ids).tolist():  # fp32 reference on the dequantized weights
            rows, j = torch.nonzero(ids == e, as_tuple=True)
            xe = x[rows].float()
            g = xe @ dequantize_rows(gate[e], gq, n_embd).T
            u = xe @ dequantize_rows(up[e], gq, n_embd).T
            ref.index_add_(0, rows, wts[rows, j, None] * ((torch.nn.functional.silu(g) * u) @ dequantize_rows(down[e], dq, n_ff).T))
        cases = [("per-pair", False, None, True), ("expanded", True, None, False)] + \
            [("sub", True, t, True) for t in tiles]
        for name, grouped, t, sub in cases:
            run = lambda: moe_experts(x, ids, wts, slots, ExpertPools(gate, up, down, gq, gq, dq, n_ff),  # noqa: E731
                                      launch=MoELaunch(grouped=grouped, tiles=t, sub=sub))
            if not grouped and T > 512:
                continue  # minutes per call
            ms = median_ms(run)
            err = rel_l2(run(), ref)
            good = err < 2e-2  # bf16 products (the grouped kernels' tl.dot) and output
            ok &= good
            tile = "auto" if t is None else "x".join(map(str, t))
            print(f"moe prefill {quant_name(gq)}/{quant_name(dq)} T={T:5d} {name:8} tiles={tile:9}: {ms * 1e3:9.1f} us  {T / ms * 1e3:9.0f} tok/s/layer"
                  f"  rel-L2 {err:.2e}{'' if good else '  FAIL'}")
    return ok


# (name, K, [(rows, qtype), ...]): a decode step's dense projections in the Qwen3.6-35B-A3B Q4_K_M
# file (its layers' stacked groups as one launch each; Q6_K where llama.cpp's *_M mix bumps them)
DENSE_SHAPES = [
    ("deltanet_in", 2048, [(8192, blocks.Q4_K), (4096 + 64, blocks.Q4_K)]),
    ("deltanet_in_q6", 2048, [(8192, blocks.Q6_K), (4096 + 64, blocks.Q4_K)]),
    ("ssm_out", 4096, [(2048, blocks.Q4_K)]),
    ("ffn_in", 2048, [(257, 0), (1024, blocks.Q4_K)]),  # 0: the F32 router
    ("shexp_down_q6", 512, [(2048, blocks.Q6_K)]),
    ("attn_qkv", 2048, [(8192 + 512, blocks.Q4_K), (512, blocks.Q6_K)]),
    ("output_head", 2048, [(248320, blocks.Q6_K)]),
]


def _dense_weight(rows: int, qtype: int, K: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw bytes, fp32 reference) of one segment."""
    if qtype in FLOAT_DTYPES:
        w = torch.randn(rows, K, generator=gen, device="cuda").mul_(0.02).to(FLOAT_DTYPES[qtype])
        return w.view(torch.uint8).reshape(rows, -1), w.float()
    raw = random_rows(qtype, rows, K)
    return raw, dequantize_rows(raw, qtype, K)


def bench_dense(args: argparse.Namespace, copy_gbs: float, gen: torch.Generator) -> bool:
    """The one-token GEMV over a layer's stacked projections against cuBLAS on the same weights
    held in bf16 (what the runtime kept before), for each ``--gemv-rows`` B: the rows of a batched
    decode step or a draft verify in one launch (B = 1: a single step)."""
    ok = True
    # ROWS,WARPS[,CHUNKS]: chunks of 256 per loop iteration, 0 or left out = the default
    tiles = [tuple(int(v) for v in (t + ",0").split(",")[:3]) for t in args.gemv_tiles] or [None]
    tiles = [t if t and t[0] else None for t in tiles]  # 0,0: the default
    print(f"{'shape':16} {'B':>2} {'tile':10} {'us':>8} {'us/row':>7} {'GB/s':>7} {'%copy':>6} {'bf16 us':>8} {'rel-L2':>9}")
    for name, K, parts in DENSE_SHAPES:
        segs = [_dense_weight(rows, qt, K, gen) for rows, qt in parts]
        qs = [(raw, qt) for (raw, _), (_, qt) in zip(segs, parts)]
        w = torch.cat([w for _, w in segs])
        w16 = w.to(torch.bfloat16)
        for B in args.gemv_rows:
            x = torch.randn(B, K, generator=gen, device="cuda").to(torch.bfloat16)
            ref = x.float() @ w.T
            out = torch.empty(B, ref.shape[1], dtype=torch.bfloat16, device="cuda")
            bf16_ms = median_ms(lambda: torch.nn.functional.linear(x, w16))
            nbytes = sum(raw.numel() for raw, _ in qs) + x.numel() * 2 + out.numel() * 2
            for tile, act in [(t, a) for t in tiles for a in args.act]:
                # int8 activations: the time includes quantizing x (one launch, as the runtime pays it)
                run = (lambda: dense.gemv(x, qs, out, tile=tile, q8=quantize(x))) if act == "q8" else \
                    (lambda: dense.gemv(x, qs, out, tile=tile))
                run()
                err = rel_l2(out.float(), ref)
                good = err < (2e-2 if act == "q8" else 1e-2)  # bf16 output; int8 adds the activations' rounding
                ok &= good
                ms = median_ms(run)
                gbs = nbytes / ms / 1e6
                label = ("auto" if tile is None else "x".join(map(str, tile))) + ("/q8" if act == "q8" else "")
                print(f"{name:16} {B:2d} {label:10} {ms * 1e3:8.1f} {ms * 1e3 / B:7.1f} {gbs:7.0f} "
                      f"{100 * gbs / copy_gbs:5.0f}% {bf16_ms * 1e3:8.1f} {err:9.2e}{'' if good else '  FAIL'}")
        del segs, qs, w, w16
    return ok


# (name, query heads, kv heads, head size, rope dims): Qwen3.6-35B-A3B, Qwen3-30B-A3B
ATTN_SHAPES = [("qwen3.6", 16, 2, 256, 64), ("qwen3-30b", 32, 4, 128, 128), ("laguna", 64, 8, 128, 64)]


def bench_attention(args: argparse.Namespace, copy_gbs: float, gen: torch.Generator) -> bool:
    """One token's attention (``kernels/attention.py``: append, split, combine) against the torch
    form it replaces (q/k norm, rope, KV append, masked GQA over the buffer, sigmoid gate), for a
    bf16 and a Q8_0 cache at several buffer sizes with the token 3/4 into the buffer. GB/s counts
    the cache rows up to the token (keys and values, codes and scales) once."""
    from sparkpack.runtime.cache import KVCache
    from sparkpack.runtime.kernels.attention import attend_decode, decode_split, qk_norm_rope_append
    from sparkpack.runtime.layers import Rope, attention, rms_norm, rope_inv_freq

    ok = True
    print(f"{'shape':10} {'kv':5} {'buffer':>7} {'pos':>6} {'split':>5} {'attend us':>9} {'GB/s':>6} {'%copy':>6} "
          f"{'3 kernels us':>12} {'torch us':>9} {'rel-L2':>9}")
    dt = torch.bfloat16
    for name, H, H_kv, d, rope_dim in ATTN_SHAPES:
        rope = Rope(rope_dim, rope_inv_freq(1e7, rope_dim))
        inv = rope.inv_freq.cuda()
        qn, kn = (torch.rand(d, generator=gen, device="cuda").to(dt) + 0.5 for _ in range(2))
        for S in args.attn_buffers:
            pos = S * 3 // 4
            for kv_type in ("auto", "q8_0"):
                cache = KVCache(S, kv_type)
                fill = torch.randn(S, H_kv, d, generator=gen, device="cuda").to(dt)
                cache.append(fill, fill.flip(0), 0)  # every row written; rows past pos are masked anyway
                q, gate = (torch.randn(1, H, d, generator=gen, device="cuda").to(dt) for _ in range(2))
                k, v = (torch.randn(1, H_kv, d, generator=gen, device="cuda").to(dt) for _ in range(2))
                split = decode_split(S, H_kv, cache.q8)  # as attend_decode picks
                scales = (cache.k_scale, cache.v_scale) if cache.q8 else (None, None)

                def fused():
                    qr = qk_norm_rope_append(q[0], k[0], v[0], qn, kn, 1e-6, inv, 1.0, pos, cache.k, cache.v, *scales)
                    return attend_decode(qr, cache.k, cache.v, pos, 0, gate[0], "sigmoid", split,
                                         k_scale=scales[0], v_scale=scales[1])

                at = torch.tensor([pos], device="cuda")  # made outside: the timing captures a CUDA graph

                def torch_form():
                    qq, kk = rms_norm(q, qn, 1e-6), rms_norm(k, kn, 1e-6)
                    cos, sin = rope.cos_sin(at, dt)
                    qq, kk = rope.apply(qq, cos, sin), rope.apply(kk, cos, sin)
                    return (attention(qq, kk, v, cache, pos) * torch.sigmoid(gate)).reshape(1, -1)

                want = torch_form().float()
                got = fused().float()
                err = rel_l2(got, want)
                good = err < 2e-2  # bf16 roundings at different points
                ok &= good
                qr = qk_norm_rope_append(q[0], k[0], v[0], qn, kn, 1e-6, inv, 1.0, pos, cache.k, cache.v, *scales)
                attend_ms = median_ms(lambda: attend_decode(qr, cache.k, cache.v, pos, 0, gate[0], "sigmoid", split,
                                                            k_scale=scales[0], v_scale=scales[1]))
                rows = pos + 1
                nbytes = 2 * H_kv * rows * (d * cache.k.element_size() + (2 * d // 32 if cache.q8 else 0))
                gbs = nbytes / attend_ms / 1e6
                fused_ms = median_ms(fused)
                try:
                    torch_ms = median_ms(torch_form)
                except RuntimeError as e:  # the torch form may not be capturable; the kernels' rows stand
                    print(f"(torch form not timed: {str(e).splitlines()[0]})")
                    torch_ms = float("nan")
                print(f"{name:10} {kv_type:5} {S:7} {pos:6} {split:5} {attend_ms * 1e3:9.1f} {gbs:6.0f} "
                      f"{100 * gbs / copy_gbs:5.0f}% {fused_ms * 1e3:12.1f} {torch_ms * 1e3:9.1f} "
                      f"{err:9.2e}{'' if good else '  FAIL'}")
                for other in args.attn_splits:  # decode_split's pick against the others asked for
                    if other == split:
                        continue
                    def attend(sp=other):
                        return attend_decode(qr, cache.k, cache.v, pos, 0, gate[0], "sigmoid", sp,
                                             k_scale=scales[0], v_scale=scales[1])
                    err = rel_l2(attend().float(), want)
                    ok &= err < 2e-2
                    other_ms = median_ms(attend)
                    print(f"{'':10} {'':5} {'':7} {'':6} {other:5} {other_ms * 1e3:9.1f} "
                          f"{nbytes / other_ms / 1e6:6.0f} {100 * nbytes / other_ms / 1e6 / copy_gbs:5.0f}%"
                          f"{'' if err < 2e-2 else '  FAIL'}")
                del cache, fill
    return ok


def bench_prefill_attention(args: argparse.Namespace, gen: torch.Generator) -> bool:
    """A prefill call's attention after ``--prefill-past`` earlier tokens: ``attend_prefill`` (one
    Triton launch), torch's fused attention with a lower-right causal mask (``sdpa-lr``: what
    cuDNN/flash/efficient kernels take for a query block at the end of its keys) and the unfused
    form in pieces (``attend_buffers`` over a past: what an eager call ran before). The past
    grows with a long prompt, so the form that wins at 32k decides a long prompt's prefill. Each
    checked against the unfused form in fp32 where that fits (past <= 16k)."""
    from torch.nn.attention.bias import causal_lower_right

    from sparkpack.runtime.kernels.attention import attend_prefill
    from sparkpack.runtime.layers import attend_positions, attend_buffers

    def sdpa_lr(q, k, v):
        T, S = q.shape[0], k.shape[1]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None],
                                             attn_mask=causal_lower_right(T, S), enable_gqa=True)
        return out[0].transpose(0, 1)

    ok = True
    print(f"{'shape':10} {'T':>5} {'past':>6} {'triton ms':>9} {'sdpa-lr ms':>10} {'unfused ms':>10} "
          f"{'rel-L2 tri':>10} {'rel-L2 sdpa':>11}")
    dt = torch.bfloat16
    for name, H, H_kv, d, _ in ATTN_SHAPES:
        for T in args.prefill_tokens:
            for past in args.prefill_past:
                S = past + T
                q = torch.randn(T, H, d, generator=gen, device="cuda").to(dt)
                k, v = (torch.randn(H_kv, S, d, generator=gen, device="cuda").to(dt) for _ in range(2))
                pos = torch.tensor(past, device="cuda")
                errs = []
                for fn in (lambda: attend_prefill(q, k, v, pos), lambda: sdpa_lr(q, k, v)):
                    try:
                        got = fn()
                    except RuntimeError as e:  # a backend that refuses the shape
                        errs.append(f"n/a ({str(e)[:30]})")
                        continue
                    if S <= 16384 + 2048:
                        at = torch.arange(past, S, device="cuda")
                        want = attend_positions(q.float(), k.float(), v.float(), at[:, None],
                                       torch.arange(S, device="cuda")[None, :], 0)
                        err = rel_l2(got.float(), want)
                        ok &= err < 2e-2
                        errs.append(f"{err:.2e}")
                    else:
                        errs.append("-")
                tri = median_ms(lambda: attend_prefill(q, k, v, pos))
                try:
                    lr = f"{median_ms(lambda: sdpa_lr(q, k, v)):10.2f}"
                except RuntimeError:
                    lr = f"{'n/a':>10}"
                unf = median_ms(lambda: attend_buffers(q, k, v, past)) if past else float("nan")
                print(f"{name:10} {T:5} {past:6} {tri:9.2f} {lr} {unf:10.2f} {errs[0]:>10} {errs[-1]:>11}")
                del q, k, v
    return ok


def bench_deltanet_prefill(args: argparse.Namespace, gen: torch.Generator) -> bool:
    """The DeltaNet prefill kernels at the Qwen3.6 shape (32 value heads of 128, 16 key heads) for
    calls of ``--prefill-tokens``: input prep, the chunked rule, the gated norm. Timed one by one
    (a profile of a whole call with programmatic dependent launch counts each kernel's wait for
    the previous one as its own time)."""
    from sparkpack.runtime.kernels import deltanet as dn

    n_k, n_v, d_k, d_v = 16, 32, 128, 128
    print(f"{'T':>5} {'prep ms':>8} {'chunked ms':>10} {'norm ms':>8}")
    for T in args.prefill_tokens:
        q, k = (F.normalize(torch.randn(T, n_v, d_k, generator=gen, device="cuda"), dim=-1) for _ in range(2))
        v = torch.randn(T, n_v, d_v, generator=gen, device="cuda")
        g = -torch.rand(T, n_v, generator=gen, device="cuda") * 0.1
        beta = torch.rand(T, n_v, generator=gen, device="cuda")
        state = torch.zeros(n_v, d_k, d_v, device="cuda")
        chunked = median_ms(lambda: dn.deltanet_chunked(q, k, v, g, beta, state, 64))
        qkv = torch.randn(T, 2 * n_k * d_k + n_v * d_v, generator=gen, device="cuda").to(torch.bfloat16)
        ba = torch.randn(T, 2 * n_v, generator=gen, device="cuda").to(torch.bfloat16)
        conv_w = torch.randn(qkv.shape[1], 4, generator=gen, device="cuda")
        win = torch.zeros(3, qkv.shape[1], device="cuda", dtype=torch.bfloat16)
        dtb, a = torch.randn(n_v, device="cuda"), -torch.rand(n_v, device="cuda")
        prep = median_ms(lambda: dn.deltanet_prefill_inputs(qkv, ba[:, :n_v], ba[:, n_v:], dtb, a, conv_w, win,
                                                             n_k, d_k, n_v))
        o = torch.randn(T, n_v, d_v, generator=gen, device="cuda")
        z = torch.randn(T, n_v * d_v, generator=gen, device="cuda").to(torch.bfloat16)
        w = torch.randn(d_v, device="cuda")
        norm = median_ms(lambda: dn.gated_rms_norm(o, z, w, 1e-6))
        print(f"{T:5} {prep:8.3f} {chunked:10.3f} {norm:8.3f}")
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moe-ff", type=int, default=768, help="expert ffn width (Qwen3-30B-A3B: 768, Laguna: 512)")
    ap.add_argument("--moe-experts", type=int, default=256, help="experts of the prefill MoE (Qwen3-30B-A3B: 128)")
    ap.add_argument("--moe-tokens", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--block-n", nargs="+", type=int, default=[0], help="rows per program to try; 0 = default")
    ap.add_argument("--warps", nargs="+", type=int, default=[0], help="warps per MoE program to try; 0 = default")
    ap.add_argument("--prefill-tokens", nargs="+", type=int, default=[16, 128, 512, 2048])
    ap.add_argument("--moe-tiles", nargs="*", default=[], help="grouped tiles to try, as BLOCK_M,BLOCK_N,WARPS")
    ap.add_argument("--gemv-tiles", nargs="*", default=[], help="dense GEMV tiles to try, as ROWS,WARPS[,CHUNKS]")
    ap.add_argument("--gemv-rows", nargs="+", type=int, default=[1],
                    help="dense GEMV: activation rows per launch (a batched decode step's or a draft verify's)")
    ap.add_argument("--moe-types", nargs="+", default=["Q4_K,Q6_K"],
                    help="expert types to time, as GATE_UP,DOWN GGML names (IQ2_M files: IQ2_S,IQ2_S)")
    ap.add_argument("--moe-cpi", nargs="+", type=int, default=[8], help="MoE q8: chunks of 256 per iteration")
    ap.add_argument("--act", nargs="+", default=["float", "q8"], choices=["float", "q8"],
                    help="one-token activations: float, or int8 (q8dot) for the MoE and dense kernels")
    ap.add_argument("--attn-buffers", nargs="+", type=int, default=[4096, 32768],
                    help="KV buffer sizes (positions) for the attention kernels")
    ap.add_argument("--attn-splits", nargs="*", type=int, default=[],
                    help="decode attention: other splits (positions per program) to time beside decode_split's")
    ap.add_argument("--prefill-past", nargs="+", type=int, default=[0, 2048, 16384],
                    help="prefill attention: earlier tokens before the call")
    kinds = ["moe", "prefill", "dense", "attention", "prefill-attention", "deltanet"]
    ap.add_argument("--only", choices=kinds, nargs="+", default=kinds)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernels_bench needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: device copy {copy_gbs:.0f} GB/s (read + write)")
    ok = True
    for gq, dq in map(moe_types, args.moe_types):
        if "moe" in args.only:
            ok &= bench_moe(args, copy_gbs, gen, gq, dq)
        if "prefill" in args.only:
            ok &= bench_moe_prefill(args, gen, gq, dq)
    if "dense" in args.only:
        ok &= bench_dense(args, copy_gbs, gen)
    if "attention" in args.only:
        ok &= bench_attention(args, copy_gbs, gen)
    if "prefill-attention" in args.only:
        ok &= bench_prefill_attention(args, gen)
    if "deltanet" in args.only:
        ok &= bench_deltanet_prefill(args, gen)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
