"""GGML quantized bytes -> torch tensors, vectorised, on the device the bytes live on.

gguf-py's numpy dequantizer is the reference (it matches llama.cpp bit for bit), but it runs on
the CPU and slowly; expert weights are re-expanded on every cache miss, so the runtime
needs the same arithmetic as whole-tensor torch ops that also run on CUDA. Each function below
repeats the reference's float32 operations *in the same order* (``d * sc`` before ``* q`` and so
on): float32 products are not associative, and the tests demand bit-exact agreement.

Grid and sign tables of the IQ types are taken from ``gguf.quants`` at import time rather than
retyped. Types without a torch implementation fall back to ``gguf.quants.dequantize``.
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from math import prod

import numpy as np
import torch
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

log = logging.getLogger(__name__)

_QK_K = 256
_IQ4_NL_VALUES = tuple(gq.IQ4_NL.kvalues)
_MXFP4_VALUES = tuple(gq.MXFP4.kvalues)


def _table(name: str) -> np.ndarray:
    """The numpy form of one gguf-py lookup table (grids are expanded to float32 once)."""
    if name == "iq2xxs_grid":
        gq.IQ2_XXS.init_grid()
        return np.asarray(gq.IQ2_XXS.grid, dtype=np.float32).reshape(gq.IQ2_XXS.grid_shape)
    if name == "iq3s_grid":
        gq.IQ3_S.init_grid()
        return np.asarray(gq.IQ3_S.grid, dtype=np.float32).reshape(gq.IQ3_S.grid_shape)
    if name == "ksigns":
        return np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8).astype(np.int64)
    if name == "iq4nl":
        return np.array(_IQ4_NL_VALUES, dtype=np.float32)
    if name == "mxfp4":
        return np.array(_MXFP4_VALUES, dtype=np.float32)
    raise KeyError(name)


_TABLE_CACHE: dict[tuple[str, str], torch.Tensor] = {}


def _lut(name: str, device: torch.device) -> torch.Tensor:
    """Lookup tables are small; keep one copy per device so CUDA calls do not re-upload them."""
    key = (name, str(device))
    t = _TABLE_CACHE.get(key)
    if t is None:
        t = torch.from_numpy(_table(name)).to(device)
        _TABLE_CACHE[key] = t
    return t


# --- field helpers: blocks is a [n_blocks, type_size] uint8 tensor -------------------------------

def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """An f16 field at byte ``start`` of every block, as float32 ``[n, 1]``."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[..., k]`` bytes -> ``[..., 2k]``: all low nibbles first, then all high (ggml's order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(b: torch.Tensor) -> torch.Tensor:
    """``[..., k]`` bytes -> ``[..., 8k]`` bits, little-endian within each byte."""
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8)
    return ((b.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:18]).to(torch.int8) - 8
    return d * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 4:20]).float()
    return d * q + m


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    qh = _bits(b[:, 2:6])
    q = (_nibbles(b[:, 6:22]) | (qh << 4)).to(torch.int8) - 16
    return d * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    qh = _bits(b[:, 4:8])
    q = (_nibbles(b[:, 8:24]) | (qh << 4)).float()
    return d * q + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    return b[:, 2:34].contiguous().view(torch.int8).float() * d


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of Q4_K/Q5_K -> eight 6-bit scales and eight 6-bit mins.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same
    for mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_sub_block_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K blocks' per-sub-block scale ``d * sc`` and offset ``dmin * mn``, ``[n, 8, 1]``."""
    sc, mn = _k_scale_min(b[:, 4:16])
    return (_f16(b, 0) * sc.float()).unsqueeze(-1), (_f16(b, 2) * mn.float()).unsqueeze(-1)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dm = _k_sub_block_scales(b)
    q = _nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, _QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dm = _k_sub_block_scales(b)
    ql = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8).view(1, 8, 1)
    qh = (b[:, 16:48].reshape(n, 1, 32) >> shifts) & 1  # sub-block i takes bit i of qh[j]
    q = (ql | (qh << 4)).float()
    return (d * q - dm).reshape(n, _QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = _nibbles(b[:, 0:128].reshape(n, 2, 64)).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(1, 1, 4, 1)
    qh = ((b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 8, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b, 208)
    d = (d * scales).reshape(n, 16, 1)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, _QK_K)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = _lut("iq4nl", b.device)[_nibbles(b[:, 2:18]).long()]
    return d * q


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    sh = b[:, 2].long() | (b[:, 3].long() << 8)
    shifts = torch.arange(0, 16, 2, device=b.device)
    hi = ((sh.unsqueeze(-1) >> shifts) & 3).to(torch.uint8)  # [n, 8]
    lo = torch.stack([b[:, 4:8] & 0x0F, b[:, 4:8] >> 4], dim=-1).reshape(n, 8)
    scales = (lo | (hi << 4)).to(torch.int8) - 32
    dl = (d * scales.float()).unsqueeze(-1)
    q = _nibbles(b[:, 8:136].reshape(n, 8, 16))
    return (dl * _lut("iq4nl", b.device)[q.long()]).reshape(n, _QK_K)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    e = b[:, 0:1].to(torch.int32)
    # e8m0 scale halved (the value table is doubled): ggml_e8m0_to_fp32_half.
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    d = bits.view(torch.float32)
    q = _lut("mxfp4", b.device)[_nibbles(b[:, 1:17]).long()]
    return d * q


def _iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    g = b[:, 2:66].reshape(n, 8, 8)
    aux = g[..., 4:8].long()
    aux = aux[..., 0] | (aux[..., 1] << 8) | (aux[..., 2] << 16) | (aux[..., 3] << 24)  # [n, 8]
    db = (d * (0.5 + (aux >> 28).float()) * 0.25).reshape(n, 8, 1, 1)
    sidx = (aux.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], device=b.device)) & 0x7F  # [n, 8, 4]
    sbyte = _lut("ksigns", b.device)[sidx]
    sbits = (sbyte.unsqueeze(-1) >> torch.arange(8, device=b.device)) & 1  # [n, 8, 4, 8]
    signs = torch.where(sbits == 0, 1.0, -1.0)
    grid = _lut("iq2xxs_grid", b.device)[g[..., 0:4].long()]  # [n, 8, 4, 8]
    return (db * grid * signs).reshape(n, _QK_K)


