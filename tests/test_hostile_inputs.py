"""The reproducers of issue 28 for profiles, corpus records and the tokenizer: each class of bad
input is one line (a command) or one counted skip reason (a corpus), never a traceback or a
blow-up."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparkpack.calibrate.readers import read_corpus
from sparkpack.calibrate.readers.base import MAX_LINE_CHARS, MAX_RECORD_CHARS
from sparkpack.formats.archs import model_spec
from sparkpack.formats.errors import FormatError, SparkpackError
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.profile import Profile, model_identity

REPO = Path(__file__).resolve().parents[1]
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.fixture(scope="module")
def profile_json(synth_model) -> dict:
    with GGUFModel(synth_model("qwen3moe")) as m:
        return Profile.new(model_identity(m), model_spec(m)).to_json()


def _huge_count(d):
    d["counts"]["prompt"][0][0] = 2**1100


def _dense_routed(d):
    d["moe_layers"] = d["moe_layers"][1:]
    d["counts"]["prompt"][0][3] = 7


PROFILE_EDITS = {
    "count of 2**1100": (_huge_count, "prompt counts must be numbers"),
    "count as a string": (lambda d: d["counts"]["generated"][1].__setitem__(2, "5"), "generated counts must be numbers"),
    "count as a bool": (lambda d: d["counts"]["generated"][1].__setitem__(2, True), "generated counts must be numbers"),
    "ragged rows": (lambda d: d["counts"]["prompt"][0].pop(), "prompt counts have shape"),
    "n_layer a float": (lambda d: d.update(n_layer=5.0), "n_layer must be an integer"),
    "file size a string": (lambda d: d["identity"].update(file_size="123"), "model identity must have"),
    "tokens an array": (lambda d: d["tokens"].update(prompt=[1]), "prompt token count"),
    "a layer listed twice": (lambda d: d.update(moe_layers=[0, 1, 1, 2, 3]), "moe_layers must list each layer once"),
    "layers out of order": (lambda d: d.update(moe_layers=[3, 2, 1, 0]), "in increasing order"),
    "routings in a layer without experts": (_dense_routed, "prompt counts route tokens in layer 0, which moe_layers"),
}


@pytest.mark.parametrize("case", sorted(PROFILE_EDITS))
def test_bad_profile_field_is_one_line(profile_json, tmp_path, case):
    d = json.loads(json.dumps(profile_json))
    edit, needle = PROFILE_EDITS[case]
    edit(d)
    (tmp_path / "p.json").write_text(json.dumps(d))
    with pytest.raises(FormatError, match=needle):
        Profile.load(tmp_path / "p.json")


def test_profile_of_other_moe_layers_is_refused_by_split(synth_model, profile_json, tmp_path):
    """Layers and experts per layer agree, the identity too, but not which layers have experts:
    the counts would be read for the wrong layers. One line from the real command."""
    d = json.loads(json.dumps(profile_json))
    d["moe_layers"] = d["moe_layers"][1:]
    (tmp_path / "p.json").write_text(json.dumps(d))
    r = subprocess.run([sys.executable, "-m", "sparkpack.repack.cli", "split", str(synth_model("qwen3moe")),
                        "--profile", str(tmp_path / "p.json"), "-o", str(tmp_path / "m.sparkpack")], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0] == f"repack: error: {tmp_path / 'p.json'}: profile's MoE layers [1, 2, 3] are not the model's " \
                       "[0, 1, 2, 3]", lines[0]
    assert not (tmp_path / "m.sparkpack").exists()


@pytest.mark.parametrize("text, needle", [
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
    ('{"a":' * 20 + "1" + "}" * 20, "nested more than 8 levels"),
    ('{"format": "sparkpack-profile", "n": NaN}', "NaN is not a number JSON allows"),
    ('{"n": 1' + "0" * 5000 + "}", "invalid JSON"),
])
def test_profile_text_is_one_line(tmp_path, text, needle):
    (tmp_path / "p.json").write_text(text)
    with pytest.raises(FormatError, match=needle):
        Profile.load(tmp_path / "p.json")


def test_profile_fifo_is_refused(tmp_path):
    os.mkfifo(tmp_path / "p.json")
    with pytest.raises(SparkpackError, match="is a FIFO"):
        Profile.load(tmp_path / "p.json")


# --- corpus records -------------------------------------------------------------------------------

def read_all(path: Path):
    convs, stats = read_corpus(path)
    return list(convs), stats


@pytest.mark.parametrize("line, reason", [
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
    (json.dumps({"messages": json.loads("[" * 80 + "]" * 80)}), "nested too deeply"),
    ('{"messages": [{"role": "user", "content": "bad \\ud800 text"}]}', "invalid unicode"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": ["image"], "text": "x"}]}]}), None),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "tool_use", "name": "x"}], "x": 1}],
                 "system": "s", "tools": 5}), "wrong types"),
    (json.dumps({"system": "s", "messages": 4096}), "wrong types"),
    (json.dumps({"messages": [{"role": ["user"], "content": "x"}]}), "wrong types"),
    (json.dumps({"conversations": [{"from": {"a": 1}, "value": "x"}]}), "unknown role"),
    ('{"prompt": 1' + "0" * 5000 + "}", "bad json"),
])
def test_bad_record_is_counted_not_fatal(tmp_path, line, reason):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(CHAT) + "\n" + line + "\n" + json.dumps(CHAT) + "\n")
    convs, stats = read_all(path)
    assert len(convs) >= 2
    if reason is not None:
        assert stats.skipped[reason] == 1, stats.skipped


def test_codex_unhashable_type_is_counted(tmp_path):
    d = tmp_path / "codex"
    d.mkdir()
    good = {"type": "response_item", "payload": {"type": "message", "role": "user",
                                                 "content": [{"type": "input_text", "text": "hi"}]}}
    bad = {"type": ["function_call"], "call_id": "c1", "name": "x"}
    (d / "rollout.jsonl").write_text("\n".join(json.dumps(x) for x in (good, bad, good)) + "\n")
    convs, stats = read_all(d)
    assert len(convs) == 1 and len(convs[0].messages) == 2


def test_huge_line_is_skipped_without_reading_it_whole(tmp_path):
    """A line of 16M characters: streamed past and counted; the records around it are read."""
    path = tmp_path / "c.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps(CHAT) + "\n")
        f.write('{"prompt": "' + "a" * (2 * MAX_LINE_CHARS) + '"}\n')
        f.write(json.dumps(CHAT) + "\n")
    convs, stats = read_all(path)
    assert len(convs) == 2 and stats.skipped["record too large"] == 1


def test_record_over_the_text_cap_is_skipped(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(CHAT) + "\n" + json.dumps({"prompt": "word " * (MAX_RECORD_CHARS // 5 + 1)}) + "\n")
    convs, stats = read_all(path)
    assert len(convs) == 1 and stats.skipped["record too large"] == 1


def test_fifo_in_a_corpus_folder_is_skipped(tmp_path):
    (tmp_path / "c.jsonl").write_text(json.dumps(CHAT) + "\n")
    os.mkfifo(tmp_path / "pipe.jsonl")
    convs, stats = read_all(tmp_path)
    assert len(convs) == 1 and stats.skipped["not a regular file"] == 1


def test_tokenizer_refuses_text_past_its_cap(synth_model):
    from sparkpack.runtime.tokenizer import MAX_ENCODE_CHARS, GGUFTokenizer

    tok = GGUFTokenizer.from_metadata(GGUFModel(synth_model("qwen3moe")))
    with pytest.raises(SparkpackError, match="more than the"):
        tok.encode("a" * (MAX_ENCODE_CHARS + 1))


@pytest.mark.slow
def test_calibrate_on_a_hostile_corpus_under_a_memory_bound(synth_model, tmp_path):
    """The issue's 16-64 MB line through the real command, in a process limited to +3 GiB:
    counted, skipped, the rest calibrated."""
    corpus = tmp_path / "c.jsonl"
    with open(corpus, "w") as f:
        f.write(json.dumps(CHAT) + "\n")
        f.write(json.dumps({"prompt": "1" * (16 << 20)}) + "\n")
        f.write("[" * 100000 + "\n")
        f.write('{"messages": [{"role": "user", "content": "\\udfff"}]}\n')
    code = ("import resource,sys; resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30)); "
            "from sparkpack.repack.cli import main; sys.argv=['repack', *sys.argv[1:]]; main()")
    r = subprocess.run([sys.executable, "-c", code, "calibrate", str(synth_model("qwen3moe")), "--corpus", str(corpus),
                        "-o", str(tmp_path / "p.json"), "--device", "cpu", "--quiet"], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "1 record too large" in r.stdout and "1 nested too deeply" in r.stdout and "1 invalid unicode" in r.stdout
    Profile.load(tmp_path / "p.json")


# --- compressed logs (.gz, .zst) ------------------------------------------------------------------

def _deflate_damaged(data: bytes) -> bytes:
    """A gzip file whose deflate stream is damaged in the middle (zlib.error, not OSError)."""
    import gzip
    import io
    import zlib

    raw = bytearray(gzip.compress(data))
    for i in range(20, len(raw) - 8):
        bad = bytearray(raw)
        bad[i] ^= 0xFF
        try:
            with gzip.open(io.BytesIO(bytes(bad))) as f:  # streamed, as the readers read it
                f.read()
        except zlib.error:
            return bytes(bad)
        except (OSError, EOFError):
            continue
    raise AssertionError("no flip gave a zlib.error")


def test_damaged_gzip_stream_is_counted(tmp_path):
    lines = "".join(json.dumps({"prompt": f"record {i} " + "x" * (i % 50)}) + "\n" for i in range(2000))
    (tmp_path / "a.jsonl.gz").write_bytes(_deflate_damaged(lines.encode()))
    (tmp_path / "b.jsonl").write_text(json.dumps(CHAT) + "\n")
    convs, stats = read_all(tmp_path)
    assert stats.skipped["unreadable file"] == 1 and stats.per_file[str(tmp_path / "b.jsonl")] == 1, stats.skipped


@pytest.mark.parametrize("name", ["big.jsonl.zst", "big.json.zst", "big.md.gz"])
def test_decompression_bomb_is_bounded(tmp_path, name):
    """A few kilobytes that decompress to 64M characters of one line (or one document): read
    only up to the caps, counted as too large, under a memory bound in a real process."""
    import gzip

    import zstandard

    body = b'{"prompt": "' + b"a" * (64 << 20) + b'"}\n'
    packed = gzip.compress(body) if name.endswith(".gz") else zstandard.ZstdCompressor(level=19).compress(body)
    assert len(packed) < (1 << 20)
    (tmp_path / name).write_bytes(packed)
    code = ("import resource,sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
            "from sparkpack.calibrate.readers import read_corpus; from pathlib import Path; "
            "c, s = read_corpus(Path(sys.argv[1])); n = len(list(c)); print(n, dict(s.skipped))")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / name)], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.startswith("0 ") and ("too large" in r.stdout), r.stdout
