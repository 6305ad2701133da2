"""What every architecture module provides: a ``ModelSpec`` read from GGUF metadata.

The spec answers the questions the rest of the pipeline asks without knowing the architecture:
which layers are MoE, which tensors hold the experts of a layer, how many experts, top-k, and the
hyperparameters a forward pass needs. Architecture modules only translate metadata into it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..errors import FormatError

if TYPE_CHECKING:
    from ..gguf_file import GGUFModel
    from .shapes import Expected

FULL, SLIDING, LINEAR = "full", "sliding", "linear"
MOE, DENSE = "moe", "dense"


@dataclass(frozen=True)
class LayerKind:
    attention: str  # FULL | SLIDING | LINEAR
    ffn: str  # MOE | DENSE


@dataclass(frozen=True)
class NextNHead:
    """The multi-token-prediction ("nextn", MTP) head a file carries after its trunk, as llama.cpp's
    converter writes it: ``{arch}.nextn_predict_layers`` extra blocks counted in ``block_count``,
    numbered after the trunk's (``blk.N`` with N >= n_layer). Each is a full-attention block with a
    MoE plus ``nextn.eh_proj``/``enorm``/``hnorm``/``shared_head_norm``. Kept apart from the
    trunk's layers: nothing that runs or places the trunk (routing profiles, calibration, the
    pack's expert placement, the --vram plan unless the head is loaded) counts its blocks."""

    layers: tuple[int, ...]
    n_head: tuple[int, ...]  # per head block
    n_head_kv: tuple[int, ...]
    tensors: frozenset[str]  # every tensor of the head's blocks
    expert_tensors: dict[int, dict[str, str]]  # as ``ModelSpec.expert_tensors``, for the head's blocks

    def expert_names(self) -> set[str]:
        return {n for roles in self.expert_tensors.values() for n in roles.values()}


@dataclass(frozen=True)
class RopeShape:
    """A rotary embedding: over the first ``dim`` channels of a head, base ``freq_base``;
    ``sections``: multimodal rope's sections (empty: plain rope)."""

    dim: int
    freq_base: float
    sections: tuple[int, ...] = ()


@dataclass(frozen=True)
class DeltaNetShape:
    """A linear-attention (Gated DeltaNet) layer's shape: ``n_v`` value heads of ``d_v`` over
    ``n_k`` key groups of state width ``d_k``, and the causal conv's kernel."""

    conv_kernel: int
    n_k: int  # ssm.group_count
    d_k: int  # ssm.state_size
    n_v: int  # ssm.time_step_rank
    inner: int  # ssm.inner_size: n_v * d_v

    @property
    def d_v(self) -> int:
        return self.inner // max(self.n_v, 1)


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling (``rope.scaling.*``; llama.cpp's ``yarn_*``): the context ``factor`` over
    the ``original_context_length``, the ramp's ``beta_fast``/``beta_slow`` and the attention
    factor (None: YaRN's own, from ``factor``)."""

    factor: float
    original_context_length: int
    beta_fast: float
    beta_slow: float
    attn_factor: float | None


@dataclass
class ModelSpec:
    arch: str
    n_layer: int
    n_embd: int
    n_vocab: int
    n_ctx_train: int
    n_head: list[int]  # per layer (some archs vary it)
    n_head_kv: list[int]
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int  # 0 when the arch has no shared expert
    n_ff_dense: int  # 0 when no dense layers
    rms_eps: float
    router: str  # "softmax" | "sigmoid"
    layers: list[LayerKind]
    rope: RopeShape  # of the full-attention layers
    # What only some archs have, each read and range-checked by its arch module; the defaults
    # are "the arch has none" (the runtime reads these fields only for the layers that use them).
    rope_swa: RopeShape | None = None  # sliding-window layers' own rope
    yarn: YarnScaling | None = None  # YaRN on the full-attention layers, when the file asks for it
    deltanet: DeltaNetShape | None = None  # the linear-attention layers' shape
    sliding_window: int = 0  # positions a sliding-window layer attends to
    norm_topk: bool = True  # the router renormalises its top-k weights (``expert_weights_norm``)
    expert_weights_scale: float = 1.0  # the routed experts' weights scaled (a sigmoid router's)
    # Tensor names of the experts of each MoE layer, filled from the file's tensor index:
    # {"gate": ..., "up": ..., "down": ...} or {"gate_up": ..., "down": ...}
    expert_tensors: dict[int, dict[str, str]] = field(default_factory=dict)
    nextn: NextNHead | None = None  # the file's MTP head, when it has one

    def head_tensor_names(self) -> frozenset[str]:
        """The tensors of the MTP head (empty without one): loaded only when the head is."""
        return self.nextn.tensors if self.nextn is not None else frozenset()

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layers) if k.ffn == MOE]

    def layer_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for k in self.layers:
            counts[f"{k.attention}-attention"] = counts.get(f"{k.attention}-attention", 0) + 1
            counts[f"{k.ffn}-ffn"] = counts.get(f"{k.ffn}-ffn", 0) + 1
        return counts


