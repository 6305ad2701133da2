"""Read a transformers checkpoint directory without torch: config.json and safetensors shards.

Tensors come back as float32 numpy arrays because every transform the converter applies (expert
stacking, -exp(A_log), +1 on norms, head reordering) is done in float32, as llama.cpp does for
bf16 sources. bf16 is decoded by hand (numpy has no bfloat16), so torch is never imported.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from sparkpack.formats.errors import SparkpackError

_NP_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


def load_config(hf_dir: Path) -> dict[str, Any]:
    """config.json, with a multimodal wrapper's ``text_config`` merged over the top level."""
    path = hf_dir / "config.json"
    if not hf_dir.is_dir():
        raise SparkpackError(hf_dir, "not a directory (expected a transformers model directory)")
    if not path.is_file():
        raise SparkpackError(hf_dir, "no config.json: not a transformers model directory")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise SparkpackError(path, f"not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise SparkpackError(path, "expected a JSON object")
    if isinstance(config.get("text_config"), dict):
        config = {**config, **config["text_config"]}
    return config


def shard_files(hf_dir: Path) -> list[Path]:
    """The safetensors files of the checkpoint, from the index when there is one."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise SparkpackError(index, f"malformed safetensors index ({e})") from None
        files = [hf_dir / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise SparkpackError(f, "safetensors shard listed in model.safetensors.index.json is missing")
        return files
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise SparkpackError(hf_dir, "no *.safetensors file (only safetensors checkpoints are supported)")
    return files


class SafetensorsSource:
    """Name -> lazily loaded float32 array over all shards of a checkpoint."""

    def __init__(self, hf_dir: Path):
        from safetensors import safe_open

        self._where: dict[str, Path] = {}
        self._dtypes: dict[str, str] = {}
        for f in shard_files(hf_dir):
            header = _read_header(f)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                self._where[name] = f
                self._dtypes[name] = info.get("dtype", "?")
        self._open = safe_open

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        path = self._where[name]
        dtype = self._dtypes[name]
        if dtype not in _NP_DTYPES:
            raise SparkpackError(path, f"tensor {name} has dtype {dtype}; only F32/F16/BF16/F64 are supported")
        if dtype == "BF16":
            return _read_bf16(path, name)
        try:
            with self._open(str(path), framework="np") as f:
                return np.asarray(f.get_tensor(name), dtype=np.float32)
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise SparkpackError(path, f"cannot read tensor {name} ({e})") from None

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self._where:
            yield name, self.get(name)


def _read_header(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ValueError("file shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > 100_000_000:
                raise ValueError(f"header length {n} is implausible")
            header = json.loads(fh.read(n))
    except (ValueError, UnicodeDecodeError) as e:
        raise SparkpackError(path, f"not a valid safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise SparkpackError(path, "not a valid safetensors file (header is not an object)")
    return header


def _read_bf16(path: Path, name: str) -> np.ndarray:
    """bf16 -> float32 exactly: the 16 bits are the high half of the float32."""
    header = _read_header(path)
    info = header[name]
    start, end = info["data_offsets"]
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        fh.seek(8 + n + start)
        raw = fh.read(end - start)
    if len(raw) != end - start:
        raise SparkpackError(path, f"tensor {name} is truncated")
    bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
    return bits.view(np.float32).reshape(info["shape"])
