"""A batched decode step (``MoEModel.decode_batch``): each sequence's logits are bit for bit its
own single-sequence step's, whatever the other sequences, their number, order and lengths, on
every arch and at any residency. On the CPU the dense products and the plain experts run their
torch forms one row at a time (``runtime.decode_rows``), and the fused MoE kernels run under
Triton's interpreter; ``SPARKPACK_TEST_DEVICE=cuda`` runs the same tests compiled on a GPU, every
product through its kernel with the row axis."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from sparkpack.formats.archs import model_spec
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.runtime.batch_step import decode_together
from sparkpack.runtime.expert_source import GGUFExpertSource
from sparkpack.runtime.expert_store import ExpertStore
from sparkpack.runtime.generate import GENERATED, Session
from sparkpack.runtime.graph import BatchGraphs, capturable, kv_addresses
from sparkpack.runtime.models import StoreOptions, load_model
from tests.decode_steps import ARCHS, FED, PROMPTS, alone, assert_same, batched
from tests.marks import quick_first

DEVICE = os.environ.get("SPARKPACK_TEST_DEVICE", "cpu")
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # a GPU runs the runtime's dtype


@pytest.mark.parametrize("arch", quick_first(ARCHS))
@pytest.mark.parametrize("hot_fraction", quick_first([0.1, 0.6, 1.0]))
def test_batched_step_is_each_sequence_alone(synth_model, arch, hot_fraction):
    """Through the tiered store (async: misses copied into two cache slots, or read from the host
    when a step's union of misses does not fit)."""
    path = synth_model(arch, "Q4_K_M", skew=1.0)
    model = load_model(path, device=DEVICE, dtype=DTYPE, store=StoreOptions(hot_fraction=hot_fraction, miss_mode="async",
                                                               cache_slots=2))
    want = alone(model)
    before = model.experts.stats.tokens
    got = batched(model)
    assert_same(got, want)
    assert model.experts.stats.tokens - before == sum(len(p) for p in PROMPTS) + sum(len(f) for f in FED)


def test_batched_step_without_a_store(synth_model):
    """The plain providers (experts expanded one by one) give the same."""
    model = load_model(synth_model("laguna", "Q4_K_M", skew=1.0), device=DEVICE, dtype=DTYPE)
    assert_same(batched(model), alone(model))


@pytest.mark.skipif(DEVICE != "cuda", reason="a GPU runs the whole model on the fused kernels; under the "
                    "interpreter test_batch_kernels runs their batched MoE call (host pool included)")
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_moe_kernels_batched(synth_model, arch):
    """The fused MoE kernels serving a batch, 10% of the experts on the device and the rest read
    from the host pool in the kernel (zero-copy), every arch's whole model."""
    gguf = GGUFModel(synth_model(arch, "Q4_K_M", skew=1.0))
    spec = model_spec(gguf)
    hot = np.zeros((spec.n_layer, spec.n_expert), dtype=bool)
    hot[list(spec.moe_layers), :max(1, spec.n_expert // 10)] = True
    model = load_model(gguf, device=DEVICE, dtype=DTYPE)
    model.experts = model.store = ExpertStore(GGUFExpertSource(gguf, spec), spec, DEVICE, DTYPE, hot, 0, "zerocopy", fused=True)
    assert all(la.fused for la in model.experts.layers.values())
    prompts, fed = ([3, 14], [7], [46, 26, 43]), ([5, 9], [53, 58], [23])
    assert_same(batched(model, prompts, fed, ((0, 1, 2), (1, 0))), alone(model, prompts, fed))
    assert model.experts.stats.zero_copy_reads > 0


@pytest.mark.parametrize("arch", quick_first(ARCHS))
def test_a_run_of_tokens_is_its_single_steps(synth_model, arch):
    """``decode_run``: K consecutive tokens of one sequence in one batched step (a draft's
    verification, issue 47) give the K single steps' logits and leave the cache as they do (the
    next single step after it is the same too), at 10% residency."""
    model = load_model(synth_model(arch, "Q4_K_M", skew=1.0), device=DEVICE, dtype=DTYPE,
                       store=StoreOptions(hot_fraction=0.1, miss_mode="async", cache_slots=2))
    prompt, run, after = PROMPTS[0], FED[2], FED[0][0]
    one = model.new_cache()
    model.forward(prompt, one, last_only=True)
    want = [model.forward([t], one)[0] for t in [*run, after]]
    cache = model.new_cache()
    model.forward(prompt, cache, last_only=True)
    got = [*model.decode_run(run, cache), model.forward([after], cache)[0]]
    assert cache.pos == one.pos
    assert_same([got], [want])


# The captured batched step (``BatchGraphs``): eight fed tokens per sequence, sets that repeat
# (replays), another order, a set of two, a lone sequence; sequence 2 (11 prompt tokens) outgrows
# the KV buffers of a session with ``GRAPH_CTX`` positions at its sixth step (the set (1, 2), new),
# so the set (0, 1, 2) captures again after it.
GRAPH_FED = ([5, 9, 2, 6, 53, 58, 97, 93], [53, 58, 97, 93, 23, 84, 62, 64], [23, 84, 62, 64, 5, 9, 2, 6])
GRAPH_STEPS = ((0, 1, 2), (0, 1, 2), (0, 1, 2), (2, 0), (0, 1, 2), (1, 2), (0, 1, 2), (1,), (0, 1, 2))
GRAPH_CTX = 16


def sessions_of(model) -> list[Session]:
    """One session per prompt, the prompt fed (captured decode steps where the model allows)."""
    sessions = [Session(model, ctx=GRAPH_CTX) for _ in PROMPTS]
    for s, prompt in zip(sessions, PROMPTS):
        s.feed(list(prompt))
    return sessions


@pytest.mark.parametrize("arch", quick_first(ARCHS))
@pytest.mark.parametrize("hot_fraction", quick_first([0.1, 0.6, 1.0]))
def test_a_captured_batched_step_is_each_sessions_own_step(synth_model, arch, hot_fraction):
    """Each row of a ``BatchGraphs`` step is its session's own decode step bit for bit (on a GPU
    its captured ``DecodeGraph`` step; zero-copy store, every row's routings counted), through
    capture, replay, a set in another order, and capture again after a sequence's KV buffers
    grew; the sessions then go on alone with the same bits. The CPU runs the same step from the
    same ids buffer eagerly (``capture=False``, positions as ints: the device positions are the GPU's)."""
    cuda = DEVICE == "cuda"
    store = StoreOptions(hot_fraction=hot_fraction, cache_slots=4, miss_mode="zerocopy" if cuda else "async")
    model = load_model(synth_model(arch, "Q4_K_M", skew=1.0), device=DEVICE, dtype=DTYPE, store=store)
    if cuda and not capturable(model):
        pytest.skip("not every expert layer has fused-kernel quant types")
    alone = sessions_of(model)
    want = [[s.feed(s.fed + [t], GENERATED) for t in tokens] for s, tokens in zip(alone, GRAPH_FED)]
    if cuda:  # the reference is each session's captured step
        assert all(s.graph is not None and s.graph.replays > 0 for s in alone)
    sessions = sessions_of(model)
    graphs = BatchGraphs(model, capture=cuda)
    model.experts.flush()
    tokens0 = model.experts.stats.tokens
    got: list[list[torch.Tensor]] = [[] for _ in PROMPTS]
    before = [kv_addresses(s.cache) for s in sessions]
    for step in GRAPH_STEPS:
        logits = decode_together([sessions[b] for b in step], [GRAPH_FED[b][len(got[b])] for b in step], graphs)
        for row, b in enumerate(step):
            got[b].append(logits[row])
    assert [kv_addresses(s.cache) != a for s, a in zip(sessions, before)] == [False, False, True]
    for b, s in enumerate(sessions):
        got[b] += [s.feed(s.fed + [t], GENERATED) for t in GRAPH_FED[b][len(got[b]):]]
        assert s.fed == [*PROMPTS[b], *GRAPH_FED[b]]
    assert_same(got, want)
    model.experts.flush()
    assert model.experts.stats.tokens - tokens0 == sum(len(f) for f in GRAPH_FED)
    sets = {step for step in GRAPH_STEPS if len(step) > 1}
    if cuda:  # every set captured, (0, 1, 2) again after sequence 2 grew; the rest replayed
        assert graphs.captures == len(sets) + 1
        assert graphs.replays == sum(len(step) > 1 for step in GRAPH_STEPS) - graphs.captures
    else:
        assert graphs.captures == graphs.replays == 0 and len(graphs.graphs) == len(sets)


def test_one_cache_per_sequence(synth_model):
    model = load_model(synth_model("qwen3moe", "Q4_K_M", skew=1.0))
    cache = model.new_cache()
    with pytest.raises(ValueError, match="one distinct cache per sequence"):
        model.decode_batch([1, 2], [cache, cache])
    with pytest.raises(ValueError, match="one distinct cache per sequence"):
        model.decode_batch([1, 2], [cache])
    with pytest.raises(ValueError, match="one distinct cache per sequence"):
        BatchGraphs(model, capture=False).step([1, 2], [cache, cache])
