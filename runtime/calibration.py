"""The model side of calibration: a window of token ids in, per-side routing counts out, at the
speed of spark-run's prefill of the same tokens.

``ModelRouter`` is the ``Router`` that ``calibrate.replay`` asks for (a Protocol written there, so
calibrate/ stays torch-free and this module never imports it). A window is fed to a
``runtime.generate.Session`` in the calls a fresh session makes for a prompt of those tokens
(``prefill_chunk`` tokens, or padded on the models that capture them: replayed from CUDA graphs,
or run eagerly where the store stages; warmed up first on a GPU), through whatever expert provider the model was opened with: the
tiered store on a GPU, also one that cannot hold the model, or the plain provider on the CPU.

The counts come from ``RoutingTap``, a provider around the model's own that adds each MoE layer's
routings into a device tensor, on the side each row belongs to: a few small launches per layer,
replayed inside the captured calls, read once per window. Counting per token keeps a window one
pass in long calls whatever its turns (calls split at every turn would pay a call's fixed cost,
a large part of an eager prefill call's time on the GPU, once per turn), and the store's own
counts cannot tell the sides apart within a call.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from sparkpack.formats.archs import ModelSpec
from sparkpack.formats.memory import call_rows

from .chat_template import ChatTemplate
from .experts import ExpertProvider
from .generate import Session
from .models.base import MoEModel
from .options import RunOptions, open_model
from .run_report import report_residency
from .tokenizer import GGUFTokenizer

if TYPE_CHECKING:
    from .kernels.q8dot import Int8Rows

DISCARD = 2  # the side of rows not to count: a padded call's padding, a warm-up's dummy tokens


def open_router(opts: RunOptions, record: bool = False) -> "ModelRouter":
    """The model ``opts`` describes (``run_options``: the flags spark-run takes, learning off, as
    calibration writes its own profile) opened as spark-run opens it, ready to route windows of
    up to ``opts.session.ctx`` tokens."""
    store = opts.store
    if opts.device == "cuda" and store is not None and store.vram is None and store.hot_fraction is None:
        # Without a budget, 90% of the free memory: calibration must run where the model does not
        # fit, and a uniform placement under that budget routes exactly as all-GPU.
        opts = dataclasses.replace(opts, store=dataclasses.replace(store, vram=int(torch.cuda.mem_get_info()[0] * 0.9)))
    if store is None:
        # The plain provider dequantizes experts on first use and keeps up to half the available
        # memory of them; beyond that the least recently used are dropped and re-read.
        opts = dataclasses.replace(opts, dequant_limit=os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2)
    model = open_model(opts)
    if model.store is not None:
        report_residency(model)
    return ModelRouter(model, opts.session.ctx, opts.session.prefill_chunk, record)


class ModelRouter:
    """Routes windows of at most ``ctx`` token ids through ``model`` (``calibrate.replay.Router``)."""

    def __init__(self, model: MoEModel, ctx: int, prefill_chunk: int, record: bool = False):
        self.model = model
        self.spec: ModelSpec = model.spec
        # no state checkpoints: a window is never gone back into (each would hold ~66 MB of
        # pinned host memory for a Qwen3.6 shape, copied after every call)
        self.session = Session(model, prefill_chunk=prefill_chunk, ctx=ctx, checkpoints=0)
        rows = call_rows(self.session.plan.longest_call)  # the most rows one call has (padded calls too)
        self.tap = RoutingTap(model.experts, model.spec, model.device, rows, record)
        self.tokenizer = GGUFTokenizer.from_metadata(model.gguf)
        template = model.gguf.get("tokenizer.chat_template")
        self.render_chat = ChatTemplate.from_tokenizer(template, self.tokenizer).render if template else None

    @contextlib.contextmanager
    def _tapped(self) -> Iterator[None]:
        """The tap in front of the model's provider while this router runs the model (a server's
        bootstrap shares the model between requests); calls captured meanwhile keep it."""
        self.model.experts = self.tap
        try:
            yield
        finally:
            self.model.experts = self.tap.inner

    def warm_up(self) -> float | None:
        """Compile and capture the calls' shapes before the corpus (``Session.warm_up``: its dummy
        tokens are on no side) on a GPU; the seconds it took, None on the CPU (nothing to warm)."""
        if self.model.device.type != "cuda":
            return None
        with self._tapped():
            return self.session.warm_up()

    def route(self, ids: list[int], generated: np.ndarray) -> np.ndarray:
        """``calibrate.replay.Router.route``. The window goes in the calls a session makes for a
        prompt of it (``CallPlan.call_tokens_at``), one ``feed`` a call so that the tap knows each
        call's sides (a lone token after them runs as a decode step)."""
        if not ids:
            raise ValueError("nothing to route")
        with self._tapped():
            self.session.reset()
            self.tap.reset()
            a = 0
            while a < len(ids):
                b = min(len(ids), a + self.session.plan.call_tokens_at(a))
                self.tap.sides(generated[a:b])
                self.session.feed(ids[:b])  # an extension: computes [a, b) in one call
                self.tap.keep(b - a)
                a = b
            return self.tap.counts()

    def take_trace(self) -> np.ndarray:
        return self.tap.take_trace()


