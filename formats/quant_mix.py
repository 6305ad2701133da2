"""Which GGML type each tensor gets in a llama.cpp file type ("mix") such as Q4_K_M.

Synthetic files must have the same per-tensor types as files made by ``convert_hf_to_gguf.py`` +
``llama-quantize``, because byte sizes (and so VRAM budgets and expert placement) depend on them.
The rules mirror ``src/llama-quant.cpp`` (``tensor_allows_quantization``,
``llama_tensor_get_type_impl`` and ``tensor_type_fallback``) for the tensor names our MoE archs
have; rules for other archs and for 8-expert models (Mixtral's attn_k/attn_v bump) are left out.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

MIXES: dict[str, T] = {
    "Q4_K_M": T.Q4_K,
    "Q5_K_M": T.Q5_K,
    "Q6_K": T.Q6_K,
    "Q8_0": T.Q8_0,
    "F16": T.F16,
    "BF16": T.BF16,
    "F32": T.F32,
}
# The llama_ftype value written as general.file_type.
FILE_TYPE: dict[str, int] = {"F32": 0, "F16": 1, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "BF16": 32}

# Tensors llama.cpp (and the converter) always keep in F32, by name substring.
_KEEP_F32 = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp", "ssm_conv1d")
# llama-quant.cpp's fallback when a row is not a whole number of 256-blocks.
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}
_LAYER = re.compile(r"blk\.(\d+)\.")


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's choice of layers that get more bits in *_M mixes (first/last eighth, every 3rd)."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def _fits(n_cols: int, qtype: T) -> bool:
    return n_cols % GGML_QUANT_SIZES[qtype][0] == 0


def keeps_f32(name: str, shape: Sequence[int]) -> bool:
    """1-D tensors, norms, routers, SSM conv and non-``.weight`` tensors (biases, ssm_a) stay F32."""
    return len(shape) < 2 or not name.endswith(".weight") or any(k in name for k in _KEEP_F32)


def tensor_qtype(name: str, shape: Sequence[int], mix: str, n_layer: int) -> T:
    """The type of tensor ``name`` (GGUF ``shape``, ne[0] first) in file type ``mix``.

    ``n_layer`` is the block count; the attn_v-like counter of llama-quant.cpp equals the layer
    index for our archs (each layer has exactly one attn_v or attn_qkv, visited in layer order).
    """
    try:
        base = MIXES[mix]
    except KeyError:
        raise ValueError(f"unknown quant mix {mix!r} (known: {', '.join(MIXES)})") from None
    if keeps_f32(name, shape):
        return T.F32
    if base in (T.F32, T.F16, T.BF16):
        return base
    n_cols = int(shape[0])
    m = _LAYER.match(name)
    il = int(m.group(1)) if m else -1
    medium = mix in ("Q4_K_M", "Q5_K_M")
    qtype = base
    if name == "output.weight":
        if not _fits(n_cols, base):
            return T.Q8_0
        return T.Q6_K if base != T.Q8_0 else base
    if ("attn_v.weight" in name or "attn_qkv.weight" in name) and medium and use_more_bits(il, n_layer):
        qtype = T.Q6_K
    elif "ffn_down" in name and medium and use_more_bits(il, n_layer):
        qtype = T.Q6_K
    if not _fits(n_cols, qtype):
        qtype = _FALLBACK.get(qtype, qtype)
        if not _fits(n_cols, qtype):
            qtype = T.F16
    return qtype
