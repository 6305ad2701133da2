"""Corrupted packs are refused by verify, join and spark-run, never turned into a different file or
different logits (the reproducers of issue 28), and version-1 packs stay readable and checked."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sparkpack.formats.sparkpack import Pack
from tests.pack_edit import edit_manifest, read_manifest, to_version_1, write_manifest

REPO = Path(__file__).resolve().parents[1]
IDS = "1,5,9,200,31"
# CI runs spark-run on the CPU; on the GPU machine SPARKPACK_TEST_DEVICE=cuda runs the same checks
# through the GPU load path (hot experts to VRAM, cold ones to pinned host memory).
DEVICE = os.environ.get("SPARKPACK_TEST_DEVICE", "cpu")


def run(monkeypatch, capsys, prog: str, *args) -> tuple[int, str]:
    """The real ``repack`` / ``spark-run`` entry point in-process: (exit code, stderr)."""
    if prog == "repack":
        from sparkpack.repack.cli import main
    else:
        from sparkpack.runtime.cli import main
    monkeypatch.setattr(sys, "argv", [prog, *map(str, args)])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    return code, capsys.readouterr().err


def one_line(code: int, err: str, prog: str, needle: str = "") -> None:
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("experts:")]
    assert code != 0 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error:") and needle in lines[0], err


@pytest.fixture(scope="module")
def clean(tmp_path_factory, synth_model):
    """A split qwen3moe pack (half its experts hot), its compressed twin, and reference logits."""
    from sparkpack.repack.cli import main

    root = tmp_path_factory.mktemp("clean")
    src = synth_model("qwen3moe")
    for name, extra in (("plain", []), ("zstd", ["--compress"])):
        sys.argv = ["repack", "split", str(src), "-o", str(root / f"{name}.sparkpack"), "--hot-fraction", "0.5",
                    *extra]
        try:
            main()
        except SystemExit as e:
            assert not e.code
    return {"src": src, "root": root}


@pytest.fixture
def pack(clean, tmp_path):
    def copy(name: str = "plain") -> Path:
        dst = tmp_path / f"{name}.sparkpack"
        shutil.copytree(clean["root"] / f"{name}.sparkpack", dst)
        return dst
    return copy


@pytest.fixture
def cli(monkeypatch, capsys):
    return lambda prog, *a: run(monkeypatch, capsys, prog, *a)


def logits(cli, pack: Path, out: Path, *store: str) -> tuple[int, str, np.ndarray | None]:
    code, err = cli("spark-run", pack, "--device", DEVICE, "--prompt-ids", IDS, "--logits-out", out, *store)
    return code, err, np.load(out) if code == 0 else None


@pytest.fixture(scope="module")
def reference(clean, tmp_path_factory):
    """Logits of the clean pack (every residency gives the same bits)."""
    from sparkpack.runtime.cli import main

    out = tmp_path_factory.mktemp("ref") / "ref.npy"
    sys.argv = ["spark-run", str(clean["root"] / "plain.sparkpack"), "--device", DEVICE, "--prompt-ids", IDS,
                "--logits-out", str(out)]
    try:
        main()
    except SystemExit as e:
        assert not e.code
    return np.load(out)


def flip(path: Path, offset: int) -> None:
    """One byte changed in place, with dd (as a user would)."""
    with open(path, "rb") as f:
        f.seek(offset)
        b = f.read(1)[0]
    subprocess.run(["dd", f"of={path}", "bs=1", f"seek={offset}", "count=1", "conv=notrunc", "status=none"],
                   input=bytes([b ^ 0x10]), check=True)


def cold(p: Path, i: int = 0):
    return [r for r in Pack.open(p).records.values() if not r.hot][i]


def hot_expert(p: Path):
    return next(r for r in Pack.open(p).records.values() if r.hot)


def hot_tensor(p: Path):
    return next(t for t in Pack.open(p).tensors.values() if t.shard)


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_suffix(".swap")
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)


def _recompress_changed(p: Path) -> None:
    """A cold zstd frame replaced by a valid frame of different content (one byte changed)."""
    import zstandard

    rec = cold(p)
    data = bytearray(zstandard.ZstdDecompressor().decompress((p / rec.shard).read_bytes()))
    data[len(data) // 2] ^= 1
    (p / rec.shard).write_bytes(zstandard.ZstdCompressor(level=3).compress(bytes(data)))


def _claim_one_tib(p: Path) -> None:
    """A frame whose header claims 1 TiB of content, with the manifest re-sealed around it so
    only the decompression bound can catch it."""
    from sparkpack.formats.checksums import checksum

    rec = cold(p)
    raw = (p / rec.shard).read_bytes()
    fhd = raw[4]
    assert fhd & 3 == 0  # no dictionary id
    single = (fhd >> 5) & 1
    old_header = 5 + (0 if single else 1) + {0: single, 1: 2, 2: 4, 3: 8}[fhd >> 6]
    # single segment, 8-byte content size, the frame's checksum flag kept
    new = raw[:4] + bytes([0xE0 | (fhd & 4)]) + (1 << 40).to_bytes(8, "little") + raw[old_header:]
    (p / rec.shard).write_bytes(new)

    def fix(m):
        lay = next(lay for lay in m["experts"] if lay["layer"] == rec.layer)
        lay["experts"][rec.expert].update(stored_nbytes=len(new), shard_checksum=checksum(m["checksum"], new))
    edit_manifest(p, fix)


CORRUPTIONS = {
    "cold byte": ("plain", lambda p: flip(p / cold(p).shard, cold(p).nbytes // 2)),
    "hot expert byte": ("plain", lambda p: flip(p / "hot.bin", hot_expert(p).offset + 3)),
    "hot tensor byte": ("plain", lambda p: flip(p / "hot.bin", hot_tensor(p).offset + 1)),
    "swapped cold shards": ("plain", lambda p: _swap(p / cold(p, 0).shard, p / cold(p, 1).shard)),
    "zero-filled cold shard": ("plain", lambda p: (p / cold(p).shard).write_bytes(bytes(cold(p).nbytes))),
    "re-compressed frame": ("zstd", _recompress_changed),
    "frame claiming 1 TiB": ("zstd", _claim_one_tib),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_shard_is_refused_everywhere(pack, clean, cli, tmp_path, reference, case):
    kind, corrupt = CORRUPTIONS[case]
    p = pack(kind)
    corrupt(p)
    one_line(*cli("repack", "verify", p), "repack")
    out = tmp_path / "back.gguf"
    one_line(*cli("repack", "join", p, "-o", out), "repack")
    assert not out.exists() and not list(tmp_path.glob(".back.gguf*"))
    # spark-run: the store loads every expert (hot to the pool, cold to the host tier) and checks
    # each; the plain path reads an expert when it is first routed: refused, or the bits of the
    # clean pack if the corrupt expert was never used
    code, err, got = logits(cli, p, tmp_path / "store.npy", "--hot-fraction", "0.5")
    one_line(code, err, "spark-run", "fails its checksum" if case != "frame claiming 1 TiB" else "claims")
    code, err, got = logits(cli, p, tmp_path / "plain.npy")
    if code != 0:
        one_line(code, err, "spark-run")
    else:
        assert np.array_equal(got, reference)


def test_dd_flip_then_join_reproducer(pack, cli, tmp_path):
    """Split a tiny model, flip one byte inside a cold shard with dd, join: refused, nothing written."""
    p = pack()
    rec = cold(p)
    flip(p / rec.shard, 100)
    code, err = cli("repack", "join", p, "-o", tmp_path / "x.gguf")
    one_line(code, err, "repack", f"shard {rec.shard} fails its checksum")
    assert [x.name for x in tmp_path.iterdir()] == [p.name]


def _swap_source_offsets(m):
    """Two same-size non-expert tensors trade places in the rebuilt file."""
    ts = [t for t in m["tensors"] if t["shard"]]
    a, b = next((a, b) for a in ts for b in ts if a is not b and a["nbytes"] == b["nbytes"])
    a["source_offset"], b["source_offset"] = b["source_offset"], a["source_offset"]
    m["tensors"].sort(key=lambda t: t["source_offset"])


MANIFEST_EDITS = {
    "parts offset": lambda m: m["experts"][0]["parts"][1].update(offset=m["experts"][0]["parts"][1]["offset"] + 64),
    "tensor offset": lambda m: next(t for t in m["tensors"] if t["shard"] and t["offset"]).update(
        offset=next(t for t in m["tensors"] if t["shard"] and t["offset"])["offset"] + 1),
    "source offset": lambda m: m["tensors"][1].update(source_offset=m["tensors"][1]["source_offset"] + 32),
    "data offset": lambda m: m["source"].update(data_offset=m["source"]["data_offset"] - 32),
    "gaps": lambda m: m["source"]["gaps"].append([m["source"]["identity"]["file_size"], 5, None]),
    "header hash": lambda m: m["source"]["identity"].update(header_hash="sha256:" + "0" * 64),
    "metadata value": lambda m: m["metadata"].update({"qwen3moe.rope.freq_base": 12345.0}),
    "swapped source offsets": _swap_source_offsets,
    "expert stored size": lambda m: next(r for lay in m["experts"] for r in lay["experts"] if r["hot"]).update(
        stored_nbytes=1),
}


@pytest.mark.parametrize("version", [2, 1])
@pytest.mark.parametrize("edit", sorted(MANIFEST_EDITS))
def test_manifest_edit_is_refused(pack, cli, tmp_path, reference, edit, version):
    """Resealed (v2) or unsealed (v1, which has no checksum): every edit of a field join relies
    on is refused by verify and join; spark-run refuses it or (a field no result depends on,
    like the identity hash that only matches profiles) computes the clean pack's exact bits."""
    p = pack()
    if version == 1:
        to_version_1(p)
    edit_manifest(p, MANIFEST_EDITS[edit])
    one_line(*cli("repack", "verify", p), "repack")
    one_line(*cli("repack", "join", p, "-o", tmp_path / "x.gguf"), "repack")
    assert not (tmp_path / "x.gguf").exists()
    code, err, got = logits(cli, p, tmp_path / "x.npy")
    if edit == "header hash" and code == 0:
        assert np.array_equal(got, reference)
    elif not (edit == "metadata value" and version == 2):
        # (a re-sealed v2 manifest is a pack rewritten on purpose: spark-run takes its metadata
        # as written; verify and join refuse it, the header disagrees)
        one_line(code, err, "spark-run")


