"""Laguna XS.2 (GGUF arch ``laguna``).

The GGUF stores no sliding-window layer pattern: with a window set, llama.cpp takes layers with
``il % 4 == 0`` as full attention and the rest as sliding window (different rope bases and rotary
widths), and dense MLPs only as a leading block (``leading_dense_block_count``). The router is a
sigmoid with a score-correction bias (``exp_probs_b``) used only for choosing, weights
renormalised and scaled; one always-on shared expert.
"""
from __future__ import annotations

from .base import DENSE, FULL, MOE, SLIDING, ArchModule, LayerKind, MetaReader, ModelSpec, common_spec


def build(model) -> ModelSpec:
    m = MetaReader(model)
    n_layer = m.int("block_count")
    window = m.int("attention.sliding_window", default=0)
    n_dense = m.int("leading_dense_block_count", default=0)
    layers = [
        LayerKind(FULL if window == 0 or i % 4 == 0 else SLIDING, DENSE if i < n_dense else MOE)
        for i in range(n_layer)
    ]
    head_dim = m.int("attention.key_length", default=128)
    rope_dim = m.int("rope.dimension_count", default=head_dim)
    return common_spec(
        model, router="sigmoid", n_layer=n_layer, layers=layers,
        n_ff_shexp=m.int("expert_shared_feed_forward_length", default=0),
        hparams={
            "sliding_window": window,
            "leading_dense": n_dense,
            "rope_freq_base": m.float("rope.freq_base", default=500000.0),
            "rope_dim": rope_dim,
            "rope_freq_base_swa": m.float("rope.freq_base_swa", default=m.float("rope.freq_base", default=10000.0)),
            "rope_dim_swa": m.int("rope.dimension_count_swa", default=rope_dim),
            "expert_weights_scale": m.float("expert_weights_scale", default=1.0),
            "expert_weights_norm": bool(m.optional("expert_weights_norm", True)),
            "norm_topk": bool(m.optional("expert_weights_norm", True)),
        },
    )


ARCH = ArchModule("laguna", "Laguna (Laguna XS.2 33B-A3B)", build)
