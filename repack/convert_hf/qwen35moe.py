"""``Qwen3_5MoeForCausalLM`` -> GGUF ``qwen35moe`` (Qwen3.5/3.6-35B-A3B family).

Value transforms, as llama.cpp's converter applies them (its runtime depends on each):

* Every RMSNorm except the DeltaNet output norm stores ``w`` and computes ``x * (1 + w)`` in
  transformers; the GGUF stores ``1 + w`` (plain ``x * w`` in llama.cpp).
* ``A_log`` -> ``ssm_a = -exp(A_log)``; ``dt_bias`` -> ``ssm_dt.bias``; the depthwise conv kernel
  (channels, 1, kernel) is squeezed to (channels, kernel).
* Value heads of the DeltaNet layers are reordered from grouped-by-key-head
  ([k0: v0..v(r-1), k1: v0..v(r-1), ...]) to tiled ([k0v0, k1v0, ..., k0v1, k1v1, ...]) so that
  ggml can broadcast key heads with a plain repeat. That touches the V rows of ``in_proj_qkv``,
  the rows of ``in_proj_z``/``in_proj_a``/``in_proj_b``, ``A_log``, ``dt_bias``, the V channels of
  the conv kernel and the input columns of ``out_proj``. Only needed when there are fewer key heads
  than value heads.

The multi-token-prediction head (``mtp.*``, ``mtp_num_hidden_layers`` blocks) becomes blocks after
the trunk, as llama.cpp's ``_Qwen35MtpMixin`` lays it out (ggml-org/llama.cpp conversion/qwen.py):
``mtp.layers.i.*`` is layer ``num_hidden_layers + i`` under the trunk's names, and ``mtp.fc`` /
``pre_fc_norm_embedding`` / ``pre_fc_norm_hidden`` / ``norm`` are that block's ``nextn.eh_proj`` /
``enorm`` / ``hnorm`` / ``shared_head_norm`` (its norms stored as ``1 + w`` too); ``block_count``
counts the head and ``nextn_predict_layers`` names it. The vision tower of the multimodal wrapper
(``Qwen3_5MoeForConditionalGeneration``) is skipped.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .common import Arch, hf_layer_count, rope_parameters, write_common_metadata

# the MTP head's own tensors -> their names in its block
MTP_NAMES = {"fc": "nextn.eh_proj", "pre_fc_norm_embedding": "nextn.enorm", "pre_fc_norm_hidden": "nextn.hnorm",
             "norm": "nextn.shared_head_norm"}

LAYER_NAMES = {
    **{f"{n}.weight": f"{n}.weight" for n in MTP_NAMES.values()},
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}

DEFAULT_MROPE_SECTION = [11, 11, 10, 0]


def mtp_blocks(hp: dict[str, Any]) -> int:
    return int(hp.get("mtp_num_hidden_layers") or 0)


def mtp_rename(name: str, hp: dict[str, Any]) -> str:
    """``mtp.*`` (or ``model.mtp.*``) -> the trunk-style name of the block after the trunk."""
    if name.startswith("model.mtp."):
        name = name[len("model."):]
    parts = name.split(".", 3)
    if parts[0] != "mtp":
        return name
    n = hf_layer_count(hp)
    if len(parts) == 4 and parts[1] == "layers" and parts[2].isdecimal():
        return f"model.layers.{n + int(parts[2])}.{parts[3]}"
    if len(parts) == 3 and parts[1] in MTP_NAMES:
        return f"model.layers.{n}.{MTP_NAMES[parts[1]]}.{parts[2]}"
    return name  # (no mapping: the converter's one error names it)


def write_metadata(w, hp: dict[str, Any], outtype: str) -> None:
    write_common_metadata(w, hp, outtype, extra_blocks=mtp_blocks(hp))
    if mtp_blocks(hp):
        w.add_uint32(f"{w.arch}.nextn_predict_layers", mtp_blocks(hp))
    w.add_expert_feed_forward_length(int(hp["moe_intermediate_size"]))
    if (n := hp.get("shared_expert_intermediate_size")) is not None:
        w.add_expert_shared_feed_forward_length(int(n))
    w.add_ssm_conv_kernel(int(hp["linear_conv_kernel_dim"]))
    w.add_ssm_state_size(int(hp["linear_key_head_dim"]))
    w.add_ssm_group_count(int(hp["linear_num_key_heads"]))
    w.add_ssm_time_step_rank(int(hp["linear_num_value_heads"]))
    w.add_ssm_inner_size(int(hp["linear_value_head_dim"]) * int(hp["linear_num_value_heads"]))
    if (layer_types := hp.get("layer_types")) is not None:
        w.add_array(f"{w.arch}.attention.recurrent_layers", [t == "linear_attention" for t in layer_types])
    w.add_full_attention_interval(int(hp.get("full_attention_interval", 4)))
    rope = rope_parameters(hp)
    head_dim = int(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])
    w.add_rope_dimension_count(int(head_dim * float(rope.get("partial_rotary_factor", 0.25))))
    if "mrope_section" not in rope:
        w.add_rope_dimension_sections(DEFAULT_MROPE_SECTION)


def tile_v_heads(a: np.ndarray, axis: int, n_k: int, n_v: int, head_dim: int) -> np.ndarray:
    """Grouped-by-key-head value heads -> tiled order along ``axis`` (see module docstring)."""
    a = np.moveaxis(a, axis, 0)
    rest = a.shape[1:]
    a = a.reshape(n_k, n_v // n_k, head_dim, *rest).swapaxes(0, 1).reshape(n_v * head_dim, *rest)
    return np.ascontiguousarray(np.moveaxis(a, 0, axis))


def transform(name: str, data: np.ndarray, hp: dict[str, Any], bid: int) -> np.ndarray:
    """``name`` is relative to the layer (``bid`` >= 0) or the full name outside layers (-1)."""
    if name.startswith("linear_attn."):
        data = _reorder(name, data, hp)
    if name == "linear_attn.A_log":
        # exp in float64 then rounded: the correctly rounded float32, which is what torch gives
        # (numpy's float32 exp is off by an ulp on some inputs)
        return (-np.exp(data.astype(np.float64))).astype(np.float32)
    if name == "linear_attn.conv1d.weight":
        return data.reshape(data.shape[0], data.shape[-1])
    if name.endswith("norm.weight") and name != "linear_attn.norm.weight":
        return data + np.float32(1.0)
    return data


def _reorder(name: str, data: np.ndarray, hp: dict[str, Any]) -> np.ndarray:
    n_k, n_v = int(hp["linear_num_key_heads"]), int(hp["linear_num_value_heads"])
    if n_k == n_v:
        return data
    dk, dv = int(hp["linear_key_head_dim"]), int(hp["linear_value_head_dim"])
    qk = 2 * n_k * dk
    if name == "linear_attn.in_proj_qkv.weight":
        return np.concatenate([data[:qk], tile_v_heads(data[qk:], 0, n_k, n_v, dv)], axis=0)
    if name == "linear_attn.conv1d.weight":
        flat = data.reshape(data.shape[0], data.shape[-1])
        return np.concatenate([flat[:qk], tile_v_heads(flat[qk:], 0, n_k, n_v, dv)], axis=0)
    if name == "linear_attn.in_proj_z.weight":
        return tile_v_heads(data, 0, n_k, n_v, dv)
    if name in ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight",
                "linear_attn.A_log", "linear_attn.dt_bias"):
        return tile_v_heads(data, 0, n_k, n_v, 1)
    if name == "linear_attn.out_proj.weight":
        return tile_v_heads(data, 1, n_k, n_v, dv)
    return data


ARCH = Arch(hf_class="Qwen3_5MoeForCausalLM", gguf_arch="qwen35moe", tokenizer_pre="qwen35",
            write_metadata=write_metadata, layer_names=LAYER_NAMES, transform=transform,
            skip=lambda name: name.startswith(("model.visual.", "visual.")), rename=mtp_rename,
            extra_blocks=mtp_blocks)
