"""Random quant blocks dequantize (through gguf-py, the referee) to finite, zero-mean weights of the
intended RMS; the quant-mix rules pick llama-quant.cpp's types; routing skew is calibrated."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

from sparkpack.repack.synth.quant_blocks import (ANY_SCALES_TYPES, SUPPORTED, float_bytes, make_rng, random_blocks,
                                           random_tensor_bytes)
from sparkpack.formats.quant_mix import mix_qtypes, tensor_qtype, use_more_bits
from sparkpack.repack.synth.routing_skew import REFERENCE_TOP_SHARE, reference_skew, top_share


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda q: q.name)
@pytest.mark.parametrize("scale", [0.02, 1.5])
def test_blocks_dequantize_to_target_rms(qtype: T, scale: float) -> None:
    blocks = random_blocks(qtype, 3000, scale, make_rng(7, int(qtype)))
    values = np.asarray(quants.dequantize(blocks.reshape(-1), qtype), dtype=np.float64).reshape(-1)
    assert np.isfinite(values).all()
    rms = float(np.sqrt(np.mean(values**2)))
    assert scale / 1.15 < rms < scale * 1.15, (qtype.name, rms)
    assert abs(values.mean()) < 0.15 * rms  # centred like real weights (Q4_0/Q5_0 codes are -8..7)


# the packed sub-block scale bytes of each type (``any_scales`` leaves them random)
SCALE_BYTES = {T.Q4_K: (4, 16), T.Q5_K: (4, 16), T.Q6_K: (192, 208), T.IQ4_XS: (2, 8)}


@pytest.mark.parametrize("qtype", ANY_SCALES_TYPES, ids=lambda q: q.name)
def test_any_scales_blocks_are_finite_near_the_target_and_keep_every_scale_pattern(qtype: T) -> None:
    """The kernel tests' blocks: finite weights of roughly the asked RMS, and every byte value in
    the packed sub-block scales (negative Q6_K scales, the K-quants' high scale bits)."""
    blocks = random_blocks(qtype, 3000, 0.02, make_rng(9, int(qtype)), any_scales=True)
    values = np.asarray(quants.dequantize(blocks.reshape(-1), qtype), dtype=np.float64).reshape(-1)
    assert np.isfinite(values).all()
    assert 0.01 < float(np.sqrt(np.mean(values**2))) < 0.04, qtype.name
    if qtype in SCALE_BYTES:
        lo, hi = SCALE_BYTES[qtype]
        assert len(np.unique(blocks[:, lo:hi])) == 256


def test_same_seed_same_bytes_other_seed_other_bytes() -> None:
    a = random_tensor_bytes(T.Q4_K, 256 * 64, 0.02, make_rng(1, 2, 3))
    b = random_tensor_bytes(T.Q4_K, 256 * 64, 0.02, make_rng(1, 2, 3))
    c = random_tensor_bytes(T.Q4_K, 256 * 64, 0.02, make_rng(1, 2, 4))
    assert a.nbytes == 64 * 144 and np.array_equal(a, b) and not np.array_equal(a, c)
    with pytest.raises(ValueError, match="not whole"):
        random_tensor_bytes(T.Q4_K, 100, 0.02, make_rng(0))


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda q: q.name)
def test_float_bytes_round_trip(qtype: T) -> None:
    x = np.linspace(-3, 3, 64, dtype=np.float32)
    back = np.asarray(quants.dequantize(float_bytes(x, qtype), qtype), dtype=np.float32).reshape(-1)
    assert np.allclose(back, x, rtol=1e-2, atol=1e-2)


def test_use_more_bits_layers_for_40() -> None:
    assert [i for i in range(40) if use_more_bits(i, 40)] == [0, 1, 2, 3, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31,
                                                              34, 35, 36, 37, 38, 39]


