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
    vtype, pos = model._index.fields[key]
    sub = None
    if vtype == gguf.GGUFValueType.ARRAY:
        sub = gguf.GGUFValueType(struct.unpack_from("<I", model._data, pos)[0])
    return gguf.GGUFValueType(vtype), sub


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