@dataclass(frozen=True)
class ArchModule:
    """Registry entry: the GGUF arch name, how to build its spec from metadata, and the tensor
    shapes that spec implies (``shapes.py``; checked whenever a spec is built)."""

    name: str
    description: str
    build: Callable[["GGUFModel"], ModelSpec]
    tensors: Callable[[ModelSpec], list["Expected"]]


# Largest hyperparameter accepted: ggml dimensions are int64, but no model dimension comes near
# 2**31 and larger values only serve to allocate absurd lists or overflow int32 kernel indices.
MAX_DIM = 2**31 - 1


class MetaReader:
    """Typed, range-checked access to ``{arch}.*`` keys: a value of the wrong type (a string, an
    array, a bool, NaN where a number belongs) or out of range is one ``FormatError`` naming the
    file and key, never an exception in the code that uses it."""

    def __init__(self, model: "GGUFModel"):
        self.model = model
        self.arch = model.arch

    def key(self, suffix: str) -> str:
        return f"{self.arch}.{suffix}"

    def _bad(self, suffix: str, problem: str) -> FormatError:
        return FormatError(self.model.path, f"metadata key {self.key(suffix)} {problem}")

    def _get(self, suffix: str, default: Any) -> Any:
        v = self.model.get(self.key(suffix))
        if v is None:
            if default is None:
                raise FormatError(self.model.path, f"missing metadata key {self.key(suffix)}")
            return default
        return v

    def _check_int(self, suffix: str, v: Any, lo: int, hi: int) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._bad(suffix, f"is {_kind(v)}, expected an integer")
        if not lo <= v <= hi:
            raise self._bad(suffix, f"is {v}, expected {lo}..{hi}")
        return v

    def int(self, suffix: str, default: int | None = None, lo: int = 0, hi: int = MAX_DIM) -> int:
        return self._check_int(suffix, self._get(suffix, default), lo, hi)

    def float(self, suffix: str, default: float | None = None, lo: float = -math.inf, hi: float = math.inf,
              lo_open: bool = False) -> float:
        v = self._get(suffix, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self._bad(suffix, f"is {_kind(v)}, expected a number")
        v = float(v)
        if not math.isfinite(v) or not lo <= v <= hi or (lo_open and v == lo):
            raise self._bad(suffix, f"is {v}, expected a finite number {'>' if lo_open else '>='} {lo}"
                                    + (f" and <= {hi}" if hi != math.inf else ""))
        return v

    def bool(self, suffix: str, default: bool) -> bool:
        v = self._get(suffix, default)
        if not isinstance(v, bool):
            raise self._bad(suffix, f"is {_kind(v)}, expected true or false")
        return v

    def str(self, suffix: str, default: str) -> str:
        v = self._get(suffix, default)
        if not isinstance(v, str):
            raise self._bad(suffix, f"is {_kind(v)}, expected a string")
        return v

    def int_list(self, suffix: str, default: list[int] | None = None, lo: int = 0, hi: int = MAX_DIM) -> list[int]:
        v = self._get(suffix, default)
        if not isinstance(v, list):
            raise self._bad(suffix, f"is {_kind(v)}, expected an array of integers")
        return [self._check_int(suffix, x, lo, hi) for x in v]

    def per_layer(self, suffix: str, n_layer: int, default: int | None = None, lo: int = 1,
                  hi: int = MAX_DIM) -> list[int]:
        """A key that is either one number for all layers or an array with one per layer."""
        v = self._get(suffix, default)
        if isinstance(v, list):
            if len(v) < n_layer:
                raise self._bad(suffix, f"has {len(v)} entries for {n_layer} layers")
            return [self._check_int(suffix, x, lo, hi) for x in v[:n_layer]]
        return [self._check_int(suffix, v, lo, hi)] * n_layer

    def layer_count(self, suffix: str = "block_count", minus: int = 0) -> int:
        """The number of layers, bounded by the tensor index: every layer has tensors, so a count
        larger than the index is corrupt (and would allocate per-layer lists for nothing)."""
        n = self.int(suffix, lo=1) - minus
        if not 1 <= n <= len(self.model.tensors):
            raise self._bad(suffix, f"gives {n} layers, but the file's tensor index ({len(self.model.tensors)} "
                                    "tensors) cannot hold them")
        return n

    def head_dim(self, n_layer: int) -> int:
        """``attention.key_length``, by default the embedding width over the first layer's heads
        (llama.cpp's ``n_embd_head_k``)."""
        default = self.int("embedding_length", lo=1) // self.per_layer("attention.head_count", n_layer)[0]
        return self.int("attention.key_length", default=max(default, 1), lo=1)

    def optional(self, suffix: str, default: Any = None) -> Any:
        v = self.model.get(self.key(suffix))
        return default if v is None else v


def _kind(v: Any) -> str:
    if isinstance(v, list):
        return "an array"
    if isinstance(v, bool):
        return "a bool"
    if isinstance(v, str):
        return f"the string {v[:40]!r}"
    return f"{v!r}" if isinstance(v, (int, float)) else type(v).__name__


def common_spec(model: "GGUFModel", *, router: str, layers: list[LayerKind], n_layer: int, rope: RopeShape,
                n_ff_shexp: int = 0, **arch_fields: Any) -> ModelSpec:
    """Read the hyperparameters every supported MoE arch shares, check that they agree with each
    other, and attach the expert tensors. ``arch_fields``: the ``ModelSpec`` fields only some
    archs have (``rope_swa``, ``deltanet``, ...), as the arch module read them."""
    m = MetaReader(model)
    n_embd = m.int("embedding_length", lo=1)
    n_head = m.per_layer("attention.head_count", n_layer)
    n_head_kv = m.per_layer("attention.head_count_kv", n_layer, default=n_head[0])
    for il, (h, kv) in enumerate(zip(n_head, n_head_kv)):
        if h % kv:
            raise FormatError(model.path, f"layer {il} has {h} attention heads for {kv} KV heads "
                                          f"({m.key('attention.head_count_kv')}): not a whole number per KV head")
    head_dim = m.head_dim(n_layer)
    vocab = m.optional("vocab_size")
    if vocab is not None:
        vocab = m.int("vocab_size", lo=1)
    else:
        tokens = model.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list) and tokens:
            vocab = len(tokens)
        elif "token_embd.weight" in model.tensors and len(model.tensors["token_embd.weight"].shape) == 2:
            vocab = model.tensors["token_embd.weight"].shape[1]
        else:
            raise FormatError(model.path, "cannot tell the vocabulary size (no vocab_size, tokens or token_embd)")
    spec = ModelSpec(
        arch=model.arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=int(vocab),
        n_ctx_train=m.int("context_length", default=4096, lo=1),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_expert=m.int("expert_count", lo=1),
        n_expert_used=m.int("expert_used_count", lo=1),
        n_ff_exp=m.int("expert_feed_forward_length", default=0),
        n_ff_shexp=n_ff_shexp,
        n_ff_dense=m.int("feed_forward_length", default=0),
        rms_eps=m.float("attention.layer_norm_rms_epsilon", default=1e-6, lo=0.0, hi=1.0, lo_open=True),
        router=router,
        layers=layers,
        rope=rope,
        **arch_fields,
    )
    if spec.n_expert_used > spec.n_expert:
        raise FormatError(model.path, f"bad expert counts: {spec.n_expert} experts, {spec.n_expert_used} used")
    attach_expert_tensors(model, spec)
    check_rope(model, spec)
    return spec


