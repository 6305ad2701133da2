"""Qwen1.5/2 MoE (GGUF arch ``qwen2moe``): full attention, softmax top-k (not renormalised) and a
shared expert behind a sigmoid gate. Supported for inspection and packing (no forward pass: only
the tensors packing relies on are checked)."""
from __future__ import annotations

from .base import FULL, MOE, ArchModule, LayerKind, MetaReader, ModelSpec, common_spec
from .shapes import Expected, globals_, routed_experts


def build(model) -> ModelSpec:
    m = MetaReader(model)
    n_layer = m.layer_count()
    return common_spec(
        model, router="softmax", n_layer=n_layer, layers=[LayerKind(FULL, MOE)] * n_layer,
        n_ff_shexp=m.int("expert_shared_feed_forward_length", default=0),
        hparams={"rope_freq_base": m.float("rope.freq_base", default=1e6, lo=1.0, lo_open=True), "norm_topk": False},
    )


def tensors(spec: ModelSpec) -> list[Expected]:
    return globals_(spec) + [x for il in spec.moe_layers for x in routed_experts(spec, il)]


ARCH = ArchModule("qwen2moe", "Qwen2 MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B)", build, tensors)