def test_unsealed_edit_fails_the_manifest_checksum(pack, cli):
    p = pack()
    edit_manifest(p, lambda m: m["placement"].update(profile="other.json"), reseal=False)
    one_line(*cli("repack", "inspect", p), "repack", "manifest fails its checksum")


def test_version_1_pack_reads_joins_and_runs(pack, clean, cli, tmp_path, reference):
    p = pack("zstd")
    to_version_1(p)
    assert Pack.open(p).version == 1 and Pack.open(p).algorithm == "sha256"
    code, err = cli("repack", "verify", p)
    assert code == 0, err
    assert cli("repack", "join", p, "-o", tmp_path / "back.gguf")[0] == 0
    assert (tmp_path / "back.gguf").read_bytes() == clean["src"].read_bytes()
    code, err, got = logits(cli, p, tmp_path / "v1.npy", "--hot-fraction", "0.5")
    assert code == 0, err
    assert np.array_equal(got, reference)


def test_verified_pack_joins_byte_identically(pack, clean, cli, tmp_path):
    p = pack()
    assert Pack.open(p).algorithm == "xxh3_128" and Pack.open(p).version == 2
    code, err = cli("repack", "verify", p)
    assert code == 0, err
    assert cli("repack", "join", p, "-o", tmp_path / "back.gguf")[0] == 0
    assert (tmp_path / "back.gguf").read_bytes() == clean["src"].read_bytes()


