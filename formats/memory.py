"""The runtime's memory model: what a model takes on the device, counted without the runtime.

``repack split --vram`` must place exactly as many hot experts as ``spark-run --vram`` will then
hold, so both plan with one planner (``formats.placement.plan_residency``) over this one model of
what the runtime allocates: dense weights as it holds them (GGUF bytes where its kernels read the
type, else expanded), the KV cache and recurrent state, a prefill call's temporaries at their
peak, its fixed overhead, and the expert pool (each expert's slot at its own size, aligned; cache
slots at the largest). That is why the runtime's sizing knobs live here rather than in
``runtime/``: split may not import the runtime (data flows one way: formats, then repack and the
runtime) and formats may not import torch, so the runtime imports its chunk sizes and limits from
this module and the tests hold both to it (``tests/test_placement.py``: split's plan is what the
store allocates; ``tests/test_generate.py``: the KV cache and prefill temporaries).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .archs import DENSE, FULL, LINEAR, MOE, SLIDING, ModelSpec
from .quants import kernels_read

# CUDA context, cuBLAS/Triton workspaces and the allocator's slack: the reserved-minus-tensors gap
# of a decode run (BENCHMARKS.md).
RUNTIME_OVERHEAD_BYTES = 768 * 1024**2

# Tokens per forward call of a long prompt. A call costs a few thousand launches whatever its
# length, so larger chunks prefill faster (BENCHMARKS.md) for activation memory, counted by
# ``prefill_activation_bytes``.
PREFILL_CHUNK = 2048
# Tokens per block of the chunked DeltaNet prefill (runtime.models.qwen35moe).
DELTANET_CHUNK = 64
# Most tokens of a prefill call captured in a CUDA graph (runtime.graph.PrefillGraphs): calls are
# padded to a few sizes up to this, and sessions of the models that capture them (every layer
# attention, on a GPU in half precision, 16-bit KV cache: runtime.graph.short_prefill_calls) feed
# every prompt in calls of at most this many tokens, whether or not their expert store can be
# captured, so the --vram plan counts this many tokens' temporaries for them (others use
# PREFILL_CHUNK). At partial residency they keep these calls (the all-GPU bits come from them)
# and stage them in groups (GROUP_TOKENS).
PREFILL_GRAPH_TOKENS = 512
# The models whose sessions make those short captured calls keep to them while the past is
# shorter than this: a call that starts after it takes PREFILL_CHUNK tokens and runs eagerly,
# where attention over the past is torch's fused kernel (runtime.layers.causal_sdpa_after; the
# captured calls' attend_prefill reads the position from memory, which that kernel cannot). After
# a long past the fused kernel is the faster attention, and eager 2048-token calls prefill a
# long prompt faster than captured 512-token ones (BENCHMARKS.md). A session whose context is no longer makes no such
# call, so the plan counts their temporaries only beyond it (``short_call_tokens``).
LONG_PAST_TOKENS = 16384
# Prompt calls of at least this many tokens stage their cold experts in bulk, one copy per layer
# into one of two device buffers, instead of reading them zero-copy tile by tile
# (runtime.expert_staging; the plan reserves the buffers: formats.placement). Chosen with
# bench/staged_prefill.py (BENCHMARKS.md): staged calls win from the smallest call tried, because
# a few dozen tokens already route to most of a layer's cold experts. Decode steps and calls of a few tokens stay
# zero-copy.
STAGE_TOKENS = 32
# A staged prompt's consecutive calls run layer by layer in groups of up to this many tokens,
# each layer's cold experts copied once for the whole group (runtime.generate.Session,
# MoEModel.forward_calls): the copy then hides behind the group's compute, as it does not behind
# one 512-token call (whose compute is shorter than the copy of a layer's cold experts at a
# partial residency). The group holds every call's residual rows between layers, which the plan
# counts with the staging buffers (``group_bytes``).
GROUP_TOKENS = 8192
# A sliding-window layer keeps its keys and values in a ring of rows (runtime.cache.KVCache):
# position j in row j % rows, rows = the window plus the longest call, rounded up to a multiple
# of this (the decode kernel's split, so every split of the window lies in the ring: ``window_rows``).
WINDOW_ALIGN = 64
# Attention scores held at once: a long chunk's queries go in pieces (runtime.layers.attention).
ATTN_SCORES_MAX = 1 << 25
# Weights a multi-token projection expands at once from quantized bytes (runtime.quant_linear):
# a band of rows for cuBLAS, in the activations' 2-byte dtype.
DEQUANT_SCRATCH_ELEMENTS = 1 << 25


# Every expert's slot in the store's pools starts at a multiple of this many bytes (so its rows
# keep the alignment the int8 kernels load them with); a slot is its expert's bytes rounded up.
SLOT_ALIGN = 256

# Bytes per cached key/value element by KV cache type ("auto": the activations' 2-byte dtype;
# q8_0: an int8 code plus an f16 scale per 32 values).
KV_BYTES_PER_VALUE = {"auto": 2.0, "q8_0": 34 / 32}
# 2-D weights the model does not multiply by (the DeltaNet conv kernel is applied elementwise)
NOT_LINEAR = ("ssm_conv1d",)


@dataclass(frozen=True)
class MemoryTarget:
    """How the runtime will hold a model, as far as its memory goes: the bytes of an expanded
    element (its compute dtype), whether the dense matrices its kernels read stay GGUF bytes (on
    a GPU), the KV cache type, the context, and the most tokens one prefill call holds.

    ``staged_chunk``: the tokens of a prefill call when the expert store stages long calls (0:
    it never does); the models whose sessions make short captured calls keep them when they
    stage (the all-GPU bits come from them: ``runtime.generate.Session``). ``host_bytes``: the
    pinned host memory allowed for cold experts (None: all of them); only a store that holds
    every cold expert there stages."""

    dtype_bytes: int = 2
    quantized_dense: bool = True
    kv_type: str = "auto"
    ctx: int = 4096
    prefill_chunk: int = PREFILL_CHUNK
    staged_chunk: int = 0
    host_bytes: int | None = None
    mtp: bool = False  # the runtime loads the file's MTP head to draft (``head_bytes``)
    # the most tokens a session drafts per verify step: one more device copy of the DeltaNet
    # states per drafted token (``runtime.cache.RowStates``; ``recurrent_state_bytes``)
    draft_tokens: int = 0

    @classmethod
    def gpu(cls, spec: ModelSpec, ctx: int = 4096, kv_type: str = "auto",
            prefill_chunk: int = PREFILL_CHUNK, stage_tokens: int | None = STAGE_TOKENS) -> "MemoryTarget":
        """spark-run on a GPU with bf16 activations (what ``repack split --vram`` plans for)."""
        prefill_chunk = longest_call(spec, ctx, kv_type, prefill_chunk)
        return cls(2, True, kv_type, ctx, prefill_chunk, staged_call_tokens(prefill_chunk, stage_tokens))

    @property
    def kv_bytes_per_value(self) -> float:
        return float(self.dtype_bytes) if self.kv_type == "auto" else KV_BYTES_PER_VALUE[self.kv_type]


def staged_call_tokens(prefill_chunk: int, stage_tokens: int | None) -> int:
    """A session's prompt calls when its store stages calls of ``stage_tokens`` tokens or more:
    ``prefill_chunk`` tokens, or 0 when no call that long stages."""
    return prefill_chunk if stage_tokens is not None and stage_tokens <= prefill_chunk else 0


def short_call_tokens(ctx: int, prefill_chunk: int) -> int:
    """The most tokens of one prompt call in a session that makes short captured calls
    (``short_calls``) with context ``ctx``: ``PREFILL_GRAPH_TOKENS``, or ``prefill_chunk`` where
    the context reaches past ``LONG_PAST_TOKENS`` (the eager calls after a long past)."""
    return prefill_chunk if ctx > LONG_PAST_TOKENS else min(prefill_chunk, PREFILL_GRAPH_TOKENS)


def longest_call(spec: ModelSpec, ctx: int, kv_type: str, prefill_chunk: int = PREFILL_CHUNK) -> int:
    """The most tokens of one prompt call a GPU session of context ``ctx`` makes: the captured
    calls' length at any residency (``short_call_tokens``) where it makes short calls, else
    ``prefill_chunk``."""
    return short_call_tokens(ctx, prefill_chunk) if short_calls(spec, kv_type) else prefill_chunk


def window_rows(window: int, calls: int) -> int:
    """Rows of a sliding-window layer's KV ring when no call writes more than ``calls`` rows
    (padding included). A call's first token reads the ``window - 1`` positions before it, which
    its own rows must not overwrite, so the ring holds ``window + calls - 1`` rows at least; and
    ``window + WINDOW_ALIGN`` at least, so the splits of ``WINDOW_ALIGN`` positions that the
    decode kernel reads a window in are distinct rows. Rounded up to ``WINDOW_ALIGN``."""
    return -(-(window + max(calls, WINDOW_ALIGN + 1) - 1) // WINDOW_ALIGN) * WINDOW_ALIGN


def call_rows(prefill_chunk: int) -> int:
    """The rows one call writes at most in a session whose longest call is ``prefill_chunk``
    tokens: a short call may be padded up to ``PREFILL_GRAPH_TOKENS`` (runtime.graph)."""
    return max(prefill_chunk, PREFILL_GRAPH_TOKENS)


def group_tokens(ctx: int, chunk: int) -> int:
    """The most tokens of a group of staged calls in a session of context ``ctx`` and calls of
    ``chunk`` tokens: ``GROUP_TOKENS``, no more than the context, at least one call."""
    return max(min(GROUP_TOKENS, ctx), chunk)


def group_bytes(spec: ModelSpec, ctx: int, chunk: int, dtype_bytes: int = 2) -> int:
    """The residual rows a group of staged calls holds between layers (``group_tokens``) beyond
    one call's, whose temporaries ``prefill_activation_bytes`` counts."""
    return (group_tokens(ctx, chunk) - chunk) * spec.n_embd * dtype_bytes


