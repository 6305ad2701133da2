"""Laguna XS.2 (GGUF arch ``laguna``).

The GGUF stores no sliding-window layer pattern: with a window set, llama.cpp takes layers with
``il % 4 == 0`` as full attention and the rest as sliding window (different rope bases and rotary
widths), and dense MLPs only as a leading block (``leading_dense_block_count``). The router is a
sigmoid with a score-correction bias (``exp_probs_b``) used only for choosing, weights
renormalised and scaled; one always-on shared expert.
"""
from __future__ import annotations

from ..errors import FormatError
from .base import (DENSE, FULL, MOE, SLIDING, ArchModule, LayerKind, MetaReader, ModelSpec, RopeShape, YarnScaling,
                   common_spec)
from .shapes import Expected, attention, dense_mlp, globals_, one, routed_experts, shared_expert


def build(model) -> ModelSpec:
    m = MetaReader(model)
    n_layer = m.layer_count()
    window = m.int("attention.sliding_window", default=0)
    n_dense = m.int("leading_dense_block_count", default=0, hi=n_layer)
    layers = [
        LayerKind(FULL if window == 0 or i % 4 == 0 else SLIDING, DENSE if i < n_dense else MOE)
        for i in range(n_layer)
    ]
    head_dim = m.head_dim(n_layer)
    rope_dim = m.int("rope.dimension_count", default=head_dim, lo=1)
    base = m.float("rope.freq_base", default=500000.0, lo=1.0, lo_open=True)
    return common_spec(
        model, router="sigmoid", n_layer=n_layer, layers=layers,
        n_ff_shexp=m.int("expert_shared_feed_forward_length", default=0),
        rope=RopeShape(rope_dim, base),
        rope_swa=RopeShape(m.int("rope.dimension_count_swa", default=rope_dim, lo=1),
                           m.float("rope.freq_base_swa", default=m.float("rope.freq_base", default=10000.0),
                                   lo=1.0, lo_open=True)),
        yarn=rope_scaling(m),
        sliding_window=window,
        norm_topk=m.bool("expert_weights_norm", True),
        expert_weights_scale=m.float("expert_weights_scale", default=1.0),
    )


def rope_scaling(m: MetaReader) -> YarnScaling | None:
    """YaRN on the full-attention layers when the file asks for it (``rope.scaling.type``)."""
    kind = m.str("rope.scaling.type", "none")
    if kind in ("none", ""):
        return None
    if kind != "yarn":
        raise FormatError(m.model.path, f"metadata key {m.key('rope.scaling.type')} is {kind!r}; laguna supports "
                                        "'yarn' or none")
    attn = m.optional("rope.scaling.yarn_attn_factor")
    return YarnScaling(factor=m.float("rope.scaling.factor", lo=0.0, lo_open=True),
                       original_context_length=m.int("rope.scaling.original_context_length", lo=1),
                       beta_fast=m.float("rope.scaling.yarn_beta_fast", default=32.0, lo=0.0, lo_open=True),
                       beta_slow=m.float("rope.scaling.yarn_beta_slow", default=1.0, lo=0.0, lo_open=True),
                       attn_factor=None if attn is None else m.float("rope.scaling.yarn_attn_factor", lo=0.0,
                                                                     lo_open=True))


def tensors(spec: ModelSpec) -> list[Expected]:
    out = globals_(spec)
    for il, kind in enumerate(spec.layers):
        p, e, h = f"blk.{il}.", spec.n_embd, spec.n_head[il]
        out += [one(p + "attn_norm.weight", e), one(p + "ffn_norm.weight", e),
                Expected(p + "attn_gate.weight", ((e, h), (e, h * spec.head_dim)))]  # per head or per channel
        out += attention(spec, il)
        if kind.ffn == DENSE:
            out += dense_mlp(spec, il)
        else:
            out += [one(p + "exp_probs_b.bias", spec.n_expert, required=False)]
            out += routed_experts(spec, il) + shared_expert(spec, il, gated=False)
    return out


ARCH = ArchModule("laguna", "Laguna (Laguna XS.2 33B-A3B)", build, tensors)
