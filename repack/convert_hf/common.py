"""The arch-independent half of the converter: naming, expert stacking, output types, metadata
that every transformers decoder shares, and the atomic GGUF write.

An arch module supplies an ``Arch``: the HF class and GGUF arch names, the per-layer name table,
the value transforms and the arch-specific metadata. Everything here mirrors what llama.cpp's
``TextModel``/``Qwen2MoeModel`` do so that the GGUF is the one llama.cpp would write.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from sparkpack.formats.atomic_file import temp_name
from sparkpack.formats.errors import SparkpackError

from .source import SafetensorsSource

# Outside the layers (same for every supported arch).
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

# Inside a layer, shared by the supported archs ("model.layers.N." prefix -> "blk.N." prefix).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.gate_proj.weight": "ffn_gate_exps.weight",
    "mlp.experts.up_proj.weight": "ffn_up_exps.weight",
    "mlp.experts.down_proj.weight": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}

# Tensors llama.cpp keeps in F32 whatever the output type (besides 1-D tensors and norms):
# routers and conv kernels, which are tiny and precision-sensitive.
ALWAYS_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
# outtype -> general.file_type (llama_ftype)
FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class Arch:
    """What one transformers class needs beyond the shared machinery."""

    hf_class: str
    gguf_arch: str
    tokenizer_pre: str
    write_metadata: Callable[[Any, dict[str, Any], str], None]  # (writer, hparams, outtype)
    layer_names: dict[str, str] = field(default_factory=dict)  # overrides/additions to LAYER_NAMES
    # (hf name inside the layer, array, hparams, layer index) -> transformed array; called with
    # the full name and layer -1 for tensors outside the layers (embeddings, final norm, lm_head)
    transform: Callable[[str, np.ndarray, dict[str, Any], int], np.ndarray] | None = None
    skip: Callable[[str], bool] = lambda name: False
    control_tokens: tuple[str, ...] = ()
    # tensors kept outside ``model.layers`` (an MTP head's ``mtp.*``) -> the layer names they take
    # in the GGUF, as blocks after the trunk (``extra_blocks`` of them, counted in block_count)
    rename: Callable[[str, dict[str, Any]], str] = lambda name, hp: name
    extra_blocks: Callable[[dict[str, Any]], int] = lambda hp: 0


def hf_layer_count(hp: dict[str, Any]) -> int:
    return int(hp["num_hidden_layers"])


def gguf_tensors(arch: Arch, source: SafetensorsSource, hp: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array in PyTorch order) for every tensor, experts stacked to 3-D.

    The array's numpy shape is the reverse of the GGUF ``ne``: a stacked gate/up tensor of shape
    (n_expert, n_ff, n_embd) becomes ne = [n_embd, n_ff, n_expert], one contiguous expert each.
    """
    names = {**LAYER_NAMES, **arch.layer_names}
    n_layer = hf_layer_count(hp) + arch.extra_blocks(hp)
    n_expert = int(hp.get("num_local_experts") or hp.get("num_experts") or 0)
    experts: dict[tuple[int, str], dict[int, str]] = {}
    for src_name in source.names():
        # multimodal wrappers keep the text model under ``language_model.``
        hf_name = arch.rename(src_name.replace("language_model.", ""), hp)
        if hf_name.endswith(".rotary_emb.inv_freq") or arch.skip(hf_name):
            continue
        if hf_name in GLOBAL_NAMES:
            data = source.get(src_name)
            if arch.transform is not None:
                data = arch.transform(hf_name, data, hp, -1)
            yield GLOBAL_NAMES[hf_name], data
            continue
        m = _LAYER_RE.match(hf_name)
        if m is None or int(m.group(1)) >= n_layer:
            raise SparkpackError(hf_name, f"tensor has no {arch.gguf_arch} GGUF mapping")
        bid, rest = int(m.group(1)), m.group(2)
        em = _EXPERT_RE.match(rest)
        if em:
            experts.setdefault((bid, em.group(2)), {})[int(em.group(1))] = src_name
            continue
        data = source.get(src_name)
        if arch.transform is not None:
            data = arch.transform(rest, data, hp, bid)
        if rest == "mlp.experts.gate_up_proj" or rest == "mlp.experts.gate_up_proj.weight":
            # fused transformers-5 layout: (n_expert, 2 * n_ff, n_embd), gate rows first
            if data.ndim != 3 or data.shape[1] % 2:
                raise SparkpackError(hf_name, f"unexpected fused gate_up shape {list(data.shape)}")
            n_ff = data.shape[1] // 2
            yield f"blk.{bid}.ffn_gate_exps.weight", np.ascontiguousarray(data[:, :n_ff])
            yield f"blk.{bid}.ffn_up_exps.weight", np.ascontiguousarray(data[:, n_ff:])
            continue
        if rest == "mlp.experts.down_proj":
            rest = "mlp.experts.down_proj.weight"
        if rest not in names:
            raise SparkpackError(hf_name, f"tensor has no {arch.gguf_arch} GGUF mapping")
        yield f"blk.{bid}.{names[rest]}", data
    for (bid, w), by_expert in sorted(experts.items()):
        if sorted(by_expert) != list(range(n_expert)):
            raise SparkpackError(f"model.layers.{bid}.mlp.experts",
                                 f"{w} found for {len(by_expert)} experts, config says {n_expert}")
        stacked = np.stack([source.get(by_expert[x]) for x in range(n_expert)], axis=0)
        yield f"blk.{bid}.{names[f'mlp.experts.{w}.weight']}", stacked


