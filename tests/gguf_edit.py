"""Rewrite a GGUF with some metadata changed (tests of bad hyperparameters and the fuzzers).

gguf-py's writer produces the file, so everything except the edited values is a real GGUF:
the tensors keep their bytes, types and order."""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from sparkpack.formats.gguf_file import GGUFModel

DROP = object()
PLAIN = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}  # a value that removes the key


def field_types(model: GGUFModel, key: str) -> tuple[gguf.GGUFValueType, gguf.GGUFValueType | None]:
    vtype, sub = model.value_type(key)
    return gguf.GGUFValueType(vtype), None if sub is None else gguf.GGUFValueType(sub)


def rewrite(src: Path, dst: Path, edits: dict[str, Any], add_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """Copy ``src`` to ``dst`` with ``edits`` applied: key -> value (written with the key's old
    type, or ``(value, GGUFValueType[, sub type])`` to choose one), or ``DROP``; ``add_tensors``
    are appended (float32 arrays, numpy order)."""
    model = GGUFModel(src)
    arch = edits.get("general.architecture", model.arch)
    arch = arch[0] if isinstance(arch, tuple) else arch
    w = gguf.GGUFWriter(str(dst), str(arch))
    keys = list(model.metadata_keys) + [k for k in edits if k not in model.metadata_keys]
    for key in keys:
        if key in ("general.architecture", "GGUF.version"):
            continue
        value = edits.get(key, model.get(key))
        if value is DROP:
            continue
        if isinstance(value, tuple):
            w.add_key_value(key, value[0], value[1], value[2] if len(value) > 2 else None)
            continue
        vtype, sub = field_types(model, key)
        w.add_key_value(key, value, vtype, sub)
    for t in model.tensors.values():
        qtype = gguf.GGMLQuantizationType(t.qtype)
        raw = np.array(model.raw(t.name))
        dims = tuple(reversed(t.shape))  # numpy order
        if qtype in PLAIN:
            w.add_tensor(t.name, raw.view(PLAIN[qtype]).reshape(dims))
        else:  # rows of blocks, as bytes
            w.add_tensor(t.name, raw.reshape(*dims[:-1], -1), raw_dtype=qtype)
    for name, array in (add_tensors or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model.close()
    return dst


# --- the tensor map -------------------------------------------------------------------------------

# How one tensor is moved onto another's bytes (issue 43), each a way ggml refuses a file:
# "onto": the case, a small tensor at the start of a big one; "same offset": two tensors
# of any size at one offset; "partial": a tensor starting inside another's range, past its start;
# "inside the header": an offset that wraps (as ggml adds it, in uint64) to byte 0 of the file.
OVERLAPS = ("onto", "same offset", "partial", "inside the header")


def tensor_offset_field(header: bytes, name: str) -> int:
    """Where ``name``'s u64 data offset sits in a GGUF header (or a pack's ``header.bin``)."""
    pos = header.rindex(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)
    n_dims = struct.unpack_from("<I", header, pos)[0]
    return pos + 4 + 8 * n_dims + 4


def overlapping_offset(path: Path, mover: str, target: str, how: str) -> int:
    """The data offset that puts tensor ``mover`` of the GGUF or header at ``path`` on ``target``'s
    range the way ``how`` says (one of ``OVERLAPS``)."""
    from sparkpack.formats.gguf_header import scan_header

    data = path.read_bytes()
    index = scan_header(data, path, file_size=2**63)  # a header.bin is shorter than its source
    t = {e.name: e for e in index.tensors}[target]
    if how in ("onto", "same offset"):
        return t.offset
    if how == "partial":
        inside = t.nbytes // 2 // index.alignment * index.alignment
        assert inside > 0, f"{target} is too small to start inside"
        return t.offset + inside
    assert how == "inside the header", how
    return 2**64 - index.data_offset


def move_tensor(path: Path, mover: str, target: str, how: str) -> int:
    """Rewrite ``mover``'s data offset in place so it overlaps ``target`` (``OVERLAPS``); returns
    the new offset. Works on a GGUF and on a pack's ``header.bin`` alike."""
    offset = overlapping_offset(path, mover, target, how)
    with open(path, "r+b") as f:
        header = f.read(1 << 20)
        f.seek(tensor_offset_field(header, mover))
        f.write(struct.pack("<Q", offset))
    return offset