def short_calls(spec: ModelSpec, kv_type: str) -> bool:
    """Whether a GPU session in half precision feeds prompts in calls of at most
    ``PREFILL_GRAPH_TOKENS`` tokens (``runtime.graph.short_prefill_calls``): every layer is
    attention (a DeltaNet state would take padding in), over a 16-bit KV cache."""
    return kv_type != "q8_0" and bool(spec.layers) and all(k.attention != LINEAR for k in spec.layers)


def held_as_bytes(name: str, shape: tuple[int, ...], qtype: int) -> bool:
    """Whether the runtime keeps this tensor as its GGUF bytes where it keeps dense matrices so
    (``runtime.weights.Weights(quantized=True)``): the matrices the model multiplies by (or
    gathers rows of), when its kernels read their type."""
    return name.endswith(".weight") and len(shape) == 2 and kernels_read(qtype) and not any(k in name for k in NOT_LINEAR)


def dense_bytes(tensors: dict, expert_names: set[str], target: MemoryTarget) -> int:
    """Device bytes of the non-expert tensors (``tensors``: name -> info with ``shape``, ``qtype``,
    ``nbytes``) as the runtime holds them."""
    return sum(t.nbytes if target.quantized_dense and held_as_bytes(t.name, t.shape, t.qtype)
               else math.prod(t.shape) * target.dtype_bytes for t in tensors.values() if t.name not in expert_names)