def output_qtype(name: str, data: np.ndarray, outtype: str):
    """The GGML type llama.cpp's converter gives this tensor for ``--outtype``."""
    from gguf import GGMLQuantizationType as Q

    if data.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") \
            or name.split(".", 2)[-1] in ALWAYS_F32 or outtype == "f32":
        return Q.F32
    if outtype == "f16":
        return Q.F16
    if outtype == "bf16":
        return Q.BF16
    # Q8_0 needs rows that are a multiple of its 32-element block; llama.cpp falls back to F16.
    return Q.Q8_0 if data.shape[-1] % 32 == 0 else Q.F16


def encode(data: np.ndarray, qtype) -> np.ndarray:
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    if qtype == Q.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    if qtype == Q.F16:
        return np.ascontiguousarray(data, dtype=np.float16)
    return quantize(np.ascontiguousarray(data, dtype=np.float32), qtype)


def write_common_metadata(w, hp: dict[str, Any], outtype: str, head_count: int | list[int] | None = None,
                          extra_blocks: int = 0) -> None:
    """The keys llama.cpp's ``TextModel.set_gguf_parameters`` writes for any decoder.

    ``head_count`` replaces the config's scalar (Laguna writes one count per layer);
    ``extra_blocks`` (an MTP head's) count in ``block_count`` after the trunk's layers."""
    w.add_block_count(hf_layer_count(hp) + extra_blocks)
    if (n_ctx := hp.get("max_position_embeddings")) is not None:
        w.add_context_length(int(n_ctx))
    w.add_embedding_length(int(hp["hidden_size"]))
    if (n_ff := hp.get("intermediate_size")) is not None:
        w.add_feed_forward_length(int(n_ff))
    w.add_head_count(head_count if head_count is not None else int(hp["num_attention_heads"]))
    if (n_kv := hp.get("num_key_value_heads")) is not None:
        w.add_head_count_kv(int(n_kv))
    rope = rope_parameters(hp)
    full = rope.get("full_attention", rope)
    _rope_scaling(w, full)
    if "mrope_section" in rope:
        sections = list(rope["mrope_section"])[:4]
        w.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
    if (theta := full.get("rope_theta")) is not None:
        w.add_rope_freq_base(float(theta))
    if (theta_swa := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(float(theta_swa))
    if (eps := hp.get("rms_norm_eps")) is not None:
        w.add_layer_norm_rms_eps(float(eps))
    n_expert = hp.get("num_local_experts") or hp.get("num_experts")
    if n_expert is not None:
        w.add_expert_count(int(n_expert))
    if (n_used := hp.get("num_experts_per_tok")) is not None:
        w.add_expert_used_count(int(n_used))
    if (head_dim := hp.get("head_dim")) is not None:
        w.add_key_length(int(head_dim))
        w.add_value_length(int(head_dim))
    w.add_file_type(FILE_TYPES[outtype])


def rope_parameters(hp: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 ``rope_parameters`` (or the older ``rope_scaling`` + ``rope_theta``)."""
    rope = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
    if "full_attention" not in rope and "sliding_attention" not in rope:
        if "rope_theta" not in rope and hp.get("rope_theta") is not None:
            rope["rope_theta"] = hp["rope_theta"]
        if "rope_type" not in rope and rope.get("type") is not None:
            rope["rope_type"] = rope["type"]
        if "partial_rotary_factor" not in rope and hp.get("partial_rotary_factor") is not None:
            rope["partial_rotary_factor"] = hp["partial_rotary_factor"]
    return rope


def _rope_scaling(w, rope: dict[str, Any]) -> None:
    from gguf import RopeScalingType

    kind, factor = rope.get("rope_type"), rope.get("factor")
    if kind == "linear" and factor is not None:
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(factor))
    elif kind == "yarn" and factor is not None:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(factor))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        for key, add in (("extrapolation_factor", w.add_rope_scaling_yarn_ext_factor),
                         ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if rope.get(key) is not None:
                add(float(rope[key]))
        attn = rope.get("attention_factor", rope.get("attn_factor"))
        if attn is not None:
            w.add_rope_scaling_yarn_attn_factor(float(attn))
    elif kind not in (None, "default"):
        raise SparkpackError("config.json", f"rope type {kind!r} is not supported by the converter")


def write_gguf(out: Path, arch: Arch, fill: Callable[[Any], None]) -> Path:
    """Build the file under a temporary name next to ``out`` and rename it into place, so an
    interrupted conversion never leaves a truncated GGUF under the final name."""
    import gguf

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(out)
    w = gguf.GGUFWriter(path=None, arch=arch.gguf_arch)
    try:
        fill(w)
        w.write_header_to_file(path=tmp)
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out
