"""The decode attention kernels (``runtime.kernels.attention``) against the torch path they replace:
``runtime.layers.rms_norm`` and ``Rope`` for the q/k norm, rope and KV append, and
``runtime.layers.attention`` over a ``runtime.cache.KVCache`` filled by earlier appends for the
attention itself, both computed in float64 on the values the kernels are given.

Without a GPU the kernels run in Triton's interpreter on tiny shapes (float32 products, see the
module's docstring); the cases still cover both head sizes' code paths (d 32 and 64), rep 1, 2
and 4, partial rope, YaRN's cos/sin scale, a sliding window, positions at 0, inside a split and
at the last row of the buffer, every gate, and garbage in the rows the mask excludes. One test
compiles the kernels for sm_90, which the interpreter does not check.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sparkpack.runtime.cache import KVCache  # noqa: E402
from sparkpack.runtime.kernels.attention import (  # noqa: E402
    attend_decode, attend_prefill, decode_split, qk_norm_rope_append)
from sparkpack.runtime.layers import Rope, attention, rms_norm, rope_inv_freq, yarn_rope  # noqa: E402
from tests.kernel_refs import DEVICE, compile_in_subprocess, rel_l2  # noqa: E402
from tests.marks import quick_first  # noqa: E402

EPS = 1e-6


def rand(g: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Random values already representable in ``dtype``, as float64 (the reference's copy)."""
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).double()


def assert_rounded_once(got: torch.Tensor, ref: torch.Tensor) -> None:
    """``got`` is ``ref`` rounded once to its dtype, give or take float32 round-off of the
    intermediate terms: half a unit in the last place on a GPU (round to nearest), a whole one in
    Triton's interpreter (it truncates to bf16)."""
    ulp = torch.finfo(got.dtype).eps * (1.0 if os.environ.get("TRITON_INTERPRET") == "1" else 0.5)
    err = (got.double().cpu() - ref).abs()
    tol = ulp * ref.abs() + 1e-5 * ref.abs().max()
    assert bool((err <= tol).all()), f"max excess {float((err - tol).max()):.3g}"


