"""The tensor index of each arch: names and GGUF shapes exactly as llama.cpp's converter writes
them (``conversion/{qwen,laguna}.py``) and its loader expects (``src/models/*.cpp``
``load_arch_tensors``), plus how each tensor's values are initialised.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .presets import Preset

# init kinds: "weight" (zero-mean, std = scale), "norm" (~1), "router" (weight rows scaled per
# expert by the routing skew), "probs_bias", "ssm_a", "ssm_dt", "conv"
WEIGHT_STD = 0.02


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # GGUF order, ne[0] first
    init: str = "weight"
    scale: float = WEIGHT_STD

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


def _llama_order(name: str) -> tuple[int, str]:
    """llama-quantize writes tensors sorted by layer (non-layer tensors first), then name."""
    m = re.match(r"blk\.(\d+)\.", name)
    return (int(m.group(1)) if m else -1, name)


def _moe(p: Preset, il: int, shared_gate: bool) -> list[TensorPlan]:
    b, e, f = f"blk.{il}.", p.n_expert, p.n_ff_exp
    out = [
        TensorPlan(b + "ffn_gate_inp.weight", (p.n_embd, e), "router"),
        TensorPlan(b + "ffn_gate_exps.weight", (p.n_embd, f, e)),
        TensorPlan(b + "ffn_up_exps.weight", (p.n_embd, f, e)),
        TensorPlan(b + "ffn_down_exps.weight", (f, p.n_embd, e)),
    ]
    if p.n_ff_shexp:
        s = p.n_ff_shexp
        out += [
            TensorPlan(b + "ffn_gate_shexp.weight", (p.n_embd, s)),
            TensorPlan(b + "ffn_up_shexp.weight", (p.n_embd, s)),
            TensorPlan(b + "ffn_down_shexp.weight", (s, p.n_embd)),
        ]
        if shared_gate:
            out.append(TensorPlan(b + "ffn_gate_inp_shexp.weight", (p.n_embd,)))
    return out


def _attention(p: Preset, il: int, q_rows: int, n_head: int | None = None) -> list[TensorPlan]:
    b, hd = f"blk.{il}.", p.head_dim
    n_head = p.n_head[il] if n_head is None else n_head
    return [
        TensorPlan(b + "attn_q.weight", (p.n_embd, q_rows)),
        TensorPlan(b + "attn_k.weight", (p.n_embd, hd * p.n_head_kv)),
        TensorPlan(b + "attn_v.weight", (p.n_embd, hd * p.n_head_kv)),
        TensorPlan(b + "attn_output.weight", (hd * n_head, p.n_embd)),
        TensorPlan(b + "attn_q_norm.weight", (hd,), "norm"),
        TensorPlan(b + "attn_k_norm.weight", (hd,), "norm"),
    ]


def is_linear_layer(p: Preset, il: int) -> bool:
    return p.arch == "qwen35moe" and (il + 1) % p.extra["full_attention_interval"] != 0


def _qwen35moe(p: Preset, il: int) -> list[TensorPlan]:
    b = f"blk.{il}."
    out = [TensorPlan(b + "attn_norm.weight", (p.n_embd,), "norm"),
           TensorPlan(b + "post_attention_norm.weight", (p.n_embd,), "norm")]
    if is_linear_layer(p, il):
        x = p.extra
        key_dim = x["ssm_state_size"] * x["ssm_group_count"]
        value_dim = x["ssm_state_size"] * x["ssm_time_step_rank"]
        n_v = x["ssm_time_step_rank"]
        out += [
            TensorPlan(b + "attn_qkv.weight", (p.n_embd, 2 * key_dim + value_dim)),
            TensorPlan(b + "attn_gate.weight", (p.n_embd, value_dim)),
            TensorPlan(b + "ssm_conv1d.weight", (x["ssm_conv_kernel"], 2 * key_dim + value_dim), "conv"),
            TensorPlan(b + "ssm_dt.bias", (n_v,), "ssm_dt"),
            TensorPlan(b + "ssm_a", (n_v,), "ssm_a"),
            TensorPlan(b + "ssm_beta.weight", (p.n_embd, n_v)),
            TensorPlan(b + "ssm_alpha.weight", (p.n_embd, n_v)),
            TensorPlan(b + "ssm_norm.weight", (x["ssm_state_size"],), "norm"),
            TensorPlan(b + "ssm_out.weight", (value_dim, p.n_embd)),
        ]
    else:
        # q rows per head are [query | output gate], hence 2x
        out += _attention(p, il, 2 * p.head_dim * p.n_head[il])
    return out + _moe(p, il, shared_gate=True)


def _laguna(p: Preset, il: int) -> list[TensorPlan]:
    b = f"blk.{il}."
    out = [TensorPlan(b + "attn_norm.weight", (p.n_embd,), "norm"),
           TensorPlan(b + "ffn_norm.weight", (p.n_embd,), "norm"),
           TensorPlan(b + "attn_gate.weight", (p.n_embd, p.n_head[il]))]  # per-head softplus gate
    out += _attention(p, il, p.head_dim * p.n_head[il])
    if il < p.extra["leading_dense"]:
        out += [TensorPlan(b + "ffn_gate.weight", (p.n_embd, p.n_ff_dense)),
                TensorPlan(b + "ffn_up.weight", (p.n_embd, p.n_ff_dense)),
                TensorPlan(b + "ffn_down.weight", (p.n_ff_dense, p.n_embd))]
    else:
        out.append(TensorPlan(b + "exp_probs_b.bias", (p.n_expert,), "probs_bias"))
        out += _moe(p, il, shared_gate=False)
    return out


def _qwen3moe(p: Preset, il: int) -> list[TensorPlan]:
    b = f"blk.{il}."
    return ([TensorPlan(b + "attn_norm.weight", (p.n_embd,), "norm"),
             TensorPlan(b + "ffn_norm.weight", (p.n_embd,), "norm")]
            + _attention(p, il, p.head_dim * p.n_head[il]) + _moe(p, il, shared_gate=False))


def _qwen35moe_mtp(p: Preset, il: int) -> list[TensorPlan]:
    """The MTP ("nextn") block the converter appends as ``blk.{n_layer}`` (``_QwenMtpMixin``): a
    gated full-attention block with the trunk's MoE, the projection of [embedding | hidden] back
    to the width, and the norms before it and before the shared output head. The real files share
    the trunk's embeddings and output (no ``nextn.embed_tokens`` / ``shared_head_head``)."""
    b, n_head = f"blk.{il}.", p.n_head[-1]
    return ([TensorPlan(b + "attn_norm.weight", (p.n_embd,), "norm"),
             TensorPlan(b + "post_attention_norm.weight", (p.n_embd,), "norm")]
            + _attention(p, il, 2 * p.head_dim * n_head, n_head) + _moe(p, il, shared_gate=True)
            + [TensorPlan(b + "nextn.eh_proj.weight", (2 * p.n_embd, p.n_embd)),
               TensorPlan(b + "nextn.enorm.weight", (p.n_embd,), "norm"),
               TensorPlan(b + "nextn.hnorm.weight", (p.n_embd,), "norm"),
               TensorPlan(b + "nextn.shared_head_norm.weight", (p.n_embd,), "norm")])


_LAYER_PLANS = {"qwen35moe": _qwen35moe, "laguna": _laguna, "qwen3moe": _qwen3moe}
# Archs whose files can carry an MTP head, and its block
MTP_PLANS = {"qwen35moe": _qwen35moe_mtp}


def tensor_plan(p: Preset, mtp: bool = False) -> list[TensorPlan]:
    """Every tensor of the model (with ``mtp`` its MTP head after the trunk), in the order
    llama-quantize writes them."""
    plans = [
        TensorPlan("token_embd.weight", (p.n_embd, p.n_vocab)),
        TensorPlan("output_norm.weight", (p.n_embd,), "norm"),
        TensorPlan("output.weight", (p.n_embd, p.n_vocab)),
    ]
    for il in range(p.n_layer):
        plans += _LAYER_PLANS[p.arch](p, il)
    if mtp:
        plans += MTP_PLANS[p.arch](p, p.n_layer)
    return sorted(plans, key=lambda t: _llama_order(t.name))
