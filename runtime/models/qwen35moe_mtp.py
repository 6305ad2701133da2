"""The multi-token-prediction ("nextn", MTP) head of Qwen3.5/3.6 files (``ModelSpec.nextn``).

One block after the trunk drafts the token after next: for the trunk's output-normed hidden
state ``h_t`` (``MoEModel.forward_hidden``, llama.cpp's ``h_nextn``) and the token ``x_{t+1}``
that follows it,

    u = eh_proj([enorm(embed(x_{t+1})) | hnorm(h_t)])            (embedding first)
    u = u + attn(attn_norm(u))       a gated full-attention block with its own KV cache
    u = u + moe(post_attention_norm(u))   routed experts + sigmoid-gated shared expert
    h' = shared_head_norm(u)  (the trunk's output_norm where the file has none)
    logits = output(h')       (the trunk's head; ``nextn.shared_head_head`` where present)

as llama.cpp's ``graph_mtp`` (ggml-org/llama.cpp src/models/qwen35moe.cpp; ``load_block_mtp`` there
names the tensors, ``shared_head_norm``/``shared_head_head``/``embed_tokens`` optional) and vLLM's
``Qwen3NextMultiTokenPredictor`` (vllm-project/vllm vllm/model_executor/models/qwen3_next_mtp.py:
``fc`` over ``cat(pre_fc_norm_embedding(embed), pre_fc_norm_hidden(h))``, one full-attention
decoder layer, ``norm``) compute it. ``h'`` feeds the next draft step in place of the trunk's
hidden state. The converter stored every norm here with its ``1 +`` added, as the trunk's.

Loaded only on request (``Qwen35MoE.load_mtp``): a run that does not draft holds none of its
weights. Its experts are all resident: every draft step is on the critical path, and the head's
routing is not what a profile of the trunk records (``formats.memory.head_bytes`` counts them).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.quants import kernels_read

from ..cache import Cache, KVCache
from ..experts import PlainProvider
from ..layers import Rows, rms_norm, swiglu
from ..weights import dequantize_bytes

if TYPE_CHECKING:
    from .qwen35moe import Qwen35MoE


class HeadExperts(PlainProvider):
    """The MTP block's routed experts, every one resident. With ``pools`` (a GPU) their GGUF
    bytes sit on the device as one pool per role and the fused MoE kernels read them through an
    identity slot table (``kernels/moe.py``); otherwise each expert is expanded on first use and
    kept (the exact torch path of the plain providers)."""

    def __init__(self, source, roles: dict[str, str], n_expert: int, device: torch.device, dtype: torch.dtype,
                 pools: bool):
        self.source, self.roles, self.n_expert = source, roles, n_expert
        self.device, self.dtype = device, dtype
        self._expanded: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.pools = self._device_pools() if pools else None
        self.slots = torch.arange(n_expert, dtype=torch.int32, device=device)  # expert e in slot e

    @property
    def capturable(self) -> bool:
        return self.pools is not None

    def _device_pools(self):
        from ..kernels.moe import ExpertPools

        def pool(role: str) -> tuple[torch.Tensor, int, int]:
            info = self.source.tensor(self.roles[role])
            raw = torch.from_numpy(self.source.raw(self.roles[role]).copy()).to(self.device)
            rows = info.shape[1]
            return raw.view(self.n_expert, rows, -1), int(info.qtype), rows

        down, down_qt, _ = pool("down")
        if "gate_up" in self.roles:
            gate, gate_qt, rows = pool("gate_up")
            return ExpertPools(gate, None, down, gate_qt, None, down_qt, rows // 2)
        (gate, gate_qt, n_ff), (up, up_qt, _) = pool("gate"), pool("up")
        return ExpertPools(gate, up, down, gate_qt, up_qt, down_qt, n_ff)

    def moe(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, q8=None) -> torch.Tensor:
        if self.pools is None:
            return super().moe(layer, x, weights, ids, q8)
        from ..kernels.moe import moe_experts

        return moe_experts(x, ids, weights.float(), self.slots, self.pools, act_q8=True, x_q8=q8, reduce=False)

    def weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(gate [ff, embd], up [ff, embd], down [embd, ff])`` of one expert, expanded once."""
        w = self._expanded.get(expert)
        if w is None:
            parts = {}
            for role, name in self.roles.items():
                info = self.source.tensor(name)
                per = info.nbytes // self.n_expert
                raw = self.source.raw(name)[expert * per:(expert + 1) * per]
                parts[role] = dequantize_bytes(raw, info.qtype, info.shape[:2], self.device, self.dtype)
            gate, up = parts["gate_up"].chunk(2, dim=0) if "gate_up" in parts else (parts["gate"], parts["up"])
            w = self._expanded[expert] = (gate, up, parts["down"])
        return w

    def forward(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, *self.weights(expert))