def head_bytes(spec: ModelSpec, tensors: dict, target: MemoryTarget) -> int:
    """Device bytes of the MTP head (``ModelSpec.nextn``) when the runtime loads it to draft
    (``target.mtp``; 0 otherwise or without a head): its dense tensors as ``dense_bytes`` counts
    the trunk's, its experts all resident (``runtime.models.qwen35moe_mtp.HeadExperts``: their
    GGUF bytes where the kernels read them, else expanded), and its KV cache at the context.

    Why its experts stay out of placement: every draft step is on the critical path, as a decode
    step is, and what the head routes to is not what a profile of the trunk records (calibration
    never runs it); resident, one layer's experts (~1/40 of the expert bytes on Qwen3.6) cost a
    drafting run a fixed share of its budget and a run that does not draft nothing."""
    head = spec.nextn
    if head is None or not target.mtp:
        return 0
    experts = head.expert_names()
    dense = dense_bytes({n: tensors[n] for n in head.tensors - experts}, set(), target)
    held = sum(t.nbytes if target.quantized_dense and kernels_read(t.qtype) else math.prod(t.shape) * target.dtype_bytes
               for t in (tensors[n] for n in experts))
    kv = sum(2 * kv_heads * spec.head_dim * target.ctx * target.kv_bytes_per_value for kv_heads in head.n_head_kv)
    return dense + held + int(kv)


def expert_slot_bytes(spec: ModelSpec, tensors: dict) -> dict[int, int]:
    """Device bytes one expert of each MoE layer takes in the store's pools: its bytes (all its
    tensors), rounded up to ``SLOT_ALIGN``."""
    out = {}
    for il in spec.moe_layers:
        nbytes = sum(tensors[n].nbytes for n in spec.expert_tensors[il].values()) // spec.n_expert
        out[il] = -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN
    return out


