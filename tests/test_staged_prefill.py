"""Staged prefill (``runtime.expert_staging``): a long call's cold experts copied to the device
in one bulk copy per layer give the bits of every other residency; the plan reserves the two
staging buffers (and the longer calls staging makes) inside a ``--vram`` budget, and the store
allocates what it reserved.

On the CPU: the spans, the table remap, the staged bytes, one staged call through the fused
kernel (interpreted in CI, compiled with ``SPARKPACK_TEST_DEVICE=cuda``) and the planner. On the GPU machine (``SPARKPACK_TEST_DEVICE=cuda``): whole
models at 100/60/10% residency, calls below and above the threshold, and sessions that feed
long prompts in staged calls; skipped elsewhere."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from sparkpack.formats.archs import model_spec
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.memory import (GROUP_TOKENS, LONG_PAST_TOKENS, PREFILL_CHUNK, PREFILL_GRAPH_TOKENS, SLOT_ALIGN,
                                      MemoryTarget, expert_slot_bytes, group_bytes, runtime_bytes)
from sparkpack.formats.placement import Budget, default_cache_slots, plan_residency, staging_bytes
from sparkpack.runtime.expert_pools import layout_pool
from sparkpack.runtime.expert_slots import NOT_RESIDENT
from sparkpack.runtime.expert_staging import cold_spans, staged_row, staging_units
from sparkpack.runtime.expert_source import GGUFExpertSource
from sparkpack.runtime.expert_store import ExpertStore
from sparkpack.runtime.generate import Session
from sparkpack.runtime.models import SessionOptions, StoreOptions, load_model
from tests.marks import quick_first

DEVICE = os.environ.get("SPARKPACK_TEST_DEVICE", "cpu")
cuda = pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available(),
                          reason="needs CUDA (SPARKPACK_TEST_DEVICE=cuda)")


def hot_mask(spec, fraction: float) -> np.ndarray:
    """The first ``fraction`` of every MoE layer's experts hot (at least one)."""
    hot = np.zeros((spec.n_layer, spec.n_expert), dtype=bool)
    hot[list(spec.moe_layers), : max(1, int(fraction * spec.n_expert))] = True
    return hot


def opened(path: Path):
    gguf = GGUFModel(path)
    return gguf, model_spec(gguf)


# --- the parts, on the CPU ---------------------------------------------------------------------

def test_each_layers_cold_experts_are_one_span():
    """The host pool (sizes mixed across layers, the larger packed first) holds each layer's
    experts in one range and nothing else there; a layer with none has no span."""
    rng = np.random.default_rng(0)
    units = {0: 3, 1: 2, 2: 3, 4: 2}
    place = np.zeros((5, 8), dtype=bool)
    place[list(units)] = rng.random((4, 8)) < 0.5
    place[4] = False
    layout = layout_pool(place, units, SLOT_ALIGN, n_slots=2)
    spans = cold_spans(layout)
    assert sorted(spans) == [0, 1, 2]
    taken = set()
    for il, s in spans.items():
        at = layout.offset[il][place[il]]
        assert s.units == units[il] * int(place[il].sum())
        assert at.min() == s.first and at.max() + units[il] == s.first + s.units
        rng_units = set(range(s.first, s.first + s.units))
        assert not (rng_units & taken)
        taken |= rng_units
    assert staging_units(spans) == max(s.units for s in spans.values())
    assert max(s.first + s.units for s in spans.values()) <= layout.slots[0]  # spare slots come after


def test_staged_row_sends_host_entries_into_the_buffer():
    row = torch.tensor([5, -(10 + 1), NOT_RESIDENT, -(12 + 1), 0], dtype=torch.int32)
    assert staged_row(row, 10).tolist() == [5, -1, NOT_RESIDENT, -3, 0]


