"""Calibration's replay on the prefill path: the profile counts are the router's own choices, each
token counted once on its side, whatever the residency, the padded or captured calls, the turns
or the tracing; and through the store its peak RSS stays well under the model's size.

The reference is the plain definition, written apart from the code it checks (and checked
against the replay that came before the prefill path, which it matched exactly): every
conversation rendered as served, cut into windows of ``--ctx`` tokens, each window run through
the model in one forward call on a fresh cache, every token's top-k counted on its side.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from sparkpack.calibrate.readers import read_corpus
from sparkpack.calibrate.render import ChatRenderer
from sparkpack.calibrate.trace import read_trace
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.repack.calibrate_cmd import calibrate_cmd
from sparkpack.runtime.chat_template import ChatTemplate
from sparkpack.runtime.models import load_model
from sparkpack.runtime.tokenizer import GGUFTokenizer

REPO = Path(__file__).resolve().parents[1]
CORPORA = REPO / "corpora"
# CI runs these on the CPU; on the GPU machine SPARKPACK_TEST_DEVICE=cuda runs the residency and
# capture checks on CUDA (the store's fused kernels, pinned host memory, captured calls).
DEVICE = os.environ.get("SPARKPACK_TEST_DEVICE", "cpu")


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matmuls on a shared 2-core machine: a second thread only adds contention."""
    from tests.serve_proc import one_thread

    with one_thread():
        yield


@dataclass
class Reference:
    """Every token in replay order: its experts per MoE layer, sorted ``[T, n_moe, k]``, and its side."""

    ids: np.ndarray
    generated: np.ndarray

    def counts(self, n_layer: int, n_expert: int, moe_layers: list[int]) -> np.ndarray:
        out = np.zeros((2, n_layer, n_expert), dtype=np.int64)
        for j, il in enumerate(moe_layers):
            for side in (0, 1):
                out[side, il] = np.bincount(self.ids[self.generated == side, j].ravel(), minlength=n_expert)
        return out


def reference(model_path: Path, corpus: Path, ctx: int) -> Reference:
    """The definition: one forward call per window on a fresh cache; each MoE layer's choice taken
    where the model makes it (``route_logits``)."""
    gguf = GGUFModel(model_path)
    model = load_model(gguf)
    tok = GGUFTokenizer.from_metadata(gguf)
    renderer = ChatRenderer(tok, ChatTemplate.from_tokenizer(gguf.get("tokenizer.chat_template"), tok).render)
    route, seen = model.route_logits, {}

    def tapped(il: int, logits: torch.Tensor):
        weights, ids = route(il, logits)
        seen[il] = ids.sort(1).values
        return weights, ids

    model.route_logits = tapped
    ids, gen = [], []
    for conv in read_corpus(corpus)[0]:
        r = renderer.render(conv)
        for w0 in range(0, len(r.ids), ctx):
            w = slice(w0, min(w0 + ctx, len(r.ids)))
            seen.clear()
            model.forward(r.ids[w], model.new_cache())
            ids.append(torch.stack([seen[il] for il in model.spec.moe_layers], 1).numpy())
            gen.append(r.generated[w])
    return Reference(np.concatenate(ids), np.concatenate(gen))


