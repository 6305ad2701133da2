"""Qwen3-30B-A3B (GGUF arch ``qwen3moe``): every layer full GQA attention with q/k RMSNorm and a
softmax top-k router over experts, renormalised; no shared expert."""
from __future__ import annotations

from .base import FULL, MOE, ArchModule, LayerKind, MetaReader, ModelSpec, common_spec


def build(model) -> ModelSpec:
    m = MetaReader(model)
    n_layer = m.int("block_count")
    return common_spec(
        model, router="softmax", n_layer=n_layer, layers=[LayerKind(FULL, MOE)] * n_layer,
        hparams={
            "rope_freq_base": m.float("rope.freq_base", default=1e6),
            "rope_dim": m.int("rope.dimension_count", default=m.int("attention.key_length", default=128)),
            "norm_topk": True,
        },
    )


ARCH = ArchModule("qwen3moe", "Qwen3 MoE (Qwen3-30B-A3B)", build)
