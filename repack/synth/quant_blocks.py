"""Random but valid GGML quant blocks with a chosen weight scale, fast enough for 20 GB files.

Synthetic models must look like real quantized weights to every consumer (gguf's dequantizer,
llama.cpp, our kernels): finite f16 scales, every code in range, dequantized RMS near a target.
Quantizing Gaussian noise through ``gguf.quants.quantize`` would be exact but far too slow for
model-sized tensors, so instead each block starts as raw random bytes (the packed codes are uniform over their range,
which is a valid quantized tensor) and only the per-block scale fields are overwritten with values
chosen so the dequantized RMS hits the target. Offsets (``m``/``dmin``) are set to centre the codes,
so the weights are zero-mean like real ones.

Byte layouts follow ggml's block structs (``ggml-common.h``): the field offsets below are the ones
``gguf.quants`` dequantizes, which the tests check.
"""
from __future__ import annotations

import math

import numpy as np
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from sparkpack.formats.quants import FLOAT_QTYPES

FLOAT_TYPES = tuple(T(q) for q in FLOAT_QTYPES)
# The low-bit types whose blocks are random codes under one f16 scale (``_LOW_BIT_D``): every
# code, grid index and sign index is valid, so the codes need no quantizer (which for the IQ
# types costs minutes a tensor), only the scale a target RMS.
_LOW_BIT_D = {T.Q2_K: 80, T.Q3_K: 108, T.IQ2_XXS: 0, T.IQ2_XS: 0, T.IQ2_S: 0, T.IQ3_XXS: 0, T.IQ3_S: 0,
              T.IQ1_S: 0, T.IQ1_M: -1}  # IQ1_M's d is the top nibbles of its four scale words
SUPPORTED = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, *_LOW_BIT_D) + FLOAT_TYPES
# With ``any_scales`` (kernel tests) also the lookup-table types the kernels read.
ANY_SCALES_TYPES = SUPPORTED + (T.IQ4_XS, T.MXFP4)


def _rms_uniform_int(lo: int, hi: int, centre: float) -> float:
    """RMS of (k - centre) for k uniform over lo..hi (what a random code dequantizes to)."""
    k = np.arange(lo, hi + 1, dtype=np.float64)
    return float(np.sqrt(np.mean((k - centre) ** 2)))


# Per-block jitter of the scale (real blocks do not share one scale): j = 0.8 + 0.4 * u / 255.
_JITTER_RMS = float(np.sqrt(np.mean((0.8 + 0.4 * np.arange(256) / 255.0) ** 2)))


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and 8 six-bit mins per row into ggml's 12-byte K-quant layout."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    return out


# Sub-block scale patterns, picked per block by one random byte: a table gather is several times
# faster than packing bits per block. K-quant scales lie in 32..63 (6 bits) with mins equal to the
# scales (see the centring below); Q6_K's int8 scales in 64..127.
_PATTERNS = np.random.default_rng(20260101)
_K_SC = _PATTERNS.integers(32, 64, size=(256, 8)).astype(np.uint8)
_K_TABLE = _pack_k_scales(_K_SC, _K_SC)
_Q6_TABLE = _PATTERNS.integers(64, 128, size=(256, 16)).astype(np.uint8)
_K_SC_RMS = float(np.sqrt(np.mean(_K_SC.astype(np.float64) ** 2)))
_Q6_SC_RMS = float(np.sqrt(np.mean(_Q6_TABLE.astype(np.float64) ** 2)))

def _rms(values) -> float:
    v = np.asarray(values, dtype=np.float64)
    return float(np.sqrt(np.mean(v**2)))


def _k_any_rms(q_max: int) -> float:
    """RMS of ``sc * q - mn`` (per unit of ``d = dmin``) with random 6-bit scales and mins and codes
    0..q_max: the K-quants' weights when every scale byte is random (``any_scales``)."""
    sc, q = np.arange(64, dtype=np.float64), np.arange(q_max + 1, dtype=np.float64)
    return float(np.sqrt(np.mean(sc**2) * np.mean(q**2) - 2 * np.mean(sc) ** 2 * np.mean(q) + np.mean(sc**2)))


