"""The torch dequantizer must equal gguf-py's numpy one bit for bit (gguf-py is the reference)."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from sparkpack.formats.quants import KERNEL_QTYPES
from sparkpack.repack.synth.quant_blocks import make_rng, random_blocks
from sparkpack.runtime.dequant import SUPPORTED, dequantize

# Types gguf-py can quantize: made from random floats, so they are realistic blocks.
QUANTIZABLE = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4]
# Types gguf-py only dequantizes: random bytes with finite f16 scales at these byte offsets.
F16_FIELDS = {
    T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_XS: (0,), T.IQ4_NL: (0,),
    T.IQ2_XXS: (0,), T.IQ3_S: (0,),
}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_raw(qtype: T, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Valid bytes of a tensor of ``shape`` (GGUF order) as rows of bytes, like a mmapped tensor."""
    rng = np.random.default_rng(seed)
    block, tsize = GGML_QUANT_SIZES[qtype]
    n_rows = int(np.prod(shape[1:]))
    if qtype in QUANTIZABLE:
        x = rng.standard_normal((n_rows, shape[0])).astype(np.float32) * 0.05
        return gq.quantize(x, qtype)
    raw = rng.integers(0, 256, size=(n_rows * shape[0] // block, tsize), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        d = (rng.uniform(1e-4, 2e-2, size=raw.shape[0]) * rng.choice([-1, 1], size=raw.shape[0]))
        raw[:, off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(n_rows, -1)


def reference(raw: np.ndarray, qtype: T, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(gq.dequantize(raw, qtype).astype(np.float32)).reshape(tuple(reversed(shape)))


ALL = QUANTIZABLE + list(F16_FIELDS)


def test_every_listed_type_has_a_torch_implementation():
    assert set(ALL) <= SUPPORTED


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_bit_exact_against_gguf(qtype, device):
    shape = (512, 3)
    raw = make_raw(qtype, shape, seed=int(qtype))
    ref = reference(raw, qtype, shape)
    out = dequantize(raw, int(qtype), shape, device=device)
    assert out.shape == (3, 512)
    assert out.dtype == torch.float32 and out.device.type == device
    assert torch.isfinite(ref).all()
    assert torch.equal(out.cpu(), ref), f"max diff {(out.cpu() - ref).abs().max()}"


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.IQ4_XS], ids=lambda t: t.name)
def test_three_d_expert_tensor(qtype):
    shape = (256, 5, 3)  # ne = [n_embd, n_ff, n_expert]
    raw = make_raw(qtype, shape, seed=7)
    out = dequantize(raw.reshape(-1), int(qtype), shape)
    assert out.shape == (3, 5, 256)
    assert torch.equal(out, reference(raw, qtype, shape))
    # one expert's contiguous byte range dequantizes to the same slice
    per_expert = raw.size // 3
    one = dequantize(raw.reshape(-1)[per_expert:2 * per_expert], int(qtype), shape[:2])
    assert torch.equal(one, out[1])


def test_accepts_uint8_torch_tensor_and_casts_dtype():
    shape = (256, 4)
    raw = make_raw(T.Q5_K, shape, seed=3)
    ref = reference(raw, T.Q5_K, shape)
    out = dequantize(torch.from_numpy(raw.copy()), int(T.Q5_K), shape, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref.to(torch.bfloat16))


def test_read_only_buffer_is_fine():
    shape = (64, 2)
    raw = make_raw(T.Q8_0, shape).copy()
    raw.setflags(write=False)
    assert torch.equal(dequantize(raw, int(T.Q8_0), shape), reference(raw, T.Q8_0, shape))


@pytest.mark.parametrize("qtype", [T(q) for q in KERNEL_QTYPES], ids=lambda t: t.name)
def test_every_kernel_type_dequantizes_as_gguf(qtype):
    """Every type of the kernels' registry (``formats.quants``) expands to gguf-py's values, by a
    torch implementation or gguf-py's own (the runtime's fallback for types without kernels, and
    the references of the kernel tests)."""
    shape = (512, 3)
    raw = random_blocks(qtype, 3 * 512 // GGML_QUANT_SIZES[qtype][0], 0.02, make_rng(5, int(qtype)),
                        any_scales=True).reshape(3, -1)
    assert torch.equal(dequantize(raw, int(qtype), shape), reference(raw, qtype, shape))


def test_other_types_fall_back_to_gguf(caplog):
    shape = (256, 2)
    block, tsize = GGML_QUANT_SIZES[T.Q2_K]
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=(2, tsize), dtype=np.uint8)
    raw[:, 80:84] = np.array([1e-2, 1e-3], dtype=np.float16).view(np.uint8)  # d, dmin
    with caplog.at_level(logging.INFO, logger="sparkpack.runtime.dequant"):
        out = dequantize(raw, int(T.Q2_K), shape)
        dequantize(raw, int(T.Q2_K), shape)
    assert torch.equal(out, reference(raw, T.Q2_K, shape))
    assert sum("Q2_K" in r.getMessage() for r in caplog.records) <= 1


def test_wrong_byte_count_and_bad_row_length_are_rejected():
    raw = make_raw(T.Q8_0, (64, 2))
    with pytest.raises(ValueError, match="needs"):
        dequantize(raw.reshape(-1)[:-1], int(T.Q8_0), (64, 2))
    with pytest.raises(ValueError, match="multiple"):
        dequantize(raw, int(T.Q8_0), (48, 2))


def test_large_matrices_are_expanded_in_bands_with_the_same_bits(monkeypatch):
    """Big dense tensors are dequantized a band of rows at a time (bounded temporaries under a
    --vram budget); the result must be the whole-tensor result exactly."""
    import sparkpack.runtime.weights as weights
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as QT

    rng = np.random.default_rng(3)
    for qt in (QT.Q4_K, QT.Q6_K, QT.Q8_0):
        block, size = GGML_QUANT_SIZES[qt]
        raw = rng.integers(0, 256, size=300 * 512 // block * size, dtype=np.uint8)
        raw[::size] = 0  # keep the f16 scales finite enough to compare
        whole = weights.dequantize_bytes(raw, qt, (512, 300), "cpu", torch.float32)
        monkeypatch.setattr(weights, "CHUNK_ELEMENTS", 512 * 7)
        banded = weights.dequantize_bytes(raw, qt, (512, 300), "cpu", torch.float32)
        monkeypatch.undo()
        assert banded.shape == (300, 512)
        assert torch.equal(torch.nan_to_num(banded), torch.nan_to_num(whole))
