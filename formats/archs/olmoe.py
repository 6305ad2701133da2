"""OLMoE (GGUF arch ``olmoe``): full attention with q/k norm, softmax top-k without
renormalisation, no shared expert. Supported for inspection and packing (no forward pass: only
the tensors packing relies on are checked)."""
from __future__ import annotations

from .base import FULL, MOE, ArchModule, LayerKind, MetaReader, ModelSpec, common_spec
from .shapes import Expected, globals_, routed_experts


def build(model) -> ModelSpec:
    m = MetaReader(model)
    n_layer = m.layer_count()
    return common_spec(
        model, router="softmax", n_layer=n_layer, layers=[LayerKind(FULL, MOE)] * n_layer,
        hparams={"rope_freq_base": m.float("rope.freq_base", default=1e4, lo=1.0, lo_open=True), "norm_topk": False},
    )


def tensors(spec: ModelSpec) -> list[Expected]:
    return globals_(spec) + [x for il in spec.moe_layers for x in routed_experts(spec, il)]


ARCH = ArchModule("olmoe", "OLMoE (OLMoE-1B-7B)", build, tensors)