def kv_cache_bytes(spec: ModelSpec, ctx: int, bytes_per_value: float = 2.0,
                   prefill_chunk: int = PREFILL_CHUNK) -> int:
    """K and V for every attention layer at ``ctx`` positions; a sliding-window layer holds a ring
    of ``window_rows`` (at most ``ctx``) for a session whose longest call is ``prefill_chunk``."""
    total = 0.0
    for il, kind in enumerate(spec.layers):
        if kind.attention in (FULL, SLIDING):
            rows = min(ctx, window_rows(spec.sliding_window, call_rows(prefill_chunk))) if kind.attention == SLIDING \
                else ctx
            total += 2 * spec.n_head_kv[il] * spec.head_dim * rows * bytes_per_value
    return int(total)


def recurrent_state_bytes(spec: ModelSpec, bytes_per_value: int = 4) -> int:
    """Gated DeltaNet state (heads x d_k x d_v) plus conv state, per linear-attention layer."""
    n_linear = sum(1 for k in spec.layers if k.attention == LINEAR)
    if not n_linear:
        return 0
    d = spec.deltanet
    conv_channels = d.inner + 2 * d.n_k * d.d_k
    per_layer = d.n_v * d.d_k * d.d_v + conv_channels * (d.conv_kernel - 1)
    return n_linear * per_layer * bytes_per_value


def prefill_activation_bytes(spec: ModelSpec, chunk: int = PREFILL_CHUNK, ctx: int = 4096,
                             scores: bool = True) -> int:
    """Temporaries of one prefill call of ``chunk`` tokens at their peak: the hungriest layer's
    (a layer's temporaries are freed before the next one runs) plus the hidden states passed
    between layers. Counted from the runtime's float32 working tensors, per token:

    - chunked DeltaNet, per value head: q, k, v (and their copies padded to whole blocks), the
      block-local decay, A and QK^T (``DELTANET_CHUNK`` values each), the triangular solve's
      right-hand side and result (d_k + d_v), the decayed keys and the output;
    - attention: one query piece's scores (at most ``ATTN_SCORES_MAX``), masked and softmaxed;
    - MoE: per routed (token, expert) pair, its SwiGLU activations and its down projection;
      a dense MLP: its gate, up and their product;
    - the band of a quantized dense matrix expanded for cuBLAS (``DEQUANT_SCRATCH_ELEMENTS``, or
      the largest matrix, the output head, when that is smaller).

    ``scores=False``: attention is one fused kernel that holds no scores (a captured call).
    """
    # residual, normed input, projections' outputs (float32 bound), the expanded weight band
    hidden = chunk * 8 * spec.n_embd * 4 + 2 * min(DEQUANT_SCRATCH_ELEMENTS, spec.n_vocab * spec.n_embd)
    worst = 0
    for il, kind in enumerate(spec.layers):
        if kind.attention == LINEAR:
            d = spec.deltanet
            n_v, d_k, d_v = d.n_v, d.d_k, d.d_v
            padded = -(-chunk // DELTANET_CHUNK) * DELTANET_CHUNK
            per_head = 2 * (2 * d_k + d_v) + 4 * DELTANET_CHUNK + 2 * (d_k + d_v) + d_k + d_v
            layer = padded * n_v * per_head * 4
        else:
            held = min(ATTN_SCORES_MAX, spec.n_head[il] * chunk * max(ctx, chunk)) if scores else 0
            layer = 3 * held * 4 + 4 * chunk * spec.n_head[il] * spec.head_dim * 4
        if kind.ffn == MOE:
            layer = max(layer, chunk * spec.n_expert_used * (spec.n_ff_exp + spec.n_embd) * 4)
        elif kind.ffn == DENSE:  # gate, up and their product
            layer = max(layer, chunk * 3 * spec.n_ff_dense * 4)
        worst = max(worst, layer)
    return hidden + worst


def prefill_graph_bytes(spec: ModelSpec, tokens: int = PREFILL_GRAPH_TOKENS) -> int:
    """The memory pool kept by the captured prefill calls (``runtime.graph.PrefillGraphs``): the
    temporaries of a ``tokens``-token call, held between calls. Only models whose every layer is
    attention capture prefill calls; their attention there is one fused kernel (no scores held)."""
    if any(kind.attention == LINEAR for kind in spec.layers):
        return 0
    return prefill_activation_bytes(spec, tokens, scores=False)


def runtime_bytes(spec: ModelSpec, ctx: int, chunk: int = PREFILL_CHUNK) -> int:
    """What the runtime needs besides weights, KV cache and recurrent state: its fixed overhead,
    a prefill call's temporaries and the captured prefill calls' pool."""
    return RUNTIME_OVERHEAD_BYTES + prefill_activation_bytes(spec, chunk, ctx) + prefill_graph_bytes(spec)