@pytest.mark.parametrize("arch, fraction", [("qwen35moe", 0.6), ("laguna", 0.1)])
def test_staged_bytes_are_the_bytes_each_expert_has_on_the_device(synth_model, arch, fraction):
    """Through the remapped row, every cold expert's bytes in a layer's staging buffer are its
    bytes in an all-hot store's device pool; consecutive staged layers take turns in the two
    buffers, and hot or cached experts keep their device slots."""
    gguf, spec = opened(synth_model(arch, "Q4_K_M", skew=1.0))
    ref = ExpertStore(GGUFExpertSource(gguf, spec), spec, DEVICE, torch.float32, hot_mask(spec, 1.0), fused=True)
    store = ExpertStore(GGUFExpertSource(gguf, spec), spec, DEVICE, torch.float32, hot_mask(spec, fraction), cache_slots=2,
                        mode="zerocopy", fused=True, stage_tokens=8)
    staging = store.staging
    assert staging is not None and staging.order == list(spec.moe_layers)
    assert store.staged_prefill(8) and not store.staged_prefill(7)
    for i, il in enumerate(spec.moe_layers):
        pools, row, new = staging.serve(il, store.tables.device[il])
        again = staging.serve(il, store.tables.device[il])  # the next call of a group: the same copy
        assert new and not again[2] and torch.equal(again[1], row)
        assert pools.host[0].data_ptr() == staging.buffers[i % 2].data_ptr() + store.layers[il].parts[0].offset
        table = store.tables.device[il]
        buf = staging.buffers[i % 2]
        nb = store.layers[il].nbytes
        for e in range(spec.n_expert):
            entry = int(row[e])
            if int(table[e]) >= 0:
                assert entry == int(table[e])
                continue
            h = -(entry + 1)
            assert torch.equal(buf[h * store.unit: h * store.unit + nb], ref.device_bytes(il, e))
        staging.done(il)
    assert staging.ahead is None  # the last layer issues nothing ahead
    assert staging.nbytes == staging_bytes(store.hot, expert_slot_bytes(spec, gguf.tensors))


@pytest.mark.slow
def test_a_staged_call_through_the_fused_kernel_gives_the_same_bits(synth_model):
    """Two MoE layers (two buffers, the second copied ahead) through the Triton kernel
    (interpreted): a call of ``stage_tokens`` tokens stages, a shorter one reads zero-copy, and
    both give the all-hot store's bits at 60% and 10% residency. The staged call's cold experts
    are counted as staged bytes, not as zero-copy reads."""
    gguf, spec = opened(synth_model("qwen35moe", "Q4_K_M", skew=1.0))
    layers = list(spec.moe_layers)[:2]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, spec.n_embd, generator=g).to(DEVICE)
    ids = torch.stack([torch.randperm(spec.n_expert, generator=g)[: spec.n_expert_used] for _ in range(2)]).to(DEVICE)
    w = torch.rand(2, spec.n_expert_used, generator=g).to(DEVICE)

    def run(store: ExpertStore, n: int) -> torch.Tensor:
        return torch.stack([store.moe(il, x[:n], w[:n], ids[:n]) for il in layers])

    ref = ExpertStore(GGUFExpertSource(gguf, spec), spec, DEVICE, torch.float32, hot_mask(spec, 1.0), mode="zerocopy",
                      fused=True, stage_tokens=2)
    assert ref.staging is None  # nothing cold: nothing to stage
    want = {n: run(ref, n) for n in (2, 1)}
    for fraction in (0.6, 0.1):
        store = ExpertStore(GGUFExpertSource(gguf, spec), spec, DEVICE, torch.float32, hot_mask(spec, fraction),
                            mode="zerocopy", fused=True, stage_tokens=2)
        assert torch.equal(run(store, 2), want[2])
        store.end_step(2)
        s = store.stats
        assert s.staged_layers == 2 and s.staged_bytes == sum(store.staging.span_bytes(il) for il in layers)
        assert s.zero_copy_reads == 0 and s.misses > 0 and s.bytes_streamed == s.staged_bytes
        assert torch.equal(run(store, 1), want[1])  # below the threshold: zero-copy
        store.end_step(1)
        assert store.stats.staged_layers == 2 and store.stats.zero_copy_reads > 0


def test_sessions_stage_where_the_store_does(synth_model, monkeypatch):
    """Sessions stage where the store does (not with staging off or a threshold above their
    calls). Sessions that feed prompts in short captured calls (all-attention models on a GPU,
    taken as given here) keep those 512-token calls over a staging store: their bits must be the
    all-GPU session's, which come from those calls. (Nothing is computed.)"""
    from sparkpack.runtime import call_plan

    path = synth_model("laguna", "Q4_K_M", skew=1.0)
    gguf, spec = opened(path)
    model = load_model(gguf)
    for short in (True, False):
        monkeypatch.setattr(call_plan, "feeds_short_calls", lambda model, cache, short=short: short)
        for stage_tokens, chunk, staged in ((1024, 2048, True), (256, 2048, True), (None, 2048, False), (4096, 2048, False)):
            model.experts = model.store = ExpertStore(GGUFExpertSource(gguf, spec), spec, "cpu", torch.float32,
                                                      hot_mask(spec, 0.6), mode="zerocopy", fused=True,
                                                      stage_tokens=stage_tokens)
            session = Session(model, prefill_chunk=chunk)
            assert session.plan.call_tokens == (512 if short else chunk)
            assert session.plan.staged == (staged and (stage_tokens or 0) <= session.plan.call_tokens)


