"""Calibration's replay on the prefill path: the profile counts are the router's own choices, each
token counted once on its side, whatever the residency, the captured calls or the tracing.

The reference is the plain definition, written apart from the code it checks (and checked
against the replay that came before the prefill path, which it matched exactly): every
conversation rendered as served, cut into windows of ``--ctx`` tokens, each window run through
the model in one forward call on a fresh cache, every token's top-k counted on its side.
"""
from __future__ import annotations

import json
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
    res = CliRunner().invoke(calibrate_cmd, [*map(str, args), "--quiet"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


def profile_counts(path: Path) -> tuple[np.ndarray, list[int]]:
    d = json.loads(path.read_text())
    return (np.stack([np.array(d["counts"]["prompt"]), np.array(d["counts"]["generated"])]).astype(np.int64),
            [d["tokens"]["prompt"], d["tokens"]["generated"]])


@pytest.mark.parametrize("arch, ctx", [("qwen35moe", 4096), ("qwen35moe", 200), ("qwen3moe", 4096),
                                       ("laguna", 300)])
def test_profile_counts_are_the_reference_counts(synth_model, tmp_path, arch, ctx):
    """The sample corpora (chats with assistant turns, agent sessions, documents; ``ctx`` 200 and
    300 cut the longer ones into windows): the profile holds exactly the reference's counts and
    tokens, with or without a trace, and the trace holds every token's reference experts."""
    model = synth_model(arch, skew="reference")
    spec = load_model(model).spec
    calibrate(model, "--corpus", CORPORA, "-o", tmp_path / "p.json", "--ctx", ctx)
    calibrate(model, "--corpus", CORPORA, "-o", tmp_path / "t.json", "--ctx", ctx, "--trace", tmp_path / "t.trace")
    ref = reference(model, CORPORA, ctx)
    assert ref.generated.any()  # assistant turns are there, on the generated side
    counts, tokens = profile_counts(tmp_path / "p.json")
    assert tokens == [int((~ref.generated).sum()), int(ref.generated.sum())]
    assert np.array_equal(counts, ref.counts(spec.n_layer, spec.n_expert, spec.moe_layers))
    assert np.array_equal(profile_counts(tmp_path / "t.json")[0], counts)
    trace = read_trace(tmp_path / "t.trace")
    assert np.array_equal(trace.generated, ref.generated) and np.array_equal(np.sort(trace.ids, axis=2), ref.ids)