def calibrate(*args) -> str:
    """The command in this process; returns what it wrote to stderr."""
    res = CliRunner().invoke(calibrate_cmd, [*map(str, args), "--quiet"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.stderr


def profile_counts(path: Path) -> tuple[np.ndarray, list[int]]:
    d = json.loads(path.read_text())
    return (np.stack([np.array(d["counts"]["prompt"]), np.array(d["counts"]["generated"])]).astype(np.int64),
            [d["tokens"]["prompt"], d["tokens"]["generated"]])


@pytest.mark.slow
@pytest.mark.parametrize("arch, ctx", [("qwen35moe", 4096), ("qwen35moe", 200), ("qwen3moe", 4096),
                                       ("laguna", 300)])
def test_profile_counts_are_the_reference_counts(synth_model, tmp_path, arch, ctx):
    """The sample corpora (chats with assistant turns, agent sessions, documents; ``ctx`` 200 and
    300 cut the longer ones into windows): the profile holds exactly the reference's counts and
    tokens, with or without a trace, and the trace holds every token's reference experts."""
    model = synth_model(arch, skew="reference")
    spec = load_model(model).spec
    calibrate(model, "--corpus", CORPORA, "-o", tmp_path / "p.json", "--ctx", ctx, "--device", "cpu")
    calibrate(model, "--corpus", CORPORA, "-o", tmp_path / "t.json", "--ctx", ctx, "--device", "cpu",
              "--trace", tmp_path / "t.trace")
    ref = reference(model, CORPORA, ctx)
    assert ref.generated.any()  # assistant turns are there, on the generated side
    counts, tokens = profile_counts(tmp_path / "p.json")
    assert tokens == [int((~ref.generated).sum()), int(ref.generated.sum())]
    assert np.array_equal(counts, ref.counts(spec.n_layer, spec.n_expert, spec.moe_layers))
    assert np.array_equal(profile_counts(tmp_path / "t.json")[0], counts)
    trace = read_trace(tmp_path / "t.trace")
    assert np.array_equal(trace.generated, ref.generated) and np.array_equal(np.sort(trace.ids, axis=2), ref.ids)


def device_or_skip() -> str:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return DEVICE


def calibrate_in_child(*args) -> subprocess.CompletedProcess:
    """The CLI in its own process (``--vram`` caps the process's GPU allocator: not in the test's)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "sparkpack.repack.cli", "calibrate", *map(str, args), "--quiet"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=600)


@pytest.mark.parametrize("arch, residencies", [
    ("qwen35moe", (["--hot-fraction", "0.25"], ["--hot-fraction", "0.25", "--host-ram", "64KiB"])),
    ("qwen3moe", (["--hot-fraction", "0.25"],)),
])
def test_the_store_at_any_residency_counts_what_all_device_counts(synth_model, tmp_path, monkeypatch, arch,
                                                                  residencies):
    """Cold experts in host memory (read zero-copy on a GPU) or on disk behind a 64 KiB cache: the
    same counts as with every expert on the device. On CUDA also: the calls run eagerly instead of
    replayed from CUDA graphs, a trace recorded inside the captured calls, and a --vram budget
    (in a child process). Bits are the store's
    promise for the same calls; padded (captured) and unpadded calls are not the same calls, so
    the disk tier (no zero-copy, no padding) is checked on the DeltaNet model, whose calls are
    never padded."""
    device = device_or_skip()
    model = synth_model(arch, "Q4_K_M", skew="reference")
    corpus = CORPORA / "openai_chat.jsonl"

    def counts(*opts: str, name: str, placed: str | None = None) -> np.ndarray:
        err = calibrate(model, "--corpus", corpus, "-o", tmp_path / f"{name}.json", "--device", device, *opts)
        if placed is not None:  # the store's line: what it holds where
            assert placed in err, err
        return profile_counts(tmp_path / f"{name}.json")[0]

    whole = counts(name="whole")
    assert whole.sum() > 0
    for i, opts in enumerate(residencies):
        where = "read from disk" if "--host-ram" in opts else "in pinned host RAM" if device == "cuda" else "in host RAM"
        assert np.array_equal(counts(*opts, name=f"r{i}", placed=f"cold experts {where} ("), whole), opts
    if device == "cuda":
        monkeypatch.setenv("SPARKPACK_CUDA_GRAPHS", "0")
        assert np.array_equal(counts(name="eager"), whole)
        monkeypatch.delenv("SPARKPACK_CUDA_GRAPHS")
        assert np.array_equal(counts("--trace", tmp_path / "t.trace", name="traced"), whole)
        trace = read_trace(tmp_path / "t.trace")  # recorded inside the captured calls
        spec = load_model(model).spec
        assert np.array_equal(Reference(np.sort(trace.ids, axis=2), trace.generated).counts(
            spec.n_layer, spec.n_expert, spec.moe_layers), whole)
        res = calibrate_in_child(model, "--corpus", corpus, "-o", tmp_path / "vram.json", "--device", "cuda",
                                 "--vram", "1.5GiB", "--hot-fraction", "0.25")
        assert res.returncode == 0, res.stderr
        assert np.array_equal(profile_counts(tmp_path / "vram.json")[0], whole)


@pytest.mark.slow
def test_peak_rss_through_the_store_is_well_under_the_model(tmp_path):
    """A 412 MiB model calibrated on the CPU through the store with 10% of its experts hot and a
    16 MiB host cache: the process's peak resident set grows by less than half the model over
    what torch and the runtime take before it (/proc/self/status, the peak counts file-backed pages
    too). Expert bytes are read into the pools, not through the file's map, whose touched pages
    would stay resident: that way the same run grew by 538 MiB."""
    from dataclasses import replace

    from bench.calibrate_speed import PEAK_RSS
    from sparkpack.repack.synth import get_preset, write_synthetic

    shape = replace(get_preset("qwen3moe", "tiny"), n_layer=8, n_head=(4,) * 8, n_expert=128, n_ff_exp=512)
    model = write_synthetic(tmp_path / "m.gguf", "qwen3moe", shape, "Q8_0")
    size = model.stat().st_size
    assert size > 400 * 2**20
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", PEAK_RSS, "calibrate", str(model), "--corpus",
                          str(CORPORA / "openai_chat.jsonl"), "-o", str(tmp_path / "p.json"), "--device", "cpu",
                          "--hot-fraction", "0.1", "--host-ram", "16MiB", "--ctx", "1024", "--quiet"],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert res.returncode == 0, res.stderr
    held = re.search(r"cold experts read from disk \(a ([\d.]+) MiB cache in host RAM\)", res.stderr)
    assert held is not None and 0 < float(held.group(1)) <= 16, res.stderr  # the --host-ram bound
    rss = json.loads(res.stderr.split("RSS ", 1)[1])
    assert rss["peak"] - rss["base"] < size / 2, (rss, size)


def test_the_calibrate_stage_loads_without_torch():
    """calibrate/ needs neither torch nor the runtime (its modules load without them), so the
    runtime may read logs and traces through it (the import edges: tests/test_packaging.py)."""
    code = ("import pkgutil, importlib, sys, sparkpack.calibrate as c\n"
            "for m in pkgutil.walk_packages(c.__path__, 'sparkpack.calibrate.'): importlib.import_module(m.name)\n"
            "print(sorted(n for n in sys.modules if n == 'torch' or n.startswith(('sparkpack.runtime', 'sparkpack.repack'))))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_a_padded_call_counts_its_real_tokens_alone(synth_model):
    """Calls padded to a captured size (run eagerly here, on the CPU: the calls a GPU session
    replays from CUDA graphs): the padding rows are counted on no side, the real rows route as
    in unpadded calls, and each counts on its side."""
    from sparkpack.runtime.calibration import ModelRouter
    from sparkpack.runtime.graph import PrefillGraphs
    from sparkpack.runtime.models import StoreOptions

    path = synth_model("qwen3moe", "Q4_K_M", skew=1.0)
    opts = StoreOptions(hot_fraction=0.5, miss_mode="zerocopy")
    padded = ModelRouter(load_model(path, store=opts), ctx=128, prefill_chunk=16, record=True)
    padded.session.prefill = PrefillGraphs(padded.model, padded.session.cache, capture=False)
    sizes, forward = [], padded.model.forward
    padded.model.forward = lambda ids, *a, **kw: (sizes.append(len(ids)), forward(ids, *a, **kw))[1]
    plain = ModelRouter(load_model(path, store=opts), ctx=128, prefill_chunk=16, record=True)
    ids = [3 + (7 * i) % 97 for i in range(41)]
    generated = np.arange(41) % 5 == 0
    got, want = padded.route(ids, generated), plain.route(ids, generated)
    assert sizes == [16, 16, 16]  # the last 9 tokens padded to 16
    spec = padded.spec
    per_token = len(spec.moe_layers) * spec.n_expert_used
    assert got[1].sum() == generated.sum() * per_token and got[0].sum() == (~generated).sum() * per_token
    assert np.array_equal(got, want)
    assert np.array_equal(np.sort(padded.take_trace(), 2), np.sort(plain.take_trace(), 2))


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3moe"])
def test_one_pass_over_the_turns_counts_what_replaying_each_turn_from_scratch_counts(synth_model, arch):
    """An agent conversation of four turns (prompt, generated, prompt, generated) is one pass: its
    cache (KV and DeltaNet state) carries each turn into the next. Replaying every turn from a
    fresh state, prefix first, and keeping the turn's own routings (the difference from the
    prefix alone) counts the same, each turn on its side. The turns end at call boundaries, so
    both make the same calls."""
    from sparkpack.runtime.calibration import ModelRouter
    from sparkpack.runtime.models import StoreOptions

    device = device_or_skip()
    path = synth_model(arch, "Q4_K_M", skew=1.0)
    model = load_model(path) if device == "cpu" else load_model(
        path, device="cuda", dtype=torch.bfloat16, store=StoreOptions(hot_fraction=0.5, miss_mode="zerocopy"))
    router = ModelRouter(model, ctx=128, prefill_chunk=16)
    ids = [3 + (11 * i) % 199 for i in range(64)]
    generated = (np.arange(64) // 16) % 2 == 1
    one_pass = router.route(ids, generated)
    turns = np.zeros_like(one_pass)
    before = np.zeros_like(one_pass)
    for end in (16, 32, 48, 64):
        upto = router.route(ids[:end], generated[:end])
        turn = upto - before
        side = int(generated[end - 1])
        assert turn[1 - side].sum() == 0 and turn[side].sum() == 16 * len(model.spec.moe_layers) * model.spec.n_expert_used
        turns += turn
        before = upto
    assert np.array_equal(turns, one_pass)