def norm_rope_ref(x: torch.Tensor, w: torch.Tensor | None, rope: Rope, pos: int) -> torch.Tensor:
    """The torch path in float64: ``rms_norm`` (when there is a weight), then ``Rope`` at ``pos``."""
    y = rms_norm(x, w, EPS) if w is not None else x
    cos, sin = rope.cos_sin(torch.tensor([pos]), torch.float64)
    return rope.apply(y[None], cos, sin)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,H_kv,d,rope_dim,norm,yarn,S,pos", [
    (4, 2, 32, 32, True, False, 64, 0),  # full rope, first position
    (4, 1, 64, 16, True, True, 64, 37),  # partial rope with a cos/sin scale
    (2, 2, 32, 16, False, False, 64, 63),  # no q/k norm, last row
    (8, 2, 64, 64, True, True, 4096, 4000),  # large angles (the kernel's cos/sin range reduction)
])
def test_qk_norm_rope_append_matches_torch(dtype, H, H_kv, d, rope_dim, norm, yarn, S, pos) -> None:
    """q and k normed and roped as the torch path does them; k and v land in row ``pos`` of the
    caches and nothing else there changes; q read in place from the [query | gate] layout gives
    what a contiguous q gives; ``pos`` as a device scalar gives what the int gives."""
    g = torch.Generator().manual_seed(d + pos)
    rope = yarn_rope(10000.0, rope_dim, 4.0, 32) if yarn else Rope(rope_dim, rope_inv_freq(10000.0, rope_dim))
    qg = rand(g, H, 2 * d, dtype=dtype, scale=3.0)  # per head [query | gate]
    k, v = rand(g, H_kv, d, dtype=dtype, scale=3.0), rand(g, H_kv, d, dtype=dtype)
    qn = (0.5 + torch.rand(d, generator=g, dtype=torch.float64)).to(dtype).double() if norm else None
    kn = (0.5 + torch.rand(d, generator=g, dtype=torch.float64)).to(dtype).double() if norm else None
    q_ref = norm_rope_ref(qg[:, :d], qn, rope, pos)
    k_ref = norm_rope_ref(k, kn, rope, pos)
    assert rope.scale != 1.0 or not yarn

    def dev(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(DEVICE, dtype)

    caches0 = [torch.randn(H_kv, S, d, generator=g).to(dtype) for _ in range(2)]
    results = []
    for q_in, p in ((dev(qg)[:, :d], pos), (dev(qg[:, :d]).contiguous(), pos),
                    (dev(qg)[:, :d], torch.tensor(pos, device=DEVICE))):
        kc, vc = (c.to(DEVICE) for c in caches0)
        out = qk_norm_rope_append(q_in, dev(k), dev(v), dev(qn), dev(kn), EPS, rope.inv_freq.to(DEVICE),
                                  rope.scale, p, kc, vc)
        assert out.shape == (H, d) and out.dtype == dtype and out.is_contiguous()
        results.append((out.cpu(), kc.cpu(), vc.cpu()))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    out, kc, vc = results[0]
    if dtype == torch.float32:
        assert rel_l2(out, q_ref) < 1e-5 and rel_l2(kc[:, pos], k_ref) < 1e-5
    else:
        assert_rounded_once(out, q_ref)
        assert_rounded_once(kc[:, pos], k_ref)
    assert torch.equal(vc[:, pos].double(), v)
    rest = torch.arange(S) != pos
    assert torch.equal(kc[:, rest], caches0[0][:, rest]) and torch.equal(vc[:, rest], caches0[1][:, rest])


def filled_cache(H_kv: int, d: int, S: int, pos: int, dtype: torch.dtype, g: torch.Generator) -> KVCache:
    """A float64 cache of capacity S holding positions 0..pos-1, written by a few appends."""
    cache = KVCache(capacity=S)
    k, v = rand(g, pos, H_kv, d, dtype=dtype), rand(g, pos, H_kv, d, dtype=dtype)
    cuts = sorted({0, pos // 3, pos // 2, pos})
    for a, b in zip(cuts, cuts[1:]):
        cache.append(k[a:b], v[a:b], a)
    return cache


def run_attention(H_kv: int, rep: int, d: int, S: int, split: int, pos: int, window: int, dtype: torch.dtype,
                  gate_kind: str = "none", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' output ``[H, d]`` (with garbage in every cache row the mask excludes, ``pos``
    given as an int and as a device scalar: both must agree) and the torch reference, gated."""
    g = torch.Generator().manual_seed(seed)
    H = H_kv * rep
    cache = filled_cache(H_kv, d, S, pos, dtype, g)
    qg = rand(g, H, 2 * d, dtype=dtype, scale=2.0)  # [query | gate], as Qwen3.5's projection
    q = qg[:, :d]
    k_new, v_new = rand(g, 1, H_kv, d, dtype=dtype, scale=2.0), rand(g, 1, H_kv, d, dtype=dtype)
    ref = attention(q[None], k_new, v_new, cache, pos, window)[0]
    assert cache.k.shape == (H_kv, S, d)
    gate = None
    if gate_kind == "sigmoid":
        gate = qg[:, d:]
        ref = ref * torch.sigmoid(gate)
    elif gate_kind == "softplus_head":
        gate = rand(g, H, dtype=dtype, scale=2.0)
        ref = ref * F.softplus(gate)[:, None]
    elif gate_kind == "softplus":
        gate = rand(g, H, d, dtype=dtype, scale=2.0)
        ref = ref * F.softplus(gate)

    j = torch.arange(S)
    excluded = (j > pos) | ((pos - j >= window) if window > 0 else torch.zeros(S, dtype=torch.bool))
    kc, vc = cache.k.to(dtype), cache.v.to(dtype)
    kc[:, excluded] = (torch.randn(H_kv, int(excluded.sum()), d, generator=g) * 1e6).to(dtype)
    vc[:, excluded] = (torch.randn(H_kv, int(excluded.sum()), d, generator=g) * 1e6).to(dtype)
    q_dev = q.to(DEVICE, dtype).contiguous()
    gate_dev = None
    if gate is not None:
        gate_dev = qg.to(DEVICE, dtype)[:, d:] if gate_kind == "sigmoid" else gate.to(DEVICE, dtype)
    outs = [attend_decode(q_dev, kc.to(DEVICE), vc.to(DEVICE), p, window, gate_dev, gate_kind, split)
            for p in (pos, torch.tensor(pos, device=DEVICE))]
    assert outs[0].shape == (1, H * d) and outs[0].dtype == dtype
    assert torch.equal(outs[0], outs[1])
    return outs[0].cpu().view(H, d), ref


TOL = {torch.float32: 1e-5, torch.bfloat16: 6e-3}


@pytest.mark.parametrize("dtype", quick_first([torch.float32, torch.bfloat16]))
@pytest.mark.parametrize("H_kv,rep,d,S,split,pos,window", [
    (2, 1, 32, 64, 32, 0, 0),  # first position: one key
    (2, 2, 64, 96, 32, 45, 0),  # inside the second split
    (1, 4, 32, 96, 32, 95, 0),  # last row of the buffer
    (2, 2, 32, 128, 96, 100, 0),  # three tiles of 32 in a split (online rescaling), then a partial split
    (2, 2, 32, 96, 32, 45, 20),  # window opening inside the previous split
    (1, 4, 64, 128, 96, 120, 80),  # window opening in a split's second tile: the first tile is skipped
    (2, 1, 32, 64, 16, 63, 1),  # window 1: the token alone
    # long-buffer splits (decode_split >= 256): on a GPU in half precision, pipelined tiles of 128
    # (64 at d=256) in three stages, partial last tiles and splits included
    (2, 4, 64, 1200, 256, 1100, 0),
    (2, 4, 64, 1200, 512, 1199, 300),
    (1, 8, 256, 700, 256, 650, 0),
])
def test_attend_decode_matches_torch(dtype, H_kv, rep, d, S, split, pos, window) -> None:
    out, ref = run_attention(H_kv, rep, d, S, split, pos, window, dtype, seed=pos + window)
    assert rel_l2(out, ref) < TOL[dtype]


@pytest.mark.parametrize("n_kv", [1, 2, 4, 8])
def test_decode_split_keeps_about_one_program_per_sm(n_kv) -> None:
    """Short buffers keep 64-position splits; long ones a power of two from 256 to 2048 that gives
    about 128 programs, fewer only where 2048 caps it, more only where 256 floors it; 256 for a
    Q8_0 cache."""
    for S in (256, 4096, 8192, 8193, 8256, 20000, 32848, 65600, 131152, 262224):
        split = decode_split(S, n_kv)
        if S <= 8192:
            assert split == 64
            continue
        assert split in (256, 512, 1024, 2048)
        programs = n_kv * -(-S // split)
        assert split == 2048 or programs <= 2 * 128 + n_kv
        assert split == 256 or programs >= 128 - n_kv
        assert decode_split(S, n_kv, q8=True) == 256


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate_kind", ["sigmoid", "softplus_head", "softplus"])
def test_attend_decode_gates(dtype, gate_kind) -> None:
    """Qwen3.5's sigmoid gate read in place from the [query | gate] layout, Laguna's softplus gate
    per head and per channel."""
    out, ref = run_attention(2, 2, 64, 64, 32, 40, 0, dtype, gate_kind, seed=7)  # two channel blocks
    assert rel_l2(out, ref) < TOL[dtype]


def test_attend_decode_ignores_excluded_rows() -> None:
    """The excluded rows must matter to an attention that read them: the same inputs with those
    rows zeroed instead of huge give the same output (so the check above can fail), and the
    result differs from attending over the whole buffer."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 32, generator=g).to(DEVICE)
    kc, vc = torch.randn(2, 64, 32, generator=g), torch.randn(2, 64, 32, generator=g)
    base = attend_decode(q, kc.to(DEVICE), vc.to(DEVICE), 20, split=16)
    kc[:, 21:], vc[:, 21:] = 0, 0
    assert torch.equal(attend_decode(q, kc.to(DEVICE), vc.to(DEVICE), 20, split=16), base)
    assert not torch.allclose(attend_decode(q, kc.to(DEVICE), vc.to(DEVICE), 63, split=16), base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_decode_int8_form(dtype) -> None:
    """With ``q8`` the combine kernel also writes the output's int8 form (``attn_output``'s input):
    bit for bit ``q8dot.quantize`` of the output, which is itself unchanged; d = 64 gives two
    blocks per head, two programs each writing its own."""
    from sparkpack.runtime.kernels import q8dot

    g = torch.Generator().manual_seed(5)
    q = torch.randn(4, 64, generator=g).to(DEVICE, dtype)
    kc, vc = (torch.randn(2, 48, 64, generator=g).to(DEVICE, dtype) for _ in range(2))
    gate = torch.randn(4, 64, generator=g).to(DEVICE, dtype)
    plain = attend_decode(q, kc, vc, 30, gate=gate, gate_kind="sigmoid", split=16)
    out, out_q8 = attend_decode(q, kc, vc, 30, gate=gate, gate_kind="sigmoid", split=16, q8=True)
    assert torch.equal(out, plain) and isinstance(plain, torch.Tensor)
    for fused, own in zip(out_q8, q8dot.quantize(out)):
        assert torch.equal(fused.cpu(), own.cpu())
    with pytest.raises(ValueError, match="multiple of 32"):
        attend_decode(q[:, :48].contiguous(), kc[..., :48].contiguous(), vc[..., :48].contiguous(), 30, q8=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_0_cache_read_and_written_as_codes(dtype) -> None:
    """A Q8_0 KV cache (int8 codes, f16 scales per 32): the append writes at row ``pos`` exactly
    the codes and scales ``runtime.cache.quantize_q8_0`` gives for the row the float cache gets
    (ties to even included), nothing else changes, and attention over the codes equals attention
    over the cache expanded by ``dequantize_q8_0`` (bit for bit where casts round to nearest);
    d = 64 is two blocks a row."""
    from sparkpack.runtime.cache import dequantize_q8_0, quantize_q8_0

    g = torch.Generator().manual_seed(11)
    H, H_kv, d, S, pos = 4, 2, 64, 48, 29
    rope = Rope(32, rope_inv_freq(10000.0, 32))
    q, k, v = (torch.randn(n, d, generator=g).to(DEVICE, dtype) for n in (H, H_kv, H_kv))
    v[0, :32] = torch.arange(32, dtype=torch.float32).to(dtype) - 15.5  # a block of n + 0.5 values ...
    v[0, 3] = 127.0  # ... whose scale is then 1: every code is a tie (round half to even)
    kn = torch.rand(d, generator=g).to(DEVICE, dtype) + 0.5
    codes = [torch.randint(-127, 128, (H_kv, S, d), generator=g, dtype=torch.int8).to(DEVICE) for _ in range(2)]
    scales = [torch.rand(H_kv, S, d // 32, generator=g).to(DEVICE, torch.float16) for _ in range(2)]
    before = [t.clone() for t in codes + scales]
    flat = [torch.zeros(H_kv, S, d, dtype=dtype, device=DEVICE) for _ in range(2)]
    inv = rope.inv_freq.to(DEVICE)
    want_q = qk_norm_rope_append(q, k, v, None, kn, EPS, inv, 1.0, pos, *flat)
    got_q = qk_norm_rope_append(q, k, v, None, kn, EPS, inv, 1.0, pos, *codes, *scales)
    assert torch.equal(got_q, want_q)
    for c, s, f in zip(codes, scales, flat):
        wc, ws = quantize_q8_0(f[:, pos])
        assert torch.equal(c[:, pos].cpu(), wc.cpu()) and torch.equal(s[:, pos].cpu(), ws.cpu())
    rest = torch.arange(S) != pos
    for t, b in zip(codes + scales, before):
        assert torch.equal(t[:, rest].cpu(), b[:, rest].cpu())
    gate = torch.randn(H, d, generator=g).to(DEVICE, dtype)
    expanded = [dequantize_q8_0(c, s, dtype) for c, s in zip(codes, scales)]
    for window in (0, 10):
        want = attend_decode(got_q, *expanded, pos, window, gate, "sigmoid", split=16)
        got = attend_decode(got_q, *codes, pos, window, gate, "sigmoid", split=16, k_scale=scales[0],
                            v_scale=scales[1])
        if dtype == torch.float32 or DEVICE == "cuda":
            assert torch.equal(got, want)
        else:  # the interpreter truncates the expanded tiles to bf16 where torch rounds them
            assert rel_l2(got.float(), want.double().cpu()) < 2e-2
    with pytest.raises(ValueError, match="Q8_0 scales"):
        attend_decode(got_q, *codes, pos, k_scale=scales[0][:, :, :1].contiguous(), v_scale=scales[1])
    with pytest.raises(ValueError, match="both"):
        attend_decode(got_q, *codes, pos, k_scale=scales[0])


@pytest.mark.skipif(DEVICE != "cuda", reason="torch's fused attention path is taken on a GPU only")
@pytest.mark.parametrize("window", [0, 4096, 100])
def test_prompt_prefill_attention_matches_the_unfused_form(window: int) -> None:
    """A prompt's first call (position 0, half precision) attends through torch's fused causal
    attention (``layers.causal_sdpa``): within 1e-2 of the unfused form (``layers.attend_positions``) in
    float64 and no farther from it than the unfused bf16 form, at the Qwen3-30B head shape over a
    300-token prompt. A window shorter than the prompt keeps the unfused form (its mask is not
    plain causal): the bits of ``attend_positions`` itself."""
    from sparkpack.runtime.layers import attend_positions, flash_prompt, attend_buffers

    g = torch.Generator().manual_seed(window)
    T, H, H_kv, d, S = 300, 32, 4, 128, 512
    q = torch.randn(T, H, d, generator=g).to(DEVICE, torch.bfloat16)
    k = torch.randn(H_kv, S, d, generator=g).to(DEVICE, torch.bfloat16)
    v = torch.randn(H_kv, S, d, generator=g).to(DEVICE, torch.bfloat16)
    got = attend_buffers(q, k, v, 0, window)
    pos = torch.arange(T, device=DEVICE)
    want = attend_positions(q, k[:, :T], v[:, :T], pos[:, None], pos[None, :], window)
    assert flash_prompt(q, 0, window) == (window != 100)
    assert got.shape == (T, H, d) and got.dtype == torch.bfloat16
    if window == 100:
        assert torch.equal(got, want)
    else:  # against the unfused form in float64
        c = [t.double().cpu() for t in (q, k[:, :T], v[:, :T], pos[:, None], pos[None, :])]
        exact = attend_positions(*c, window)
        assert rel_l2(got, exact) < 1e-2 and rel_l2(got, exact) < 2 * rel_l2(want, exact)
    assert not flash_prompt(q, 5, 0) and not flash_prompt(q.float(), 0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H_kv,rep,d,S,pos,window", [
    (7, 2, 2, 32, 64, 0, 0),  # a prompt's first call
    (20, 1, 4, 64, 96, 45, 0),  # a continuation over a past, blocks of tokens crossing key tiles
    (33, 2, 1, 32, 128, 60, 16),  # a window shorter than the call: early keys drop out row by row
    (5, 2, 3, 32, 64, 59, 0),  # rep 3 (padded rows), the call ending at the last row of the buffer
    (16, 1, 8, 128, 256, 100, 300),  # the Qwen3-30B head shape, a window longer than the past
    (150, 2, 2, 32, 256, 70, 40),  # many blocks of tokens, each with its own window start
])
def test_attend_prefill_matches_torch(dtype, T, H_kv, rep, d, S, pos, window) -> None:
    """``attend_prefill`` (a captured prefill call's attention) against ``runtime.layers.attend_positions`` in
    float64, with garbage in every row past the call; the position by value and from memory give
    the same bits."""
    from sparkpack.runtime.layers import attend_positions

    g = torch.Generator().manual_seed(T + pos)
    H = H_kv * rep
    q = rand(g, T, H, d, dtype=dtype, scale=2.0)
    k, v = rand(g, H_kv, S, d, dtype=dtype, scale=2.0), rand(g, H_kv, S, d, dtype=dtype)
    k[:, pos + T:], v[:, pos + T:] = 1e6, -1e6  # never attended
    qpos = torch.arange(pos, pos + T)[:, None]
    ref = attend_positions(q, k, v, qpos, torch.arange(S)[None, :], window)
    dev = [t.to(DEVICE, dtype).contiguous() for t in (q, k, v)]
    outs = [attend_prefill(*dev, p, window) for p in (pos, torch.tensor(pos, device=DEVICE))]
    assert outs[0].shape == (T, H, d) and outs[0].dtype == dtype and torch.equal(outs[0], outs[1])
    assert rel_l2(outs[0].cpu(), ref) < TOL[dtype]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q8", [False, True])
def test_a_ring_gives_the_whole_buffers_bits(dtype, q8) -> None:
    """A sliding-window layer's ring (``KVCache.ring``: position p in row p % S) against a whole
    buffer holding the same keys: the append writes row ``p % S`` and nothing else; decode
    (window opening inside a split, the position by value and from memory, a Q8_0 cache too) and
    a prefill call whose rows wrap around the ring give the whole buffer's bits, at split 64 (the
    ring's); a ring too short for a call is refused."""
    from sparkpack.formats.memory import window_rows
    from sparkpack.runtime.cache import quantize_q8_0

    g = torch.Generator().manual_seed(21)
    H_kv, rep, d, window, T = 2, 2, 32, 40, 20
    H, S = H_kv * rep, window_rows(window, T)
    L = 3 * S  # the whole buffer's positions
    full = [torch.randn(H_kv, L, d, generator=g).to(DEVICE, dtype) for _ in range(2)]
    if q8:
        qs = [quantize_q8_0(t) for t in full]
        full = [c for c, _ in qs] + [sc for _, sc in qs]
    ring = [torch.full((t.shape[0], S, *t.shape[2:]), 99, dtype=t.dtype, device=DEVICE) for t in full]
    last = 2 * S + 17  # the ring holds positions (last - S, last]
    at = torch.arange(last - S + 1, last + 1, device=DEVICE)
    for r, f in zip(ring, full):
        r[:, at % S] = f[:, at]
    codes = lambda ts: dict(k_scale=ts[2], v_scale=ts[3]) if q8 else {}  # noqa: E731
    q = torch.randn(H, d, generator=g).to(DEVICE, dtype)
    for p in (last, last - 3):
        want = attend_decode(q, full[0], full[1], p, window, split=64, **codes(full))
        got = [attend_decode(q, ring[0], ring[1], pp, window, ring=True, **codes(ring))
               for pp in (p, torch.tensor(p, device=DEVICE))]
        assert torch.equal(got[0], want) and torch.equal(got[1], want)
    with pytest.raises(ValueError, match="window"):
        attend_decode(q, ring[0], ring[1], last, 0, ring=True, **codes(ring))
    if q8:
        return
    # a prefill call of T tokens at pos: its keys appended first (rows wrap past the ring's end)
    pos = 3 * S - T - 5 - S  # ends past row S - 1 of the ring: pos % S + T > S
    pos += (S - pos % S) - T // 2  # rows wrap half-way through the call
    rope = Rope(d, rope_inv_freq(10000.0, d))
    inv = rope.inv_freq.to(DEVICE)
    qt, kt, vt = (torch.randn(T, n, d, generator=g).to(DEVICE, dtype) for n in (H, H_kv, H_kv))
    before = [t.clone() for t in ring[:2]]
    q_full = qk_norm_rope_append(qt, kt, vt, None, None, EPS, inv, 1.0, pos, *full[:2])
    q_ring = qk_norm_rope_append(qt, kt, vt, None, None, EPS, inv, 1.0, pos, *ring[:2], ring=True)
    assert torch.equal(q_full, q_ring)
    written = torch.arange(pos, pos + T, device=DEVICE) % S
    assert written.min() == 0 and written.max() == S - 1  # (it wraps)
    rest = torch.ones(S, dtype=torch.bool, device=DEVICE)
    rest[written] = False
    for r, f, b in zip(ring, full, before):
        assert torch.equal(r[:, written], f[:, pos:pos + T]) and torch.equal(r[:, rest], b[:, rest])
    # the window before pos must be in the ring too (its rows were filled from the whole buffer)
    before_pos = torch.arange(pos - window + 1, pos, device=DEVICE)
    for r, f in zip(ring, full):
        r[:, before_pos % S] = f[:, before_pos]
    want = attend_prefill(q_full, full[0], full[1], pos, window)
    for pp in (pos, torch.tensor(pos, device=DEVICE)):
        assert torch.equal(attend_prefill(q_ring, ring[0], ring[1], pp, window, ring=True), want)
    with pytest.raises(ValueError, match="ring"):
        attend_prefill(q_ring, ring[0][:, :window].contiguous(), ring[1][:, :window].contiguous(), pos, window,
                       ring=True)


def test_bad_shapes_raise() -> None:
    f32 = dict(device=DEVICE, dtype=torch.float32)
    q, k, v = torch.zeros(4, 32, **f32), torch.zeros(2, 32, **f32), torch.zeros(2, 32, **f32)
    kc, vc = torch.zeros(2, 16, 32, **f32), torch.zeros(2, 16, 32, **f32)
    inv = torch.ones(8, **f32)
    w = torch.ones(32, **f32)

    def append(**kw):
        args = dict(q=q, k=k, v=v, q_norm=w, k_norm=w, eps=EPS, inv_freq=inv, rope_scale=1.0, pos=3,
                    k_cache=kc, v_cache=vc)
        return qk_norm_rope_append(**{**args, **kw})

    def attend(**kw):
        args = dict(q=q, k_cache=kc, v_cache=vc, pos=3)
        return attend_decode(**{**args, **kw})

    bad = [
        lambda: append(q=q[None]),  # q not [H, d]
        lambda: append(v=torch.zeros(3, 32, **f32)),  # v's heads differ from k's
        lambda: append(k=torch.zeros(2, 16, **f32)),  # head size differs
        lambda: append(q=q.to(torch.bfloat16)),  # mixed dtypes
        lambda: append(q=torch.zeros(4, 64, **f32)[:, ::2]),  # strided last axis
        lambda: append(k_cache=torch.zeros(3, 16, 32, **f32)),  # cache heads
        lambda: append(v_cache=torch.zeros(2, 16, 64, **f32)[..., :32]),  # non-contiguous cache
        lambda: append(q_norm=torch.ones(16, **f32)),  # norm weight size
        lambda: append(inv_freq=torch.ones(17, **f32)),  # rope wider than the head
        lambda: append(inv_freq=inv.double()),  # frequencies not float32
        lambda: append(pos=16),  # past the buffer
        lambda: append(pos=torch.tensor(3.0, device=DEVICE)),  # float position
        lambda: attend(q=q[:, :16]),  # head size differs from the cache's
        lambda: attend(q=torch.zeros(3, 32, **f32)),  # 3 query heads over 2 kv heads
        lambda: attend(q=torch.zeros(32, 4, **f32).t()),  # non-contiguous q
        lambda: attend(k_cache=kc.to(torch.bfloat16)),  # mixed dtypes
        lambda: attend(v_cache=torch.zeros(2, 8, 32, **f32)),  # caches differ
        lambda: attend(split=24),  # not a multiple of 16
        lambda: attend(pos=-1),
        lambda: attend(window=-2),
        lambda: attend(gate_kind="tanh", gate=q),
        lambda: attend(gate_kind="sigmoid"),  # gate missing
        lambda: attend(gate_kind="none", gate=q),  # gate given without a kind
        lambda: attend(gate_kind="sigmoid", gate=torch.zeros(4, 16, **f32)),
        lambda: attend(gate_kind="softplus_head", gate=q),  # per-head gate must be [H]
        lambda: attend(gate_kind="softplus", gate=torch.zeros(4, 64, **f32)[:, ::2]),  # strided channels
    ]
    for i, call in enumerate(bad):
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"case {i} did not raise")


def aot_compile_attention(arch: int = 90) -> None:
    """Compile the four kernels for sm_``arch`` at the real models' largest shapes (d=256,
    rep 16) with the launch options ``attend_decode`` uses, and check that each fits the shared
    memory of a Hopper SM (227 KiB). Needs TRITON_INTERPRET unset."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sparkpack.runtime.kernels import attention as at

    floats = {"eps", "rope_scale", "qk_scale"}
    jobs = []
    for act, dev in (("bf16", True), ("fp32", False)):
        # the bf16 variants read and write a Q8_0 cache, read positions from memory and take PDL
        rows = {"tab_ptr": "*i64", "pos_ptr": "*i64"}
        jobs += [
            (at.qk_norm_rope_append_kernel,
             {**{n: "*" + act for n in ("q_ptr", "k_ptr", "v_ptr", "qn_ptr", "kn_ptr", "qo_ptr")}, **rows,
              "inv_ptr": "*fp32"},
             {"HAS_QN": True, "HAS_KN": not dev, "Q8KV": dev, "RING": not dev, "BLOCK_D": 256, "PDL": dev}, 1, 3),
            (at.attend_split_kernel,
             {"q_ptr": "*" + act, **rows, "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32"},
             {"DOT_FP32": act == "fp32", "Q8KV": dev, "RING": not dev, "REP_P2": 16, "BLOCK_D": 256,
              "BLOCK_S": 64, "SPLIT": 64, "PDL": dev}, 4, 1),
            (at.attend_combine_kernel,
             {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "gate_ptr": "*" + act, "out_ptr": "*" + act,
              **rows, "xq": "*i8", "xd": "*fp32", "xs": "*fp32"},
             {"SPLIT": 64, "RING": not dev, "GATE": 1 if dev else 2, "BLOCK_SP": 64, "BLOCK_C": 32, "Q8": dev,
              "PDL": dev}, 4, 3),
            (at.attend_prefill_kernel,
             {"q_ptr": "*" + act, "k_ptr": "*" + act, "v_ptr": "*" + act, "out_ptr": "*" + act,
              "pos": "*i64" if dev else "i32"},
             {"POS_PTR": dev, "DOT_FP32": act == "fp32", "RING": not dev, "REP_P2": 16, "BLOCK_T": 4, "BLOCK_D": 256,
              "BLOCK_S": 32, "PDL": dev}, 4, 3),
        ]
    target = GPUTarget("cuda", arch, 32)
    for fn, ptrs, consts, warps, stages in jobs:
        sig = {p.name: "constexpr" if p.is_constexpr else ptrs.get(p.name, "fp32" if p.name in floats else "i32")
               for p in fn.params}
        kernel = triton.compile(ASTSource(fn, sig, consts), target=target,
                                options={"num_warps": warps, "num_stages": stages})
        assert kernel.asm["cubin"], (fn.__name__, consts)
        assert kernel.metadata.shared <= 227 * 1024, (fn.__name__, consts, kernel.metadata.shared)
    print("compiled", len(jobs))


@pytest.mark.slow
def test_attention_kernels_compile_for_h100() -> None:
    compile_in_subprocess("from tests.test_attention_kernel import aot_compile_attention; aot_compile_attention()", 8)