@pytest.mark.parametrize("name, shape, mix, expected", [
    ("output.weight", (2048, 151936), "Q4_K_M", T.Q6_K),
    ("output.weight", (2048, 151936), "Q8_0", T.Q8_0),
    ("output.weight", (96, 1000), "Q4_K_M", T.Q8_0),
    ("token_embd.weight", (2048, 151936), "Q4_K_M", T.Q4_K),
    ("blk.0.attn_v.weight", (2048, 512), "Q4_K_M", T.Q6_K),
    ("blk.5.attn_v.weight", (2048, 512), "Q4_K_M", T.Q4_K),
    ("blk.7.attn_qkv.weight", (2048, 8192), "Q5_K_M", T.Q6_K),
    ("blk.7.ffn_down_exps.weight", (512, 2048, 256), "Q4_K_M", T.Q6_K),
    ("blk.8.ffn_down_exps.weight", (512, 2048, 256), "Q4_K_M", T.Q4_K),
    ("blk.8.ffn_gate_exps.weight", (2048, 512, 256), "Q5_K_M", T.Q5_K),
    ("blk.8.ffn_down_shexp.weight", (128, 256), "Q4_K_M", T.Q5_0),  # row not a multiple of 256
    ("blk.7.ffn_down_shexp.weight", (128, 256), "Q4_K_M", T.Q8_0),  # Q6_K layer, falls back
    ("blk.8.ffn_down_shexp.weight", (128, 256), "Q5_K_M", T.Q5_1),
    ("blk.8.attn_q.weight", (48, 256), "Q8_0", T.F16),  # not even 32-blocks
    ("blk.0.ffn_gate_inp.weight", (2048, 256), "Q4_K_M", T.F32),
    ("blk.0.ffn_gate_inp_shexp.weight", (2048,), "Q4_K_M", T.F32),
    ("blk.0.attn_norm.weight", (2048,), "Q8_0", T.F32),
    ("blk.0.ssm_conv1d.weight", (4, 8192), "Q4_K_M", T.F32),
    ("blk.0.ssm_a", (32,), "Q4_K_M", T.F32),
    ("blk.1.exp_probs_b.bias", (256,), "Q4_K_M", T.F32),
    ("blk.0.ssm_beta.weight", (2048, 32), "Q4_K_M", T.Q4_K),
    ("blk.0.ffn_gate_inp.weight", (2048, 256), "F16", T.F32),
    ("blk.8.ffn_up_exps.weight", (2048, 512, 256), "BF16", T.BF16),
    ("output.weight", (2048, 151936), "F16", T.F16),
    # the low-bit mixes (llama-quant.cpp; qwen3.6's 16 query heads over 2 KV heads: n_gqa 8)
    ("output.weight", (2048, 248320), "IQ2_XXS", T.Q5_K),
    ("output.weight", (2048, 248320), "IQ3_M", T.Q6_K),
    ("token_embd.weight", (2048, 248320), "IQ2_XXS", T.Q2_K),
    ("token_embd.weight", (2048, 248320), "IQ2_M", T.IQ3_S),
    ("token_embd.weight", (2048, 248320), "IQ3_XXS", T.IQ3_S),
    ("token_embd.weight", (2048, 248320), "Q3_K_M", T.Q3_K),
    ("blk.9.attn_qkv.weight", (2048, 8192), "IQ2_XXS", T.Q4_K),
    ("blk.9.attn_v.weight", (2048, 512), "IQ3_XXS", T.Q4_K),
    ("blk.9.attn_q.weight", (2048, 8192), "IQ3_XXS", T.IQ2_S),
    ("blk.9.attn_output.weight", (4096, 2048), "IQ3_XXS", T.IQ3_S),
    ("blk.9.attn_output.weight", (4096, 2048), "IQ2_M", T.IQ3_S),
    ("blk.9.attn_output.weight", (4096, 2048), "IQ1_M", T.IQ2_XXS),
    ("blk.9.attn_output.weight", (4096, 2048), "Q3_K_M", T.Q4_K),
    ("blk.9.ffn_gate_exps.weight", (2048, 512, 256), "IQ2_M", T.IQ2_S),
    ("blk.9.ffn_gate_exps.weight", (2048, 512, 256), "IQ2_S", T.IQ2_XS),
    ("blk.9.ffn_up_exps.weight", (2048, 512, 256), "IQ1_S", T.IQ1_S),
    ("blk.9.ffn_up_exps.weight", (2048, 512, 256), "IQ3_M", T.IQ3_S),
    ("blk.2.ffn_down_exps.weight", (512, 2048, 256), "IQ2_XXS", T.Q2_K),
    ("blk.2.ffn_down_exps.weight", (512, 2048, 256), "IQ2_M", T.IQ3_S),
    ("blk.9.ffn_down_exps.weight", (512, 2048, 256), "IQ2_M", T.IQ2_S),
    ("blk.2.ffn_down_exps.weight", (512, 2048, 256), "IQ3_M", T.Q4_K),
    ("blk.9.ffn_down_exps.weight", (512, 2048, 256), "IQ3_M", T.IQ3_S),
    ("blk.9.ffn_down_exps.weight", (512, 2048, 256), "IQ3_XXS", T.IQ3_XXS),
    ("blk.9.ffn_down_exps.weight", (512, 2048, 256), "Q2_K", T.Q3_K),
    ("blk.1.ffn_down_exps.weight", (512, 2048, 256), "Q3_K_M", T.Q5_K),
    ("blk.9.ffn_down_exps.weight", (512, 2048, 256), "Q3_K_M", T.Q4_K),
    ("blk.9.ffn_gate_exps.weight", (2048, 512, 256), "Q3_K_M", T.Q3_K),
    ("blk.9.ffn_down_shexp.weight", (128, 256), "IQ2_XXS", T.IQ4_NL),  # rows not of 256: the fallback
    ("blk.9.ffn_down_shexp.weight", (128, 256), "Q2_K", T.Q4_0),
    ("blk.9.ffn_up_exps.weight", (2048, 512, 256), "Q4_1", T.Q4_1),
    ("output.weight", (2048, 248320), "Q5_1", T.Q6_K),
])
def test_quant_mix_rules(name: str, shape: tuple[int, ...], mix: str, expected: T) -> None:
    assert tensor_qtype(name, shape, mix, 40, n_gqa=8) == expected