@pytest.mark.slow
def test_calls_after_a_long_past_take_a_whole_chunk(synth_model, monkeypatch):
    """Sessions of short captured calls (taken as given here, with a long past of 1024 tokens)
    end their calls every 512 tokens up to the long past and every ``prefill_chunk`` after it;
    the plan counts those calls' temporaries where the context reaches past it. A prompt that
    extends one beyond the long past keeps its calls and gives a fresh session's bits."""
    from sparkpack.runtime import call_plan

    path = synth_model("laguna", "Q4_K_M", skew=1.0)
    gguf, spec = opened(path)
    monkeypatch.setattr(call_plan, "feeds_short_calls", lambda model, cache: True)
    monkeypatch.setattr(call_plan, "LONG_PAST_TOKENS", 1024)
    model = load_model(gguf)
    ids = prompt(1024 + 2 * 640 + 100, spec.n_vocab, seed=4)
    session = Session(model, prefill_chunk=640, ctx=4096)
    assert [session.plan.call_tokens_at(p) for p in (0, 512, 1023, 1024, 1664)] == [512, 512, 512, 640, 640]
    assert session.plan.longest_call == 640
    session.feed(ids[:1024 + 700])
    assert session.reuse.cuts == [0, 512, 1024, 1664] and session.reuse.exact == 1664
    logits = session.prompt(ids)  # the next request: keeps the whole calls
    assert session.reused == 1664 and session.reuse.cuts == [0, 512, 1024, 1664, 2304] and session.reuse.exact == 2304
    fresh = Session(model, prefill_chunk=640, ctx=4096)
    assert torch.equal(fresh.feed(ids), logits)
    # the plan: 512-token calls up to a context of LONG_PAST_TOKENS, whole chunks beyond
    for ctx, chunk in ((LONG_PAST_TOKENS, PREFILL_GRAPH_TOKENS), (LONG_PAST_TOKENS + 1, PREFILL_CHUNK)):
        assert MemoryTarget.gpu(spec, ctx=ctx).prefill_chunk == chunk
    assert MemoryTarget.gpu(spec, ctx=LONG_PAST_TOKENS + 1, kv_type="q8_0").prefill_chunk == PREFILL_CHUNK


