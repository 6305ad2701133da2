"""The bounded GGUF header walk: equal to gguf-py's reader on real files, one clear line (and no
hang) on hostile ones."""
from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from sparkpack.formats.errors import FormatError
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.gguf_header import scan_header
from tests.gguf_edit import tensor_offset_field

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("arch, quant", [("qwen3moe", "Q8_0"), ("qwen35moe", "Q4_K_M"), ("laguna", "Q6_K")])
def test_walk_equals_gguf_py(synth_model, arch, quant):
    path = synth_model(arch, quant=quant)
    ref = gguf.GGUFReader(path)
    model = GGUFModel(path)
    assert model.metadata_keys == [k for k in ref.fields if not k.startswith("GGUF.")]
    for key in model.metadata_keys:
        assert model.get(key) == ref.fields[key].contents(), key
    assert model.data_offset == ref.data_offset
    assert [(t.name, t.shape, t.qtype, t.offset, t.nbytes) for t in model.tensors.values()] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset), int(t.n_bytes))
        for t in ref.tensors]
    for t in ref.tensors:
        assert np.array_equal(model.raw(t.name), ref.data[t.data_offset: t.data_offset + t.n_bytes])


def test_converted_model_values_equal_gguf_py(tiny_hf_gguf):
    path = tiny_hf_gguf("qwen3moe")[1]
    ref = gguf.GGUFReader(path)
    model = GGUFModel(path)
    for key in model.metadata_keys:
        assert model.get(key) == ref.fields[key].contents(), key


# --- hostile headers --------------------------------------------------------------------------

def _copy(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes())
    return dst


def _field_pos(path: Path, key: str) -> int:
    data = path.read_bytes()
    return scan_header(data, path).fields[key][1]


def _patch(path: Path, offset: int, fmt: str, value) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, value))


def _tensor_info_pos(path: Path, name: str) -> int:
    """Byte offset of the tensor info record of ``name`` (its name length field)."""
    data = path.read_bytes()
    needle = struct.pack("<Q", len(name)) + name.encode()
    return data.index(needle)


def _open_in_child(path: Path) -> subprocess.CompletedProcess:
    """``repack inspect`` in a real process with a time and memory bound."""
    code = ("import resource,sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
            "from sparkpack.repack.cli import main; sys.argv=['repack','inspect',sys.argv[1]]; main()")
    return subprocess.run([sys.executable, "-c", code, str(path)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


HOSTILE = {
    "huge string array count": lambda p: _patch(p, _field_pos(p, "tokenizer.ggml.tokens") + 4, "<Q", 2**62),
    "huge number array count": lambda p: _patch(p, _field_pos(p, "tokenizer.ggml.token_type") + 4, "<Q", 2**40),
    "huge string length": lambda p: _patch(p, _field_pos(p, "general.architecture"), "<Q", 2**63),
    "nested array": lambda p: _patch(p, _field_pos(p, "tokenizer.ggml.token_type"), "<I", 9),
    "unknown value type": lambda p: _patch(p, _field_pos(p, "general.architecture") - 4, "<I", 77),
    "huge kv count": lambda p: _patch(p, 16, "<Q", 2**50),
    "huge tensor count": lambda p: _patch(p, 8, "<Q", 2**50),
    "five dimensions": lambda p: _patch(p, _tensor_info_pos(p, "token_embd.weight") + 8 + 17, "<I", 5),
    "unknown tensor type": lambda p: _patch(p, _tensor_info_pos(p, "output_norm.weight") + 8 + 18 + 4 + 8, "<I", 99),
    "tensor past the end": lambda p: _patch(p, tensor_offset_field(p.read_bytes(), "output_norm.weight"), "<Q", 2**40),
    "truncated header": lambda p: p.write_bytes(p.read_bytes()[:4000]),
    "cut after the tensor index": lambda p: p.write_bytes(p.read_bytes()[:_tensor_index_end(p)]),
    "control characters in a key": lambda p: _rename_key(p, "general.architecture", "general\narch\x00tecture", 77),
}


def _tensor_index_end(path: Path) -> int:
    """The byte after the last tensor info record (where the alignment padding begins)."""
    ref = gguf.GGUFReader(path)
    return max(t.field.offset + sum(part.nbytes for part in t.field.parts) for t in ref.tensors)


def _rename_key(path: Path, key: str, new: str, vtype: int) -> None:
    """Overwrite ``key``'s bytes with ``new`` (same length) and its value type with ``vtype``."""
    assert len(new.encode()) == len(key)
    pos = _field_pos(path, key)
    _patch(path, pos - 4 - len(key), f"{len(key)}s", new.encode())
    _patch(path, pos - 4, "<I", vtype)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_header_is_one_line(synth_model, tmp_path, case):
    path = _copy(synth_model("qwen3moe"), tmp_path / "bad.gguf")
    HOSTILE[case](path)
    with pytest.raises(FormatError):
        GGUFModel(path)
    r = _open_in_child(path)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"repack: error: {path}:"), lines[0]
    assert lines[0].isprintable() and len(lines[0]) < 400, lines[0]


def test_fifo_is_refused_without_blocking(tmp_path):
    import os

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    r = _open_in_child(fifo)
    assert r.returncode == 1 and "is a FIFO" in r.stderr and "Traceback" not in r.stderr


def test_a_vocab_only_file_without_padding_opens(synth_model, tmp_path):
    """llama.cpp ships tokenizers as GGUFs without tensors (models/ggml-vocab-*.gguf) that end right
    after their header, before the alignment padding: ggml and gguf-py read them (an empty data
    section), so we do; a file with tensors cut there is still truncated (``HOSTILE``)."""
    src = GGUFModel(synth_model("qwen3moe"))
    path = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(path, "qwen3moe")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        value = src.get(key)
        w.add_array(key, value) if isinstance(value, list) else w.add_string(key, value)
    w.add_string("general.name", "vocab")  # (last: its bytes end the header, and none is zero)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path.write_bytes(path.read_bytes().rstrip(b"\0"))
    ref = gguf.GGUFReader(path)
    assert ref.data_offset > path.stat().st_size and not ref.tensors  # (the padding is not there)
    model = GGUFModel(path)
    assert not model.tensors and model.get("general.name") == "vocab"
    assert model.get("tokenizer.ggml.tokens") == src.get("tokenizer.ggml.tokens")
