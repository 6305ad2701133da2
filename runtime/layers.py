"""Building blocks shared by the model files: norms, rotary embeddings, attention, MLPs, routers.

Everything works on one sequence (no batch axis): activations are ``[T, ...]`` with T the number of
new tokens. All math runs in the dtype of the activations (float32 by default, float64 for
references): the caller picks the precision once. Only half-precision activations (bf16/f16 on
GPU) are widened to float32 for reductions (norms, softmax, routing), as transformers does.
Conventions follow transformers, the referee, on GGUF-converted weights (see the model files for
what the converter changed, e.g. Qwen3.5's ``1 + w`` norms are stored already added).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from sparkpack.formats.memory import ATTN_SCORES_MAX

from .cache import KVCache, prefill_rows
from .decode_rows import each_row

if TYPE_CHECKING:
    from .kernels.q8dot import Int8Rows


HALF = (torch.bfloat16, torch.float16)


def wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least float32 (reductions in bf16/f16 lose too much)."""
    return x.float() if x.dtype in HALF else x


class Rows(NamedTuple):
    """Activation rows that feed quantized products, with their int8 form (``kernels/q8dot.py``)
    when the launch that wrote them made it too (one decode row on a GPU): the products then skip
    their own quantize launch. Elsewhere ``q8`` is None."""

    x: torch.Tensor
    q8: "Int8Rows | None" = None


def cat_rows(parts: "list[Rows]") -> Rows:
    """Rows computed apart (a batched decode step's sequences, one at a time) as one set, their
    int8 forms too where each has one."""
    x = torch.cat([p.x for p in parts])
    if any(p.q8 is None for p in parts):
        return Rows(x)
    q8 = parts[0].q8
    return Rows(x, type(q8)(*(torch.cat(t) for t in zip(*(p.q8 for p in parts)))))


class Normed(NamedTuple):
    """A block-opening RMSNorm that the previous block's epilogue computed in its own launch
    (``ffn_residual_and_norm``): which norm (its weight) and its output."""

    weight: torch.Tensor
    rows: Rows


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None
             ) -> "torch.Tensor | tuple[torch.Tensor, torch.Tensor]":
    """RMSNorm over the last axis; ``weight`` None means no scale. On a GPU one Triton launch
    (``kernels/norm.py``, same rounding points) instead of seven small kernels.

    ``residual``: normalise ``x + residual`` and return ``(x + residual, norm)`` (the new residual
    stream and the block input, one launch on a GPU)."""
    s, y, _ = _rms_norm(x, weight, eps, residual, False)
    return y if residual is None else (s, y)


def norm_rows(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None
              ) -> "Rows | tuple[torch.Tensor, Rows]":
    """``rms_norm`` of rows that feed quantized products: for one GPU row (decode) their int8
    form comes from the same launch."""
    s, y, q8 = _rms_norm(x, weight, eps, residual, True)
    return Rows(y, q8) if residual is None else (s, Rows(y, q8))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None,
              q8: bool) -> "tuple[torch.Tensor | None, torch.Tensor, Int8Rows | None]":
    if x.is_cuda and x.dim() in (2, 3) and x.stride(-1) == 1 and x.dtype != torch.float64 \
            and (weight is None or (weight.dtype == x.dtype and weight.is_contiguous() and weight.numel() == x.shape[-1])) \
            and (residual is None or (x.dim() == 2 and residual.is_contiguous() and residual.dtype == x.dtype)):
        from .kernels import q8dot
        from .kernels.norm import rms_norm_rows

        q8 = q8 and x.dim() == 2 and q8dot.wanted(x.shape[0], x.shape[1])
        out = rms_norm_rows(x, weight, eps, residual, q8)
        out = out if isinstance(out, tuple) else (out,)
        s = out[0] if residual is not None else None
        return s, out[1 if residual is not None else 0], out[-1] if q8 else None
    s = None
    if residual is not None:
        x = s = x + residual

    def normed(r: torch.Tensor) -> torch.Tensor:
        rw = wide(r)
        return (rw * torch.rsqrt(rw.pow(2).mean(-1, keepdim=True) + eps)).to(r.dtype)

    y = each_row(normed, x)  # (a batched decode step's rows one at a time: ``decode_rows``)
    return s, (y if weight is None else y * weight), None


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The FLA/transformers l2 norm: eps inside the rsqrt of the squared sum (not a max with eps)."""
    xw = wide(x)
    return (xw * torch.rsqrt((xw * xw).sum(-1, keepdim=True) + eps)).to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> Rows:
    """``silu(gate) * up``, the SwiGLU activation, as rows for the down projection; one launch on a
    GPU (``kernels/ffn.py``), which also writes one decode row's int8 form."""
    if gate.is_cuda and gate.dim() == 2 and gate.dtype != torch.float64:
        from .kernels import q8dot
        from .kernels.ffn import silu_mul_rows

        if q8dot.wanted(gate.shape[0], gate.shape[1]):
            return Rows(*silu_mul_rows(gate, up, True))
        return Rows(silu_mul_rows(gate, up))
    return Rows(F.silu(gate) * up)