def _iq3_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    qs, qh, sg, sc = b[:, 2:66], b[:, 66:74], b[:, 74:106], b[:, 106:110]
    scales = torch.stack([sc & 0x0F, sc >> 4], dim=-1).reshape(n, 8)
    db = (d * (1 + 2 * scales).float()).reshape(n, 8, 1, 1)
    signs = torch.where(_bits(sg) == 0, 1.0, -1.0).reshape(n, 8, 4, 8)
    idx = qs.long() | (_bits(qh).long() << 8)  # [n, 64]
    grid = _lut("iq3s_grid", b.device)[idx].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, _QK_K)


_BLOCK_FNS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0,
    T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
    T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs, T.MXFP4: _mxfp4, T.IQ2_XXS: _iq2_xxs, T.IQ3_S: _iq3_s,
}
# The plain float types as torch dtypes (their bytes are viewed, not expanded; the dense kernels
# read them the same way).
FLOAT_DTYPES: dict[int, torch.dtype] = {int(T.F32): torch.float32, int(T.F16): torch.float16,
                                        int(T.BF16): torch.bfloat16}
SUPPORTED: frozenset[int] = frozenset(_BLOCK_FNS) | frozenset(FLOAT_DTYPES)
_fallback_noted: set[int] = set()


def _as_bytes(raw: np.ndarray | torch.Tensor | bytes | memoryview) -> torch.Tensor:
    """A flat uint8 torch view of ``raw`` without copying when possible."""
    if isinstance(raw, torch.Tensor):
        if raw.dtype != torch.uint8:
            raise TypeError(f"expected uint8 bytes, got a {raw.dtype} tensor")
        return raw.reshape(-1)
    arr = np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, (bytes, bytearray, memoryview)) else raw
    arr = np.ascontiguousarray(arr).reshape(-1)
    if arr.dtype != np.uint8:
        arr = arr.view(np.uint8)
    with warnings.catch_warnings():  # mmapped files are read-only; nothing here writes to them
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def _fallback(flat: torch.Tensor, qtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    if qtype not in _fallback_noted:
        _fallback_noted.add(qtype)
        log.info("no torch dequantizer for %s; using gguf-py's numpy one (slower)", T(qtype).name)
    rows = flat.cpu().numpy().reshape(-1, flat.numel() // max(1, prod(shape[1:])))
    return torch.from_numpy(np.ascontiguousarray(gq.dequantize(rows, T(qtype)), dtype=np.float32))


def dequantize(raw: np.ndarray | torch.Tensor | bytes, qtype: int, shape: tuple[int, ...],
               device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Expand one tensor's GGML bytes; ``shape`` is GGUF order (ne[0] first), the result is the
    torch order ``reversed(shape)`` on ``device`` (default: where ``raw`` is) in ``dtype``.

    The arithmetic runs in float32 on the target device (bytes are moved first, as they are the
    smallest form), so the result equals gguf-py's before the final cast."""
    shape = tuple(int(s) for s in shape)
    qtype = int(qtype)
    if qtype not in GGML_QUANT_SIZES:
        raise ValueError(f"unknown GGML type {qtype}")
    block, tsize = GGML_QUANT_SIZES[T(qtype)]
    if not shape or shape[0] % block:
        raise ValueError(f"row length {shape[0] if shape else 0} is not a multiple of the "
                         f"{T(qtype).name} block size {block}")
    n_el = prod(shape)
    flat = _as_bytes(raw)
    expected = n_el // block * tsize
    if flat.numel() != expected:
        raise ValueError(f"{T(qtype).name} tensor of shape {shape} needs {expected} bytes, got {flat.numel()}")
    dev = torch.device(device) if device is not None else flat.device
    out_shape = tuple(reversed(shape))
    if qtype in FLOAT_DTYPES:
        vals = flat.to(dev).view(FLOAT_DTYPES[qtype])
        return vals.to(dtype).reshape(out_shape)
    fn = _BLOCK_FNS.get(qtype)
    if fn is None:
        return _fallback(flat, qtype, shape).to(device=dev, dtype=dtype).reshape(out_shape)
    blocks = flat.to(dev).reshape(-1, tsize)
    return fn(blocks).to(dtype).reshape(out_shape)