@pytest.mark.parametrize("command", ["verify", "join", pytest.param("spark-run", marks=pytest.mark.slow)])
def test_fifo_in_place_of_a_shard_does_not_block(pack, tmp_path, command):
    p = pack()
    rec = cold(p)
    (p / rec.shard).unlink()
    os.mkfifo(p / rec.shard)
    args = {"verify": ["-m", "sparkpack.repack.cli", "verify", str(p)],
            "join": ["-m", "sparkpack.repack.cli", "join", str(p), "-o", str(tmp_path / "x.gguf")],
            "spark-run": ["-m", "sparkpack.runtime.cli", str(p), "--device", DEVICE, "--prompt-ids", IDS,
                          "--max-tokens", "1", "--hot-fraction", "0.5"]}[command]
    r = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"shard {rec.shard} is not a regular file" in r.stderr


def test_deeply_nested_manifest(pack, cli):
    p = pack()
    m = read_manifest(p)
    (p / "manifest.json").write_text("[" * 100000 + "]" * 100000)
    one_line(*cli("repack", "verify", p), "repack", "nested too deeply")
    m["metadata"]["x"] = json.loads("[" * 40 + "]" * 40)
    write_manifest(p, m)
    one_line(*cli("repack", "inspect", p), "repack", "nested more than")