def ffn_residual(x: torch.Tensor, routed: torch.Tensor, shared: torch.Tensor | None = None,
                 shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """The residual stream after a MoE block: ``x + routed + sigmoid(shared_gate) * shared`` (no
    gate: the shared expert always counts; no shared expert: ``x + routed``). ``routed`` may be
    float32 (the fused MoE kernels' output) and is rounded to x's dtype first; it may also be
    ``[T, k, n]``, the k weighted expert outputs of each token, summed here in choice order in
    float32 (as the MoE kernels sum them). One launch on a GPU (``kernels/ffn.py``) instead of up
    to six."""
    if x.is_cuda and x.dim() == 2 and x.dtype != torch.float64:
        from .kernels.ffn import ffn_residual_rows

        return ffn_residual_rows(x.contiguous(), routed.contiguous(), shared, shared_gate)
    if routed.dim() == x.dim() + 1:
        parts, routed = routed.unbind(-2), torch.zeros_like(routed[..., 0, :])
        for part in parts:  # one addition at a time, in order: the kernels' rounding
            routed = routed + part
    out = routed.to(x.dtype)
    if shared is not None:
        if shared_gate is not None:
            shared = shared * torch.sigmoid(shared_gate)
        out = out + shared
    return x + out


def ffn_residual_and_norm(x: torch.Tensor, routed: torch.Tensor, shared: torch.Tensor | None,
                          shared_gate: torch.Tensor | None, norm: tuple[torch.Tensor, float]
                          ) -> tuple[torch.Tensor, Normed | None]:
    """``ffn_residual``, and on a GPU in the same launch the RMSNorm that opens the next block
    (``norm`` = (weight, eps)) with one decode row's int8 form; elsewhere that norm is left to
    the next block (None)."""
    if not (x.is_cuda and x.dim() == 2 and x.dtype != torch.float64 and norm[0].dtype == x.dtype):
        return ffn_residual(x, routed, shared, shared_gate), None
    from .kernels import q8dot
    from .kernels.ffn import ffn_residual_rows

    q8 = q8dot.wanted(x.shape[0], x.shape[1])
    y, h, *codes = ffn_residual_rows(x.contiguous(), routed.contiguous(), shared, shared_gate, norm, q8=q8)
    return y, Normed(norm[0], Rows(h, codes[0] if codes else None))


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP with weights in torch ``[out, in]`` layout."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


# --- rotary embeddings -------------------------------------------------------------------------


@dataclass(frozen=True)
class Rope:
    """NEOX-style rotary embedding over the first ``dim`` channels of each head.

    ``inv_freq`` holds the dim/2 frequencies (plain, or YaRN-corrected); ``scale`` multiplies
    cos/sin (YaRN's attention factor, 1 otherwise). ``sections`` turns on Qwen3.5's interleaved
    multi-section rope (imrope): frequency i uses the height position when ``i % 3 == 1`` and
    ``i < 3 * sections[1]``, the width position when ``i % 3 == 2`` and ``i < 3 * sections[2]``,
    the time position otherwise. Text has the same position on all three axes, so imrope then
    equals plain rope; the section logic is kept so multimodal positions can be fed later.
    """

    dim: int
    inv_freq: torch.Tensor
    scale: float = 1.0
    sections: tuple[int, ...] = ()

    def cos_sin(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``pos`` is ``[T]`` or, for imrope, ``[3, T]``; returns cos/sin of shape ``[T, dim]``.

        Angles are formed in float32 like transformers does (positions times float32 inv_freq),
        then cast: matching the referee bit for bit matters more here than float64 angles.
        """
        inv = self.inv_on(pos.device)
        if pos.dim() == 1:
            freqs = pos[:, None].float() * inv
        else:
            f3 = pos[..., None].float() * inv  # [3, T, dim/2]
            freqs = f3[0].clone()
            for axis in (1, 2):
                if len(self.sections) > axis and self.sections[axis] > 0:
                    idx = slice(axis, 3 * self.sections[axis], 3)
                    freqs[:, idx] = f3[axis][:, idx]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)

    def inv_on(self, device: torch.device) -> torch.Tensor:
        """``inv_freq`` as float32 on ``device``, copied there once (a captured step may not
        copy from host memory)."""
        cache = self.__dict__.setdefault("_on_device", {})
        t = cache.get(device)
        if t is None:
            t = cache[device] = self.inv_freq.to(device=device, dtype=torch.float32)
        return t

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape ``[T, H, head_dim]``; channels past ``dim`` pass through."""
        cos, sin = cos[:, None, :], sin[:, None, :]
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        half = self.dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


def rope_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def yarn_rope(base: float, dim: int, factor: float, orig_ctx: int, beta_fast: float = 32.0,
              beta_slow: float = 1.0, attn_factor: float | None = None) -> Rope:
    """YaRN as transformers computes it (truncated correction range, mscale 0.1*ln(factor)+1)."""

    def corr_dim(n_rot: float) -> float:
        return (dim * math.log(orig_ctx / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extra = 1.0 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    if attn_factor is None:
        attn_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return Rope(dim, inv, attn_factor)


# --- attention ---------------------------------------------------------------------------------


def positions(pos0: "int | torch.Tensor", T: int, device: torch.device) -> torch.Tensor:
    """Positions ``pos0 .. pos0+T-1`` as a device tensor; ``pos0`` may itself be a device scalar
    (a captured decode step reads its position from memory)."""
    return torch.arange(T, device=device) + pos0


def attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache: KVCache | None,
              pos0: "int | torch.Tensor", window: int = 0) -> torch.Tensor:
    """Causal GQA attention of ``q [T, H, d]`` over cached + new keys; returns ``[T, H, d]``.

    With a cache, keys are its whole buffer (row i = position i) and positions not yet written
    are masked with the causal rule, so shapes do not depend on the position. The sliding window
    is part of the mask (``i - j < window``), exactly the transformers/llama.cpp rule; query head
    h reads kv head ``h // (H / H_kv)``.
    """
    if cache is not None:
        return attend_buffers(q, *cache.append(k_new, v_new, pos0), pos0, window, cache.ring)
    qpos = positions(pos0, q.shape[0], q.device)[:, None]
    return _in_pieces(q, k_new.transpose(0, 1), v_new.transpose(0, 1), qpos, qpos.reshape(1, -1), window)


def attend_buffers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos0: "int | torch.Tensor",
                   window: int = 0, ring: bool = False) -> torch.Tensor:
    """``attention`` of ``q [T, H, d]`` at positions ``pos0 ..`` over whole KV buffers
    ``[H_kv, S, d]`` whose row i holds position i (the new keys already written); ``ring``: row
    ``i % S`` (a sliding-window layer's ring, ``runtime.cache.KVCache``).

    Several tokens at a known position (a prefill call) read only the rows some query may see:
    a 512-token prompt in a 32k buffer would otherwise score 64 times the keys it needs. One
    token keeps the whole buffer (shapes independent of the position, as a captured step needs)."""
    T = q.shape[0]
    if k.dtype == q.dtype and flash_prompt(q, pos0, window):
        return causal_sdpa(q, k[:, :T], v[:, :T])
    if ring:
        return _attend_ring(q, k, v, pos0, window)
    lo, hi = 0, k.shape[1]
    rows = prefill_rows(pos0, T)
    if rows is not None:
        hi = min(hi, rows)
        lo = max(0, pos0 - window + 1) if window > 0 else 0
    qpos = positions(pos0, T, q.device)[:, None]
    return _in_pieces(q, k[:, lo:hi], v[:, lo:hi], qpos, torch.arange(lo, hi, device=q.device)[None, :], window)


def _attend_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos0: "int | torch.Tensor",
                 window: int) -> torch.Tensor:
    """``attend_buffers`` over a ring: at a known position, the rows of the positions the queries
    may see, gathered in position order (so the result does not depend on the ring's size); at a
    device position, every row, each at the position it holds for the call's last token (rows of
    positions before 0 are masked by the window)."""
    T, S = q.shape[0], k.shape[1]
    if isinstance(pos0, int):
        kpos = torch.arange(max(0, pos0 - window + 1), pos0 + T, device=q.device)
        k, v = k[:, kpos % S], v[:, kpos % S]
    else:
        last = pos0 + T - 1
        kpos = last - (last - torch.arange(S, device=q.device)) % S
        kpos = torch.where(kpos >= 0, kpos, kpos - window)
    return _in_pieces(q, k, v, positions(pos0, T, q.device)[:, None], kpos[None, :], window)


def flash_prompt(q: torch.Tensor, pos0: "int | torch.Tensor", window: int) -> bool:
    """Whether a prefill call is a prompt's first tokens (position 0) in half precision on a GPU,
    with no sliding window that could bite (``T <= window``): then the mask is plain causal and
    torch's fused attention (flash) takes it in one launch. The unfused form of ``attend_positions`` is
    ~10 launches a layer plus its mask, and a 512-token prefill of the all-attention shapes
    (Qwen3-30B, Laguna) was host-bound on issuing them.
    Only where a fused kernel runs (Ampere or newer, head size a multiple of 8 up to 256): torch's
    fallback (the math kernel) would build the whole score matrix, which the prefill's memory plan
    does not count (the unfused form scores in pieces of ``ATTN_SCORES_MAX``)."""
    return (q.shape[0] > 1 and isinstance(pos0, int) and pos0 == 0 and (window <= 0 or q.shape[0] <= window)
            and fused_sdpa_runs(q))


@functools.cache
def _ampere_or_newer(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 8


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of ``q [T, H, d]`` over ``k, v [H_kv, T, d]`` (positions 0..T-1),
    scaled by ``d ** -0.5`` as ``attend_positions``; returns ``[T, H, d]``."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], is_causal=True, enable_gqa=True)
    return out[0].transpose(0, 1)


def causal_sdpa_after(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of ``q [T, H, d]``, the last T positions, over ``k, v [H_kv, S, d]``
    (positions 0..S-1, S >= T; any row stride): a prefill call after a past. torch's fused
    kernels take the lower-right causal mask in one launch, faster over a long past than
    ``kernels.attention.attend_prefill`` and the unfused form (``bench/kernels_bench.py --only
    prefill-attention``). Only the fused
    backends are allowed: the math fallback would hold the whole score matrix."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    T, S = q.shape[0], k.shape[1]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None],
                                             attn_mask=causal_lower_right(T, S), enable_gqa=True)
    return out[0].transpose(0, 1)


def fused_sdpa_runs(q: torch.Tensor) -> bool:
    """Whether torch's fused attention kernels take ``q [T, H, d]``: half precision on an Ampere or
    newer GPU, head size a multiple of 8 up to 256."""
    d = q.shape[-1]
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and d % 8 == 0 and d <= 256 \
        and _ampere_or_newer(q.device)


def output_gate(o: torch.Tensor, gate: torch.Tensor | None, kind: str) -> torch.Tensor:
    """Attention output ``o [T, H, d]`` times its gate: ``"sigmoid"`` per channel (Qwen3.5/3.6,
    ``gate [T, H, d]``), ``"softplus_head"`` (Laguna, ``gate [T, H]``), ``"softplus"`` per channel
    (``[T, H, d]``), ``"none"``. The kinds ``kernels/attention.attend_decode`` applies itself."""
    if kind == "sigmoid":
        return o * torch.sigmoid(gate)
    if kind == "softplus_head":
        return o * F.softplus(gate)[..., None]
    if kind == "softplus":
        return o * F.softplus(gate)
    return o


def _in_pieces(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor,
               window: int) -> torch.Tensor:
    """``attend_positions`` over query pieces: the scores of a long prefill chunk over a long cache would be
    a large transient (512 queries x 32k keys x 16 heads is 1 GiB in fp32, twice over with the
    softmax), so queries go in pieces holding at most ATTN_SCORES_MAX scores. Each query row's
    result does not depend on the others."""
    T, H, _ = q.shape
    rows = max(1, ATTN_SCORES_MAX // (H * k.shape[1]))
    if T <= rows:
        return attend_positions(q, k, v, qpos, kpos, window)
    return torch.cat([attend_positions(q[i:i + rows], k, v, qpos[i:i + rows], kpos, window) for i in range(0, T, rows)])


def attend_positions(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor,
            window: int) -> torch.Tensor:
    """``attention`` for queries ``q [T, H, d]`` at positions ``qpos [T, 1]`` over keys/values
    ``[Hkv, S, d]`` at ``kpos [1, S]``."""
    T, H, d = q.shape
    Hkv, S, _ = k.shape
    rep = H // Hkv
    # The query heads sharing a kv head become rows of one matrix: two batched GEMMs over the kv
    # heads, keys and values read in place (a broadcast batch axis would make matmul copy them).
    qh = q.reshape(T, Hkv, rep, d).permute(1, 2, 0, 3).reshape(Hkv, rep * T, d)
    scores = torch.bmm(qh, k.transpose(1, 2)).view(Hkv, rep, T, S) * (d ** -0.5)
    allowed = kpos <= qpos
    if window > 0:
        allowed &= (qpos - kpos) < window
    scores = wide(scores).masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(Hkv, rep * T, S)
    out = torch.bmm(probs, v).view(Hkv, rep, T, d)
    return out.permute(2, 0, 1, 3).reshape(T, H, d)


# --- routers -----------------------------------------------------------------------------------


def _router_kernel_takes(logits: torch.Tensor) -> bool:
    """Whether ``kernels/router.py`` serves these logits: [T, n_expert] on a GPU, rows contiguous."""
    return logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1 and logits.dtype != torch.float64


def route_softmax(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen routers: softmax over all experts, top-k, optionally renormalised to sum 1. On a GPU
    one Triton launch (``kernels/router.py``) instead of five to seven."""
    if _router_kernel_takes(logits):
        from .kernels.router import softmax_topk

        return softmax_topk(logits, k, norm)
    probs = torch.softmax(wide(logits), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    if norm:
        w = w / w.sum(-1, keepdim=True)
    return w, ids


def route_sigmoid(logits: torch.Tensor, bias: torch.Tensor | None, k: int, norm: bool,
                  scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Laguna router: experts chosen on sigmoid + correction bias, weighted by the unbiased
    sigmoids (renormalised), times the routed scaling factor. On a GPU one Triton launch
    (``kernels/router.py``) instead of about nine."""
    if _router_kernel_takes(logits):
        from .kernels.router import sigmoid_topk

        return sigmoid_topk(logits, bias, k, norm, scale)
    scores = torch.sigmoid(wide(logits))
    choose = scores if bias is None else scores + bias
    _, ids = torch.topk(choose, k, dim=-1)
    w = scores.gather(-1, ids)
    if norm:
        w = w / w.sum(-1, keepdim=True)
    return w * scale, ids
