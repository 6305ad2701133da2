"""Attention of a batched decode step in one launch of each kernel for all rows
(``kernels/attention.py``: ``kv_rows``, ``qk_norm_rope_append_rows``, ``attend_decode_rows``): each
row bit for bit what its own one-row launches give, over caches of other sizes, at other
positions, several rows of one cache at consecutive positions (a verify step), Q8_0 caches and
sliding-window rings past their wrap; through the models (``decode_batch``, ``decode_run``) with
the kernels on; and a batched step's attention launches do not grow with its rows.

CPU: Triton's interpreter on tiny shapes (float32 products); ``SPARKPACK_TEST_DEVICE=cuda`` runs
the same compiled on a GPU, in bf16 through the models."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from sparkpack.formats.archs import LINEAR  # noqa: E402
from sparkpack.runtime.cache import quantize_q8_0  # noqa: E402
from sparkpack.runtime.kernels import attention as at  # noqa: E402
from sparkpack.runtime.layers import rope_inv_freq  # noqa: E402
from sparkpack.runtime.models import load_model  # noqa: E402
from tests.kernel_refs import DEVICE  # noqa: E402
from tests.marks import quick_first  # noqa: E402
from tests.decode_steps import FED, PROMPTS, alone, assert_same, batched  # noqa: E402

H, H_KV, D = 4, 2, 32


def caches_of(sizes: list[int], dtype: torch.dtype, q8: bool, g: torch.Generator) -> list[list[torch.Tensor | None]]:
    """One sequence's key and value buffers ``[H_kv, S, d]`` per size, filled with garbage (rows
    the masks exclude must not matter): Q8_0 codes and scales, or the activations' dtype."""
    out = []
    for S in sizes:
        k, v = (torch.randn(H_KV, S, D, generator=g).to(DEVICE, dtype) for _ in range(2))
        if q8:
            (k, ks), (v, vs) = quantize_q8_0(k), quantize_q8_0(v)
            out.append([k, v, ks, vs])
        else:
            out.append([k, v, None, None])
    return out


def each_alone(rows, caches, pos, q, k, v, gate, kind, window, ring, q8, norms, inv):
    """Row after row through the one-row entry points (a single step each), in row order on
    copies of the caches: the outputs, their int8 forms, the caches after."""
    caches = [[None if t is None else t.clone() for t in c] for c in caches]
    outs = []
    for b, (ci, p) in enumerate(zip(rows, pos)):
        kc, vc, ks, vs = caches[ci]
        qr = at.qk_norm_rope_append(q[b], k[b], v[b], *norms, 1e-6, inv, 1.0, p, kc, vc, ks, vs, ring=ring)
        outs.append(at.attend_decode(qr, kc, vc, p, window, None if gate is None else gate[b], kind, q8=q8,
                                     k_scale=ks, v_scale=vs, ring=ring))
    return outs, caches


def together(rows, caches, pos, q, k, v, gate, kind, window, ring, q8, norms, inv):
    """The same rows in one launch of each kernel."""
    caches = [[None if t is None else t.clone() for t in c] for c in caches]
    kv = at.kv_rows([tuple(caches[ci]) for ci in rows], pos, ring)
    qr = at.qk_norm_rope_append_rows(q, k, v, *norms, 1e-6, inv, 1.0, kv)
    return at.attend_decode_rows(qr, kv, window, gate, kind, q8=q8), caches


# Rows: (which cache, its position). Caches of other sizes (the third takes another split than the
# others, so the attend runs one launch pair per split), the second repeated at consecutive
# positions after a row of another cache (a verify step's rows next to another sequence's).
SIZES = [64, 256, 8256, 64]
ROWS = [(0, 37), (1, 200), (1, 201), (1, 202), (2, 300), (3, 0)]
# Rings (a sliding window of 40 in 128 rows): positions past the wrap, one sequence's rows in a run.
RING_SIZES = [128, 128]
RING_ROWS = [(0, 300), (1, 5), (0, 301), (0, 302)]


# each case once, the two activation types taken in turn (the interpreter's time: CI's limit)
@pytest.mark.parametrize(("case", "dtype"), quick_first([
    pytest.param("buffers", torch.float32, id="buffers-f32"), pytest.param("q8_0", torch.bfloat16, id="q8_0-bf16"),
    pytest.param("ring", torch.bfloat16, id="ring-bf16"), pytest.param("ring-q8_0", torch.float32, id="ring-q8_0-f32")]))