def test_mix_counters_follow_llama_cpps_tensor_order() -> None:
    """The IQ2 mixes bump the first eighth of the ffn_down tensors counted in llama.cpp's order
    (by layer, then name: a layer's ffn_down_exps before its ffn_down_shexp), and Q3_K_M the
    first two attn_v-like tensors; Q2_K's attn_v depends on the GQA ratio."""
    down = [(f"blk.{il}.ffn_down_{k}.weight", (512, 2048, 256) if k == "exps" else (512, 2048))
            for il in reversed(range(40)) for k in ("shexp", "exps")]
    got = {n: q for (n, _), q in zip(down, mix_qtypes(down, "IQ2_XXS", 40))}
    bumped = {n for n, q in got.items() if q == T.Q2_K}
    assert bumped == {"blk.0.ffn_down_exps.weight", "blk.0.ffn_down_shexp.weight", "blk.1.ffn_down_exps.weight",
                      "blk.1.ffn_down_shexp.weight", "blk.2.ffn_down_exps.weight"}
    assert set(got.values()) == {T.Q2_K, T.IQ2_XXS}
    v = [(f"blk.{il}.attn_{'v' if il % 4 == 3 else 'qkv'}.weight", (2048, 512)) for il in range(40)]
    assert mix_qtypes(v, "Q3_K_M", 40)[:3] == [T.Q5_K, T.Q5_K, T.Q4_K]
    assert mix_qtypes(v, "Q2_K", 40, n_gqa=8)[0] == T.Q4_K and mix_qtypes(v, "Q2_K", 40, n_gqa=2)[0] == T.Q3_K


def test_unknown_mix_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown quant mix"):
        tensor_qtype("output.weight", (256, 256), "Q3_K_XL", 4)


@pytest.mark.parametrize("n_expert, top_k", [(128, 8), pytest.param(256, 8, marks=pytest.mark.slow)])
def test_top_share_is_monotone_and_reference_hits_target(n_expert: int, top_k: int) -> None:
    grid = [0.0, 0.1, 0.2, 0.3, 0.5, 0.8]
    shares = [top_share(s, n_expert, top_k) for s in grid]
    assert all(a <= b for a, b in zip(shares, shares[1:])), shares
    assert shares[0] < 0.7 < 0.99 < shares[-1]  # no skew is near uniform; strong skew concentrates
    s_ref = reference_skew(n_expert, top_k)
    assert abs(top_share(s_ref, n_expert, top_k) - REFERENCE_TOP_SHARE) <= 0.02
