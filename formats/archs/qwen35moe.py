"""Qwen3.5/3.6-35B-A3B (GGUF arch ``qwen35moe``).

Hybrid stack: Gated DeltaNet linear-attention layers with one gated full-attention layer every
``full_attention_interval`` (default 4, the full layer last in each group, as llama.cpp reads it).
Every layer is MoE: softmax top-k renormalised plus a shared expert behind a sigmoid gate.
Trailing multi-token-prediction blocks (``nextn_predict_layers``, the MTP head some files carry)
are not part of the trunk: the spec holds them apart (``ModelSpec.nextn``).
"""
from __future__ import annotations

from ..errors import FormatError
from .base import (FULL, LINEAR, MOE, ArchModule, DeltaNetShape, LayerKind, MetaReader, ModelSpec, RopeShape, common_spec,
                   nextn_head)
from .shapes import Expected, attention, globals_, one, routed_experts, shared_expert


def build(model) -> ModelSpec:
    m = MetaReader(model)
    n_nextn = m.int("nextn_predict_layers", default=0)
    n_layer = m.layer_count(minus=n_nextn)
    recurrent = m.optional("attention.recurrent_layers")
    if isinstance(recurrent, list) and len(recurrent) >= n_layer:
        if not all(isinstance(x, (bool, int)) for x in recurrent[:n_layer]):
            raise FormatError(model.path, f"metadata key {m.key('attention.recurrent_layers')} must hold booleans")
        is_linear = [bool(x) for x in recurrent[:n_layer]]
    else:
        interval = m.int("full_attention_interval", default=4, lo=1)
        is_linear = [(i + 1) % interval != 0 for i in range(n_layer)]
    layers = [LayerKind(LINEAR if lin else FULL, MOE) for lin in is_linear]
    head_dim = m.head_dim(n_layer)
    ssm = {k: m.int(k, lo=1) for k in ("ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank",
                                         "ssm.group_count")}
    if ssm["ssm.time_step_rank"] % ssm["ssm.group_count"] or \
            ssm["ssm.inner_size"] != ssm["ssm.state_size"] * ssm["ssm.time_step_rank"]:
        raise FormatError(model.path, f"DeltaNet sizes disagree: inner size {ssm['ssm.inner_size']} must be state "
                                      f"size {ssm['ssm.state_size']} x value heads {ssm['ssm.time_step_rank']}, and "
                                      f"the value heads a multiple of the {ssm['ssm.group_count']} key heads")
    m.int("full_attention_interval", default=4, lo=1)  # (checked where recurrent_layers lists the kinds too)
    spec = common_spec(
        model, router="softmax", n_layer=n_layer, layers=layers,
        n_ff_shexp=m.int("expert_shared_feed_forward_length", default=0),
        rope=RopeShape(m.int("rope.dimension_count", default=head_dim // 4, lo=1),
                       m.float("rope.freq_base", default=1e7, lo=1.0, lo_open=True),
                       tuple(m.int_list("rope.dimension_sections", default=[]))),
        deltanet=DeltaNetShape(ssm["ssm.conv_kernel"], ssm["ssm.group_count"], ssm["ssm.state_size"],
                               ssm["ssm.time_step_rank"], ssm["ssm.inner_size"]),
        norm_topk=m.bool("expert_weights_norm", True),
    )
    spec.nextn = nextn_head(model, spec, n_nextn)
    return spec


def tensors(spec: ModelSpec) -> list[Expected]:
    d, e = spec.deltanet, spec.n_embd
    n_v, d_state = d.n_v, d.d_k
    key_dim, value_dim = d_state * d.n_k, d_state * n_v
    out = globals_(spec)
    for il, kind in enumerate(spec.layers):
        p = f"blk.{il}."
        out += [one(p + "attn_norm.weight", e), one(p + "post_attention_norm.weight", e)]
        if kind.attention == LINEAR:
            out += [one(p + "attn_qkv.weight", e, 2 * key_dim + value_dim), one(p + "attn_gate.weight", e, value_dim),
                    one(p + "ssm_conv1d.weight", d.conv_kernel, 2 * key_dim + value_dim),
                    one(p + "ssm_dt.bias", n_v), one(p + "ssm_a", n_v), one(p + "ssm_beta.weight", e, n_v),
                    one(p + "ssm_alpha.weight", e, n_v), one(p + "ssm_norm.weight", d_state),
                    one(p + "ssm_out.weight", value_dim, e)]
        else:
            out += attention(spec, il, q_per_head=2)
        out += routed_experts(spec, il) + shared_expert(spec, il, gated=True)
    return out + nextn_tensors(spec)


def nextn_tensors(spec: ModelSpec) -> list[Expected]:
    """The MTP head's blocks as llama.cpp's ``load_block_mtp`` reads them: a gated full-attention
    block with the trunk's MoE, plus the projection of [embedding norm | hidden norm] and the
    head's own output norm (``embed_tokens`` and ``shared_head_head`` are optional: without them
    the head reads the trunk's embeddings and output)."""
    head, e = spec.nextn, spec.n_embd
    if head is None:
        return []
    out: list[Expected] = []
    for il, h, kv in zip(head.layers, head.n_head, head.n_head_kv):
        p = f"blk.{il}."
        out += [one(p + "attn_norm.weight", e), one(p + "post_attention_norm.weight", e)]
        out += attention(spec, il, q_per_head=2, heads=(h, kv))
        out += routed_experts(spec, il, head.expert_tensors[il]) + shared_expert(spec, il, gated=True)
        out += [one(p + "nextn.eh_proj.weight", 2 * e, e), one(p + "nextn.enorm.weight", e),
                one(p + "nextn.hnorm.weight", e), one(p + "nextn.shared_head_norm.weight", e, required=False),
                one(p + "nextn.embed_tokens.weight", e, spec.n_vocab, required=False),
                one(p + "nextn.shared_head_head.weight", e, spec.n_vocab, required=False)]
    return out


ARCH = ArchModule("qwen35moe", "Qwen3.5/3.6 MoE (Qwen3.6-35B-A3B)", build, tensors)
