"""The tensor shapes an architecture's forward pass reads, from its spec, checked at load.

A GGUF can parse and still disagree with itself: a head count that does not divide the query
projection, an embedding narrower than ``embedding_length``. Without this check the runtime
finds out inside a matmul, with a torch error and a traceback; with it, every command that
builds a spec (``inspect``, ``split``, ``calibrate``, ``spark-run``) names the tensor, its shape
and the shape the hyperparameters imply. Shapes are GGUF order (``ne[0]`` first) and follow
llama.cpp's ``load_arch_tensors`` for each arch; tensors a file has that the table does not
name are left alone.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..errors import FormatError

if TYPE_CHECKING:
    from .base import ModelSpec

Shape = tuple[int, ...]


class HasShape(Protocol):
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Expected:
    name: str
    shapes: tuple[Shape, ...]  # any one of these
    required: bool = True


def one(name: str, *shape: int, required: bool = True) -> Expected:
    return Expected(name, (tuple(shape),), required)


def globals_(spec: "ModelSpec") -> list[Expected]:
    """Embeddings, the output norm and the head (tied to the embeddings when absent)."""
    return [one("token_embd.weight", spec.n_embd, spec.n_vocab), one("output_norm.weight", spec.n_embd),
            one("output.weight", spec.n_embd, spec.n_vocab, required=False)]


def attention(spec: "ModelSpec", il: int, q_per_head: int = 1, heads: tuple[int, int] | None = None
              ) -> list[Expected]:
    """GQA projections with per-head q/k RMSNorm; ``q_per_head`` 2 where each query head carries
    its output gate (Qwen3.5). ``heads``: (query, KV) heads of a block outside the trunk's layers
    (an MTP head's), else the spec's of layer ``il``."""
    h, kv = heads if heads is not None else (spec.n_head[il], spec.n_head_kv[il])
    p, d, e = f"blk.{il}.", spec.head_dim, spec.n_embd
    return [one(p + "attn_q.weight", e, q_per_head * d * h), one(p + "attn_k.weight", e, d * kv),
            one(p + "attn_v.weight", e, d * kv), one(p + "attn_output.weight", d * h, e),
            one(p + "attn_q_norm.weight", d), one(p + "attn_k_norm.weight", d)]


def routed_experts(spec: "ModelSpec", il: int, roles: Mapping[str, str] | None = None) -> list[Expected]:
    """The router and the 3-D expert tensors (separate gate/up or merged gate_up); ``roles``: the
    block's expert tensors where they are not the spec's (an MTP head's)."""
    p, e, f, n = f"blk.{il}.", spec.n_embd, spec.n_ff_exp, spec.n_expert
    out = [one(p + "ffn_gate_inp.weight", e, n), one(p + "ffn_down_exps.weight", f, e, n)]
    roles = spec.expert_tensors.get(il, {}) if roles is None else roles
    if "gate_up" in roles:
        out.append(one(p + "ffn_gate_up_exps.weight", e, 2 * f, n))
    else:
        out += [one(p + "ffn_gate_exps.weight", e, f, n), one(p + "ffn_up_exps.weight", e, f, n)]
    return out


def shared_expert(spec: "ModelSpec", il: int, gated: bool) -> list[Expected]:
    p, e, s = f"blk.{il}.", spec.n_embd, spec.n_ff_shexp
    out = [one(p + "ffn_gate_shexp.weight", e, s), one(p + "ffn_up_shexp.weight", e, s),
           one(p + "ffn_down_shexp.weight", s, e)]
    return out + ([one(p + "ffn_gate_inp_shexp.weight", e)] if gated else [])


def dense_mlp(spec: "ModelSpec", il: int) -> list[Expected]:
    p, e, f = f"blk.{il}.", spec.n_embd, spec.n_ff_dense
    return [one(p + "ffn_gate.weight", e, f), one(p + "ffn_up.weight", e, f), one(p + "ffn_down.weight", f, e)]


def _trim(shape: tuple[int, ...]) -> tuple[int, ...]:
    """ggml compares all four ``ne`` with missing ones 1, so [64, 1] is the vector [64]."""
    shape = tuple(shape)
    while shape and shape[-1] == 1:
        shape = shape[:-1]
    return shape


def check_shapes(spec: "ModelSpec", tensors: Mapping[str, HasShape], expected: list[Expected], where: object) -> None:
    """Every expected tensor present (unless optional) with one of its shapes."""
    for x in expected:
        t = tensors.get(x.name)
        if t is None:
            if x.required:
                raise FormatError(where, f"missing tensor {x.name}, which {spec.arch} needs")
            continue
        if _trim(t.shape) not in {_trim(s) for s in x.shapes}:
            want = " or ".join(str(list(s)) for s in x.shapes)
            raise FormatError(where, f"tensor {x.name} has shape {list(t.shape)}, but the file's hyperparameters "
                                     f"give {want}")
