"""``repack split`` / ``join`` / ``verify`` / ``inspect`` on packs, and the ``Pack`` reader API."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from sparkpack.formats.archs import model_spec
from sparkpack.formats.errors import FormatError
from sparkpack.formats.experts import expert_bytes as gguf_expert_bytes
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.profile import Profile, model_identity
from sparkpack.formats.sparkpack import ALIGNMENT, Pack, is_pack
from sparkpack.repack.verify_cmd import verify_pack
from tests.pack_edit import edit_manifest, first_cold

REPO = Path(__file__).resolve().parents[1]


def assert_one_line_error(code: int, err: str, needle: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code != 0
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("repack: error:"), err
    assert needle in lines[0], lines[0]


@pytest.mark.parametrize("arch, quant", [
    ("qwen3moe", "Q8_0"), ("qwen3moe", "Q4_K_M"), ("qwen3moe", "F16"),
    ("qwen35moe", "Q4_K_M"), ("qwen35moe", "Q6_K"), ("laguna", "Q4_K_M"), ("laguna", "Q8_0"),
    ("qwen35moe", "IQ2_M"), ("laguna", "IQ3_XXS"), ("qwen3moe", "Q2_K"), ("qwen3moe", "IQ1_M"),
])
def test_split_join_round_trip_is_byte_identical(synth_model, tmp_path, cli, arch, quant):
    src = synth_model(arch, quant=quant)
    pack = tmp_path / "m.sparkpack"
    code, _, err = cli("split", src, "-o", pack, "--hot-fraction", "0.4")
    assert code == 0, err
    assert "uniformly" in err and "hot experts" in err
    code, _, err = cli("join", pack, "-o", tmp_path / "back.gguf")
    assert code == 0, err
    assert (tmp_path / "back.gguf").read_bytes() == src.read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_compressed_round_trip_and_default_output(synth_model, tmp_path, cli):
    src = tmp_path / "model.gguf"
    src.write_bytes(synth_model("laguna", quant="Q8_0").read_bytes())
    code, _, err = cli("split", src, "--compress", "--hot-fraction", "0.25")
    assert code == 0, err
    pack = tmp_path / "model.sparkpack"
    assert is_pack(pack)
    p = Pack.open(pack)
    assert p.compression == "zstd" and all(r.compression == "zstd" for r in p.records.values() if not r.hot)
    assert list((pack / "cold").rglob("*.bin.zst"))
    assert cli("verify", pack)[0] == 0
    code, _, err = cli("join", pack, "-o", tmp_path / "back.gguf")
    assert code == 0, err
    assert (tmp_path / "back.gguf").read_bytes() == src.read_bytes()


def test_compressed_experts_read_concurrently(synth_model, tmp_path, cli):
    """The runtime loads cold experts from a thread pool; zstd decompression must not share state."""
    from concurrent.futures import ThreadPoolExecutor

    src = tmp_path / "model.gguf"
    src.write_bytes(synth_model("qwen3moe", quant="Q8_0").read_bytes())
    assert cli("split", src, "--compress", "--hot-fraction", "0.1")[0] == 0
    pack = Pack.open(tmp_path / "model.sparkpack")
    cold = [k for k, r in pack.records.items() if not r.hot] * 8
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda k: pack.expert_bytes(*k), cold))  # raises on a bad checksum


def test_reader_api_matches_the_gguf(synth_model, tmp_path, cli):
    src = synth_model("qwen35moe", quant="Q4_K_M")
    pack_path = tmp_path / "m.sparkpack"
    assert cli("split", src, "-o", pack_path, "--hot-fraction", "0.5")[0] == 0
    model = GGUFModel(src)
    spec = model_spec(model)
    pack = Pack.open(pack_path)
    assert pack.identity == model_identity(model) and pack.arch == "qwen35moe"
    for name in pack.non_expert_tensors():
        view = pack.tensor(name)
        assert np.array_equal(view, model.raw(name))
        assert view.base is not None and pack.tensors[name].offset % ALIGNMENT == 0  # mmapped view
    assert 0 < pack.hot.sum() < pack.hot.size
    for il in spec.moe_layers:
        for e in range(spec.n_expert):
            parts = pack.expert_parts(il, e)
            want = gguf_expert_bytes(model, spec, il, e)
            assert [p.role for p in pack.parts[il]] == list(parts)
            assert all(np.array_equal(a, b) for a, b in zip(parts.values(), want))
            rec = pack.expert_record(il, e)
            assert rec.hot == pack.is_hot(il, e)
            if rec.hot:
                assert rec.offset % ALIGNMENT == 0
    assert pack.metadata["general.architecture"] == "qwen35moe"
    assert "tokenizer.chat_template" in pack.metadata


def test_profile_placement_prefers_busy_experts_and_reports(synth_model, tmp_path, cli):
    src = synth_model("qwen3moe")
    model = GGUFModel(src)
    spec = model_spec(model)
    prof = Profile.new(model_identity(model), spec)
    gen = np.zeros((spec.n_layer, spec.n_expert))
    gen[:, 5] = 100  # expert 5 busy in every layer
    gen[0, :] += 1
    prof.add(generated=gen, generated_tokens=100)
    prof.save(tmp_path / "p.json")
    code, _, err = cli("split", src, "--profile", tmp_path / "p.json", "--hot-fraction", "0.1",
                       "-o", tmp_path / "m.sparkpack")
    assert code == 0, err
    assert "expected cold-hit rate" in err and "uniform" not in err
    pack = Pack.open(tmp_path / "m.sparkpack")
    assert all(pack.is_hot(il, 5) for il in spec.moe_layers)
    code, out, _ = cli("inspect", tmp_path / "m.sparkpack")
    assert code == 0 and "hot experts" in out and "from profile p.json" in out


def test_vram_budget_counts_fixed_costs(synth_model, tmp_path, cli):
    src = synth_model("qwen3moe")
    code, _, err = cli("split", src, "--vram", "2GiB", "--ctx", "1024", "--cache-slots", "4",
                       "-o", tmp_path / "a.sparkpack")
    assert code == 0, err
    assert "KV cache" in err and "runtime overhead" in err
    manifest = json.loads((tmp_path / "a.sparkpack" / "manifest.json").read_text())
    b = manifest["placement"]["budget"]
    assert b["experts"] == 2 * 1024**3 - (b["non_expert"] + b["kv_cache"] + b["recurrent_state"]
                                          + 4 * b["cache_slot_bytes"] + b["runtime"] + b["staging"])
    assert manifest["placement"]["hot_bytes"] <= b["experts"]


# --- verify ---------------------------------------------------------------------------------

@pytest.fixture
def packed(synth_model, tmp_path, cli):
    pack = tmp_path / "m.sparkpack"
    assert cli("split", synth_model("qwen3moe"), "-o", pack, "--hot-fraction", "0.5")[0] == 0
    return pack


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_verify_ok(packed, cli):
    code, out, _ = cli("verify", packed)
    assert code == 0 and "OK" in out


def test_verify_names_flipped_cold_shard(packed, cli):
    pack = Pack.open(packed)
    rec = next(r for r in pack.records.values() if not r.hot)
    flip(packed / rec.shard, rec.nbytes // 2)
    code, _, err = cli("verify", packed)
    assert_one_line_error(code, err, f"shard {rec.shard} fails its checksum")
    with pytest.raises(FormatError, match="fails its checksum"):
        pack.expert_bytes(rec.layer, rec.expert)


def test_verify_names_flipped_hot_bytes(packed, cli):
    pack = Pack.open(packed)
    rec = next(r for r in pack.records.values() if r.hot)
    flip(packed / "hot.bin", rec.offset + 5)
    code, _, err = cli("verify", packed)
    assert_one_line_error(code, err, f"shard hot.bin fails its checksum at layer {rec.layer} expert {rec.expert}")
    t = pack.non_expert_tensors()[0]
    flip(packed / "hot.bin", pack.tensors[t].offset)
    code, _, err = cli("verify", packed)
    assert_one_line_error(code, err, f"shard hot.bin fails its checksum at tensor {t}")


def test_verify_header_shard(packed, cli):
    flip(packed / "header.bin", 100)
    assert_one_line_error(*cli("verify", packed)[::2], "shard header.bin fails its checksum")


# --- bad input through the real CLI ---------------------------------------------------------

@pytest.mark.parametrize("command", ["verify", "join", "inspect"])
def test_missing_shard(packed, cli, command, tmp_path):
    rec = first_cold(json.loads((packed / "manifest.json").read_text()))
    (packed / rec["shard"]).unlink()
    args = [command, packed] + (["-o", tmp_path / "x.gguf"] if command == "join" else [])
    assert_one_line_error(*cli(*args)[::2], f"shard {rec['shard']} is missing")
    assert not (tmp_path / "x.gguf").exists()


def test_truncated_shard(packed, cli):
    rec = first_cold(json.loads((packed / "manifest.json").read_text()))
    with open(packed / rec["shard"], "r+b") as f:
        f.truncate(10)
    assert_one_line_error(*cli("verify", packed)[::2], f"shard {rec['shard']} has 10 bytes")


@pytest.mark.parametrize("shard", ["../../etc/passwd", "/etc/passwd", "cold/../../x.bin"])
def test_path_traversal_is_refused(packed, cli, shard):
    edit_manifest(packed, lambda m: first_cold(m).update(shard=shard))
    # cold shard names are fixed by the layout: any other name is refused before it is opened
    assert_one_line_error(*cli("verify", packed)[::2], "but the pack's layout gives ('cold/L000")


def test_symlink_out_of_pack_is_refused(packed, cli, tmp_path):
    rec = first_cold(json.loads((packed / "manifest.json").read_text()))
    outside = tmp_path / "outside.bin"
    outside.write_bytes((packed / rec["shard"]).read_bytes())
    (packed / rec["shard"]).unlink()
    os.symlink(outside, packed / rec["shard"])
    assert_one_line_error(*cli("verify", packed)[::2], "points outside the pack")


@pytest.mark.parametrize("edit, needle", [
    (lambda m: first_cold(m).update(offset=10**9), "but the pack's layout gives"),
    (lambda m: next(t for t in m["tensors"] if t["shard"]).update(nbytes=10**12),
     "nbytes: is 1000000000000, but the pack's layout gives"),
    (lambda m: m["shards"][1].update(nbytes=1), "shards[hot.bin].nbytes: is 1"),
    (lambda m: m.update(version=7), "version 7 is not supported"),
    (lambda m: m["experts"][0]["experts"].pop(), "placement is missing"),
    (lambda m: m.pop("tensors"), "manifest: has no 'tensors'"),
])
def test_bad_manifest(packed, cli, edit, needle):
    edit_manifest(packed, edit)
    assert_one_line_error(*cli("verify", packed)[::2], needle)


def test_not_a_pack(cli, tmp_path):
    (tmp_path / "empty").mkdir()
    assert_one_line_error(*cli("verify", tmp_path / "empty")[::2], "not a sparkpack")
    (tmp_path / "junk" / "x").mkdir(parents=True)
    (tmp_path / "junk" / "manifest.json").write_text("[1, 2")
    assert_one_line_error(*cli("join", tmp_path / "junk", "-o", tmp_path / "o.gguf")[::2], "not a pack manifest: invalid JSON")
    assert_one_line_error(*cli("verify", tmp_path / "nope")[::2], "no such pack")


def test_split_refuses_existing_output(packed, synth_model, cli):
    before = (packed / "manifest.json").read_bytes()
    assert_one_line_error(*cli("split", synth_model("qwen3moe"), "-o", packed)[::2], "already exists (use --force")
    assert (packed / "manifest.json").read_bytes() == before


def test_split_force_replaces(packed, synth_model, cli):
    assert cli("split", synth_model("qwen3moe"), "-o", packed, "--hot-fraction", "1", "--force")[0] == 0
    new = Pack.open(packed)
    assert new.hot[sorted(new.parts)].all()  # the old pack had half its experts hot
    assert not [p for p in packed.parent.iterdir() if p.name.startswith(".")]


def test_join_refuses_existing_output(packed, cli, tmp_path):
    (tmp_path / "o.gguf").write_bytes(b"keep")
    assert_one_line_error(*cli("join", packed, "-o", tmp_path / "o.gguf")[::2], "already exists")
    assert (tmp_path / "o.gguf").read_bytes() == b"keep"


def test_split_budget_too_small(synth_model, cli, tmp_path):
    out = tmp_path / "m.sparkpack"
    assert_one_line_error(*cli("split", synth_model("qwen3moe"), "--vram", "100MiB", "-o", out)[::2],
                          "is too small: non-expert weights")
    assert not out.exists()


def test_split_profile_for_other_model(synth_model, cli, tmp_path):
    other = GGUFModel(synth_model("qwen3moe", seed=3))
    prof = Profile.new(model_identity(other), model_spec(other))
    prof.save(tmp_path / "p.json")
    assert_one_line_error(*cli("split", synth_model("qwen3moe"), "--profile", tmp_path / "p.json",
                               "-o", tmp_path / "m.sparkpack")[::2], "profile is for another model")


def test_split_profile_wrong_shape(synth_model, cli, tmp_path):
    other = GGUFModel(synth_model("laguna"))
    Profile.new(model_identity(other), model_spec(other)).save(tmp_path / "p.json")
    assert_one_line_error(*cli("split", synth_model("qwen3moe"), "--profile", tmp_path / "p.json",
                               "-o", tmp_path / "m.sparkpack")[::2], "profile has 5 layers x 16 experts")


def test_split_bad_profile_file_and_flags(synth_model, cli, tmp_path):
    (tmp_path / "p.json").write_text("{}")
    assert_one_line_error(*cli("split", synth_model("qwen3moe"), "--profile", tmp_path / "p.json",
                               "-o", tmp_path / "m.sparkpack")[::2], "not a profile")
    assert_one_line_error(*cli("split", synth_model("qwen3moe"), "--vram", "1GiB", "--hot-fraction", "0.5",
                               "-o", tmp_path / "m.sparkpack")[::2], "either --vram or --hot-fraction")
    assert_one_line_error(*cli("split", tmp_path / "p.json", "-o", tmp_path / "m.sparkpack")[::2], "GGUF")


# --- crash safety ---------------------------------------------------------------------------

def kill_split_midway(model: Path, out: Path, *extra: str) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "sparkpack.repack.cli", "split", str(model), "-o", str(out),
                             "--hot-fraction", "0", "--compress", *extra],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp = out.parent / f".{out.name}.sparkpack-tmp-{proc.pid}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        layer0 = tmp / "cold" / "L000"
        if layer0.is_dir() and any(layer0.iterdir()):  # header and hot shard done, cold shards started
            break
        time.sleep(0.002)
    assert proc.poll() is None, "split finished before it could be killed: make the model larger"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert tmp.is_dir()  # it was killed after writing part of the pack


def test_kill_9_leaves_no_pack(slow_model, tmp_path, cli):
    out = tmp_path / "m.sparkpack"
    kill_split_midway(slow_model, out)
    assert not out.exists()
    code, _, err = cli("verify", out)  # removes what the killed split left beside it, then finds no pack
    removed, *rest = err.strip().splitlines()
    assert removed.startswith("repack: removed .m.sparkpack.sparkpack-tmp-") and "a run that was killed" in removed, err
    assert_one_line_error(code, "\n".join(rest), "no such pack")
    assert [p.name for p in tmp_path.iterdir()] == []
    assert cli("split", slow_model, "-o", out, "--hot-fraction", "0.2")[0] == 0
    assert [p.name for p in tmp_path.iterdir()] == ["m.sparkpack"]


def test_kill_9_with_force_keeps_old_pack(slow_model, tmp_path, cli):
    out = tmp_path / "m.sparkpack"
    assert cli("split", slow_model, "-o", out, "--hot-fraction", "1")[0] == 0
    before = (out / "manifest.json").read_bytes()
    kill_split_midway(slow_model, out, "--force")
    assert (out / "manifest.json").read_bytes() == before
    verify_pack(out)
    old = Pack.open(out)
    assert old.hot[sorted(old.parts)].all()  # still the all-hot pack, not the killed all-cold one