class MTPHead:
    """The first MTP block of a loaded ``Qwen35MoE`` (llama.cpp runs only one), drafting through
    the trunk's weights object (its blocks' tensors load on first use, or at ``preload``)."""

    def __init__(self, model: "Qwen35MoE"):
        head = model.spec.nextn
        if head is None:
            raise SparkpackError(model.gguf.path, "this file has no multi-token-prediction head "
                                                  f"({model.spec.arch}.nextn_predict_layers is absent)")
        self.model, self.il = model, head.layers[0]
        p = self.prefix = f"blk.{self.il}."
        w = model.w
        self.embed_name = p + "nextn.embed_tokens.weight" if w.has(p + "nextn.embed_tokens.weight") \
            else "token_embd.weight"
        self.norm_name = p + "nextn.shared_head_norm.weight" if w.has(p + "nextn.shared_head_norm.weight") \
            else "output_norm.weight"
        self.out_name = p + "nextn.shared_head_head.weight" if w.has(p + "nextn.shared_head_head.weight") \
            else model.output_name()
        roles = head.expert_tensors[self.il]
        pools = model.kernels and w.quantized and all(kernels_read(model.gguf.tensor(n).qtype) for n in roles.values())
        self.experts = HeadExperts(model.gguf, roles, model.spec.n_expert, model.device, model.dtype, pools)

    def preload(self) -> None:
        """Load the head's dense tensors now (a budgeted run counts them from the start)."""
        head, w = self.model.spec.nextn, self.model.w
        assert head is not None
        for group in self.model.stack_groups([self.il]):  # stacked first: no part is ever held twice
            w.stacked(group)
        w.preload(sorted(head.tensors - head.expert_names()))

    def new_cache(self, capacity: int = 256, kv_type: str = "auto") -> Cache:
        """The head's own KV cache: one full-attention layer, at the head's block index (the
        trunk's slots before it stay empty: the head's attention reads only its own)."""
        return Cache([None] * self.il + [KVCache(capacity, kv_type)])  # type: ignore[list-item]

    @torch.no_grad()
    def forward(self, ids: torch.Tensor | list[int], hidden: torch.Tensor, cache: Cache, last_only: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits ``[T, n_vocab]`` and the head's normed hidden states ``[T, n_embd]`` for
        rows pairing ``ids[i]`` with ``hidden[i]``, the hidden state of the position before it
        (the trunk's ``forward_hidden`` rows, or this head's own previous output when drafting
        further). Row i takes position ``cache.pos + i`` of the head's cache, which it advances:
        positions only need to be consecutive (rotary attention reads differences), so vLLM's
        pairing (``h_t`` with ``x_{t+1}`` at t) and llama.cpp's (at t + 1) give the same values.
        Going back (a rejected draft) is setting ``cache.pos`` back: later rows are masked.
        ``last_only``: the last row's logits only (a prompt's rows fill the head's cache; the
        output head over every row would be the largest product by far)."""
        m, p = self.model, self.prefix
        ids = torch.as_tensor(ids, dtype=torch.long, device=m.device).reshape(-1)
        e = rms_norm(m.w.embed(ids, self.embed_name), m.w(p + "nextn.enorm.weight"), m.eps)
        h = rms_norm(hidden.to(m.dtype), m.w(p + "nextn.hnorm.weight"), m.eps)
        x = m.linear(Rows(torch.cat((e, h), dim=-1)), p + "nextn.eh_proj.weight")
        a = m.attn(self.il, m.norm(x, p + "attn_norm.weight"), cache, cache.pos)
        x, hn = m.add_norm(x, a, p + "post_attention_norm.weight")
        x, _ = m.ffn(self.il, hn, x, self.experts)
        cache.pos += ids.numel()
        out = m.norm(x, self.norm_name)
        return m.linear(Rows(out.x[-1:]) if last_only else out, self.out_name), out.x

    @torch.no_grad()
    def draft(self, token: int | torch.Tensor, hidden: torch.Tensor, cache: Cache, k: int) -> list[int]:
        """``k`` greedy drafts after ``token``, whose hidden state of the position before is
        ``hidden [1, n_embd]`` (the trunk's): each step feeds the head its own previous output, as
        llama.cpp's draft-mtp does. The head's cache is left where it was: its rows for the drafts
        hold the head's own hidden states, so after a verify the accepted tokens are fed again
        with the trunk's, from the position this began at (``mtp.MtpDrafter``). Each drafted
        token stays on the device until the last (``token`` may be one there too): on a GPU the
        steps queue without a host round trip between them."""
        start, out = cache.pos, []
        token = torch.as_tensor(token, dtype=torch.long, device=self.model.device).reshape(1)
        for _ in range(k):
            logits, hidden = self.forward(token, hidden, cache)
            token = logits[-1:].argmax(-1)
            out.append(token)
        cache.pos = start
        return torch.cat(out).tolist() if out else []
