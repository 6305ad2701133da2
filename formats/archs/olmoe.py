"""OLMoE (GGUF arch ``olmoe``): full attention with q/k norm, softmax top-k without
renormalisation, no shared expert. Supported for inspection and packing."""
from __future__ import annotations

from .base import FULL, MOE, ArchModule, LayerKind, MetaReader, ModelSpec, common_spec


def build(model) -> ModelSpec:
    m = MetaReader(model)
    n_layer = m.int("block_count")
    return common_spec(
        model, router="softmax", n_layer=n_layer, layers=[LayerKind(FULL, MOE)] * n_layer,
        hparams={"rope_freq_base": m.float("rope.freq_base", default=1e4), "norm_topk": False},
    )


ARCH = ArchModule("olmoe", "OLMoE (OLMoE-1B-7B)", build)
