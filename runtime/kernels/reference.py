"""Torch-only block generator and dequantizer for the kernel types, for machines without gguf.

Why a second dequantizer next to ``runtime/dequant.py``: the GPU bench must check the kernels at
real shapes on a machine where gguf-py is not installed, and ``runtime.dequant`` imports gguf.
This one covers only the types that have kernels, is written from the block layouts
(ggml-common.h), and is checked bit for bit against ``gguf.quants.dequantize`` by the tests.
"""
from __future__ import annotations

import math

import torch

from sparkpack.runtime.kernels.qmatvec import BLOCK_LAYOUT, IQ4_XS, MXFP4, Q4_0, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0, row_bytes_of

# Byte offsets of each block's f16 fields (d, dmin): random bytes there could be inf/NaN.
F16_FIELDS: dict[int, tuple[int, ...]] = {Q4_0: (0,), Q5_0: (0,), Q8_0: (0,), Q4_K: (0, 2), Q5_K: (0, 2),
                                          Q6_K: (208,), IQ4_XS: (0,), MXFP4: ()}
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # kvalues_iq4nl
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1, doubled (ggml)


def random_blocks(qtype: int, rows: int, K: int, gen: torch.Generator, weight_rms: float = 0.02) -> torch.Tensor:
    """uint8 ``[rows, row_bytes]`` of random valid blocks on ``gen``'s device: random codes and
    sub-block scales (every bit pattern occurs) with finite f16 super-scales giving weights of
    roughly ``weight_rms``."""
    qk, ts = BLOCK_LAYOUT[int(qtype)]
    n_blocks = rows * K // qk
    dev = gen.device
    blocks = torch.randint(0, 256, (n_blocks, ts), generator=gen, dtype=torch.uint8, device=dev)
    # rough code RMS x sub-scale RMS, so that d * sc * q has RMS ~ weight_rms
    spread = {Q4_0: 4.6, Q5_0: 9.2, Q8_0: 74.0, Q4_K: 4.6 * 36.0, Q5_K: 9.2 * 36.0, Q6_K: 18.5 * 73.0,
              IQ4_XS: 67.0 * 18.5, MXFP4: 5.7}[int(qtype)]
    for off in F16_FIELDS[int(qtype)]:
        d = (torch.rand(n_blocks, generator=gen, device=dev) + 0.5) * (weight_rms / spread)
        blocks[:, off:off + 2] = d.to(torch.float16).view(torch.uint8).reshape(n_blocks, 2)
    if int(qtype) == MXFP4:  # the e8m0 exponent byte: d = 2^(e - 128) around weight_rms / spread
        e = round(math.log2(weight_rms / spread)) + 128
        blocks[:, 0] = torch.randint(e - 2, e + 3, (n_blocks,), generator=gen, device=dev).to(torch.uint8)
    return blocks.reshape(rows, row_bytes_of(qtype, K))


def _f16(blocks: torch.Tensor, off: int) -> torch.Tensor:
    return blocks[:, off:off + 2].contiguous().view(torch.float16).float()  # [nb, 1]


def _nibbles(qs: torch.Tensor, groups: int) -> torch.Tensor:
    """[nb, groups*n] bytes -> [nb, groups*2*n] codes: per group all low nibbles, then all high."""
    q = qs.reshape(qs.shape[0], groups, 1, -1)
    return torch.cat([q & 15, q >> 4], dim=2).reshape(qs.shape[0], -1).int()


def _k_scales(sc12: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b = sc12.int()
    sc = torch.cat([b[:, 0:4] & 63, (b[:, 8:12] & 15) | ((b[:, 0:4] >> 6) << 4)], dim=1)
    mn = torch.cat([b[:, 4:8] & 63, (b[:, 8:12] >> 4) | ((b[:, 4:8] >> 6) << 4)], dim=1)
    return sc.float(), mn.float()


def dequantize_rows(raw: torch.Tensor, qtype: int, K: int) -> torch.Tensor:
    """uint8 ``[..., row_bytes]`` -> float32 ``[..., K]`` on the same device."""
    qtype = int(qtype)
    qk, ts = BLOCK_LAYOUT[qtype]
    lead = raw.shape[:-1]
    blk = raw.reshape(-1, ts)
    nb = blk.shape[0]
    if qtype == MXFP4:  # 2^(e - 128) from its float bits, as ggml_e8m0_to_fp32_half
        e = blk[:, 0:1].int()
        d = torch.where(e < 2, 0x00200000 << e.clamp(max=1), (e - 1) << 23).view(torch.float32)
        q = _nibbles(blk[:, 1:17], 1)
        return (d * torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=raw.device)[q]).reshape(*lead, K)
    d = _f16(blk, 208 if qtype == Q6_K else 0)
    if qtype == IQ4_XS:
        sh = blk[:, 2].int() | (blk[:, 3].int() << 8)
        s = torch.arange(8, device=raw.device)
        ls = ((blk[:, 4 + s // 2].int() >> ((s % 2) * 4)) & 15) | (((sh[:, None] >> (2 * s)) & 3) << 4)
        q = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32, device=raw.device)[_nibbles(blk[:, 8:136], 8)]
        w = (d * (ls - 32).float())[:, :, None] * q.reshape(nb, 8, 32)
    elif qtype == Q8_0:
        w = d * blk[:, 2:].contiguous().view(torch.int8).float()
    elif qtype == Q4_0:
        w = d * (_nibbles(blk[:, 2:18], 1) - 8).float()
    elif qtype == Q5_0:
        bit = torch.arange(32, device=raw.device)
        qh = (blk[:, 2:6].int()[:, bit // 8] >> (bit % 8)) & 1
        w = d * ((_nibbles(blk[:, 6:22], 1) | (qh << 4)) - 16).float()
    elif qtype in (Q4_K, Q5_K):
        sc, mn = _k_scales(blk[:, 4:16])
        if qtype == Q4_K:
            q = _nibbles(blk[:, 16:144], 4)
        else:
            shift = torch.arange(8, device=raw.device)[None, :, None]
            qh = (blk[:, 16:48].int()[:, None, :] >> shift) & 1
            q = _nibbles(blk[:, 48:176], 4) | (qh.reshape(nb, 256) << 4)
        w = ((d * sc)[:, :, None] * q.reshape(nb, 8, 32).float() - (_f16(blk, 2) * mn)[:, :, None])
    elif qtype == Q6_K:
        ql = _nibbles(blk[:, 0:128], 2)
        shift = torch.tensor([0, 2, 4, 6], device=raw.device)[None, None, :, None]
        qh = (blk[:, 128:192].int().reshape(nb, 2, 1, 32) >> shift) & 3
        q = (ql | (qh.reshape(nb, 256) << 4)) - 32
        sc = blk[:, 192:208].contiguous().view(torch.int8).float()
        w = (d * sc)[:, :, None] * q.reshape(nb, 16, 16).float()
    else:
        raise ValueError(f"quant type {qtype} has no torch reference here")
    return w.reshape(*lead, K)