@pytest.mark.slow
def test_a_staged_groups_deferred_counts_are_no_zero_copy_reads(synth_model):
    """A group's routings learned a step later (``end_step(defer=True)``, as a replayed group's
    are) count as staged, like those learned at once: its cold experts were copied in bulk, and
    counted so, not read zero-copy."""
    gguf, spec = opened(synth_model("qwen35moe", "Q4_K_M", skew=1.0))
    hot = hot_mask(spec, 0.5)
    cold = [int(np.flatnonzero(~hot[il])[0]) for il in range(spec.n_layer)]
    x = torch.randn(2, spec.n_embd, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    weights = torch.full((2, 1), 1.0, device=DEVICE)
    stats = []
    for defer in (False, True):
        store = ExpertStore(GGUFExpertSource(gguf, spec), spec, DEVICE, torch.float32, hot, mode="zerocopy", fused=True,
                            stage_tokens=2)
        store.stage_calls(2)
        for il in spec.moe_layers:
            store.moe(il, x, weights, torch.full((2, 1), cold[il], dtype=torch.long, device=DEVICE))
        store.stage_calls(None)
        store.end_step(2, routed=True, defer=defer)
        store.flush()
        stats.append(store.stats)
    for st in stats:
        assert st.misses == 2 * len(spec.moe_layers) and st.zero_copy_reads == 0
        assert st.staged_layers == len(spec.moe_layers) and st.bytes_streamed == st.staged_bytes


@pytest.mark.parametrize("arch", quick_first(["qwen35moe", "laguna", "qwen3moe"]))
def test_a_group_of_calls_gives_the_bits_of_its_calls_one_by_one(synth_model, arch, tmp_path):
    """A staging session runs a prompt's calls layer by layer in groups (``forward_calls``): its
    logits are those of the calls one by one bit for bit, its DeltaNet state copies (taken layer
    by layer) let the next turn keep the same prefix and still give a fresh session's bits, and
    its routing trace is the calls' one by one. The grouping, not the staging, is what is tested
    here: on the CPU a whole model through the interpreted fused kernel takes minutes, so the
    zero-copy store computes experts one by one and is told that it stages (the staging buffer
    shared by a group: test_staged_bytes_are_the_bytes_each_expert_has_on_the_device; whole
    models staged in groups on the GPU: test_a_staged_session_gives_the_all_gpu_sessions_bits)."""
    from sparkpack.calibrate.trace import read_trace
    from sparkpack.runtime.routing_trace import attach_trace

    gguf, spec = opened(synth_model(arch, "Q4_K_M", skew=1.0))
    chunk, breaks = 16, frozenset({7})

    def session(grouped: bool, trace: str) -> Session:
        model = load_model(gguf)
        store = ExpertStore(GGUFExpertSource(gguf, spec), spec, "cpu", torch.float32, hot_mask(spec, 0.5), mode="zerocopy")
        if grouped:
            store.staged_prefill = lambda n_tokens: n_tokens >= 2
        model.experts = model.store = store
        attach_trace(model, tmp_path / trace).active = True
        return Session(model, prefill_chunk=chunk, ctx=128, breaks=breaks)

    one_by_one, grouped = session(False, "a.trace"), session(True, "b.trace")
    assert grouped.plan.staged and not one_by_one.plan.staged and grouped.plan.group_tokens == 128
    turn1 = [t if t != 7 else 8 for t in prompt(70, 200, seed=4)]
    turn1[30] = 7  # a call ends before it (a break 14 tokens into the second call)
    turn2 = turn1[:60] + prompt(25, 200, seed=5)
    calls = []
    forward_calls = grouped.model.forward_calls
    grouped.model.forward_calls = lambda c, *a: calls.append(len(c)) or forward_calls(c, *a)
    assert torch.equal(one_by_one.feed(turn1), grouped.feed(turn1))
    assert calls == [5]  # [0, 16) [16, 30) [30, 46) [46, 62) [62, 70): one group
    assert grouped.reuse.cuts == one_by_one.reuse.cuts == [0, 16, 30, 46, 62]
    assert grouped.reuse.exact == one_by_one.reuse.exact == 62
    if arch == "qwen35moe":
        assert grouped.reuse.checkpoints.positions == one_by_one.reuse.checkpoints.positions == [16, 30, 46, 62]
    want2, got2 = one_by_one.prompt(turn2), grouped.prompt(turn2)
    reused = 46  # the last call end before the first new token (and, qwen35moe, its state copy)
    assert grouped.reused == one_by_one.reused == reused and torch.equal(want2, got2)
    assert calls == [5, 3]  # [46, 62) [62, 78) [78, 85)
    assert torch.equal(session(False, "c.trace").feed(turn2), got2)
    if arch == "qwen35moe":  # a group interrupted halfway keeps no half-copied state
        kept = list(grouped.reuse.checkpoints.positions)

        def interrupted(c, cache, after):
            def stop(i: int, il: int) -> None:
                after(i, il)
                if (i, il) == (1, 1):
                    raise KeyboardInterrupt
            return forward_calls(c, cache, stop)

        grouped.model.forward_calls = interrupted
        with pytest.raises(KeyboardInterrupt):
            grouped.prompt(turn2 + prompt(40, 200, seed=6))
        assert grouped.reuse.checkpoints.positions == kept
    a, b = (read_trace(s.model.experts.recorder.close()) for s in (one_by_one, grouped))
    assert np.array_equal(a.ids, b.ids) and a.n_tokens == 70 + 85 - reused


# --- the plan ------------------------------------------------------------------------------

def test_the_plan_reserves_staging_until_it_fits(synth_model):
    """Under ``--vram`` the buffers' size follows the hot set and the hot set what they leave:
    the plan reserves the buffers of its own hot set, and the whole fits the budget. Without
    room for them, or without the host RAM to hold the cold experts, or with staging off, the
    plan is the one without staging."""
    gguf, spec = opened(synth_model("qwen35moe", "Q4_K_M", skew=1.0))
    sizes = expert_slot_bytes(spec, gguf.tensors)
    target = MemoryTarget.gpu(spec, 512)
    off = MemoryTarget.gpu(spec, 512, stage_tokens=None)
    assert target.staged_chunk == PREFILL_CHUNK and off.staged_chunk == 0
    full = plan_residency(spec, gguf.tensors, Budget(vram=2**40), target)
    assert full.staging_bytes == 0  # all hot
    fixed = full.dense_bytes + full.kv_bytes + full.state_bytes + full.overhead_bytes \
        + default_cache_slots(spec) * full.cache_slot_bytes

    def used(p) -> int:
        return p.dense_bytes + p.kv_bytes + p.state_bytes + p.overhead_bytes + p.cache_bytes + p.hot_bytes + p.staging_bytes

    vram = fixed + full.hot_bytes * 3 // 4
    plan = plan_residency(spec, gguf.tensors, Budget(vram=vram), target)
    unstaged = plan_residency(spec, gguf.tensors, Budget(vram=vram), off)
    assert plan.staging_bytes == staging_bytes(plan.hot, sizes) > 0 and unstaged.staging_bytes == 0
    assert used(plan) <= vram and plan.hot_bytes + plan.staging_bytes <= vram - fixed
    assert plan.expert_budget + plan.staging_bytes <= unstaged.expert_budget
    assert 0 < plan.hot.sum() < unstaged.hot.sum()
    assert plan.overhead_bytes == unstaged.overhead_bytes  # (qwen35moe's calls are that long anyway)
    cold = sum(int((~plan.hot[il]).sum()) * nb for il, nb in sizes.items())
    small_host = plan_residency(spec, gguf.tensors, Budget(vram=vram),
                                MemoryTarget(2, True, "auto", 512, PREFILL_CHUNK, PREFILL_CHUNK, cold // 2))
    assert small_host.staging_bytes == 0 and np.array_equal(small_host.hot, unstaged.hot)
    fraction = plan_residency(spec, gguf.tensors, Budget(hot_fraction=0.5), target)  # no budget to fit: reported
    assert fraction.staging_bytes == staging_bytes(fraction.hot, sizes) > 0


def test_no_room_for_staging_keeps_the_unstaged_plan(synth_model):
    gguf, spec = opened(synth_model("qwen35moe", "Q4_K_M", skew=1.0))
    sizes = expert_slot_bytes(spec, gguf.tensors)
    target, off = MemoryTarget.gpu(spec, 512), MemoryTarget.gpu(spec, 512, stage_tokens=None)
    full = plan_residency(spec, gguf.tensors, Budget(vram=2**40), target)
    fixed = full.dense_bytes + full.kv_bytes + full.state_bytes + full.overhead_bytes \
        + default_cache_slots(spec) * full.cache_slot_bytes
    vram = fixed + sum(sizes.values())  # one expert a layer: no room for two buffers
    plan, unstaged = (plan_residency(spec, gguf.tensors, Budget(vram=vram), t) for t in (target, off))
    assert plan.staging_bytes == 0 and np.array_equal(plan.hot, unstaged.hot) and plan.hot.any()


def header_only(path: Path, arch: str, preset: str, monkeypatch) -> Path:
    """A full-size synthetic GGUF's header over a sparse file: the planner reads no weights."""
    from sparkpack.repack.synth import write_synthetic, writer

    with monkeypatch.context() as m:
        m.setattr(writer, "write_data", lambda *a, **k: None)
        return write_synthetic(path, arch, preset, "Q4_K_M")


@pytest.mark.parametrize("arch, preset", [("qwen35moe", "qwen3.6-35b-a3b"), ("laguna", "laguna-xs2"),
                                          ("qwen3moe", "qwen3-30b-a3b")])
def test_a_full_size_plan_at_14gib_stages_within_the_budget(tmp_path, monkeypatch, arch, preset):
    """At the shapes users run, a 14 GiB plan holds the two buffers, and the buffers are those of
    its own hot set; its runtime share counts the calls' temporaries (the all-attention models'
    captured 512-token calls, which they keep when staging) and the rows a group of staged calls
    holds."""
    gguf, spec = opened(header_only(tmp_path / "m.gguf", arch, preset, monkeypatch))
    sizes = expert_slot_bytes(spec, gguf.tensors)
    vram = 14 * 1024**3
    target = MemoryTarget.gpu(spec, 4096)
    chunk = PREFILL_CHUNK if arch == "qwen35moe" else PREFILL_GRAPH_TOKENS
    assert target.prefill_chunk == target.staged_chunk == chunk
    plan = plan_residency(spec, gguf.tensors, Budget(vram=vram), target)
    assert 0 < plan.hot.sum() < len(sizes) * spec.n_expert
    assert plan.staging_bytes == staging_bytes(plan.hot, sizes) > 0
    rows = group_bytes(spec, 4096, chunk)
    assert rows == (4096 - chunk) * spec.n_embd * 2  # a group of a 4096-token context: the other calls' rows
    assert plan.overhead_bytes == runtime_bytes(spec, 4096, chunk) + rows
    assert plan.dense_bytes + plan.kv_bytes + plan.state_bytes + plan.overhead_bytes + plan.cache_bytes \
        + plan.hot_bytes + plan.staging_bytes <= vram
    unstaged = plan_residency(spec, gguf.tensors, Budget(vram=vram), MemoryTarget.gpu(spec, 4096, stage_tokens=None))
    assert unstaged.hot_bytes > plan.hot_bytes  # what staging costs in hot experts
    assert unstaged.overhead_bytes == runtime_bytes(spec, 4096, chunk)


# --- whole models on the GPU ---------------------------------------------------------------

ARCHS = ["qwen35moe", "qwen3moe", "laguna"]


def gpu_model(path: Path, fraction: float, stage_tokens: int | None, **session):
    """``session``: ``SessionOptions``' fields (context, prompt calls) the plan is made for."""
    model = load_model(path, device="cuda", dtype=torch.bfloat16,
                       store=StoreOptions(hot_fraction=fraction, miss_mode="zerocopy", stage_tokens=stage_tokens),
                       session=SessionOptions(**session))
    if not model.store.fused_all:  # tiny shapes may give a layer a quant type without a fused kernel
        pytest.skip("not every expert layer has fused-kernel quant types")
    return model


def prompt(n: int, n_vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, n_vocab, (n,), generator=g).tolist()


def forward_calls(model, ids: list[int], calls: list[int], last_only: bool = False) -> list[torch.Tensor]:
    """The logits of each eager call of ``calls`` tokens, one after another into one cache
    (``last_only``: of its last token alone, as a session computes them)."""
    cache, out, at = model.new_cache(sum(calls) + 8), [], 0
    for n in calls:
        out.append(model.forward(ids[at: at + n], cache, last_only=last_only))
        at += n
    return out


@cuda
@pytest.mark.parametrize("fraction", [1.0, 0.6, 0.1])
def test_staged_calls_give_the_all_gpu_bits(synth_model, fraction):
    """Calls below the threshold (zero-copy), above it (staged) and below again into one cache:
    every call's logits are the all-GPU store's, and the zero-copy store's at that residency."""
    path = synth_model("qwen35moe", "Q4_K_M", skew=1.0)
    calls = [40, 300, 20, 100]
    ids = prompt(sum(calls), 2000)
    want = forward_calls(gpu_model(path, 1.0, None), ids, calls)
    zero_copy = forward_calls(gpu_model(path, fraction, None), ids, calls)
    model = gpu_model(path, fraction, 64)
    store = model.experts
    assert (store.staging is None) == (fraction == 1.0)
    got = forward_calls(model, ids, calls)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and all(torch.equal(a, b) for a, b in zip(zero_copy, want))
    store.flush()
    s = store.stats
    if fraction < 1.0:
        n_staged = len(store.staging.order)
        assert s.staged_layers == 2 * n_staged  # the 300- and 100-token calls
        assert s.staged_bytes == 2 * sum(store.staging.span_bytes(il) for il in store.staging.order)
        assert s.zero_copy_reads > 0  # the 40- and 20-token calls
    else:
        assert s.staged_layers == s.staged_bytes == s.bytes_streamed == 0


@cuda
@pytest.mark.parametrize("arch", ARCHS)
def test_a_staged_session_gives_the_all_gpu_sessions_bits(synth_model, arch):
    """A session over a staging store gives what a session over the all-GPU store gives, logits
    and tokens: qwen35moe's long eager calls, and the all-attention models' 512-token calls
    padded as their all-GPU sessions capture them, run eagerly in one group, which copies each
    layer's cold experts once."""
    path = synth_model(arch, "Q4_K_M", skew=1.0)
    chunk = 640
    ids = prompt(2 * chunk, 2000, seed=1)
    model = gpu_model(path, 0.6, 256, prefill_chunk=chunk, ctx=4 * chunk)
    session = Session(model, prefill_chunk=chunk, ctx=4 * chunk)
    long_calls = arch == "qwen35moe"
    assert session.plan.staged and session.plan.call_tokens == (chunk if long_calls else 512)
    assert (session.prefill is None) == long_calls and session.plan.group_tokens == 4 * chunk
    session.warm_up()
    calls = []
    forward_calls = model.forward_calls
    model.forward_calls = lambda c, *a: calls.append(len(c)) or forward_calls(c, *a)
    logits = session.feed(ids)
    model.experts.flush()
    assert calls == [2 if long_calls else 3]  # 640 + 640, or 512 + 512 + 256 (padded: 256)
    assert model.experts.stats.staged_layers == len(model.experts.staging.order)
    tokens = list(session.decode(logits, 8, torch.argmax))
    full = gpu_model(path, 1.0, None, prefill_chunk=chunk, ctx=4 * chunk)
    ref = Session(full, prefill_chunk=chunk, ctx=4 * chunk)
    assert not ref.plan.staged and ref.plan.call_tokens == session.plan.call_tokens
    ref_logits = ref.feed(ids)
    assert torch.equal(ref_logits, logits) and list(ref.decode(ref_logits, 8, torch.argmax)) == tokens


@cuda
@pytest.mark.parametrize("arch", ["laguna", "qwen3moe"])
def test_eager_calls_after_a_long_past_give_the_all_gpu_bits(synth_model, arch, monkeypatch):
    """After a long past (1024 tokens here) the all-attention models' sessions feed whole chunks
    eagerly (fused attention over the past) between their captured calls; a staging store runs
    them in groups of their own: a prompt, its reply and the next request (prefix reuse across
    the switch) give the all-GPU session's bits, warmed up both, and the next request a fresh
    session's."""
    from sparkpack.runtime import call_plan

    monkeypatch.setattr(call_plan, "LONG_PAST_TOKENS", 1024)
    path = synth_model(arch, "Q4_K_M", skew=1.0)
    chunk, ctx = 640, 4096
    ids = prompt(1024 + 2 * chunk + 300, 2000, seed=5)
    more = ids + prompt(200, 2000, seed=6)

    def run(model) -> tuple[list[torch.Tensor], list[int], list[int], Session]:
        s = Session(model, prefill_chunk=chunk, ctx=ctx)
        assert s.plan.long_past == 1024 and s.prefill is not None
        s.warm_up()
        groups = []
        forward_calls = model.forward_calls
        model.forward_calls = lambda c, *a: groups.append(len(c)) or forward_calls(c, *a)
        logits = [s.feed(ids)]
        tokens = list(s.decode(logits[0], 6, torch.argmax))
        logits.append(s.prompt(more))
        assert s.reused == 1024 + 2 * chunk
        return logits, tokens, groups, s

    got, tokens, groups, s = run(gpu_model(path, 0.6, 32, prefill_chunk=chunk, ctx=ctx))
    assert s.plan.staged and groups[:3] == [2, 2, 1]  # 512 + 512 padded, 640 + 640 eager, 300 padded
    want, want_tokens, ref_groups, ref = run(gpu_model(path, 1.0, None, prefill_chunk=chunk, ctx=ctx))
    assert not ref.plan.staged and not ref_groups
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and tokens == want_tokens
    fresh = Session(ref.model, prefill_chunk=chunk, ctx=ctx)
    assert torch.equal(fresh.feed(more), want[1])


@cuda
@pytest.mark.parametrize("arch", ["laguna", "qwen3moe"])
def test_a_whole_group_replays_its_graph_with_the_all_gpu_bits(synth_model, arch, tmp_path):
    """On the all-attention models a group of whole 512-token calls is captured in a CUDA graph,
    its staging copies included, and replayed (eager 512-token calls are launch-bound): the first
    whole group captures, the next ones replay, and every prompt and its reply give the all-GPU
    session's bits; each replay counts its copies, and the routing trace is the all-GPU one."""
    from sparkpack.calibrate.trace import read_trace
    from sparkpack.runtime.routing_trace import attach_trace

    path = synth_model(arch, "Q4_K_M", skew=1.0)
    ctx = GROUP_TOKENS + 1024  # groups of 16 whole calls
    prompts = [prompt(GROUP_TOKENS + 300, 2000, seed=2), prompt(GROUP_TOKENS + 100, 2000, seed=3)]

    def run(model, trace: str) -> tuple[list[torch.Tensor], list[int], Session]:
        attach_trace(model, tmp_path / trace).active = True
        s = Session(model, ctx=ctx)
        logits, tokens = [], []
        for ids in prompts:
            s.reset()
            logits.append(s.feed(ids))
            tokens += list(s.decode(logits[-1], 6, torch.argmax))
        return logits, tokens, s

    model = gpu_model(path, 0.6, 32, ctx=ctx)
    got, tokens, s = run(model, "staged.trace")
    assert s.plan.group_tokens == GROUP_TOKENS and list(s.prefill.groups) == [16]  # captured at its first use
    model.experts.flush()
    assert model.experts.stats.staged_layers == 4 * len(model.experts.staging.order)  # 2 groups a prompt
    full = gpu_model(path, 1.0, None, ctx=ctx)
    want, want_tokens, ref = run(full, "all.trace")
    assert not ref.plan.staged and not ref.prefill.groups
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and tokens == want_tokens
    a, b = (read_trace(m.experts.recorder.close()) for m in (model, full))
    assert np.array_equal(a.ids, b.ids) and a.n_tokens == sum(len(p) + 6 for p in prompts) - 2


@cuda
def test_a_vram_budget_allocates_the_planned_staging(synth_model):
    """``--vram`` on the GPU: the store allocates the buffers the plan reserved, and describes them."""
    path = synth_model("qwen35moe", "Q4_K_M", skew=1.0)
    gguf, spec = opened(path)
    full = plan_residency(spec, gguf.tensors, Budget(vram=2**40), MemoryTarget.gpu(spec, 512))
    fixed = full.dense_bytes + full.kv_bytes + full.state_bytes + full.overhead_bytes \
        + default_cache_slots(spec) * full.cache_slot_bytes
    model = load_model(path, device="cuda", dtype=torch.bfloat16,
                       store=StoreOptions(vram=fixed + full.hot_bytes * 3 // 4), session=SessionOptions(ctx=512))
    plan, store = model.residency, model.store
    if not store.fused_all:
        pytest.skip("not every expert layer has fused-kernel quant types")
    assert plan.staging_bytes > 0 and store.staging is not None and store.staging.nbytes == plan.staging_bytes
    d = store.describe()
    assert d["staging_bytes"] == plan.staging_bytes and d["stage_tokens"] == StoreOptions().stage_tokens


@pytest.mark.slow
def test_re_placement_keeps_a_staging_stores_layer_ranges(synth_model):
    """Live re-placement on a store that stages: the swaps stay within each layer (a swap across
    layers would leave a layer's cold experts outside the host range its staged copy takes, and
    is refused), and a staged call after them gives the bits it gave before."""
    from sparkpack.formats.placement import Swaps, plan_swaps_in_place

    gguf, spec = opened(synth_model("qwen35moe", "Q4_K_M", skew=1.0))
    store = ExpertStore(GGUFExpertSource(gguf, spec), spec, DEVICE, torch.float32, hot_mask(spec, 0.5), cache_slots=2,
                        mode="zerocopy", fused=True, stage_tokens=2)
    layers = list(spec.moe_layers)
    x = torch.randn(6, spec.n_embd, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ids = torch.stack([torch.randperm(spec.n_expert, generator=torch.Generator().manual_seed(t))[: spec.n_expert_used]
                       for t in range(6)]).to(DEVICE)
    weights = torch.full(ids.shape, 1.0 / spec.n_expert_used, device=DEVICE)

    def staged_outputs() -> list[torch.Tensor]:
        assert store.staged_prefill(6)
        out = [store.moe(layer, x, weights, ids) for layer in layers]
        store.end_step(6)
        return out

    before = staged_outputs()
    hot0 = store.hot.copy()
    scores = np.random.default_rng(0).random(hot0.shape)
    scores[~hot0] += 1.0  # traffic moved to the cold experts: many swaps wanted
    units = store.device_layout.units
    across = plan_swaps_in_place(store.hot, scores, units)
    pair = next((p, d) for p, d in zip(across.promote, across.demote) if p[0] != d[0])  # a non-staging store's
    with pytest.raises(ValueError, match="within a layer"):
        store.apply_swaps(Swaps([pair[0]], [pair[1]], 0.0))
    assert (store.hot == hot0).all()  # refused before anything moved
    within = plan_swaps_in_place(store.hot, scores, units, across_layers=False)
    assert within and all(p[0] == d[0] for p, d in zip(within.promote, within.demote))
    store.apply_swaps(within)
    assert (store.hot != hot0).any() and (store.hot.sum(axis=1) == hot0.sum(axis=1)).all()
    for a, b in zip(staged_outputs(), before):
        assert torch.equal(a, b)
