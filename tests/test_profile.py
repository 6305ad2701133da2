"""Placement profiles: identity, counts, atomic save/load with clear errors, merge with decay."""
from __future__ import annotations

import json

import numpy as np
import pytest

from sparkpack.formats.archs import model_spec
from sparkpack.formats.errors import FormatError, SparkpackError
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.profile import Profile, model_identity


@pytest.fixture(scope="module")
def model(synth_model):
    m = GGUFModel(synth_model("qwen3moe"))
    yield m
    m.close()


def test_identity_hashes_only_the_header(model, synth_model, tmp_path):
    ident = model_identity(model)
    assert ident.file_size == model.file_size and ident.header_bytes == model.data_offset
    assert ident.header_hash.startswith("sha256:")
    raw = bytearray(model.path.read_bytes())
    copy = tmp_path / "copy.gguf"
    raw[-1] ^= 0xFF  # a weight byte: same identity (content of the header, not the path)
    copy.write_bytes(raw)
    assert model_identity(GGUFModel(copy)) == ident
    name_at = raw.index(b"general.architecture")
    raw[name_at] ^= 0x01  # a header byte: another identity
    copy.write_bytes(raw)
    assert model_identity(GGUFModel(copy)).header_hash != ident.header_hash
    assert model_identity(GGUFModel(synth_model("laguna"))) != ident


def test_add_save_load_round_trip(model, tmp_path):
    spec = model_spec(model)
    p = Profile.new(model_identity(model), spec)
    gen = np.zeros((spec.n_layer, spec.n_expert))
    gen[0, 3] = 7
    p.add(prompt=np.ones((spec.n_layer, spec.n_expert)), generated=gen, prompt_tokens=10, generated_tokens=2)
    path = p.save(tmp_path / "p.json")
    q = Profile.load(path)
    assert q.identity == p.identity and q.arch == "qwen3moe"
    assert np.array_equal(q.counts["generated"], gen) and q.tokens == {"prompt": 10.0, "generated": 2.0}
    d = json.loads(path.read_text())  # human-inspectable: plain nested lists of integers
    assert d["counts"]["generated"][0][3] == 7 and d["format"] == "sparkpack-profile"
    assert not list(tmp_path.glob(".*tmp*"))
    with pytest.raises(ValueError):
        p.add(generated=np.ones((1, 2)))


def test_merge_with_decay(model):
    spec = model_spec(model)
    a = Profile.new(model_identity(model), spec)
    a.add(generated=np.full((spec.n_layer, spec.n_expert), 4.0), generated_tokens=8)
    b = Profile.new(model_identity(model), spec)
    b.add(generated=np.full((spec.n_layer, spec.n_expert), 1.0), generated_tokens=2)
    m = a.merge(b, decay=0.5)
    assert np.allclose(m.counts["generated"], 3.0) and m.tokens["generated"] == 6.0
    assert np.allclose(a.counts["generated"], 4.0)  # inputs untouched


def test_merge_and_check_refuse_other_models(model, synth_model):
    spec = model_spec(model)
    a = Profile.new(model_identity(model), spec)
    other = GGUFModel(synth_model("qwen35moe"))
    b = Profile.new(model_identity(other), model_spec(other))
    with pytest.raises(SparkpackError, match="different models"):
        a.merge(b)
    with pytest.raises(SparkpackError, match="another model"):
        b.check_model(model_identity(model), spec, "p.json")


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(format="x"), "not a profile"),
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d["counts"].update(prompt=[[1, 2]]), "shape"),
    (lambda d: d["counts"]["generated"][0].__setitem__(0, -1), ">= 0"),
    (lambda d: d.pop("identity"), "model identity must have"),
])
def test_load_rejects_bad_files(model, tmp_path, edit, message):
    p = Profile.new(model_identity(model), model_spec(model))
    d = p.to_json()
    edit(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(FormatError, match=message):
        Profile.load(path)


def test_load_rejects_non_json(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("{nope")
    with pytest.raises(FormatError, match="not a profile"):
        Profile.load(path)