def test_one_launch_for_all_rows_is_each_row_alone(case: str, dtype: torch.dtype) -> None:
    """Outputs (with their int8 forms), and the caches written, bit for bit; positions as ints, as
    views of one device tensor (a captured step's inputs) or as separate device scalars alike;
    each gate kind."""
    ring, q8kv = case.startswith("ring"), case.endswith("q8_0")
    sizes, spec = (RING_SIZES, RING_ROWS) if ring else (SIZES, ROWS)
    window = 40 if ring else 0
    g = torch.Generator().manual_seed(len(case) + (dtype == torch.float32))
    rows, pos = [r for r, _ in spec], [p for _, p in spec]
    B = len(spec)
    caches = caches_of(sizes, dtype, q8kv, g)
    q = torch.randn(B, H, 2 * D, generator=g).to(DEVICE, dtype)[..., :D]  # the query half of [query | gate]
    k, v = (torch.randn(B, H_KV, D, generator=g).to(DEVICE, dtype) for _ in range(2))
    norms = [(0.5 + torch.rand(D, generator=g)).to(DEVICE, dtype) for _ in range(2)]
    inv = rope_inv_freq(10000.0, D).to(DEVICE)
    device_pos = torch.tensor(pos, device=DEVICE)
    for kind, gate in (("sigmoid", torch.randn(B, H, 2 * D, generator=g).to(DEVICE, dtype)[..., D:]),
                       ("softplus_head", torch.randn(B, H, generator=g).to(DEVICE, dtype)), ("none", None)):
        want, want_caches = each_alone(rows, caches, pos, q, k, v, gate, kind, window, ring, True, norms, inv)
        forms = (pos, list(device_pos.unbind()), [torch.tensor(x, device=DEVICE) for x in pos]) if gate is None \
            else (pos,)
        for p in forms:
            (out, codes), got_caches = together(rows, caches, p, q, k, v, gate, kind, window, ring, True, norms, inv)
            for b, (o, c) in enumerate(want):
                assert torch.equal(out[b:b + 1], o), (kind, b)
                for got_t, want_t in zip(codes, c):
                    assert torch.equal(got_t[b:b + 1], want_t), (kind, b)
            for got_c, want_c in zip(got_caches, want_caches):
                assert all(x is None and y is None or torch.equal(x, y) for x, y in zip(got_c, want_c))


def test_row_splits_follow_each_rows_buffer() -> None:
    """A row's split comes from its own buffer's size: rows of other sizes past 8192 positions
    group by split, and every row of one size takes one launch whatever the others."""
    assert at.decode_split(SIZES[2], H_KV) != at.decode_split(SIZES[0], H_KV) == at.decode_split(SIZES[1], H_KV)


def test_bad_rows_raise() -> None:
    g = torch.Generator().manual_seed(0)
    (k0, v0, _, _), (k1, v1, _, _) = caches_of([64, 64], torch.float32, False, g)
    q = torch.zeros(2, H, D, device=DEVICE)
    bad = [
        lambda: at.kv_rows([(k0, v0, None, None)], [1, 2]),  # a position per row
        lambda: at.kv_rows([(k0, v0, None, None), (k1[:1], v1[:1], None, None)], [1, 2]),  # other kv heads
        lambda: at.kv_rows([(k0, v0, None, None), (k1.double(), v1.double(), None, None)], [1, 2]),  # other types
        lambda: at.kv_rows([(k0, v0, None, None)], [64]),  # past the buffer
        lambda: at.kv_rows([(torch.zeros(H_KV * 8 * D + 1, device=DEVICE)[1:].view(H_KV, 8, D),
                             torch.zeros(H_KV, 8, D, device=DEVICE), None, None)], [1]),  # a buffer starting misaligned
        lambda: at.kv_rows([(k0, v0, None, None), (k1, v1, None, None)], [1, torch.tensor(2)]),  # ints and tensors
        lambda: at.attend_decode_rows(q[:1], at.kv_rows([(k0, v0, None, None), (k1, v1, None, None)], [1, 2])),
        # a ring of 64 rows cannot take 30 rows of one sequence past a window of 40: the last would
        # overwrite what the first reads
        lambda: at.attend_decode_rows(torch.zeros(30, H, D, device=DEVICE),
                                      at.kv_rows([(k0, v0, None, None)] * 30, list(range(100, 130)), ring=True), 40),
    ]
    for i, call in enumerate(bad):
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"case {i} did not raise")


def test_a_ring_shorter_than_its_window_takes_rows_that_do_not_wrap():
    """A sliding layer's ring of a short context (fewer rows than the window) holds every position
    while none has wrapped around its end: its rows attend as over a plain buffer (a tiny laguna
    at ``ctx`` 16 with a 64-token window decodes so until its buffers grow)."""
    g = torch.Generator().manual_seed(1)
    ((k, v, _, _),) = caches_of([16], torch.float32, False, g)
    q = torch.randn(2, H, D, generator=g).to(DEVICE)
    ring = at.attend_decode_rows(q, at.kv_rows([(k, v, None, None)] * 2, [5, 6], ring=True), 64)
    plain = at.attend_decode_rows(q, at.kv_rows([(k, v, None, None)] * 2, [5, 6]))
    torch.testing.assert_close(ring, plain)
    with pytest.raises(ValueError, match="a ring of 16 rows"):  # past its end, the window would be overwritten
        at.attend_decode_rows(q, at.kv_rows([(k, v, None, None)] * 2, [15, 16], ring=True), 64)


