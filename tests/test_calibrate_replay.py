"""Calibration's replay on the prefill path: the profile counts are the router's own choices, each
token counted once on its side, whatever the call sizes, the residency or the prefix reuse.

The reference here is the plain definition, written apart from the code it checks: every
conversation rendered as served, cut into windows of ``--ctx`` tokens, each window run through
the model in one forward call on a fresh cache, and every token's top-k ids counted on its side.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from sparkpack.calibrate.readers import read_corpus
from sparkpack.calibrate.render import ChatRenderer
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


class RouterTap:
    """An expert provider around the model's own: remembers each MoE layer's router choice of the
    last call, then hands the call on."""

    def __init__(self, inner):
        self.inner = inner
        self.ids: dict[int, torch.Tensor] = {}

    @property
    def capturable(self) -> bool:
        return False

    def moe(self, layer, x, weights, ids, q8=None):
        self.ids[layer] = ids.clone()
        return self.inner.moe(layer, x, weights, ids, q8)

    def __getattr__(self, name):  # the rest of the contract, unchanged
        return getattr(self.inner, name)


def reference_counts(model_path: Path, corpus: Path, ctx: int) -> tuple[np.ndarray, list[int]]:
    """Counts ``[2 (prompt, generated), n_layer, n_expert]`` and tokens per side, by the definition."""
    gguf = GGUFModel(model_path)
    model = load_model(gguf)
    tok = GGUFTokenizer.from_metadata(gguf)
    renderer = ChatRenderer(tok, ChatTemplate.from_tokenizer(gguf.get("tokenizer.chat_template"), tok).render)
    tap = RouterTap(model.experts)
    model.experts = tap
    spec = model.spec
    counts = np.zeros((2, spec.n_layer, spec.n_expert), dtype=np.int64)
    tokens = [0, 0]
    convs, _ = read_corpus(corpus)
    for conv in convs:
        r = renderer.render(conv)
        side = r.generated.astype(np.int64)
        tokens[1] += int(side.sum())
        tokens[0] += len(r.ids) - int(side.sum())
        for w0 in range(0, len(r.ids), ctx):
            w = slice(w0, min(w0 + ctx, len(r.ids)))
            tap.ids.clear()
            model.forward(r.ids[w], model.new_cache())
            for il, ids in tap.ids.items():
                np.add.at(counts, (side[w][:, None], il, ids.numpy()), 1)
    return counts, tokens


@pytest.mark.parametrize("arch, ctx", [("qwen35moe", 4096), ("qwen35moe", 200), ("qwen3moe", 4096),
                                       ("laguna", 300)])
def test_profile_counts_are_the_reference_counts(synth_model, tmp_path, arch, ctx):
    """The sample corpora (chats with assistant turns, agent sessions, documents; ``ctx`` 200 and
    300 cut the longer ones into windows): the profile holds exactly the reference's counts."""
    model = synth_model(arch, skew="reference")
    out = tmp_path / "p.json"
    res = CliRunner().invoke(calibrate_cmd, [str(model), "--corpus", str(CORPORA), "-o", str(out), "--ctx", str(ctx),
                                             "--quiet"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    prof = json.loads(out.read_text())
    counts, tokens = reference_counts(model, CORPORA, ctx)
    assert tokens[1] > 0 and counts[1].sum() > 0  # assistant turns are there, on the generated side
    assert [prof["tokens"]["prompt"], prof["tokens"]["generated"]] == tokens
    assert np.array_equal(np.array(prof["counts"]["prompt"]), counts[0])
    assert np.array_equal(np.array(prof["counts"]["generated"]), counts[1])
