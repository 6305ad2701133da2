"""Qwen3-30B-A3B (GGUF arch ``qwen3moe``): every layer full GQA attention with q/k RMSNorm and a
softmax top-k router over experts, renormalised; no shared expert."""
from __future__ import annotations

from .base import FULL, MOE, ArchModule, LayerKind, MetaReader, ModelSpec, RopeShape, common_spec
from .shapes import Expected, attention, globals_, one, routed_experts


def build(model) -> ModelSpec:
    m = MetaReader(model)
    n_layer = m.layer_count()
    return common_spec(
        model, router="softmax", n_layer=n_layer, layers=[LayerKind(FULL, MOE)] * n_layer,
        rope=RopeShape(m.int("rope.dimension_count", default=m.head_dim(n_layer), lo=1),
                       m.float("rope.freq_base", default=1e6, lo=1.0, lo_open=True)),
        norm_topk=m.bool("expert_weights_norm", True),
    )


def tensors(spec: ModelSpec) -> list[Expected]:
    out = globals_(spec)
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        out += [one(p + "attn_norm.weight", spec.n_embd), one(p + "ffn_norm.weight", spec.n_embd)]
        out += attention(spec, il) + routed_experts(spec, il)
    return out


ARCH = ArchModule("qwen3moe", "Qwen3 MoE (Qwen3-30B-A3B)", build, tensors)