# RMS of one dequantized weight divided by the block's f16 ``d`` (before jitter).
_CODE_RMS = {
    T.Q8_0: _rms_uniform_int(-128, 127, 0.0),
    T.Q4_0: _rms_uniform_int(0, 15, 8.0),
    T.Q4_1: _rms_uniform_int(0, 15, 7.5),
    T.Q5_0: _rms_uniform_int(0, 31, 16.0),
    T.Q5_1: _rms_uniform_int(0, 31, 15.5),
    T.Q4_K: _rms_uniform_int(0, 15, 7.5) * _K_SC_RMS,
    T.Q5_K: _rms_uniform_int(0, 31, 15.5) * _K_SC_RMS,
    T.Q6_K: _rms_uniform_int(0, 63, 32.0) * _Q6_SC_RMS,
    T.IQ4_NL: _rms(gq.IQ4_NL.kvalues),
}
# The same with every sub-block scale (and min) byte random: ``any_scales``.
_ANY_CODE_RMS = {**_CODE_RMS,
                 T.Q4_K: _k_any_rms(15), T.Q5_K: _k_any_rms(31),
                 T.Q6_K: _rms_uniform_int(0, 63, 32.0) * _rms_uniform_int(-128, 127, 0.0),
                 T.IQ4_XS: _rms(gq.IQ4_NL.kvalues) * _rms_uniform_int(0, 63, 32.0)}
_MXFP4_RMS = _rms(gq.MXFP4.kvalues)  # a weight is kvalues[code] * 2^(e - 128) (ggml_e8m0_to_fp32_half)


# Q2_K's realistic scales: a random 4-bit scale per sub-block of 16 with the min equal to it, so that
# with dmin = 1.5 d the codes 0..3 are centred (w = d sc (q - 1.5)).
_Q2_SC = _PATTERNS.integers(8, 16, size=(256, 16)).astype(np.uint8)
_Q2_TABLE = _Q2_SC | (_Q2_SC << 4)


def _set_low_bit_d(qtype: T, blocks: np.ndarray, d: np.ndarray, any_scales: bool) -> None:
    """Write the per-block scale ``d`` (float32 ``[n]``) into low-bit blocks, and for Q2_K
    without ``any_scales`` the centred scale pattern and dmin."""
    at = _LOW_BIT_D[qtype]
    if qtype == T.IQ1_M:  # bits 4i..4i+3 of d are the top nibble of scale word i (bytes 48 + 2i, + 1)
        bits = d.astype(np.float16).view(np.uint16)
        for i in range(4):
            hi = 49 + 2 * i
            blocks[:, hi] = (blocks[:, hi] & 0x0F) | (((bits >> (4 * i)) & 0x0F) << 4).astype(np.uint8)
        return
    d16 = d.astype(np.float16)
    blocks[:, at:at + 2] = d16.view(np.uint8).reshape(-1, 2)
    if qtype == T.Q2_K:
        if not any_scales:
            blocks[:, 0:16] = _Q2_TABLE[blocks[:, 16]]
            blocks[:, 82:84] = _f16_bytes(1.5 * d16.astype(np.float32))
        else:
            blocks[:, 82:84] = _f16_bytes(d)


_UNIT_RMS: dict[tuple[T, bool], float] = {}


def _low_bit_unit_rms(qtype: T, any_scales: bool) -> float:
    """RMS of a random block's weights per unit of its ``d``: measured once per type through
    gguf's dequantizer (the IQ lattices' RMS has no closed form worth keeping)."""
    key = (qtype, any_scales)
    if key not in _UNIT_RMS:
        blocks = random_bytes(make_rng(20260101, int(qtype)), 512 * GGML_QUANT_SIZES[qtype][1]).reshape(512, -1).copy()
        _set_low_bit_d(qtype, blocks, np.ones(512, np.float32), any_scales)
        _UNIT_RMS[key] = _rms(gq.dequantize(blocks.reshape(-1), qtype))
    return _UNIT_RMS[key]


def make_rng(*seed: int) -> np.random.Generator:
    """A fast generator keyed by a tuple (model seed, tensor index, chunk...): chunks can be made in
    any order or process and still give the same file."""
    return np.random.Generator(np.random.SFC64(np.random.SeedSequence(list(seed))))