class RoutingTap(ExpertProvider):
    """The model's expert provider with every routing counted on the device, per side of the row
    it comes from, and (``record``) each layer's choice kept. The buffers are allocated once, so a
    call captured in a CUDA graph replays the counting too."""

    def __init__(self, inner: ExpertProvider, spec: ModelSpec, dev: torch.device, rows: int, record: bool):
        self.inner, self.spec, self.rows = inner, spec, rows
        self.moe_layers = list(spec.moe_layers)
        self.plane = spec.n_layer * spec.n_expert  # one side's counts
        # the first flat index of each row's side: side * plane (DISCARD: the third plane)
        self.base = torch.full((rows, 1), DISCARD * self.plane, dtype=torch.long, device=dev)
        self.ones = torch.ones(rows * spec.n_expert_used, dtype=torch.long, device=dev)
        self._counts = torch.zeros(3 * self.plane, dtype=torch.long, device=dev)
        self.ids = (torch.zeros((len(self.moe_layers), rows, spec.n_expert_used), dtype=torch.long, device=dev)
                    if record else None)
        self.column = {il: j for j, il in enumerate(self.moe_layers)}
        self._kept: list[np.ndarray] = []

    def reset(self) -> None:
        self._counts.zero_()
        self._kept = []

    def sides(self, generated: np.ndarray) -> None:
        """The next call's rows: ``generated[i]`` is row i's side; rows past them are not counted."""
        n = len(generated)
        host = np.full((self.rows, 1), DISCARD * self.plane, dtype=np.int64)
        host[:n, 0] = np.where(generated, 1, 0) * self.plane
        self.base.copy_(torch.from_numpy(host))  # the previous call is done (Session waits for its logits)

    def keep(self, n: int) -> None:
        """After a call of ``n`` rows: keep their experts (recording)."""
        if self.ids is not None:
            self._kept.append(self.ids[:, :n].permute(1, 0, 2).to("cpu", copy=True).numpy())  # the buffer is reused

    def counts(self) -> np.ndarray:
        """Every routing since ``reset``, int64 ``[2, n_layer, n_expert]`` (waits for the device)."""
        return self._counts.view(3, self.spec.n_layer, self.spec.n_expert)[:2].to("cpu", copy=True).numpy()

    def take_trace(self) -> np.ndarray:
        if self.ids is None:
            raise RuntimeError("this router was opened without record=True")
        kept, self._kept = self._kept, []
        if not kept:
            return np.zeros((0, len(self.moe_layers), self.spec.n_expert_used), dtype=np.int64)
        return np.concatenate(kept)

    # --- the expert-provider contract: count, then hand on ----------------------------------------

    @property
    def capturable(self) -> bool:
        return self.inner.capturable  # nothing here leaves the device

    def moe(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            q8: "Int8Rows | None" = None) -> torch.Tensor:
        T, k = ids.shape
        if T > self.rows:
            raise ValueError(f"a call of {T} tokens is longer than the {self.rows} the routing tap holds")
        self._counts.index_add_(0, (ids + (self.base[:T] + layer * self.spec.n_expert)).reshape(-1),
                                self.ones[: T * k])
        if self.ids is not None:
            self.ids[self.column[layer], :T].copy_(ids)
        return self.inner.moe(layer, x, weights, ids, q8)

    def staged_prefill(self, n_tokens: int) -> bool:
        return self.inner.staged_prefill(n_tokens)

    def stage_calls(self, n_tokens: int | None) -> None:
        self.inner.stage_calls(n_tokens)

    def count_real_tokens(self, real: torch.Tensor | None) -> None:
        self.inner.count_real_tokens(real)

    def routing_side(self, side: str) -> None:
        self.inner.routing_side(side)

    def end_step(self, n_tokens: int, routed: bool | None = None, defer: bool = False) -> None:
        self.inner.end_step(n_tokens, routed, defer)

    def forget_traffic(self) -> None:
        self.inner.forget_traffic()