def check_rope(model: "GGUFModel", spec: ModelSpec) -> None:
    """Rotary widths the runtime can apply: even, and no wider than a head."""
    for key, rope in (("rope_dim", spec.rope), ("rope_dim_swa", spec.rope_swa)):
        dim = rope.dim if rope is not None else None
        if dim is not None and not (0 < dim <= spec.head_dim and dim % 2 == 0):
            raise FormatError(model.path, f"rotary width {dim} ({key}) must be even and at most the head size "
                                          f"{spec.head_dim}")


def attach_expert_tensors(model: "GGUFModel", spec: ModelSpec) -> None:
    """Find the 3-D expert tensors of every MoE layer (separate gate/up/down or merged gate_up)."""
    for il in spec.moe_layers:
        spec.expert_tensors[il] = find_expert_tensors(model, il, spec.n_expert)
        if not spec.n_ff_exp:  # the file gives no expert width: take the first layer's
            spec.n_ff_exp = model.tensors[spec.expert_tensors[il]["down"]].shape[0]


def find_expert_tensors(model: "GGUFModel", il: int, n_expert: int) -> dict[str, str]:
    """Block ``il``'s expert tensors by role, each 3-D with ``n_expert`` experts last."""
    p = f"blk.{il}."
    names = {
        "gate": p + "ffn_gate_exps.weight",
        "up": p + "ffn_up_exps.weight",
        "gate_up": p + "ffn_gate_up_exps.weight",
        "down": p + "ffn_down_exps.weight",
    }
    have = {k: v for k, v in names.items() if v in model.tensors}
    if "down" in have and "gate_up" in have:
        roles = {"gate_up": have["gate_up"], "down": have["down"]}
    elif "down" in have and "gate" in have and "up" in have:
        roles = {"gate": have["gate"], "up": have["up"], "down": have["down"]}
    else:
        raise FormatError(model.path, f"layer {il} is a MoE layer but its expert tensors are missing "
                                      f"(expected {names['gate']} / {names['up']} / {names['down']})")
    for name in roles.values():
        shape = model.tensors[name].shape
        if len(shape) != 3 or shape[2] != n_expert:
            raise FormatError(model.path, f"expert tensor {name} has shape {list(shape)}, "
                                          f"expected 3 dimensions with {n_expert} experts last")
    return roles


def nextn_head(model: "GGUFModel", spec: ModelSpec, n_nextn: int) -> NextNHead | None:
    """The ``n_nextn`` MTP blocks after ``spec``'s trunk (None when 0): their tensors, heads and
    expert tensors (a head's block is MoE, as the trunk's)."""
    if not n_nextn:
        return None
    m = MetaReader(model)
    n_all = spec.n_layer + n_nextn
    heads = m.per_layer("attention.head_count", n_all)
    heads_kv = m.per_layer("attention.head_count_kv", n_all, default=heads[0])
    layers = tuple(range(spec.n_layer, n_all))
    prefixes = tuple(f"blk.{il}." for il in layers)
    return NextNHead(layers, tuple(heads[il] for il in layers), tuple(heads_kv[il] for il in layers),
                     frozenset(n for n in model.tensors if n.startswith(prefixes)),
                     {il: find_expert_tensors(model, il, spec.n_expert) for il in layers})
