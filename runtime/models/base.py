"""What every model file shares: loading, the embedding -> blocks -> norm -> head loop, caches.

A model file subclasses ``MoEModel`` and writes ``block(il, x, cache, pos0, pre)``: the residual
block of layer ``il`` on hidden states ``x [T, n_embd]``. A call is one sequence; prefill is a call
with many tokens, decode a call with one, and both go through the same code. A batched decode
step (``decode_batch``, run by ``row_steps``) is one token of each of several sequences through
the same blocks, with a ``Batch`` in place of the cache: its attention (``attend``) runs per sequence.
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

from ..cache import Q8_BLOCK, Cache, KVCache, RecurrentState, RowStates
from ..experts import ExpertProvider, GGUFExperts
from ..layers import Normed, Rope, Rows, norm_rows
from ..weights import Weights, quantizes_dense
from .attention import Attention
from .moe_block import MoEBlock
from .projections import Projections
from .row_steps import Batch, RowSteps

if TYPE_CHECKING:
    from sparkpack.formats.placement import ResidencyPlan

    from ..expert_store import ExpertStore


def kv_heads(spec: ModelSpec, il: int) -> int:
    """KV heads of block ``il``: a trunk layer's, or past the trunk an MTP head block's (whose
    cache ``MoEModel.reserve_kv`` grows as the trunk's: ``qwen35moe_mtp.MTPHead.new_cache``)."""
    if il < spec.n_layer or spec.nextn is None:
        return spec.n_head_kv[il]
    return spec.nextn.n_head_kv[spec.nextn.layers.index(il)]


@dataclass(frozen=True)
class Call:
    """One prefill call of a group (``MoEModel.forward_calls``): ``n`` tokens ``ids`` (a device
    tensor), or a padded call as ``runtime.graph.PrefillGraphs`` makes it: ``ids`` padded, its
    first position ``pos`` and ``real`` (= ``n``) as device scalars."""

    ids: torch.Tensor
    n: int
    pos: torch.Tensor | None = None
    real: torch.Tensor | None = None


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
        self.eps = spec.rms_eps
        self.w = Weights(gguf, device, dtype, quantized=quantizes_dense(self.device, dtype))
        self.experts = experts if experts is not None else GGUFExperts(gguf, spec, device, dtype)
        # The fused one-token DeltaNet step (kernels/deltanet.py): on by default on a GPU; the
        # torch form stays the reference (CPU, prefill) and tests compare the two. (RMSNorm and
        # the softmax router take their Triton kernels for any GPU tensor: runtime.layers.)
        self.kernels = self.device.type == "cuda"
        self.rows = RowSteps(self)

    @property
    def w(self) -> Weights:
        return self._w

    @w.setter
    def w(self, w: Weights) -> None:
        """The dense weights and the parts built over them (``attention``, ``proj``,
        ``moe_block``): given other weights (the same file held another way), all compute with them."""
        self._w = w
        self.attention = Attention(w, self.eps)
        self.proj = Projections(w, self.STACKS)
        self.moe_block = MoEBlock(self.proj, self.eps, self.spec.n_layer, self.FFN_IN)

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

    @abstractmethod
    def route_logits(self, il: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, ids) ``[T, k]`` from layer ``il``'s router logits ``[T, n_expert]`` (which a
        layer may compute in one GEMM with other projections of its MoE input)."""

    def block(self, il: int, x: torch.Tensor, cache: "Cache | Batch", pos0: int | torch.Tensor, pre: Normed | None
              ) -> tuple[torch.Tensor, Normed | None]:
        """Layer ``il``'s residual block on ``x [T, n_embd]`` whose first token is at ``pos0``: the
        new residual stream, and the next block's input norm when this block's epilogue computed
        it (``epilogue``), which comes back as ``pre`` of the next call (``norm`` takes it). Here
        the pre-norm block of the all-attention archs; an arch whose blocks differ overrides it."""
        a = self.attn(il, self.norm(x, f"blk.{il}.attn_norm.weight", pre), cache, pos0)
        x, h = self.add_norm(x, a, f"blk.{il}.{self.ffn_norm}.weight")
        return self.ffn(il, h, x)

    @abstractmethod
    def attn(self, il: int, h: Rows, cache: "Cache | Batch", pos0: int | torch.Tensor) -> torch.Tensor:
        """Layer ``il``'s attention on its normed input ``h``, through ``attn_output``."""

    def reserve_kv(self, cache: Cache, n: int, call: int = 1) -> None:
        """Make every KV cache of ``cache`` hold positions up to ``n``, written by calls of up to
        ``call`` rows, before a call that reads its position from the device (which cannot grow
        them itself)."""
        for il, layer in enumerate(cache.layers):
            if isinstance(layer, KVCache) and not layer.fits(n, call):  # (every call: cheap when done)
                like = torch.empty(0, kv_heads(self.spec, il), self.spec.head_dim, dtype=self.dtype, device=self.device)
                layer.reserve(n, like, call)

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

    # -- steps whose rows are one-token steps (``row_steps.RowSteps``; callers use these names)
    def decode_batch(self, ids: Sequence[int] | torch.Tensor, caches: Sequence[Cache]) -> torch.Tensor:
        return self.rows.decode_batch(ids, caches)

    def decode_run(self, ids: Sequence[int] | torch.Tensor, cache: Cache) -> torch.Tensor:
        return self.rows.decode_run(ids, cache)

    def verify_rows(self, ids: Sequence[int] | torch.Tensor, cache: Cache, pos: torch.Tensor | None = None,
                    states: RowStates | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows.verify_rows(ids, cache, pos, states)

    def rows_logits(self, ids: torch.Tensor, caches: Sequence[Cache], pos: Sequence[int | torch.Tensor]
                    ) -> torch.Tensor:
        return self.rows.rows_logits(ids, caches, pos)

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
        self.experts.count_real_tokens(real)
        try:
            for il in range(self.spec.n_layer):
                x, pre = self.block(il, x, cache, cache.pos if pos is None else pos, pre)
        finally:
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

    # -- the parts every block composes: ``attention``, ``proj`` (projections), ``moe_block``
    def linear(self, h: Rows, name: str) -> torch.Tensor:
        return self.proj.linear(h, name)

    def stack_groups(self, layers: Sequence[int] | None = None) -> list[tuple[str, ...]]:
        """Every layer's ``STACKS`` groups as stacked (``Projections.groups``); ``layers``: those
        blocks' only (an MTP head's), else the trunk's."""
        return self.proj.groups(range(self.spec.n_layer) if layers is None else layers)

    def ffn(self, il: int, h: Rows, x: torch.Tensor, experts: ExpertProvider | None = None
            ) -> tuple[torch.Tensor, Normed | None]:
        """Layer ``il``'s MoE block (``MoEBlock``); ``experts``: the provider of a block outside
        the trunk (an MTP head's), else the model's."""
        return self.moe_block(il, h, x, self.experts if experts is None else experts, self.route_logits,
                              kernels=self.kernels)

    def attend(self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: "Cache | Batch",
               pos0: "int | torch.Tensor", rope: Rope, window: int = 0, gate: torch.Tensor | None = None,
               gate_kind: str = "none") -> Rows:
        """Layer ``il``'s attention from its raw projections (``Attention``)."""
        return self.attention(il, q, k, v, cache, pos0, rope, window, gate, gate_kind, kernels=self.kernels)

    def norm(self, x: torch.Tensor, name: str, pre: Normed | None = None) -> Rows:
        """A block input or the output norm: it feeds projections, which read one decode row in
        its int8 form, so on a GPU that form comes from the norm's launch, or from the previous
        block's epilogue, which computed both (``pre``, taken when it is this norm)."""
        w = self.w(name)
        if pre is not None and pre.weight is w:
            return pre.rows
        return norm_rows(x, w, self.eps)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor, name: str) -> tuple[torch.Tensor, Rows]:
        """``(x + delta, norm(x + delta))``: the residual add and the next norm, one launch on a GPU."""
        return norm_rows(delta, self.w(name), self.eps, residual=x)
