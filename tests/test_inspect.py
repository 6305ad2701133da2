"""``repack inspect`` on synthetic models of every arch and mix, and on broken files through the
real CLI (one line on stderr naming the file and the problem, non-zero exit, no traceback)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner

from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.repack.cli import cli
from sparkpack.repack.synth.presets import get_preset

LAYER_KINDS = {
    "qwen35moe": {"linear-attention": 3, "full-attention": 1, "moe-ffn": 4},
    "laguna": {"full-attention": 2, "sliding-attention": 3, "dense-ffn": 1, "moe-ffn": 4},
    "qwen3moe": {"full-attention": 4, "moe-ffn": 4},
}
EXPERT_TYPES = {  # quant types of the routed-expert tensors of the tiny presets
    ("qwen35moe", "Q4_K_M"): {"Q4_K", "Q6_K"},
    ("laguna", "Q4_K_M"): {"Q4_K", "Q6_K"},
    ("qwen3moe", "Q4_K_M"): {"Q4_K", "Q5_0", "Q8_0"},  # expert ffn 96: down rows fall back
}


def _inspect_json(path: Path) -> dict:
    r = CliRunner().invoke(cli, ["inspect", "--json", str(path)])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


@pytest.mark.parametrize("quant", ["Q4_K_M", "Q8_0", "F16"])
@pytest.mark.parametrize("arch", ["qwen35moe", "laguna", "qwen3moe"])
def test_inspect_synthetic(synth_model, arch: str, quant: str) -> None:
    path = synth_model(arch, quant)
    p = get_preset(arch, "tiny")
    r = _inspect_json(path)
    assert r["arch"] == arch and r["layers"] == p.n_layer
    assert r["layer_kinds"] == LAYER_KINDS[arch]
    assert (r["experts"], r["experts_used"], r["expert_ffn"]) == (p.n_expert, p.n_expert_used, p.n_ff_exp)
    assert r["moe_layers"] == LAYER_KINDS[arch]["moe-ffn"]
    expert_types = set(r["groups"]["routed experts"]["types"])
    assert expert_types == EXPERT_TYPES.get((arch, quant), {quant})
    assert set(r["groups"]["norms"]["types"]) == {"F32"} and set(r["groups"]["router"]["types"]) == {"F32"}
    assert set(r["groups"]["output"]["types"]) == ({"Q6_K"} if quant == "Q4_K_M" else {quant})
    # every data byte is a tensor byte or alignment padding
    with GGUFModel(path) as m:
        align, start = m.alignment, m.data_offset
        padded = sum(-(-t.nbytes // align) * align for t in m.tensors.values())
        assert sorted(t.offset for t in m.tensors.values())[0] == start
    assert r["file_bytes"] - start == padded
    assert 0 <= padded - r["tensor_bytes"] < align * r["tensor_count"]


def _run_inspect(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparkpack.repack.cli", "inspect", str(path)], capture_output=True, text=True)


def _assert_one_line_error(path: Path, *fragments: str) -> None:
    proc = _run_inspect(path)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"repack: error: {path}: "), lines[0]
    for f in fragments:
        assert f in lines[0], lines[0]


def _copy_with(src: Path, dst: Path, *, keep: int | None = None, patch: dict[int, bytes] | None = None) -> Path:
    data = bytearray(src.read_bytes())
    for at, b in (patch or {}).items():
        data[at:at + len(b)] = b
    dst.write_bytes(bytes(data[:keep] if keep is not None else data))
    return dst


def _minimal_gguf(path: Path, arch: str, with_expert_count: bool = True) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_head_count(4)
    if with_expert_count:
        w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_vocab_size(16)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_truncated_file(synth_model, tmp_path: Path) -> None:
    src = synth_model("qwen3moe")
    _assert_one_line_error(_copy_with(src, tmp_path / "head.gguf", keep=200), "truncated")
    with GGUFModel(src) as m:
        cut = m.data_offset + 1000
    _assert_one_line_error(_copy_with(src, tmp_path / "cut.gguf", keep=cut), "truncated")
    _assert_one_line_error(_copy_with(src, tmp_path / "short.gguf", keep=5), "too short")


def test_tensor_offsets_past_end(synth_model, tmp_path: Path) -> None:
    src = synth_model("laguna")
    size = src.stat().st_size
    _assert_one_line_error(_copy_with(src, tmp_path / "last.gguf", keep=size - 64), "truncated")
    # a tensor index entry pointing far past the end: name, n_dims (u32), 2 dims (u64), type (u32), offset
    name = b"output_norm.weight"
    header = src.read_bytes()[:200_000]
    at = header.index(name) + len(name) + 4 + 8 + 4
    assert int.from_bytes(header[at - 12:at - 4], "little") == 256  # the one dim of output_norm
    bad = _copy_with(src, tmp_path / "offset.gguf", patch={at: (size * 4).to_bytes(8, "little")})
    _assert_one_line_error(bad, "truncated")


def test_wrong_magic_and_version(synth_model, tmp_path: Path) -> None:
    src = synth_model("qwen3moe")
    _assert_one_line_error(_copy_with(src, tmp_path / "magic.gguf", patch={0: b"GGML"}), "not a GGUF file")
    _assert_one_line_error(_copy_with(src, tmp_path / "v9.gguf", patch={4: (9).to_bytes(4, "little")}),
                           "unsupported GGUF version 9")


def test_unknown_and_non_moe_arch(tmp_path: Path) -> None:
    _assert_one_line_error(_minimal_gguf(tmp_path / "foo.gguf", "foo"), "architecture 'foo'")
    _assert_one_line_error(_minimal_gguf(tmp_path / "llama.gguf", "llama"), "'llama' is not a mixture-of-experts")


def test_missing_expert_count(tmp_path: Path) -> None:
    _assert_one_line_error(_minimal_gguf(tmp_path / "noexp.gguf", "qwen3moe", with_expert_count=False),
                           "missing metadata key qwen3moe.expert_count")


def test_missing_file(tmp_path: Path) -> None:
    _assert_one_line_error(tmp_path / "nope.gguf", "no such file")