def random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` uniform random bytes, from the generator's raw words (faster than ``Generator.bytes``)."""
    words = rng.bit_generator.random_raw((n + 7) // 8)
    return words.view(np.uint8)[:n]


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _block_d(blocks: np.ndarray, jitter_col: int, base: float) -> np.ndarray:
    """Per-block scale ``base`` x jitter, the jitter read from a still-random byte of the block."""
    return base * (0.8 + 0.4 * blocks[:, jitter_col].astype(np.float32) / 255.0)


def random_blocks(qtype: int, n_blocks: int, scale: float, rng: np.random.Generator,
                  any_scales: bool = False) -> np.ndarray:
    """``n_blocks`` valid blocks of ``qtype`` whose weights have RMS ~= ``scale``, as uint8 rows.

    For float types a "block" is one element (Gaussian values of std ``scale``). ``any_scales``:
    the sub-block scales and mins stay random bytes like the codes, so every bit pattern of the
    packed scales occurs (what the kernel tests need); only the blocks' f16 (or e8m0) scales are
    set, to finite values around ``scale``, and the weights are not centred.
    """
    qtype = T(qtype)
    ts = GGML_QUANT_SIZES[qtype][1]
    if qtype in FLOAT_TYPES:
        vals = rng.standard_normal(n_blocks, dtype=np.float32) * np.float32(scale)
        return float_bytes(vals, qtype).reshape(n_blocks, ts)
    if qtype in _LOW_BIT_D:
        blocks = random_bytes(rng, n_blocks * ts).reshape(n_blocks, ts)
        d = _block_d(blocks, 20,  # byte 20: codes in every low-bit type
                     scale / (_low_bit_unit_rms(qtype, any_scales) * _JITTER_RMS))
        _set_low_bit_d(qtype, blocks, d, any_scales)
        return blocks
    code_rms = _ANY_CODE_RMS if any_scales else _CODE_RMS
    if qtype not in code_rms and not (any_scales and qtype == T.MXFP4):
        raise ValueError(f"no random block generator for {qtype.name}" + ("" if any_scales else " (any_scales=False)"))
    blocks = random_bytes(rng, n_blocks * ts).reshape(n_blocks, ts)
    if qtype == T.MXFP4:  # the e8m0 exponent byte e (d = 2^(e - 128)): the target's, or one off
        e = round(math.log2(scale / _MXFP4_RMS)) + 128
        blocks[:, 0] = e - 1 + blocks[:, 0] % 3
        return blocks
    base = scale / (code_rms[qtype] * _JITTER_RMS)
    if qtype in (T.Q8_0, T.Q4_0, T.Q5_0, T.IQ4_NL, T.IQ4_XS):
        blocks[:, 0:2] = _f16_bytes(_block_d(blocks, 0, base))
    elif qtype in (T.Q4_1, T.Q5_1):
        d = _block_d(blocks, 0, base).astype(np.float16)
        centre = 7.5 if qtype == T.Q4_1 else 15.5
        blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
        blocks[:, 2:4] = _f16_bytes(-centre * d.astype(np.float32))
    elif qtype in (T.Q4_K, T.Q5_K) and any_scales:  # d and dmin each jittered around the target
        blocks[:, 0:2] = _f16_bytes(_block_d(blocks, 0, base))
        blocks[:, 2:4] = _f16_bytes(_block_d(blocks, 2, base))
    elif qtype in (T.Q4_K, T.Q5_K):
        d = _block_d(blocks, 0, base).astype(np.float16)
        centre = 7.5 if qtype == T.Q4_K else 15.5
        pattern = _K_TABLE[blocks[:, 4]]
        blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
        # value = d*sc*q - dmin*m; with m == sc and dmin = centre*d the codes are centred.
        blocks[:, 2:4] = _f16_bytes(centre * d.astype(np.float32))
        blocks[:, 4:16] = pattern
    elif qtype == T.Q6_K:
        # layout: ql[128] qh[64] scales[16] (int8) d (f16)
        if not any_scales:
            blocks[:, 192:208] = _Q6_TABLE[blocks[:, 192]]
        blocks[:, 208:210] = _f16_bytes(_block_d(blocks, 208, base))
    return blocks


def float_bytes(values: np.ndarray, qtype: int) -> np.ndarray:
    """Float32 values encoded as F32, F16 or BF16 bytes (flat uint8)."""
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    qtype = T(qtype)
    if qtype == T.F32:
        return values.view(np.uint8)
    if qtype == T.F16:
        return values.astype(np.float16).view(np.uint8)
    if qtype == T.BF16:
        bits = values.view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
        return rounded.astype(np.uint16).view(np.uint8)
    raise ValueError(f"{qtype.name} is not a float type")


def random_tensor_bytes(qtype: int, n_elements: int, scale: float, rng: np.random.Generator) -> np.ndarray:
    """Flat bytes of ``n_elements`` random weights in ``qtype`` (a whole number of blocks)."""
    bs = GGML_QUANT_SIZES[T(qtype)][0]
    if n_elements % bs:
        raise ValueError(f"{n_elements} elements are not whole {T(qtype).name} blocks of {bs}")
    return random_blocks(qtype, n_elements // bs, scale, rng).reshape(-1)

