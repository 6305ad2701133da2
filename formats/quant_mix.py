"""Which GGML type each tensor gets in a llama.cpp file type ("mix") such as Q4_K_M or IQ2_M.

Synthetic files must have the same per-tensor types as files made by ``convert_hf_to_gguf.py`` +
``llama-quantize``, because byte sizes (and so VRAM budgets and expert placement) depend on them.
The rules mirror ``src/llama-quant.cpp`` (``tensor_allows_quantization``,
``llama_tensor_get_type_impl``, ``tensor_type_fallback``, ``llama_ftype_get_default_type``) for
the tensor names our MoE archs have (never 8 experts, so Mixtral's bumps are left out, and never
Falcon). The IQ1/IQ2/IQ3_XXS mixes need an importance matrix in llama.cpp (it refuses to make
them without one), so those rules are taken with one; the other mixes without, as
``llama-quantize`` runs by default. Two rules count tensors in llama.cpp's visiting order (by
layer, then name: ``weight_name_comparer``): the IQ1/IQ2 mixes' first eighth of ``ffn_down``
tensors, and Q3_K_M's first two attn_v-like tensors; ``mix_qtypes`` computes those counters.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T, LlamaFileType as F

# mix name -> (llama_ftype written as general.file_type, default tensor type)
_MIX_TABLE: dict[str, tuple[F, T]] = {
    "F32": (F.ALL_F32, T.F32), "F16": (F.MOSTLY_F16, T.F16), "BF16": (F.MOSTLY_BF16, T.BF16),
    "Q8_0": (F.MOSTLY_Q8_0, T.Q8_0), "Q4_1": (F.MOSTLY_Q4_1, T.Q4_1), "Q5_1": (F.MOSTLY_Q5_1, T.Q5_1),
    "Q6_K": (F.MOSTLY_Q6_K, T.Q6_K), "Q5_K_M": (F.MOSTLY_Q5_K_M, T.Q5_K), "Q4_K_M": (F.MOSTLY_Q4_K_M, T.Q4_K),
    "Q3_K_L": (F.MOSTLY_Q3_K_L, T.Q3_K), "Q3_K_M": (F.MOSTLY_Q3_K_M, T.Q3_K), "Q3_K_S": (F.MOSTLY_Q3_K_S, T.Q3_K),
    "Q2_K": (F.MOSTLY_Q2_K, T.Q2_K), "Q2_K_S": (F.MOSTLY_Q2_K_S, T.Q2_K),
    "IQ3_M": (F.MOSTLY_IQ3_M, T.IQ3_S), "IQ3_S": (F.MOSTLY_IQ3_S, T.IQ3_S),
    "IQ3_XXS": (F.MOSTLY_IQ3_XXS, T.IQ3_XXS),
    "IQ2_M": (F.MOSTLY_IQ2_M, T.IQ2_S), "IQ2_S": (F.MOSTLY_IQ2_S, T.IQ2_XS), "IQ2_XS": (F.MOSTLY_IQ2_XS, T.IQ2_XS),
    "IQ2_XXS": (F.MOSTLY_IQ2_XXS, T.IQ2_XXS), "IQ1_M": (F.MOSTLY_IQ1_M, T.IQ1_M), "IQ1_S": (F.MOSTLY_IQ1_S, T.IQ1_S),
}
MIXES: dict[str, T] = {name: base for name, (_, base) in _MIX_TABLE.items()}
# The llama_ftype value written as general.file_type.
FILE_TYPE: dict[str, int] = {name: int(ft) for name, (ft, _) in _MIX_TABLE.items()}

# The mixes of llama-quant.cpp's low-bit IQ branch, and those among them whose bumps are IQ3_S.
_IQ_LOW = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M")
_IQ2_SM = ("IQ2_S", "IQ2_M")
# Tensors llama.cpp (and the converter) always keep in F32, by name substring.
_KEEP_F32 = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp", "ssm_conv1d")
# llama-quant.cpp's fallback when a row is not a whole number of the type's blocks.
_FALLBACK = {T.IQ1_S: T.IQ4_NL, T.IQ1_M: T.IQ4_NL, T.IQ2_XXS: T.IQ4_NL, T.IQ2_XS: T.IQ4_NL, T.IQ2_S: T.IQ4_NL,
             T.IQ3_XXS: T.IQ4_NL, T.IQ3_S: T.IQ4_NL, T.IQ4_XS: T.IQ4_NL, T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0,
             T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}
_LAYER = re.compile(r"blk\.(\d+)\.")
_FLOATS = (T.F32, T.F16, T.BF16)


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's choice of layers that get more bits in *_M mixes (first/last eighth, every 3rd)."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def _fits(n_cols: int, qtype: T) -> bool:
    return n_cols % GGML_QUANT_SIZES[qtype][0] == 0


def keeps_f32(name: str, shape: Sequence[int]) -> bool:
    """1-D tensors, norms, routers, SSM conv and non-``.weight`` tensors (biases, ssm_a) stay F32."""
    return len(shape) < 2 or not name.endswith(".weight") or any(k in name for k in _KEEP_F32)


def _is_attn_v(name: str) -> bool:
    return "attn_v.weight" in name or "attn_qkv.weight" in name or "attn_kv_b.weight" in name


def _output_type(mix: str, base: T, n_cols: int) -> T:
    if not _fits(n_cols, base):
        return T.Q8_0
    if mix in _IQ_LOW or mix == "IQ3_XXS":
        return T.Q5_K
    return base if base == T.Q8_0 else T.Q6_K


def _chosen(name: str, mix: str, base: T, il: int, n_layer: int, n_gqa: int, i_ffn_down: int, i_attn_v: int,
            n_attn_v: int) -> T:
    """``llama_tensor_get_type_impl`` for a quantized tensor other than output.weight."""
    if name == "token_embd.weight":
        if mix in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"):
            return T.Q2_K
        return T.IQ3_S if mix in _IQ2_SM or mix == "IQ3_XXS" else base
    if mix in _IQ_LOW:
        if _is_attn_v(name):
            return T.Q4_K  # n_expert >= 4 for every MoE arch
        if "ffn_down" in name:
            return (T.IQ3_S if mix in _IQ2_SM else T.Q2_K) if i_ffn_down < n_layer // 8 else base
        if "attn_output.weight" in name:
            return T.IQ2_XXS if mix in ("IQ1_S", "IQ1_M") else T.IQ3_S if mix in _IQ2_SM else base
        return base
    if _is_attn_v(name):
        if mix == "Q2_K":
            return T.Q4_K if n_gqa >= 4 else T.Q3_K
        if mix == "Q2_K_S" and n_gqa >= 4:
            return T.Q4_K
        if mix == "IQ3_XXS":
            return T.Q4_K if n_gqa >= 4 else T.IQ3_XXS  # (IQ3_S without an imatrix)
        if mix == "IQ3_S" and n_gqa >= 4 or mix == "IQ3_M":
            return T.Q4_K
        if mix == "Q3_K_M":
            return T.Q5_K if i_attn_v < 2 else T.Q4_K
        if mix == "Q3_K_L":
            return T.Q5_K
        if mix in ("Q4_K_M", "Q5_K_M") and use_more_bits(i_attn_v, n_attn_v):
            return T.Q6_K
        return base
    if "attn_k.weight" in name or "attn_q.weight" in name:
        return T.IQ2_S if mix == "IQ3_XXS" else base
    if "ffn_down" in name:
        if mix == "Q2_K":
            return T.Q3_K
        if mix == "Q2_K_S":
            return T.Q4_K if il < n_layer // 8 else base
        if mix == "Q3_K_M":
            return T.Q5_K if il < n_layer // 16 else T.Q4_K
        if mix == "IQ3_M" and il < n_layer // 8:
            return T.Q4_K
        if mix == "Q3_K_L":
            return T.Q5_K
        if mix in ("Q4_K_M", "Q5_K_M") and use_more_bits(il, n_layer):
            return T.Q6_K
        return base
    if "attn_output.weight" in name:
        return {"Q2_K": T.Q3_K, "IQ3_XXS": T.IQ3_S, "Q3_K_M": T.Q4_K, "Q3_K_L": T.Q5_K, "IQ3_M": T.Q4_K}.get(mix, base)
    return base


def tensor_qtype(name: str, shape: Sequence[int], mix: str, n_layer: int, *, n_gqa: int = 1,
                 i_ffn_down: int | None = None, i_attn_v: int | None = None, n_attn_v: int | None = None) -> T:
    """The type of tensor ``name`` (GGUF ``shape``, ne[0] first) in file type ``mix``.

    ``n_layer`` is the block count, ``n_gqa`` query heads per KV head (of layer 0). The counters
    of llama-quant.cpp (this tensor's place among the ``ffn_down`` tensors and among the
    attn_v-like ones, and how many of those there are) default to the layer index and
    ``n_layer``: right for a model with one of each per layer (``mix_qtypes`` counts them).
    """
    try:
        base = MIXES[mix]
    except KeyError:
        raise ValueError(f"unknown quant mix {mix!r} (known: {', '.join(MIXES)})") from None
    if keeps_f32(name, shape):
        return T.F32
    if base in _FLOATS:
        return base
    n_cols = int(shape[0])
    m = _LAYER.match(name)
    il = int(m.group(1)) if m else -1
    if name == "output.weight":
        qtype = _output_type(mix, base, n_cols)
    else:
        qtype = _chosen(name, mix, base, il, n_layer, n_gqa, il if i_ffn_down is None else i_ffn_down,
                        il if i_attn_v is None else i_attn_v, n_layer if n_attn_v is None else n_attn_v)
    if not _fits(n_cols, qtype):
        qtype = _FALLBACK.get(qtype, qtype)
        if not _fits(n_cols, qtype):
            qtype = T.F16
    return qtype


def _visit_key(name: str) -> tuple[int, str]:
    """llama.cpp's tensor order (``weight_name_comparer``): by layer (none first), then name."""
    m = _LAYER.match(name)
    return (int(m.group(1)) if m else -1, name)


def mix_qtypes(tensors: Sequence[tuple[str, Sequence[int]]], mix: str, n_layer: int, n_gqa: int = 1) -> list[T]:
    """``tensor_qtype`` of every ``(name, shape)``, with llama-quant.cpp's counters taken in its
    visiting order (the result is in the order given)."""
    order = sorted(range(len(tensors)), key=lambda i: _visit_key(tensors[i][0]))
    quantized = [i for i in order if not keeps_f32(*tensors[i])]
    attn_v = [i for i in quantized if _is_attn_v(tensors[i][0])]
    down = [i for i in quantized if "ffn_down" in tensors[i][0]]
    at_v, at_down = {i: k for k, i in enumerate(attn_v)}, {i: k for k, i in enumerate(down)}
    return [tensor_qtype(name, shape, mix, n_layer, n_gqa=n_gqa, i_ffn_down=at_down.get(i), i_attn_v=at_v.get(i),
                         n_attn_v=len(attn_v)) for i, (name, shape) in enumerate(tensors)]
