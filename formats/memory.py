"""Device memory a model needs besides its weights: KV cache, recurrent state, runtime overhead.

Both ``repack inspect`` (VRAM for all-GPU) and ``repack split`` (what is left for experts under a
budget) count these the same way, so they live here, next to the spec they read.
"""
from __future__ import annotations

from .archs import FULL, LINEAR, SLIDING, ModelSpec

# CUDA context, cuBLAS/Triton workspaces and the allocator's slack. Measured on the GPU machine
# as the reserved-minus-tensors gap of a decode run; see BENCHMARKS.md.
RUNTIME_OVERHEAD_BYTES = 768 * 1024**2


# Bytes per cached key/value element by KV cache type ("auto": the activations' 2-byte dtype;
# q8_0: an int8 code plus an f16 scale per 32 values).
KV_BYTES_PER_VALUE = {"auto": 2.0, "q8_0": 34 / 32}


def kv_cache_bytes(spec: ModelSpec, ctx: int, bytes_per_value: float = 2.0) -> int:
    """K and V for every attention layer at ``ctx`` positions. Sliding-window layers count the
    whole context too: the runtime keeps every key (the window is part of its attention mask, so
    a captured decode step has the same shapes at every position)."""
    total = 0.0
    for il, kind in enumerate(spec.layers):
        if kind.attention in (FULL, SLIDING):
            total += 2 * spec.n_head_kv[il] * spec.head_dim * ctx * bytes_per_value
    return int(total)


def recurrent_state_bytes(spec: ModelSpec, bytes_per_value: int = 4) -> int:
    """Gated DeltaNet state (heads x d_k x d_v) plus conv state, per linear-attention layer."""
    n_linear = sum(1 for k in spec.layers if k.attention == LINEAR)
    if not n_linear:
        return 0
    h = spec.hparams
    n_v_heads = h["ssm_time_step_rank"]
    d_state = h["ssm_state_size"]
    d_inner = h["ssm_inner_size"]
    head_v = d_inner // max(n_v_heads, 1)
    conv_channels = d_inner + 2 * h["ssm_group_count"] * d_state
    per_layer = n_v_heads * d_state * head_v + conv_channels * (h["ssm_conv_kernel"] - 1)
    return n_linear * per_layer * bytes_per_value
