"""What every model file shares: loading, the embedding -> blocks -> norm -> head loop, caches.

A model file subclasses ``MoEModel`` and writes ``block(il, x, cache, pos0, pre)``: the residual
block of layer ``il`` on hidden states ``x [T, n_embd]``. A call is one sequence; prefill is a call
with many tokens, decode a call with one, and both go through the same code. A batched decode
step (``decode_batch``) is one token of each of several sequences through the same blocks, with
a ``Batch`` in place of the cache: its attention (``attend``) runs per sequence.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sparkpack.formats.archs import LINEAR, SLIDING, ModelSpec
from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.memory import PREFILL_CHUNK

from ..cache import Q8_BLOCK, Cache, KVCache, RecurrentState, RowStates, prefill_rows
from ..decode_rows import decoding_rows, one_token_rows
from ..experts import ExpertProvider, GGUFExperts
from ..layers import (Normed, Rope, Rows, attend_buffers, attention, cat_rows, causal_sdpa_after, ffn_residual,
                      ffn_residual_and_norm, fused_sdpa_runs, norm_rows, output_gate, positions, rms_norm, silu_mul)
from ..quant_linear import QuantLinear, linear
from ..weights import Weights, quantizes_dense

if TYPE_CHECKING:
    from sparkpack.formats.placement import ResidencyPlan

    from ..expert_store import ExpertStore


@dataclass(frozen=True)
class Call:
    """One prefill call of a group (``MoEModel.forward_calls``): ``n`` tokens ``ids`` (a device
    tensor), or a padded call as ``runtime.graph.PrefillGraphs`` makes it: ``ids`` padded, its
    first position ``pos`` and ``real`` (= ``n``) as device scalars."""

    ids: torch.Tensor
    n: int
    pos: torch.Tensor | None = None
    real: torch.Tensor | None = None


@dataclass(frozen=True)
class Batch:
    """The rows of a batched decode step (``MoEModel.decode_batch``, ``decode_run``), passed to
    the blocks where one sequence's cache goes: each row's cache and the position of its token.
    What reads per-sequence state (attention, DeltaNet) runs once per row, in row order (rows of
    one sequence at consecutive positions: one after another on its state)."""

    caches: tuple[Cache, ...]
    pos: tuple[int | torch.Tensor, ...]  # device scalars in a captured step (``runtime.graph.VerifyGraphs``)
    states: RowStates | None = None  # DeltaNet states kept after each row (a verify step: ``decode_run``)


class MoEModel(ABC):
    arch = ""
    # The tiered expert store when the experts are one (``experts`` is then the store, or a tap
    # wrapping it while calibrating), with its plan; None on the plain path. Code that needs the
    # store's own methods (statistics, re-placement, traces) asks ``store``, never ``experts``.
    store: ExpertStore | None = None
    residency: ResidencyPlan | None = None
    start_profile = None  # the profile it was placed with / learns into (runtime.residency.StartProfile)
    ffn_norm = "ffn_norm"  # the norm in front of a block's MoE (``blk.N.<ffn_norm>.weight``)
    # Projections of one input that run as one GEMM (``project``): per layer, the members of a
    # group that the file has, when at least two do.
    STACKS: tuple[tuple[str, ...], ...] = ()
    # The projections of a MoE block's input, one GEMM when several (``ffn``): the router, then
    # where the arch has them a shared expert's gate logit, gate and up.
    FFN_IN: tuple[str, ...] = ("ffn_gate_inp",)
    topk_of_logits = False  # the router picks the top-k of its logits (softmax routers)
    # Where eager calls append their output-normed rows (``keep_hidden``); None: nowhere.
    hidden_out: list[torch.Tensor] | None = None

    def __init__(self, gguf: GGUFModel, spec: ModelSpec, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, experts: ExpertProvider | None = None):
        self.gguf, self.spec = gguf, spec
        self.device, self.dtype = torch.device(device), dtype
        # On a GPU the dense matrices stay GGUF bytes, read by the dense kernels (kernels/dense.py);
        # the CPU path expands them (the reference the tests compare with).
        self.w = Weights(gguf, device, dtype, quantized=quantizes_dense(self.device, dtype))
        self.experts = experts if experts is not None else GGUFExperts(gguf, spec, device, dtype)
        self.eps = spec.rms_eps
        # The fused one-token DeltaNet step (kernels/deltanet.py): on by default on a GPU; the
        # torch form stays the reference (CPU, prefill) and tests compare the two. (RMSNorm and
        # the softmax router take their Triton kernels for any GPU tensor: runtime.layers.)
        self.kernels = self.device.type == "cuda"

    def meta(self, suffix: str, default=None):
        """An ``{arch}.suffix`` metadata value not carried by the spec."""
        return self.gguf.get(f"{self.spec.arch}.{suffix}", default)

    def new_cache(self, capacity: int = 256, kv_type: str = "auto", calls: int = PREFILL_CHUNK) -> Cache:
        """A fresh cache whose KV buffers start with room for ``capacity`` positions, holding
        keys and values as ``kv_type`` (``runtime.cache.KV_TYPES``); sliding-window layers hold
        rings sized for calls of up to ``calls`` rows (``formats.memory.window_rows``)."""
        if kv_type == "q8_0" and self.spec.head_dim % Q8_BLOCK:
            raise SparkpackError(self.gguf.path, f"--kv-type q8_0 needs a head size that is a multiple of "
                                                 f"{Q8_BLOCK}; this model's is {self.spec.head_dim}")
        return Cache([RecurrentState() if k.attention == LINEAR else
                      KVCache(capacity, kv_type, self.spec.sliding_window if k.attention == SLIDING else 0, calls)
                      for k in self.spec.layers])

    def route(self, il: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``il``'s router on normed hidden states ``h [T, n_embd]``: (weights, ids) ``[T, k]``."""
        return self.route_logits(il, self.w.linear(h, f"blk.{il}.ffn_gate_inp.weight"))

    @abstractmethod
    def route_logits(self, il: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, ids) ``[T, k]`` from layer ``il``'s router logits ``[T, n_expert]`` (which a
        layer may compute in one GEMM with other projections of its MoE input)."""

    @abstractmethod
    def block(self, il: int, x: torch.Tensor, cache: Cache, pos0: int | torch.Tensor, pre: Normed | None
              ) -> tuple[torch.Tensor, Normed | None]:
        """Layer ``il``'s residual block on ``x [T, n_embd]`` whose first token is at ``pos0``: the
        new residual stream, and the next block's input norm when this block's epilogue computed
        it (``epilogue``), which comes back as ``pre`` of the next call (``norm`` takes it)."""

    def reserve_kv(self, cache: Cache, n: int, call: int = 1) -> None:
        """Make every KV cache of ``cache`` hold positions up to ``n``, written by calls of up to
        ``call`` rows, before a call that reads its position from the device (which cannot grow
        them itself)."""
        for il, layer in enumerate(cache.layers):
            if isinstance(layer, KVCache) and not layer.fits(n, call):  # (every call: cheap when done)
                like = torch.empty(0, self.kv_heads(il), self.spec.head_dim, dtype=self.dtype, device=self.device)
                layer.reserve(n, like, call)

    def kv_heads(self, il: int) -> int:
        """KV heads of block ``il``: a trunk layer's, or past the trunk an MTP head block's (whose
        cache ``reserve_kv`` grows as the trunk's: ``qwen35moe_mtp.MTPHead.new_cache``)."""
        if il < self.spec.n_layer or self.spec.nextn is None:
            return self.spec.n_head_kv[il]
        return self.spec.nextn.n_head_kv[self.spec.nextn.layers.index(il)]

    @torch.no_grad()
    def forward(self, ids: torch.Tensor | list[int], cache: Cache | None = None,
                last_only: bool = False, pos: torch.Tensor | None = None,
                real: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[T, n_vocab]`` for the new tokens ``ids`` (``[1, n_vocab]`` for the last one
        only with ``last_only``: generation needs no more, and the head is the largest matmul);
        advances ``cache`` when given.

        Without a cache the call is a fresh full-sequence forward (a throwaway cache is used).
        ``pos`` (a device scalar holding the first new position) is for a step captured in a CUDA
        graph (``runtime.graph``): nothing here then touches the host, and the caller advances
        ``cache.pos`` and the expert store's bookkeeping itself.

        ``real`` (with ``pos``; a device scalar): a padded call (``runtime.graph.PrefillGraphs``):
        only the first ``real`` ids are tokens, the rest pad the call to a captured size and sit
        after them (causal attention keeps them out of the real tokens' results). The logits are
        the last real token's, and the expert store counts only the real tokens' routings.
        """
        if real is not None and pos is None:
            raise ValueError("forward: a padded call (real=...) reads its position from the device (pos=...)")
        x, pre = self.trunk(ids, cache if cache is not None else self.new_cache(), pos, real)
        return self.head(x, pre, last_only, real)

    @torch.no_grad()
    def decode_batch(self, ids: Sequence[int] | torch.Tensor, caches: Sequence[Cache]) -> torch.Tensor:
        """Logits ``[B, n_vocab]`` of one new token for each of B sequences: ``ids[b]`` appended to
        ``caches[b]`` (each its own sequence, at its own position). Row b is bit for bit what
        ``forward([ids[b]], caches[b])`` gives alone: every product that reads weights runs its
        one-token program once per row (``runtime.decode_rows``; on a GPU the rows of one weight
        tile next to each other, so the weights are read from memory about once for the batch),
        and attention and DeltaNet run on each sequence's own state. The expert store serves the
        batch at once: the union of its routed experts per layer, each miss read once."""
        if len(caches) != len(ids) or len({id(c) for c in caches}) != len(caches) or not len(caches):
            raise ValueError("decode_batch: one token and one distinct cache per sequence")
        logits = self._decode_rows(ids, Batch(tuple(caches), tuple(c.pos for c in caches)))[0]
        for c in caches:
            c.pos += 1
        return logits

    @torch.no_grad()
    def decode_run(self, ids: Sequence[int] | torch.Tensor, cache: Cache) -> torch.Tensor:
        """Logits ``[K, n_vocab]`` of K consecutive tokens of one sequence appended to ``cache``,
        row i bit for bit what the i-th of K single steps (``forward([ids[i]], cache)``) gives: a
        batched step whose rows are the same sequence at consecutive positions, so attention and
        DeltaNet take them one after another on the one state. What a drafted run's verification
        needs (the logits of the step that would have produced each token), at the cost of one
        read of the weights and of each missed expert for the K tokens."""
        return self.verify_rows(ids, cache)[0]

    @torch.no_grad()
    def verify_rows(self, ids: Sequence[int] | torch.Tensor, cache: Cache, pos: torch.Tensor | None = None,
                    states: RowStates | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``decode_run``'s logits and the output-normed hidden rows ``[K, n_embd]`` they come
        from (what ``forward_hidden`` gives; an MTP drafter reads them). ``states``: the DeltaNet
        states after each row are copied there (``runtime.cache.RowStates``), so the sequence can
        keep fewer rows. ``pos`` (device positions ``[K]``, with ``cache``'s KV buffers reserved
        past them): a step captured in a CUDA graph (``runtime.graph.VerifyGraphs``), which
        touches nothing on the host; the caller then advances ``cache.pos`` and the store."""
        if not len(ids):
            raise ValueError("decode_run: no tokens")
        at = tuple(cache.pos + i for i in range(len(ids))) if pos is None else tuple(pos.unbind())
        logits, hidden = self._decode_rows(ids, Batch((cache,) * len(ids), at, states), step=pos is None)
        if pos is None:
            cache.pos += len(ids)
        return logits, hidden

    def _decode_rows(self, ids: Sequence[int] | torch.Tensor, batch: Batch, step: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits of ``batch``'s rows (one token each, ``ids``), every row a one-token step, and
        their output-normed rows; ``step``: tell the store the step is over (a captured one's
        caller does, after the replay)."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).reshape(-1)
        with decoding_rows():
            x = self.w.embed(ids)
            pre = None
            for il in range(self.spec.n_layer):
                x, pre = self.block(il, x, batch, 0, pre)
            h = self.norm(x, "output_norm.weight", pre)  # (``head``'s two products)
            logits = self.linear(h, self.output_name())
        if step:
            self.experts.end_step(len(ids))
        return logits, h.x

    @torch.no_grad()
    def forward_hidden(self, ids: torch.Tensor | list[int], cache: Cache | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s logits ``[T, n_vocab]`` and the rows they come from, the output-normed
        hidden states ``[T, n_embd]``: what a multi-token-prediction head drafts from
        (``qwen35moe_mtp.MTPHead``; llama.cpp's ``h_nextn``). The same bits as ``forward``."""
        x, pre = self.trunk(ids, cache if cache is not None else self.new_cache(), None, None)
        h = self.norm(x, "output_norm.weight", pre)
        return self.linear(h, self.output_name()), h.x

    def trunk(self, ids: torch.Tensor | list[int], cache: Cache, pos: torch.Tensor | None,
              real: torch.Tensor | None) -> tuple[torch.Tensor, Normed | None]:
        """The residual stream after the last block for ``forward``'s arguments, and the output
        norm when the last block's epilogue computed it."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).reshape(-1)
        x = self.w.embed(ids)
        pre = None
        if real is not None:
            self.experts.count_real_tokens(real)
        try:
            for il in range(self.spec.n_layer):
                x, pre = self.block(il, x, cache, cache.pos if pos is None else pos, pre)
        finally:
            if real is not None:
                self.experts.count_real_tokens(None)
        if pos is None:
            cache.pos += ids.numel()
            self.experts.end_step(ids.numel())  # the store learns between tokens
        return x, pre

    @torch.no_grad()
    def forward_calls(self, calls: Sequence[Call], cache: Cache,
                      after: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """The logits ``[1, n_vocab]`` of the last token of consecutive prefill calls into
        ``cache``, computed layer by layer: every call's block of a layer, in call order, before
        the next layer's. Each call computes exactly what it computes alone (``forward``; a padded
        one as ``PrefillGraphs`` runs it): a block reads only its own layer's cache, which the
        calls before it in the group have written. Why: a store that stages (partial residency)
        copies each layer's cold experts once for the whole group instead of once per call
        (``ExpertProvider.stage_calls``). ``after(i, il)``: called once call ``i``'s block of layer
        ``il`` is launched (a session copies DeltaNet states at its calls' ends there). Padded
        calls (all or none) leave ``cache.pos`` and the store's ``end_step`` to the caller, as
        ``forward`` does with ``pos``: a group of them may be captured in a CUDA graph."""
        xs = [self.w.embed(c.ids) for c in calls]
        pres: list[Normed | None] = [None] * len(calls)
        starts, at = [], cache.pos
        for c in calls:
            starts.append(at if c.pos is None else c.pos)
            at += c.n
        self.experts.stage_calls(sum(c.ids.numel() for c in calls))
        try:
            for il in range(self.spec.n_layer):
                for i, c in enumerate(calls):
                    self.experts.count_real_tokens(c.real)
                    xs[i], pres[i] = self.block(il, xs[i], cache, starts[i], pres[i])
                    if after is not None:
                        after(i, il)
        finally:
            self.experts.count_real_tokens(None)
            self.experts.stage_calls(None)
        if calls[0].pos is None:  # (padded calls, as ``forward`` with ``pos``: the caller does this)
            n, cache.pos = at - cache.pos, at
            self.experts.end_step(n)
        for i in range(len(calls) - 1):
            self.keep_hidden(xs[i], pres[i], calls[i].real)
        return self.head(xs[-1], pres[-1], True, calls[-1].real)

    def head(self, x: torch.Tensor, pre: Normed | None, last_only: bool, real: torch.Tensor | None) -> torch.Tensor:
        """The logits of a call's rows ``x`` (its last real one with ``last_only`` or ``real``)."""
        self.keep_hidden(x, pre, real)
        if real is not None:  # (a padded call has several rows: no norm was computed ahead)
            x = x.index_select(0, (real - 1).reshape(1))
        if last_only and x.shape[0] > 1:  # (one row: ``pre`` is its output norm, when computed)
            x = x[-1:]
        h = self.norm(x, "output_norm.weight", pre)
        return self.linear(h, self.output_name())

    def keep_hidden(self, x: torch.Tensor, pre: Normed | None, real: torch.Tensor | None) -> None:
        """Append a call's output-normed rows to ``hidden_out`` when a session collects them (a
        drafter that reads the main model's hidden states: ``runtime.drafting``). Eager calls
        only: a replayed graph runs no Python, so such a session feeds its single steps eagerly
        and verifies with ``verify_rows`` (which returns the rows); the captured padded prompt
        calls of the all-attention models would append only when captured (the MTP head, the one
        drafter that reads rows, is qwen35moe's, whose prompt calls are eager)."""
        if self.hidden_out is None:
            return
        if real is not None:
            x = x[: int(real)]
        self.hidden_out.append(self.norm(x, "output_norm.weight", pre).x)

    def output_name(self) -> str:
        """The output head: ``output.weight``, or the embeddings where the file ties them."""
        return "output.weight" if self.w.has("output.weight") else "token_embd.weight"

    def linear(self, h: Rows, name: str) -> torch.Tensor:
        """``h @ W^T`` for the weight ``name``, on h's int8 form where its launch made it."""
        return self.w.linear(h.x, name, h.q8)

    def project(self, h: Rows, prefix: str, *names: str) -> list[torch.Tensor]:
        """The projections ``prefix + name + ".weight"`` of ``h``, as one GEMM over their stacked
        matrices (``Weights.stacked``; ``names`` one of ``STACKS``), split back into one output
        per name."""
        full = tuple(f"{prefix}{n}.weight" for n in names)
        stacked = self.w.stacked(full)
        sizes = stacked.sizes if isinstance(stacked, QuantLinear) else [self.w(n).shape[0] for n in full]
        return list(linear(h.x, stacked, h.q8, self.w.int8_activations).split(sizes, dim=-1))

    def project_present(self, h: Rows, prefix: str, group: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """``project`` over the members of ``group`` (one of ``STACKS``) this layer has, by name."""
        names = [n for n in group if self.w.has(f"{prefix}{n}.weight")]
        if len(names) == 1:
            return {names[0]: self.linear(h, f"{prefix}{names[0]}.weight")}
        return dict(zip(names, self.project(h, prefix, *names)))

    def mlp(self, h: Rows, prefix: str) -> torch.Tensor:
        """A dense layer's SwiGLU MLP ``ffn_{gate,up,down}``, gate and up as one GEMM
        (``(ffn_gate, ffn_up)`` must be one of ``STACKS``)."""
        gate, up = self.project(h, prefix, "ffn_gate", "ffn_up")
        return self.linear(silu_mul(gate, up), f"{prefix}ffn_down.weight")

    def ffn(self, il: int, h: Rows, x: torch.Tensor, experts: ExpertProvider | None = None
            ) -> tuple[torch.Tensor, Normed | None]:
        """The residual stream ``x`` after layer ``il``'s MoE block on its normed input ``h``: the
        routed experts, a shared expert where the file has one (behind a sigmoid gate where it has
        that too), added in one epilogue launch (``epilogue``). ``experts``: the provider of a
        block outside the trunk (an MTP head's), else the model's."""
        p = f"blk.{il}."
        y = self.project_present(h, p, self.FFN_IN)
        experts = self.experts if experts is None else experts
        routed = experts.moe(il, h.x, *self.route_logits(il, y["ffn_gate_inp"]), h.q8)
        shared = gate = None
        if "ffn_up_shexp" in y:
            shared = self.linear(silu_mul(y["ffn_gate_shexp"], y["ffn_up_shexp"]), p + "ffn_down_shexp.weight")
            gate = y.get("ffn_gate_inp_shexp")
        return self.epilogue(il, x, routed, shared, gate)

    def epilogue(self, il: int, x: torch.Tensor, routed: torch.Tensor, shared: torch.Tensor | None = None,
                 gate: torch.Tensor | None = None) -> tuple[torch.Tensor, Normed | None]:
        """Layer ``il``'s FFN output added into the residual stream (``layers.ffn_residual``); a
        one-token GPU step also norms the next block's input in the same launch (``next_norm``)."""
        nxt = self.next_norm(il, x)
        if nxt is None:
            return ffn_residual(x, routed, shared, gate), None
        return ffn_residual_and_norm(x, routed, shared, gate, nxt)

    def stack_groups(self, layers: Sequence[int] | None = None) -> list[tuple[str, ...]]:
        """Every layer's ``STACKS`` groups as stacked: the members the file has, two or more
        (full tensor names); ``layers``: those blocks' only (an MTP head's), else the trunk's."""
        out = []
        for il in range(self.spec.n_layer) if layers is None else layers:
            for group in self.STACKS:
                full = tuple(n for n in (f"blk.{il}.{m}.weight" for m in group) if self.w.has(n))
                if len(full) >= 2:
                    out.append(full)
        return out

    def attend(self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: "Cache | Batch",
               pos0: "int | torch.Tensor", rope: Rope, window: int = 0, gate: torch.Tensor | None = None,
               gate_kind: str = "none") -> Rows:
        """Attention of layer ``il`` from the raw projections (``q [T, H, d]``, k and v
        ``[T, H_kv, d]``, ``gate`` as ``layers.output_gate`` takes it): the q/k RMSNorms
        (``attn_q_norm``, ``attn_k_norm``), rope, the KV append and the gated attention, as
        ``attn_output``'s input ``[T, H * d]``. The one entry of every arch: the kernels
        (``attend_step``) where they run, else the torch form (the reference); a batched decode
        step's sequences (``Batch``) one at a time, each over its own cache at its position."""
        if isinstance(cache, Batch):
            return cat_rows([self.attend(il, q[b:b + 1], k[b:b + 1], v[b:b + 1], c, at, rope, window,
                                         None if gate is None else gate[b:b + 1], gate_kind)
                             for b, (c, at) in enumerate(zip(cache.caches, cache.pos))])
        o = self.attend_step(il, q, k, v, cache, pos0, rope, window, gate, gate_kind)
        if o is not None:
            return o
        p, w, T = f"blk.{il}.", self.w, q.shape[0]
        q = rms_norm(q, w(p + "attn_q_norm.weight"), self.eps)
        k = rms_norm(k, w(p + "attn_k_norm.weight"), self.eps)
        cos, sin = rope.cos_sin(positions(pos0, T, q.device), q.dtype)
        q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        o = attention(q, k, v, cache.layers[il], pos0, window)  # [T, H, d]
        return Rows(output_gate(o, gate, gate_kind).reshape(T, -1))

    def attend_step(self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: Cache,
                    pos0: "int | torch.Tensor", rope: Rope, window: int = 0, gate: torch.Tensor | None = None,
                    gate_kind: str = "none") -> Rows | None:
        """Attention from the raw projections (``q [T, H, d]``, k and v ``[T, H_kv, d]``) with the
        Triton kernels of ``kernels/attention.py``, returning ``attn_output``'s input ``[T, H * d]``
        (with one decode row's int8 form), or None where the model file's torch form runs instead (CPU without ``kernels``, float64).
        The q/k RMSNorms, rope and the KV append are one launch for any T; one token then attends
        in two more (split and combine, the output gate included); several tokens (prefill)
        attend and take the gate in torch: from position 0 with torch's fused causal attention
        (``layers.attend_buffers``), after a past with its lower-right form
        (``layers.causal_sdpa_after``) where no sliding window clips the past, else (a window, a
        Q8_0 cache) with one launch of ``attention.attend_prefill``, which also serves a call whose
        position is on the device (a padded call, ``runtime.graph.PrefillGraphs``). A Q8_0
        KV cache is written as codes (and, decoding, read as codes). Gate kinds as
        ``attention.attend_decode`` takes them."""
        kv = cache.layers[il] if cache is not None else None
        if not (self.kernels and isinstance(kv, KVCache) and q.dtype in (torch.bfloat16, torch.float16, torch.float32)):
            return None
        from ..kernels import q8dot
        from ..kernels.attention import attend_decode, attend_prefill, qk_norm_rope_append

        p, (T, H, d) = f"blk.{il}.", q.shape
        if not isinstance(pos0, torch.Tensor):
            kv.reserve(pos0 + T, k, T)
        scales = (kv.k_scale, kv.v_scale) if kv.q8 else (None, None)  # a Q8_0 cache is written as codes
        qr = qk_norm_rope_append(q, k, v, self.w.opt(p + "attn_q_norm.weight"), self.w.opt(p + "attn_k_norm.weight"),
                                 self.eps, rope.inv_on(q.device), rope.scale, pos0, kv.k, kv.v, *scales, ring=kv.ring)
        if T > 1:
            # After a past (a long prompt's later chunks, a chat's next turn) the unfused form
            # scored in pieces (~10 launches) over a past that grows with the prompt: a long
            # prompt prefills faster with attend_prefill.
            if not kv.q8 and isinstance(pos0, int) and pos0 > 0 and window <= 0 and fused_sdpa_runs(qr):
                o = causal_sdpa_after(qr, kv.k[:, : pos0 + T], kv.v[:, : pos0 + T])
            elif not kv.q8 and (isinstance(pos0, torch.Tensor) or pos0 > 0):
                o = attend_prefill(qr, kv.k, kv.v, pos0, window, kv.ring)
            elif kv.q8 and not isinstance(pos0, torch.Tensor) and pos0 > 0:  # the rows it reads, expanded
                o = attend_prefill(qr, *kv.buffers(pos0 + T), pos0, window, kv.ring)
            else:
                o = attend_buffers(qr, *kv.buffers(prefill_rows(pos0, T)), pos0, window, kv.ring)
            return Rows(output_gate(o, gate, gate_kind).reshape(T, H * d))
        q8 = q8dot.wanted(1, d)
        o = attend_decode(qr[0], kv.k, kv.v, pos0, window, None if gate is None else gate[0], gate_kind,
                          q8=q8, k_scale=scales[0], v_scale=scales[1], ring=kv.ring)
        return Rows(*o) if q8 else Rows(o)

    def norm(self, x: torch.Tensor, name: str, pre: Normed | None = None) -> Rows:
        """A block input or the output norm: it feeds projections, which read one decode row in
        its int8 form, so on a GPU that form comes from the norm's launch, or from the previous
        block's epilogue, which computed both (``pre``, taken when it is this norm)."""
        w = self.w(name)
        if pre is not None and pre.weight is w:
            return pre.rows
        return norm_rows(x, w, self.eps)

    def next_norm(self, il: int, x: torch.Tensor) -> tuple[torch.Tensor, float] | None:
        """For layer ``il``'s epilogue on ``x``: the norm that opens the next block (the output norm
        after the last), when a one-token GPU step can compute it in the same launch."""
        if not (self.kernels and one_token_rows(x.shape[0])):
            return None
        return self.w(f"blk.{il + 1}.attn_norm.weight" if il + 1 < self.spec.n_layer else "output_norm.weight"), self.eps

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor, name: str) -> tuple[torch.Tensor, Rows]:
        """``(x + delta, norm(x + delta))``: the residual add and the next norm, one launch on a GPU."""
        return norm_rows(delta, self.w(name), self.eps, residual=x)