def test_split_refuses_a_zero_dimension(synth_model, tmp_path, cli):
    from tests.gguf_edit import rewrite

    # a valid GGUF with one tensor of no elements: nothing a pack can hold
    src = rewrite(synth_model("qwen3moe"), tmp_path / "z.gguf", {}, {"extra.weight": np.zeros((0, 4), np.float32)})
    out = tmp_path / "z.sparkpack"
    one_line(*cli("repack", "split", src, "-o", out), "repack", "extra.weight has shape [4, 0]")
    assert not out.exists()


@pytest.mark.parametrize("how", ["onto", "same offset", "partial", "inside the header"])
@pytest.mark.parametrize("version", [2, 1])
def test_overlap_in_the_header_copy_is_refused(pack, cli, tmp_path, reference, how, version):
    """header.bin's tensor index with one tensor moved onto another's bytes, its identity hash
    re-computed (issue 43): verify and join refuse it naming both tensors; spark-run reads a v1
    pack's header at open and refuses it too, a v2 pack's never (the manifest's map is sound and
    the logits are the clean pack's)."""
    from tests.pack_edit import overlap_in_header

    p = pack()
    if version == 1:
        to_version_1(p)
    mover, target = ("blk.1.attn_q.weight" if how == "same offset" else "blk.1.ffn_norm.weight",
                     "blk.1.attn_output.weight")
    overlap_in_header(p, mover, target, how)
    needle = f"{mover} has data offset" if how == "inside the header" else f"{target} (bytes"
    for args in (("verify", p), ("join", p, "-o", tmp_path / "x.gguf")):
        code, err = cli("repack", *args)
        one_line(code, err, "repack", needle)
        assert "header.bin" in err and mover in err
    assert not (tmp_path / "x.gguf").exists()
    code, err, got = logits(cli, p, tmp_path / "x.npy")
    if version == 1:
        one_line(code, err, "spark-run", needle)
    else:
        assert code == 0 and np.array_equal(got, reference), err


@pytest.mark.parametrize("how", ["onto", "same offset", "partial", "inside the header"])
def test_overlap_in_the_manifest_is_refused_at_open(pack, cli, tmp_path, how):
    """The manifest's own tensor list moved the same way (re-sealed): every command that opens
    the pack refuses it in one line naming both tensors (or the header, for byte 0)."""
    from tests.pack_edit import overlap_in_manifest

    p = pack()
    overlap_in_manifest(p, "blk.1.attn_q.weight" if how == "same offset" else "blk.1.ffn_norm.weight",
                        "blk.1.attn_output.weight", how)
    needle = "starts at byte 0, inside the header" if how == "inside the header" else "blk.1.attn_output.weight ("
    one_line(*cli("repack", "inspect", p), "repack", needle)
    one_line(*cli("repack", "verify", p), "repack", needle)
    one_line(*logits(cli, p, tmp_path / "x.npy")[:2], "spark-run", needle)


def test_one_tensor_named_for_two_layers_is_refused(pack, cli):
    """spec.expert_tensors naming one tensor twice (and the parts following it): two layers' experts
    would be read from the same bytes. Refused where the manifest is parsed, naming both places."""
    p = pack()

    def reuse(m):
        m["spec"]["expert_tensors"]["1"]["up"] = m["spec"]["expert_tensors"]["0"]["up"]
        m["experts"][1]["parts"] = m["experts"][0]["parts"]
    edit_manifest(p, reuse)
    for args in (("inspect", p), ("verify", p)):
        one_line(*cli("repack", *args), "repack", "spec.expert_tensors.1.up: names blk.0.ffn_up_exps.weight, already "
                                                  "spec.expert_tensors.0.up")


def test_verify_refuses_a_cold_file_the_manifest_does_not_name(pack, cli, tmp_path, reference):
    """A shard file beside the listed ones (a hot expert's slot, as another split would have
    written it): verify refuses the pack; join and spark-run, which never open it, are unchanged."""
    p = pack()
    m = Pack.open(p)
    cold_one = next(r for r in m.records.values() if not r.hot)
    hot_one = next(r for r in m.records.values() if r.hot and r.layer == cold_one.layer)
    stray = f"cold/L{hot_one.layer:03d}/E{hot_one.expert:04d}.bin"
    shutil.copy(p / cold_one.shard, p / stray)
    one_line(*cli("repack", "verify", p), "repack", f"{stray} is not a shard the manifest names")
    code, err, got = logits(cli, p, tmp_path / "x.npy")
    assert code == 0 and np.array_equal(got, reference), err
    (p / stray).unlink()
    assert cli("repack", "verify", p)[0] == 0
