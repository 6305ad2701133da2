"""The fused DeltaNet decode step over the rows of a batched step (``kernels.deltanet.deltanet_rows``,
issue 46): one launch of each kernel for all rows, every sequence's rows taken in order on its own
state from a device table, each row bit for bit what its step alone gives (a single step is the
same launch with a table of one row). Kernel level: B sequences against B single launches, one
sequence's K rows (a verify) against K single steps with the states after each row copied out,
sequences of different row counts in one launch. Model level (the tiny qwen35moe with its fused
kernels on; the CPU runs them in Triton's interpreter): ``decode_batch`` and verify steps with
every rollback against single steps, the launch count of a batched step independent of B, and
the states' addresses (which the tables hold) unchanged by everything that rewrites a state.
``SPARKPACK_TEST_DEVICE=cuda`` runs the model tests on a GPU (the kernel tests run compiled
wherever CUDA is)."""
from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from sparkpack.runtime import device_tables  # noqa: E402
from sparkpack.runtime.cache import RecurrentState  # noqa: E402
from sparkpack.runtime.generate import GENERATED, Session  # noqa: E402
from sparkpack.runtime.kernels import deltanet  # noqa: E402
from sparkpack.runtime.kernels.deltanet import deltanet_rows, sequence_row  # noqa: E402
from sparkpack.runtime.models import load_model  # noqa: E402
from sparkpack.runtime.sequence_state import RecurrentRows  # noqa: E402
from tests.kernel_refs import DEVICE, deltanet_decode  # noqa: E402
from tests.marks import quick_first  # noqa: E402

MODEL_DEVICE = os.environ.get("SPARKPACK_TEST_DEVICE", "cpu")
MODEL_DTYPE = torch.bfloat16 if MODEL_DEVICE == "cuda" else torch.float32
N_K, D_K, N_V, D_V, K = 2, 32, 4, 32, 4  # value heads of 32: the int8 output form applies
C = 2 * N_K * D_K + N_V * D_V
EPS = 1e-6