def kernel_model(synth_model, arch: str):
    """A tiny model of ``arch`` with its kernels on (the GPU's default; interpreted on the CPU)."""
    model = load_model(synth_model(arch, "Q4_K_M", skew=1.0), device=DEVICE,
                       dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32)
    model.kernels = True
    return model


# (the qwen35moe shape, attention beside DeltaNet layers; the rings' kernels are taken above, and
# test_decode_batch takes every arch's batched step; on a GPU every arch runs its kernels)
@pytest.mark.parametrize("arch", ["qwen35moe"] + (["laguna", "qwen3moe"] if DEVICE == "cuda" else []))
def test_models_batched_attention_is_each_sequence_alone(synth_model, arch) -> None:
    """Through ``decode_batch`` with the kernels on: sequences of other lengths joining, leaving
    and in another order, each row its sequence's single step bit for bit (Laguna: sliding-window
    rings and full layers; Qwen3.5: sigmoid gates beside DeltaNet layers)."""
    model = kernel_model(synth_model, arch)
    assert_same(batched(model), alone(model))


@pytest.mark.parametrize(("arch", "kv_type"), [("qwen35moe", "auto")]  # (Q8_0 rows: the kernel-level cases)
                         + ([("qwen35moe", "q8_0"), ("laguna", "auto"), ("laguna", "q8_0")] if DEVICE == "cuda" else []))
def test_models_run_of_tokens_is_its_single_steps(synth_model, arch, kv_type) -> None:
    """``decode_run`` with the kernels on (one sequence's rows at consecutive positions, appended
    together, each attending up to its own): its single steps' logits, and the step after."""
    model = kernel_model(synth_model, arch)
    prompt, run, after = PROMPTS[2], FED[0], FED[1][0]
    one = model.new_cache(kv_type=kv_type)
    model.forward(prompt, one, last_only=True)
    want = [model.forward([t], one)[0] for t in [*run, after]]
    cache = model.new_cache(kv_type=kv_type)
    model.forward(prompt, cache, last_only=True)
    got = [*model.decode_run(run, cache), model.forward([after], cache)[0]]
    assert_same([got], [want])


class Launches:
    """Counts the launches of a Triton kernel (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel, self.n = kernel, 0

    def __getitem__(self, grid):
        self.n += 1
        return self.kernel[grid]


def test_a_batched_steps_attention_launches_do_not_grow_with_its_rows(synth_model, monkeypatch) -> None:
    """One ``decode_batch`` step of B = 1, 2, 4 sequences: the same attention launches (one of
    each kernel per attention layer), where a launch per row made B times as many (the
    qwen35moe shape: its attention layers between DeltaNet ones)."""
    model = kernel_model(synth_model, "qwen35moe")
    names = ("qk_norm_rope_append_kernel", "attend_split_kernel", "attend_combine_kernel")
    counters = {n: Launches(getattr(at, n)) for n in names}
    for n, c in counters.items():
        monkeypatch.setattr(at, n, c)
    layers = sum(la.attention != LINEAR for la in model.spec.layers)
    counts = []
    for B in (1, 2, 4):
        caches = [model.new_cache() for _ in range(B)]
        for b, c in enumerate(caches):
            model.forward(PROMPTS[b % len(PROMPTS)][: 2 + b], c, last_only=True)
        for c in counters.values():
            c.n = 0
        model.decode_batch([FED[b % len(FED)][0] for b in range(B)], caches)
        counts.append({n: c.n for n, c in counters.items()})
    assert counts[0] == counts[1] == counts[2] == {n: layers for n in names}, counts


def test_an_eager_step_copies_one_table(synth_model) -> None:
    """The row tables are made once per content (``runtime.device_tables``): a batched step after
    the first over the same caches makes only its positions' table (one small copy a step), and
    what a capture uses is collected for its graph to keep (``kept``)."""
    from sparkpack.runtime import device_tables

    model = kernel_model(synth_model, "qwen3moe")
    caches = [model.new_cache() for _ in PROMPTS]
    for prompt, c in zip(PROMPTS, caches):
        model.forward(prompt, c, last_only=True)
    model.decode_batch([f[0] for f in FED], caches)
    made = device_tables.made()
    with device_tables.kept() as tables:
        model.decode_batch([f[1] for f in FED], caches)
    assert device_tables.made() == made + 1
    layers = len(model.spec.layers)
    assert len(tables) == 3 * layers  # each layer: the positions, its rows for the append and for attending
    assert len({t.data_ptr() for t in tables}) == layers + 1  # (a layer's two tables of its rows: one content)
