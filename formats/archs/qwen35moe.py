"""Qwen3.5/3.6-35B-A3B (GGUF arch ``qwen35moe``).

Hybrid stack: Gated DeltaNet linear-attention layers with one gated full-attention layer every
``full_attention_interval`` (default 4, the full layer last in each group, as llama.cpp reads it).
Every layer is MoE: softmax top-k renormalised plus a shared expert behind a sigmoid gate.
Trailing multi-token-prediction layers (``nextn_predict_layers``) are not part of the trunk.
"""
from __future__ import annotations

from .base import FULL, LINEAR, MOE, ArchModule, LayerKind, MetaReader, ModelSpec, common_spec


def build(model) -> ModelSpec:
    m = MetaReader(model)
    n_layer = m.int("block_count") - m.int("nextn_predict_layers", default=0)
    recurrent = m.optional("attention.recurrent_layers")
    if isinstance(recurrent, list) and len(recurrent) >= n_layer:
        is_linear = [bool(x) for x in recurrent[:n_layer]]
    else:
        interval = m.int("full_attention_interval", default=4)
        is_linear = [(i + 1) % interval != 0 for i in range(n_layer)]
    layers = [LayerKind(LINEAR if lin else FULL, MOE) for lin in is_linear]
    head_dim = m.int("attention.key_length", default=256)
    return common_spec(
        model, router="softmax", n_layer=n_layer, layers=layers,
        n_ff_shexp=m.int("expert_shared_feed_forward_length", default=0),
        hparams={
            "rope_freq_base": m.float("rope.freq_base", default=1e7),
            "rope_dim": m.int("rope.dimension_count", default=head_dim // 4),
            "rope_sections": list(m.optional("rope.dimension_sections", [])),
            "ssm_conv_kernel": m.int("ssm.conv_kernel"),
            "ssm_inner_size": m.int("ssm.inner_size"),
            "ssm_state_size": m.int("ssm.state_size"),
            "ssm_time_step_rank": m.int("ssm.time_step_rank"),
            "ssm_group_count": m.int("ssm.group_count"),
            "full_attention_interval": m.int("full_attention_interval", default=4),
            "norm_topk": True,
        },
    )


ARCH = ArchModule("qwen35moe", "Qwen3.5/3.6 MoE (Qwen3.6-35B-A3B)", build)
