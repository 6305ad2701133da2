"""The tiered expert store: residency changes speed, never results; bad shards and small budgets
fail clearly. On CPU the store runs its full bookkeeping over CPU tensors (CI); the fused-kernel
path runs under the Triton interpreter on a few decode steps."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.naive_store import NaiveStore
from sparkpack.formats.sparkpack import Pack
from sparkpack.runtime.expert_pools import DiskTier, HostPool
from sparkpack.runtime.expert_source import GGUFExpertSource
from sparkpack.runtime.expert_store import ExpertStore
from sparkpack.runtime.generate import Session, generate
from sparkpack.runtime.models import StoreOptions, load_model, plan_store
from tests.marks import quick_first

REPO = Path(__file__).resolve().parents[1]
IDS = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]
# CI runs the fused-kernel test interpreted on the CPU; on the GPU machine SPARKPACK_TEST_DEVICE=cuda
# runs it compiled, the zero-copy tier then being real pinned host memory read over PCIe.
DEVICE = os.environ.get("SPARKPACK_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def model_path(synth_model) -> Path:
    # Q4_K_M: K-quant experts (the fused kernel's types) with Q5_0/Q8_0 fallbacks, skewed routing.
    return synth_model("qwen35moe", "Q4_K_M", skew=1.0)


@pytest.fixture(scope="module")
def reference(model_path):
    """The plain forward (experts expanded one by one, no store): full-sequence logits, logits of
    each decode step, and a greedy continuation."""
    model = load_model(model_path)
    return model.forward(IDS), decode_steps(model), list(generate(model, None, IDS[:4], None, 12, stop_ids=()))


def decode_steps(model) -> torch.Tensor:
    session = Session(model)
    return torch.stack([session.feed(IDS[: i + 1]) for i in range(len(IDS))])


def run_cli(args: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600, **kw)


def load_with_store(model_path, mode: str, **opts):
    """The model with its tiered store in ``mode``, or ("naive") the benchmarks' baseline store
    (bench/naive_store.py) planned the same way."""
    if mode != "naive":
        return load_model(model_path, store=StoreOptions(miss_mode=mode, **opts))
    model = load_model(model_path, store=StoreOptions(miss_mode="async", **opts))
    src, plan = plan_store(model.gguf, None, model.spec, model.device, model.dtype, StoreOptions(miss_mode="async", **opts))
    model.experts = model.store = NaiveStore(src, model.spec, model.device, model.dtype, plan.hot, plan.cache_slots)
    return model


@pytest.mark.parametrize("mode", ["naive", "async", "zerocopy"])
@pytest.mark.parametrize("hot_fraction", quick_first([0.1, 0.6, 1.0]))
@pytest.mark.parametrize("cache_slots", quick_first([6, 0]))
def test_any_residency_gives_identical_outputs(model_path, reference, mode, hot_fraction, cache_slots):
    full, steps, greedy = reference
    model = load_with_store(model_path, mode, hot_fraction=hot_fraction, cache_slots=cache_slots)
    store = model.experts
    assert isinstance(store, ExpertStore) and store.mode == ("async" if mode == "naive" else mode)
    assert isinstance(store, NaiveStore) == (mode == "naive")
    assert torch.equal(model.forward(IDS), full)
    assert torch.equal(decode_steps(model), steps)
    assert list(generate(model, None, IDS[:4], None, 12, stop_ids=())) == greedy
    # an all-hot zero-copy store leaves the counts on the device between tokens (nothing can
    # move): flushing reads them, and they are whole
    assert (store.counts.unread > 0) == (hot_fraction == 1.0 and mode == "zerocopy")
    before = store.stats.tokens
    store.flush()
    s = store.stats
    assert store.counts.unread == 0 and not bool(store.counts.step.any())
    assert (s.tokens > before) == (hot_fraction == 1.0 and mode == "zerocopy")  # reading alone learns nothing
    routings = s.hot_hits + s.cache_hits + s.misses
    assert routings == s.tokens * model.spec.n_expert_used * len(model.spec.moe_layers)
    # the forward, the decode steps, generate's prompt, and 11 steps for 12 tokens (the last is not fed)
    assert s.tokens == 2 * len(IDS) + 4 + 11
    if hot_fraction == 1.0:
        assert s.misses == 0 and s.bytes_streamed == 0
    else:
        assert s.misses > 0 and s.bytes_streamed > 0
    if cache_slots and hot_fraction < 1.0:
        assert s.cache_hits > 0 and s.loads > 0  # repeats were served from cache slots
    if not cache_slots:
        assert s.cache_hits == 0


def test_all_hot_store_counts_when_flushed(model_path):
    """An all-hot zero-copy store reads no counts between tokens; resetting its stats drops the
    counts not read yet, so the new stats hold only what came after."""
    model = load_model(model_path, store=StoreOptions(hot_fraction=1.0, miss_mode="zerocopy"))
    store = model.experts
    assert store.all_hot
    session = Session(model)
    session.feed(IDS[:6])
    assert store.counts.unread == 6
    store.reset_stats()
    assert store.counts.unread == 0 and not bool(store.counts.step.any())
    session.feed(IDS[:7])
    session.feed(IDS[:8])
    assert store.stats.tokens == 0  # not flushed yet: the counts are still on the device
    store.flush()
    s = store.stats
    assert s.tokens == 2 and s.hot_hits == 2 * model.spec.n_expert_used * len(model.spec.moe_layers)


@pytest.mark.slow
def test_fused_kernel_path_is_residency_independent(model_path):
    """Decode steps through the Triton MoE kernel (interpreted on CPU): all experts in the device
    pool vs 10% there and the rest read from the host pool (zero-copy) or copied into the cache."""
    from sparkpack.formats.archs import model_spec
    from sparkpack.formats.gguf_file import GGUFModel

    gguf = GGUFModel(model_path)
    spec = model_spec(gguf)

    def steps(hot_fraction: float, mode: str, cache: int) -> tuple[torch.Tensor, ExpertStore]:
        hot = np.zeros((spec.n_layer, spec.n_expert), dtype=bool)
        n = max(1, int(hot_fraction * spec.n_expert))
        hot[list(spec.moe_layers), :n] = True
        store = ExpertStore(GGUFExpertSource(gguf, spec), spec, DEVICE, torch.float32, hot, cache, mode, fused=True)
        assert all(la.fused for la in store.layers.values())
        if isinstance(store.cold, HostPool) and store.cold.tensor.numel():
            assert store.cold.tensor.is_pinned() == (DEVICE == "cuda")
        model = load_model(gguf, device=DEVICE)
        model.experts = model.store = store
        session = Session(model)
        session.feed(IDS[:2])  # prefill: plain path
        return torch.stack([session.feed(IDS[: i + 1]) for i in range(2, 5)]), store

    all_dev, _ = steps(1.0, "async", 0)
    zero, zs = steps(0.1, "zerocopy", 0)
    copied, cs = steps(0.1, "async", 8)
    assert torch.equal(zero, all_dev) and torch.equal(copied, all_dev)
    assert zs.stats.zero_copy_reads > 0 and cs.stats.loads > 0


# The low-bit mixes whose experts (and dense matrices) are the types added for 8 GB cards: every
# kernel type of the registry but the older ones occurs in one of them (tests/test_kernels.py
# checks each type's kernels on their own).
LOW_BIT_MIXES = ("IQ2_XXS", "IQ2_XS", "IQ2_M", "IQ3_XXS", "IQ3_M", "IQ1_S", "IQ1_M", "Q2_K", "Q3_K_M", "Q4_1", "Q5_1")
# Triton's interpreter takes a minute or more a mix (IQ1_M's two: the longest test of the suite):
# on the CPU one mix of the grid lattices and the offset blocks on float activations keep the
# suite within CI's time (IQ1's and the low-bit K-quants' kernels: test_kernels on the CPU, this
# test on a GPU, which runs every mix).
INTERPRETER_MIXES = ("IQ2_M", "Q5_1")


@pytest.mark.parametrize("mix", LOW_BIT_MIXES)
@pytest.mark.slow
def test_low_bit_files_run_on_the_kernels_at_any_residency(synth_model, mix, monkeypatch):
    """A file of each low-bit mix (llama.cpp's per-tensor types, tiny qwen35moe shapes) decodes
    with every expert read as stored by the Triton kernels on int8 activations (the runtime's
    path): the same bits with all experts in the device pool, 60% there and the rest read
    zero-copy from the host pool, and 10% there with the rest copied into cache slots. On float
    activations (the int8 ones round the inputs) the logits are those of the dequantized weights
    (float64, no kernels) to fp32 round-off. (The mixes' dense matrices held as bytes:
    tests/test_forward.py.)"""
    from sparkpack.formats.archs import model_spec
    from sparkpack.formats.gguf_file import GGUFModel
    from sparkpack.formats.quants import kernels_read
    from sparkpack.runtime.kernels.q8dot import Q8_TYPES, readable

    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("kernels on CPU tensors need Triton's interpreter")
    if DEVICE == "cpu" and mix not in INTERPRETER_MIXES:
        pytest.skip("the interpreter runs one mix a kernel family (test_kernels checks every type); a GPU runs all")
    path = synth_model("qwen35moe", mix, skew=1.0)
    gguf = GGUFModel(path)
    spec = model_spec(gguf)
    assert all(kernels_read(t.qtype) for t in gguf.tensors.values()), mix
    n_ids = 3 if DEVICE == "cuda" else 2  # (the interpreter's time: a prompt token and a decode step)

    def steps(hot_fraction: float, mode: str, cache: int, int8: bool = True) -> tuple[torch.Tensor, ExpertStore]:
        hot = np.zeros((spec.n_layer, spec.n_expert), dtype=bool)
        hot[list(spec.moe_layers), :max(1, int(hot_fraction * spec.n_expert))] = True
        store = ExpertStore(GGUFExpertSource(gguf, spec), spec, DEVICE, torch.float32, hot, cache, mode, fused=True)
        assert all(la.fused for la in store.layers.values())
        model = load_model(gguf, device=DEVICE)
        model.w.int8_activations = int8  # the dense matrices' products (held as bytes on a GPU)
        model.experts = model.store = store
        session = Session(model)
        return torch.stack([session.feed(IDS[: i + 1]) for i in range(n_ids)]), store

    all_dev, _ = steps(1.0, "async", 0)
    zero, zs = steps(0.6, "zerocopy", 0)
    copied, cs = steps(0.1, "async", 4)
    assert torch.equal(zero, all_dev) and torch.equal(copied, all_dev)
    assert zs.stats.zero_copy_reads > 0 and cs.stats.loads > 0
    for la in zs.layers.values():  # every pool (device and host) aligned for the int8 kernels' loads
        p = la.host_pools
        for qt, views in ((p.gate_qtype, (p.gate, p.host[0])), (p.up_qtype, (p.up, p.host[1])),
                          (p.down_qtype, (p.down, p.host[2]))):
            assert qt is None or int(qt) not in Q8_TYPES or readable(qt, *views), (mix, qt)
    monkeypatch.setattr("sparkpack.runtime.kernels.moe.readable", lambda *a: False)  # float activations
    on_float, _ = steps(0.6, "zerocopy", 0, int8=False)
    ref = Session(load_model(gguf, dtype=torch.float64))
    want = torch.stack([ref.feed(IDS[: i + 1]) for i in range(n_ids)])
    assert torch.isfinite(want).all()
    err = float(((on_float.double().cpu() - want).norm(dim=-1) / want.norm(dim=-1)).max())
    assert err < 1e-4, (mix, err)
    expert_types = {gguf.tensors[n].qtype for il in spec.moe_layers for n in spec.expert_tensors[il].values()}
    if expert_types & set(Q8_TYPES):  # the runs above took the int8 products (Q4_1, Q5_1 have none)
        assert not torch.equal(on_float, all_dev)


@pytest.mark.slow
def test_pack_placement_and_stats_json(model_path, reference, tmp_path):
    pack = tmp_path / "m.sparkpack"
    r = run_cli(["-m", "sparkpack.repack.cli", "split", str(model_path), "--hot-fraction", "0.5", "-o", str(pack)])
    assert r.returncode == 0, r.stderr
    model = load_model(pack, store=StoreOptions(cache_slots=4))
    assert np.array_equal(model.experts.hot, Pack.open(pack).hot)
    assert torch.equal(model.forward(IDS), reference[0])

    stats = tmp_path / "stats.json"
    ids = ",".join(map(str, IDS[:4]))
    r = run_cli(["-m", "sparkpack.runtime.cli", str(pack), "--prompt-ids", ids, "--max-tokens", "6", "--temperature", "0",
                 "--cache-slots", "4", "--stats-json", str(stats)])
    assert r.returncode == 0, r.stderr
    s = json.loads(stats.read_text())
    assert s["decode_tokens"] >= 1 and s["prefill_tokens"] == 4 and s["decode_tok_s"] > 0
    st = s["store"]
    assert st["hot_experts"] == int(Pack.open(pack).hot.sum()) and st["cache_slots"] == 4
    assert st["routings"] == st["hot_hits"] + st["cache_hits"] + st["misses"] > 0
    assert "the pack's placement" in r.stderr and "decode" in r.stderr


def test_profile_places_the_experts_the_traffic_uses(model_path, tmp_path):
    """A profile's hottest experts are the ones the store keeps on the device."""
    from sparkpack.formats.archs import model_spec
    from sparkpack.formats.gguf_file import GGUFModel
    from sparkpack.formats.profile import Profile, model_identity

    gguf = GGUFModel(model_path)
    spec = model_spec(gguf)
    prof = Profile.new(model_identity(gguf), spec)
    counts = np.zeros((spec.n_layer, spec.n_expert))
    favourite = {il: (3 * il + 5) % spec.n_expert for il in spec.moe_layers}
    for il, e in favourite.items():
        counts[il, e] = 100
    prof.add(generated=counts, generated_tokens=100)
    path = prof.save(tmp_path / "p.profile.json")
    model = load_model(model_path, store=StoreOptions(hot_fraction=0.1, profile=path))
    assert all(model.experts.hot[il, e] for il, e in favourite.items())
    assert "profile p.profile.json" in model.residency.source


def test_zero_copy_cache_admits_repeat_traffic_only(model_path):
    """Zero-copy cache slots cost an extra transfer, so a one-off miss must not take one; an
    expert routed again is copied in, and a more often routed expert displaces a less often
    routed one. The slot then holds the expert's exact bytes."""
    from sparkpack.formats.archs import model_spec
    from sparkpack.formats.gguf_file import GGUFModel

    gguf = GGUFModel(model_path)
    spec = model_spec(gguf)
    il = spec.moe_layers[0]
    hot = np.zeros((spec.n_layer, spec.n_expert), dtype=bool)
    hot[list(spec.moe_layers), :4] = True
    store = ExpertStore(GGUFExpertSource(gguf, spec), spec, "cpu", torch.float32, hot, 2, "zerocopy")

    def step(*experts: int) -> None:
        for e in experts:
            store.counts.step[il, e] += 1
        store.end_step(1, routed=True)

    table = store.slots.table
    step(10)
    assert table[il, 10] < 0 and store.stats.loads == 0  # once: read from host, not copied
    step(10, 10, 10)
    assert table[il, 10] >= 0 and store.stats.loads == 1  # again and again: copied into a slot
    step(11, 11, 11, 11)
    step(13)
    assert table[il, 11] >= 0 and table[il, 13] < 0 and store.stats.loads == 2
    step(*[12] * 5)  # routed more often than expert 10 lately: takes its slot
    assert table[il, 12] >= 0 and table[il, 10] < 0 and table[il, 11] >= 0
    assert table[il, 10] == -(store.cold.layout.offset[il, 10] + 1)  # back to zero-copy reads
    assert store.stats.misses == 1 + 3 + 4 + 1 + 5 and store.stats.cache_hits == 0
    assert torch.equal(store.device_bytes(il, 12), store.cold.bytes(il, 12)[0])


def test_small_host_budget_falls_back_to_disk_tier(model_path, reference):
    warnings: list[str] = []
    from sparkpack.formats.archs import model_spec
    from sparkpack.formats.gguf_file import GGUFModel

    gguf = GGUFModel(model_path)
    spec = model_spec(gguf)
    hot = np.zeros((spec.n_layer, spec.n_expert), dtype=bool)
    hot[list(spec.moe_layers), :2] = True
    store = ExpertStore(GGUFExpertSource(gguf, spec), spec, "cpu", torch.float32, hot, 4, "auto",
                        host_bytes=3 * 200_000, warn=warnings.append)
    assert isinstance(store.cold, DiskTier) and store.cold.cap >= 1
    assert len(warnings) == 1 and "disk tier" in warnings[0] and model_path.name in warnings[0]
    model = load_model(gguf)
    model.experts = model.store = store
    assert torch.equal(model.forward(IDS), reference[0])
    assert store.stats.disk_reads > 0 and len(store.cold.cache) <= store.cold.cap


def corrupt_one_cold_shard(pack: Path) -> str:
    p = Pack.open(pack)
    rec = next(r for r in p.records.values() if not r.hot)
    path = pack / rec.shard
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return rec.shard


@pytest.mark.slow
@pytest.mark.parametrize("host_ram", [None, "300KB"])
def test_corrupt_cold_shard_is_named_and_stops_cleanly(model_path, tmp_path, host_ram):
    pack = tmp_path / "m.sparkpack"
    assert run_cli(["-m", "sparkpack.repack.cli", "split", str(model_path), "--hot-fraction", "0.3", "-o", str(pack)]).returncode == 0
    shard = corrupt_one_cold_shard(pack)
    args = ["-m", "sparkpack.runtime.cli", str(pack), "--prompt-ids", ",".join(map(str, IDS)), "--max-tokens", "24",
            "--temperature", "0", "--cache-slots", "16", "--hot-fraction", "0.0"]
    if host_ram:  # disk tier: the shard is read (and checked) when a token first needs it
        args += ["--host-ram", host_ram]
    r = run_cli(args)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    err = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(err) == 1 and shard in err[0] and "checksum" in err[0], r.stderr


@pytest.mark.slow
def test_vram_budget_too_small_is_one_line(model_path):
    r = run_cli(["-m", "sparkpack.runtime.cli", str(model_path), "-p", "hi", "--device", "cpu", "--vram", "1MiB"])
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "VRAM budget" in r.stderr and "too small" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_vram_budget_sizes_the_hot_set(model_path):
    """A budget that leaves room for half the experts' bytes gets a partial hot set that fits."""
    from sparkpack.formats.placement import default_cache_slots

    model = load_model(model_path, store=StoreOptions(vram=10**12))
    big = model.residency
    slots = default_cache_slots(model.spec) * big.cache_slot_bytes  # planned for, if any expert stays cold
    fixed = big.dense_bytes + big.kv_bytes + big.state_bytes + big.overhead_bytes + slots
    assert big.hot[list(model.spec.moe_layers)].all()
    mid = load_model(model_path, store=StoreOptions(vram=fixed + big.hot_bytes // 2))
    r = mid.residency
    assert 0 < r.hot_bytes <= big.hot_bytes // 2
    assert r.dense_bytes + r.kv_bytes + r.state_bytes + r.overhead_bytes + r.hot_bytes + r.cache_bytes <= r.vram
    assert 0 < mid.experts.n_hot < int(big.hot.sum())
    # The plan counts what is really allocated: the expert pool, and the dense weights (loaded
    # with the model, so a budget fails at load rather than mid-reply).
    assert r.hot_bytes + r.cache_bytes == mid.experts.pool.numel()
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in mid.w.expanded.values()}
    assert r.dense_bytes == sum(held.values())  # stacked projections: parts are views, counted once


def test_vram_plan_counts_dense_matrices_held_as_gguf_bytes(model_path):
    """On a GPU dense matrices stay GGUF bytes (``Weights(quantized=True)``); the plan must count
    exactly what such weights hold once loaded as at load (stacks first, then the rest), and
    less than the expanded weights need."""
    from sparkpack.formats.experts import expert_tensor_names
    from sparkpack.formats.memory import MemoryTarget
    from sparkpack.formats.placement import Budget, plan_residency
    from sparkpack.runtime.weights import Weights

    model = load_model(model_path)
    w = Weights(model.gguf, "cpu", torch.float32, quantized=True)
    for group in model.stack_groups():
        w.stacked(group)
    names = expert_tensor_names(model.spec)
    w.preload(n for n in model.gguf.tensors if n not in names)
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in w.expanded.values()}
    held.update({raw.untyped_storage().data_ptr(): raw.untyped_storage().nbytes()
                 for q in w.as_stored.values() for raw, _ in q.segments})

    def dense(quantized: bool) -> int:
        return plan_residency(model.spec, model.gguf.tensors, Budget(vram=10**12),
                              MemoryTarget(4, quantized)).dense_bytes
    assert dense(True) == sum(held.values()) < dense(False)


def test_experts_without_a_kernel_are_named_once(synth_model, model_path):
    """Expert quant types the Triton kernels do not read (here F16) fall back to dequantizing on
    use, and the store says so in one line naming the file and the types; a Q4_K_M file, or a
    store not asked for the kernels, says nothing."""
    from sparkpack.formats.archs import model_spec
    from sparkpack.formats.gguf_file import GGUFModel

    def warnings_of(path: Path, fused: bool) -> list[str]:
        gguf = GGUFModel(path)
        spec = model_spec(gguf)
        hot = np.ones((spec.n_layer, spec.n_expert), dtype=bool)
        said: list[str] = []
        store = ExpertStore(GGUFExpertSource(gguf, spec), spec, "cpu", torch.float32, hot, 0, "auto", fused=fused,
                            warn=said.append)
        assert store.fused_all == (fused and path == model_path)
        return said

    f16 = synth_model("qwen35moe", "F16")
    said = warnings_of(f16, True)
    assert len(said) == 1 and f16.name in said[0] and "F16" in said[0] and "dequantize" in said[0]
    assert warnings_of(f16, False) == [] and warnings_of(model_path, True) == []


def test_deferred_bookkeeping_is_the_same_one_step_later(model_path):
    """A replayed decode step's bookkeeping (``end_step(defer=True)``) runs at the next
    ``end_step``, while that step computes: the same counts, promotions and table as learning at
    once, one step later. ``flush`` or an eager step learns a pending step first, and resetting
    the stats drops it."""
    from sparkpack.formats.archs import model_spec
    from sparkpack.formats.gguf_file import GGUFModel

    gguf = GGUFModel(model_path)
    spec = model_spec(gguf)
    il = spec.moe_layers[0]
    hot = np.zeros((spec.n_layer, spec.n_expert), dtype=bool)
    hot[list(spec.moe_layers), :4] = True
    steps = [(10,), (10, 10, 10), (11, 11, 11, 11), (13,), (12,) * 5, (1, 12)]

    def run(defer: bool) -> tuple[ExpertStore, list[np.ndarray]]:
        store = ExpertStore(GGUFExpertSource(gguf, spec), spec, "cpu", torch.float32, hot, 2, "zerocopy")
        tables = []
        for experts in steps:
            for e in experts:
                store.counts.step[il, e] += 1
            store.end_step(1, routed=True, defer=defer)
            tables.append(store.slots.table.copy())
        return store, tables

    def counts(store: ExpertStore) -> dict:
        store.flush()
        return {k: v for k, v in store.stats.as_json().items() if k != "step_seconds"}

    now, now_tables = run(False)
    later, later_tables = run(True)
    assert not np.array_equal(now_tables[2], now_tables[1])  # the steps do move experts
    for a, b in zip(now_tables[:-1], later_tables[1:]):
        assert np.array_equal(a, b)
    assert counts(later) == counts(now) and counts(now)["tokens"] == len(steps)
    assert int(later.counts.step.sum()) == 0  # the device counts were reset behind each step

    later.counts.step[il, 10] += 1
    later.end_step(1, routed=True, defer=True)
    later.counts.step[il, 11] += 2
    later.end_step(1, routed=True)  # eager: the pending step first, then its own counts
    assert later.counts.pending is None and counts(later)["tokens"] == len(steps) + 2
    later.counts.step[il, 11] += 1
    later.end_step(1, routed=True, defer=True)
    later.reset_stats()
    later.flush()
    assert later.stats.tokens == 0  # the pending step belonged to the stats replaced


@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (SPARKPACK_TEST_DEVICE=cuda)")
def test_pinned_host_memory_is_its_own_size_and_copies_both_ways():
    """``runtime.pinned``: a 300 MiB pinned buffer (torch's pinned allocator would lock 512) adds
    about 300 MiB to the process, reports pinned, round-trips through the GPU asynchronously, and
    gives its pages back once the last tensor over it has gone (at ``release``: never from the
    garbage collector, which may run inside a graph capture)."""
    import gc

    from sparkpack.runtime.pinned import pinned_empty, release

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    n = 300 * 2**20
    # buffers an earlier test of this worker left to ``release`` go first: pinned_empty frees them
    # before it maps, which counted them against this buffer (179 of 300 MiB "grown" on the GPU
    # machine, in an xdist worker)
    gc.collect()
    release()
    before = rss()
    host = pinned_empty(n)
    grown = rss() - before
    assert host.numel() == n and host.is_pinned()
    assert 0.9 * n < grown < 1.2 * n, grown
    data = torch.randint(0, 256, (n,), dtype=torch.uint8)
    host.copy_(data)
    dev = host[1000:].to("cuda", non_blocking=True)
    back = pinned_empty(n - 1000)
    back.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, data[1000:])
    del host, back, data, dev
    gc.collect()
    release()
    assert rss() - before < 0.5 * n  # both buffers unregistered and unmapped
