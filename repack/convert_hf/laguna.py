"""``LagunaForCausalLM`` -> GGUF ``laguna`` (poolside Laguna XS.2).

Tensors need no value transform; besides the shared names there are the per-head softplus output
gate ``g_proj`` (-> ``attn_gate``), the dense MLP of the leading layers and the router's score
correction bias (-> ``exp_probs_b.bias``). Metadata carries what the GGUF cannot infer: per-layer
head counts (an array), the window, the leading dense block count, sigmoid gating with
renormalised weights times ``moe_routed_scaling_factor``, and separate rope base/width for full
and sliding layers. ``</assistant>`` is promoted to CONTROL and registered as EOT, as llama.cpp does.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from sparkpack.formats.errors import SparkpackError

from .common import Arch, rope_parameters, write_common_metadata

LAYER_NAMES = {
    "self_attn.g_proj.weight": "attn_gate.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.experts.e_score_correction_bias": "exp_probs_b.bias",
}


def heads_per_layer(hp: dict[str, Any]) -> list[int]:
    heads = hp.get("num_attention_heads_per_layer") or [hp["num_attention_heads"]] * hp["num_hidden_layers"]
    if len(heads) != hp["num_hidden_layers"]:
        raise SparkpackError("config.json", f"num_attention_heads_per_layer has {len(heads)} entries for "
                                            f"{hp['num_hidden_layers']} layers")
    return [int(h) for h in heads]


def gate_per_head(hp: dict[str, Any]) -> list[bool]:
    """Per layer: True for one gate per head, False for one per (head, channel)."""
    def norm(t: object) -> str:
        s = str(t).replace("-", "_")
        if s not in ("per_head", "per_element"):
            raise SparkpackError("config.json", f"unknown Laguna attention gate type {t!r}")
        return s

    gating, types = hp.get("gating"), hp.get("gating_types")
    if types:
        kinds = [norm(t) for t in types]
    elif isinstance(gating, str):
        kinds = [norm(gating)] * hp["num_hidden_layers"]
    elif gating is True:
        kinds = ["per_head"] * hp["num_hidden_layers"]
    else:
        raise SparkpackError("config.json", f"cannot tell the Laguna attention gate type (gating={gating!r})")
    return [k == "per_head" for k in kinds]


def leading_dense(hp: dict[str, Any]) -> int:
    n = 0
    for t in hp.get("mlp_layer_types") or ["dense"] + ["sparse"] * (hp["num_hidden_layers"] - 1):
        if t != "dense":
            break
        n += 1
    return n


def write_metadata(w, hp: dict[str, Any], outtype: str) -> None:
    write_common_metadata(w, hp, outtype, head_count=heads_per_layer(hp))
    w.add_vocab_size(int(hp["vocab_size"]))
    gate_per_head(hp)  # reject an inconsistent gating config now, not mid-write
    if window := hp.get("sliding_window") or 0:
        w.add_sliding_window(int(window))
    w.add_expert_feed_forward_length(int(hp["moe_intermediate_size"]))
    w.add_expert_shared_feed_forward_length(int(hp["shared_expert_intermediate_size"]))
    w.add_expert_weights_norm(True)
    w.add_expert_weights_scale(float(hp.get("moe_routed_scaling_factor", 1.0)))
    w.add_uint32(f"{w.arch}.expert_gating_func", 2)  # gguf ExpertGatingFuncType.SIGMOID
    w.add_leading_dense_block_count(leading_dense(hp))
    rope = rope_parameters(hp)
    head_dim = int(hp["head_dim"])
    w.add_rope_dimension_count(int(head_dim * float(rope["full_attention"].get("partial_rotary_factor", 1.0))))
    if (swa := rope.get("sliding_attention")) is not None:
        w.add_rope_dimension_count_swa(int(head_dim * float(swa.get("partial_rotary_factor", 1.0))))
    eos = hp.get("eos_token_id")
    if isinstance(eos, list):
        extra = [e for e in eos if e != hp.get("bos_token_id")]
        if extra:
            w.add_eot_token_id(int(extra[0]))


def transform(name: str, data: np.ndarray, hp: dict[str, Any], bid: int) -> np.ndarray:
    """No value change; the gate width must match the declared granularity, else the weights and
    the config disagree and a runtime would silently misread the gate."""
    if bid >= 0 and name == "self_attn.g_proj.weight":
        n_head = heads_per_layer(hp)[bid]
        expected = n_head if gate_per_head(hp)[bid] else n_head * int(hp["head_dim"])
        if data.shape[0] != expected:
            raise SparkpackError(f"model.layers.{bid}.{name}", f"gate has {data.shape[0]} rows, the config's "
                                                               f"gating implies {expected}")
    return data


ARCH = Arch(hf_class="LagunaForCausalLM", gguf_arch="laguna", tokenizer_pre="laguna",
            write_metadata=write_metadata, layer_names=LAYER_NAMES, transform=transform,
            control_tokens=("</assistant>",))