class Layer:
    """One DeltaNet layer's weights and ``n`` sequences' windows and states (random, seeded)."""

    def __init__(self, n: int, dtype: torch.dtype, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.conv_w = torch.randn(C, K, generator=g).to(DEVICE, dtype)
        self.dt, self.a = torch.randn(N_V, generator=g).to(DEVICE, dtype), (-torch.rand(N_V, generator=g)).to(DEVICE, dtype)
        self.norm_w = torch.randn(D_V, generator=g).to(DEVICE, dtype)
        self.wins = [torch.randn(K - 1, C, generator=g).to(DEVICE, dtype) for _ in range(n)]
        self.states = [(torch.randn(N_V, D_K, D_V, generator=g) * 0.1).to(DEVICE) for _ in range(n)]
        self.g = g

    def inputs(self, T: int) -> tuple[torch.Tensor, ...]:
        """Projections of ``T`` rows as the stacked projection gives them: column bands of one
        ``[T, C + width + 2 n_v]`` output (strided rows)."""
        width = N_V * D_V
        stacked = torch.randn(T, C + width + 2 * N_V, generator=self.g)
        stacked[:, C + width + N_V:] *= 4  # large alphas: the softplus threshold
        stacked = stacked.to(DEVICE, self.dtype)
        return (stacked[:, :C], stacked[:, C:C + width], stacked[:, C + width:C + width + N_V],
                stacked[:, C + width + N_V:])

    def copy(self) -> "Layer":
        twin = Layer.__new__(Layer)
        twin.__dict__.update(self.__dict__)
        twin.wins = [w.clone() for w in self.wins]
        twin.states = [s.clone() for s in self.states]
        return twin

    def rows(self, qkv, z, beta, alpha, table: torch.Tensor, q8: bool):
        out = deltanet_rows(qkv, z, beta, alpha, self.dt, self.a, self.conv_w, table, self.norm_w, N_K, D_K, D_V,
                            EPS, q8=q8)
        return list(out[:1]) + list(out[1]) if q8 else [out]

    def step(self, b: int, qkv, z, beta, alpha, q8: bool):
        """Sequence ``b``'s single step on one row (its own launch, a table of one row)."""
        out = deltanet_decode(qkv[0], z[0], beta[0], alpha[0], self.dt, self.a, self.conv_w, self.wins[b],
                              self.states[b], self.norm_w, N_K, D_K, EPS, q8=q8)
        return list(out[:1]) + list(out[1]) if q8 else [out]


def table(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64).to(DEVICE)


def assert_rows_equal(got: list[torch.Tensor], alone: list[list[torch.Tensor]]) -> None:
    """Every output of a launch over rows (the rows, their int8 codes, scales, sums) equals the
    single launches' outputs stacked."""
    assert len(got) == len(alone[0])
    for i, g in enumerate(got):
        assert torch.equal(g, torch.cat([a[i] for a in alone])), i


@pytest.mark.parametrize("q8", quick_first([True, False]), ids=["int8", "float"])
@pytest.mark.parametrize("dtype", quick_first([torch.bfloat16, torch.float32]), ids=["bf16", "f32"])
def test_sequences_in_one_launch_are_each_alone(q8: bool, dtype: torch.dtype) -> None:
    """B sequences of one row each (a batched step) in one launch: each row, window and state
    bit for bit its own single step's, over a few steps."""
    B = 3
    batch = Layer(B, dtype)
    alone = batch.copy()
    for _ in range(3):
        inputs = batch.inputs(B)
        got = batch.rows(*inputs, table([sequence_row(batch.wins[b], batch.states[b], b, 1) for b in range(B)]), q8)
        want = [alone.step(b, *(t[b:b + 1] for t in inputs), q8) for b in range(B)]
        assert_rows_equal(got, want)
        for b in range(B):
            assert torch.equal(batch.wins[b], alone.wins[b]) and torch.equal(batch.states[b], alone.states[b])


@pytest.mark.parametrize("kept", quick_first([3, 0, 4]), ids=lambda n: f"copies{n}")
def test_a_sequences_rows_in_order_are_its_single_steps(kept: int) -> None:
    """One sequence's K consecutive rows (a verify) in one launch give the K single steps' rows;
    with row-state buffers of ``kept`` slots, slot i holds the window and state after row i (what
    a sequence keeping i + 1 of the rows goes back to), bit for bit the single steps'; the live
    window and state end where the K steps leave them."""
    n = 5
    run = Layer(1, torch.bfloat16, seed=1)
    alone = run.copy()
    saved = (torch.full((kept, K - 1, C), float("nan"), dtype=torch.bfloat16, device=DEVICE),
             torch.full((kept, N_V, D_K, D_V), float("nan"), device=DEVICE))
    inputs = run.inputs(n)
    got = run.rows(*inputs, table([sequence_row(run.wins[0], run.states[0], 0, n, saved if kept else None)]), True)
    want = []
    for t in range(n):
        want.append(alone.step(0, *(x[t:t + 1] for x in inputs), True))
        if t < kept:
            assert torch.equal(saved[0][t], alone.wins[0]) and torch.equal(saved[1][t], alone.states[0]), t
    assert_rows_equal(got, want)
    assert torch.equal(run.wins[0], alone.wins[0]) and torch.equal(run.states[0], alone.states[0])


def test_sequences_of_different_row_counts_in_one_launch() -> None:
    """Sequences of 2, 1 and 3 rows (rows 0-1, 2, 3-5) in one launch, each its single steps."""
    counts = [2, 1, 3]
    batch = Layer(len(counts), torch.float32, seed=2)
    alone = batch.copy()
    inputs = batch.inputs(sum(counts))
    firsts = [sum(counts[:b]) for b in range(len(counts))]
    got = batch.rows(*inputs, table([sequence_row(batch.wins[b], batch.states[b], f, n)
                                     for b, (f, n) in enumerate(zip(firsts, counts))]), True)
    want = [alone.step(b, *(x[f + t:f + t + 1] for x in inputs), True)
            for b, (f, n) in enumerate(zip(firsts, counts)) for t in range(n)]
    assert_rows_equal(got, want)
    for b in range(len(counts)):
        assert torch.equal(batch.states[b], alone.states[b]) and torch.equal(batch.wins[b], alone.wins[b])


def test_bad_tables_and_buffers_are_refused() -> None:
    layer = Layer(1, torch.float32)
    with pytest.raises(ValueError, match="sequence table"):
        layer.rows(*layer.inputs(1), torch.zeros(1, 7, dtype=torch.int64, device=DEVICE), False)
    wrong = (torch.empty(2, K - 1, C, device=DEVICE), torch.empty(2, N_V, D_K, D_V + 1, device=DEVICE))
    with pytest.raises(ValueError, match="after each row"):
        sequence_row(layer.wins[0], layer.states[0], 0, 3, wrong)


# ----------------------------------------------------------------------------- the model

PROMPTS = ([3, 14, 15, 92, 65], [7, 1], [46, 26, 43, 38], [2, 71, 8])
FED = ([5, 9], [53, 58], [23, 84], [62, 64])


@pytest.fixture(scope="module")
def model(synth_model):
    """The tiny qwen35moe with its fused kernels on (the default on a GPU; the CPU runs them in
    the interpreter)."""
    m = load_model(synth_model("qwen35moe", "Q4_K_M", skew=1.0), device=MODEL_DEVICE, dtype=MODEL_DTYPE)
    m.kernels = True
    return m


@contextlib.contextmanager
def torch_prompts(model) -> Iterator[None]:
    """On the CPU, prompts through the torch forms (the interpreter's prefill kernels cost a
    test minutes); the sequences compared are prompted alike either way."""
    model.kernels = MODEL_DEVICE == "cuda"
    try:
        yield
    finally:
        model.kernels = True


def prompted(model, prompts=PROMPTS) -> list:
    caches = []
    with torch_prompts(model):
        for p in prompts:
            caches.append(model.new_cache())
            model.forward(p, caches[-1], last_only=True)
    return caches


def test_batched_steps_are_each_sequence_alone(model) -> None:
    """``decode_batch`` over sets of sequences (three, then two in another order) against each
    sequence's single steps: the same logits bit for bit, the caches left alike."""
    prompts, fed = PROMPTS[:3], FED[:3]
    caches = prompted(model, prompts)
    want = [[model.forward([t], c)[0] for t in tokens] for c, tokens in zip(caches, fed)]
    caches = prompted(model, prompts)
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in ((0, 1, 2), (2, 0), (1,)):
        logits = model.decode_batch([fed[b][len(got[b])] for b in step], [caches[b] for b in step])
        for row, b in enumerate(step):
            got[b].append(logits[row])
    for b in range(len(prompts)):
        assert len(got[b]) == len(want[b])
        for x, y in zip(got[b], want[b]):
            assert torch.equal(x, y), b


@pytest.mark.slow
def test_verify_rows_and_every_rollback_are_the_single_steps(model) -> None:
    """A verify step of K rows (``Session.verify``: the states after each row copied in the
    launch) keeping k < K of them: its rows' logits, and the step after the rollback
    (``Session.keep``), are the single steps' bit for bit; ``decode_run`` (no copies) too."""
    prompt, run, after = list(PROMPTS[0]), [5, 9, 2], 53
    cache = prompted(model, [prompt])[0]
    want, nexts = [], []
    for t in run:
        want.append(model.forward([t], cache)[0])
        branch = copy.deepcopy(cache)  # the sequence keeping the run up to t, then ``after``
        nexts.append(model.forward([after], branch)[0])
    for k in range(1, len(run)):
        s = Session(model, graphs=False)
        with torch_prompts(model):
            s.feed(prompt)
        logits, _ = s.verify(run)
        assert s.row_states is not None
        for i in range(len(run)):
            assert torch.equal(logits[i], want[i]), (k, i)
        s.keep(k)
        assert torch.equal(s.feed(prompt + run[:k] + [after], GENERATED), nexts[k - 1]), k
    cache = prompted(model, [prompt])[0]
    for x, y in zip(model.decode_run(run, cache), want):
        assert torch.equal(x, y)


def deltanet_launches(monkeypatch) -> list[str]:
    """Every launch of a ``kernels/deltanet.py`` kernel from now on, by name."""
    launched: list[str] = []
    for name in dir(deltanet):
        fn = getattr(deltanet, name)
        if hasattr(fn, "run") and hasattr(fn, "fn"):  # a @triton.jit kernel (compiled or interpreted)
            run = fn.run

            def counted(*args, _run=run, _name=name, **kwargs):
                launched.append(_name)
                return _run(*args, **kwargs)

            monkeypatch.setattr(fn, "run", counted)
    return launched


def test_a_batched_step_launches_the_deltanet_kernels_once(model, monkeypatch) -> None:
    """The DeltaNet kernels of one ``decode_batch`` step launch as often for B = 1, 2 and 4
    sequences (once per layer each), and as a single step's: the rows share the launches."""
    launched = deltanet_launches(monkeypatch)
    counts = {}
    for B in (1, 2, 4):
        caches = prompted(model, PROMPTS[:B])
        launched.clear()
        model.decode_batch([FED[b][0] for b in range(B)], caches)
        counts[B] = sorted(launched)
    caches = prompted(model, PROMPTS[:1])
    launched.clear()
    model.forward([FED[0][0]], caches[0])
    linear = sum(la.attention == "linear" for la in model.spec.layers)
    assert linear > 0 and len(counts[1]) >= linear
    assert counts[1] == counts[2] == counts[4] == sorted(launched), counts


@pytest.mark.slow
def test_state_addresses_outlive_every_rewrite(model) -> None:
    """What a captured step relies on to be replayed rather than captured again (its device
    tables hold the states' addresses: ``graph.state_addresses``): a session's DeltaNet tensors
    keep their addresses through a new prompt that reuses a prefix (a checkpoint copied in), a
    verify that keeps fewer rows (a row's copy copied in), a state put back from a
    conversation's saved copy (``sequence_state.RecurrentRows``) and a reset."""
    s = Session(model, graphs=False)
    prompt = list(PROMPTS[0])

    def addresses() -> list[tuple[int, int]]:
        return [(la.conv.data_ptr(), la.ssm.data_ptr()) for la in s.cache.layers if isinstance(la, RecurrentState)]

    with torch_prompts(model):
        s.feed(prompt)
    s.feed(prompt + [5], GENERATED)
    before = addresses()
    with torch_prompts(model):
        s.feed(prompt[:3] + [9, 9])  # another prompt on the first three tokens: a checkpoint restored
    s.verify([6, 7])
    s.keep(1)
    for la in s.cache.layers:
        if isinstance(la, RecurrentState):
            RecurrentRows().put(la, [la.conv.cpu(), la.ssm.cpu()], s.cache.pos, la.ssm.device, la.conv.dtype)
    s.feed(prompt[:3] + [9, 9, 6, 1], GENERATED)
    s.reset()
    with torch_prompts(model):
        s.feed(prompt)
    s.feed(prompt + [5], GENERATED)
    assert addresses() == before


def test_a_step_finds_its_tables_made(model) -> None:
    """The DeltaNet tables are made once per content (``runtime.device_tables``): a batched step
    after the first over the same caches makes none (only the attention layers' positions)."""
    caches = prompted(model, PROMPTS[:2])
    model.decode_batch([1, 2], caches)
    made = device_tables.made()
    model.decode_batch([3, 4], caches)
    assert device_tables.made() == made + 1
