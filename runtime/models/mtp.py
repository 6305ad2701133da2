"""Drafting with the file's multi-token-prediction head (``--draft mtp``): ``MtpDrafter``.

The head (``qwen35moe_mtp.MTPHead``) predicts token ``t + 2`` from the trunk's output-normed hidden
state at ``t`` and the token at ``t + 1``. What the drafter relies on, with its sources:

- The hidden state the head reads is the trunk's last residual after ``output_norm``: llama.cpp
  names that tensor ``h_nextn`` and hands it to the MTP graph (ggml-org/llama.cpp
  src/models/qwen35moe.cpp, ``graph``: "post-norm hidden state feeds both the LM head and the MTP
  seed"); vLLM's target model returns ``self.norm(hidden_states, residual)`` and its
  ``Qwen3NextMultiTokenPredictor`` (vllm-project/vllm
  vllm/model_executor/models/qwen3_next_mtp.py) takes those. The loop hands over exactly those
  rows (``runtime.drafting.Drafter``, the protocol this class follows).
- A draft step after the first feeds the head its own output, ``shared_head_norm`` of its block's
  residual (llama.cpp's ``graph_mtp`` sets ``t_h_nextn`` to that norm; vLLM's predictor returns
  ``self.norm(...)`` the same way), with the token it just drafted.
- The head keeps its own KV cache for its one attention block, one row per trunk position: the
  row of position ``i`` pairs ``h_i`` with the token at ``i + 1`` (vLLM's pairing; llama.cpp puts
  it at ``i + 1``, and rotary attention reads only differences). Draft rows are scratch: the
  cache position goes back after drafting, and the accepted tokens are paired again with the
  trunk's rows once the verify has computed them (a design choice, not read from llama.cpp: the
  trunk's row of a kept position is what a plain run would have paired there).

The drafter's state is in step with the main sequence when the positions the head has paired are
exactly the trunk positions ``0 .. n - 2`` of a sequence of ``n`` tokens (the last one picked, not
yet fed), each paired with the token after it. A draft never decides output: the verify does.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .qwen35moe import Qwen35MoE


class MtpDrafter:
    """Greedy drafts of one sequence from the MTP head of a ``Qwen35MoE`` that carries one.

    The rows handed to ``propose`` end at the position before the picked token, so they start
    ``len(hidden)`` positions before it; rows of positions the head has paired already are
    skipped. The first call's rows may start past 0 (a session that kept a prefix): the head's
    context starts there. Rows that never arrived (a gap) leave the head's context without them.

    Going back below what the head has paired (a conversation cut back to an earlier turn) keeps
    the pair at the cut: its token may have changed, and the trunk row it needs is gone. That one
    context row can only make drafts worse, never the output different."""

    name = "mtp"
    needs_hidden = True

    def __init__(self, model: "Qwen35MoE", kv_type: str = "auto"):
        self.head = model.load_mtp()
        self.kv_type = kv_type
        self.cache = self.head.new_cache(kv_type=kv_type)
        self._base: int | None = None  # the trunk position of the head's cache row 0
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # the last pair's (logits, head hidden) rows

    @property
    def paired(self) -> int:
        """Trunk positions whose rows the head has paired with the token after them."""
        return 0 if self._base is None else self._base + self.cache.pos

    def rewind(self, n_tokens: int) -> None:
        if self._base is None:
            return
        if n_tokens <= self._base:  # before the head's context began: start over
            self.reset()
        elif n_tokens < self.paired:
            self.cache.pos = n_tokens - self._base
            self._last = None

    def reset(self) -> None:
        self.cache = self.head.new_cache(kv_type=self.kv_type)
        self._base, self._last = None, None

    @torch.no_grad()
    def propose(self, tokens: Sequence[int], k: int, hidden: torch.Tensor | None) -> list[int]:
        n = len(tokens)
        if self.paired > n - 1:  # the sequence went back without a rewind
            self.rewind(n - 1)
        if hidden is not None and hidden.shape[0]:
            start = n - 1 - hidden.shape[0]
            if start < 0:  # more rows than positions: not this sequence's
                return []
            if self._base is None:
                self._base = start
            elif start > self.paired:  # positions whose rows never came: the context skips them
                self._base += start - self.paired
            self._pair(tokens, hidden[max(0, self.paired - start):])
        if k <= 0 or self._last is None or self.paired != n - 1:
            return []  # no pair for the last position: a draft for it would be a guess
        logits, h = self._last
        first = logits[-1:].argmax(-1)  # (on the device: the draft steps queue behind it)
        rest = self.head.draft(first, h, self.cache, k - 1)
        return [int(first)] + rest

    def _pair(self, tokens: Sequence[int], rows: torch.Tensor) -> None:
        """Pair the trunk rows of positions ``paired ..`` with the tokens after them."""
        if not rows.shape[0]:
            return
        at = self.paired
        logits, h = self.head.forward(list(tokens[at + 1:at + 1 + rows.shape[0]]), rows, self.cache, last_only=True)
        self._last = (logits, h[-1:])
