"""What every architecture module provides: a ``ModelSpec`` read from GGUF metadata.

The spec answers the questions the rest of the pipeline asks without knowing the architecture:
which layers are MoE, which tensors hold the experts of a layer, how many experts, top-k, and the
hyperparameters a forward pass needs. Architecture modules only translate metadata into it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..errors import FormatError

if TYPE_CHECKING:
    from ..gguf_file import GGUFModel

FULL, SLIDING, LINEAR = "full", "sliding", "linear"
MOE, DENSE = "moe", "dense"


@dataclass(frozen=True)
class LayerKind:
    attention: str  # FULL | SLIDING | LINEAR
    ffn: str  # MOE | DENSE


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
    hparams: dict[str, Any] = field(default_factory=dict)  # arch-specific extras
    # Tensor names of the experts of each MoE layer, filled from the file's tensor index:
    # {"gate": ..., "up": ..., "down": ...} or {"gate_up": ..., "down": ...}
    expert_tensors: dict[int, dict[str, str]] = field(default_factory=dict)

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
    """Registry entry: the GGUF arch name and how to build its spec from metadata."""

    name: str
    description: str
    build: Callable[["GGUFModel"], ModelSpec]


class MetaReader:
    """Typed access to ``{arch}.*`` keys with errors that name the file and key."""

    def __init__(self, model: "GGUFModel"):
        self.model = model
        self.arch = model.arch

    def key(self, suffix: str) -> str:
        return f"{self.arch}.{suffix}"

    def int(self, suffix: str, default: int | None = None) -> int:
        v = self.model.get(self.key(suffix))
        if v is None:
            if default is None:
                raise FormatError(self.model.path, f"missing metadata key {self.key(suffix)}")
            return default
        if isinstance(v, list):
            raise FormatError(self.model.path, f"metadata key {self.key(suffix)} is an array, expected a number")
        return int(v)

    def float(self, suffix: str, default: float | None = None) -> float:
        v = self.model.get(self.key(suffix))
        if v is None:
            if default is None:
                raise FormatError(self.model.path, f"missing metadata key {self.key(suffix)}")
            return default
        return float(v)

    def per_layer(self, suffix: str, n_layer: int, default: int | None = None) -> list[int]:
        """A key that is either one number for all layers or an array with one per layer."""
        v = self.model.get(self.key(suffix))
        if v is None:
            if default is None:
                raise FormatError(self.model.path, f"missing metadata key {self.key(suffix)}")
            return [default] * n_layer
        if isinstance(v, list):
            if len(v) < n_layer:
                raise FormatError(
                    self.model.path, f"metadata key {self.key(suffix)} has {len(v)} entries for {n_layer} layers"
                )
            return [int(x) for x in v[:n_layer]]
        return [int(v)] * n_layer

    def optional(self, suffix: str, default: Any = None) -> Any:
        v = self.model.get(self.key(suffix))
        return default if v is None else v


def common_spec(model: "GGUFModel", *, router: str, layers: list[LayerKind], n_layer: int,
                n_ff_shexp: int = 0, hparams: dict[str, Any] | None = None) -> ModelSpec:
    """Read the hyperparameters every supported MoE arch shares and attach expert tensors."""
    m = MetaReader(model)
    n_embd = m.int("embedding_length")
    n_head = m.per_layer("attention.head_count", n_layer)
    n_head_kv = m.per_layer("attention.head_count_kv", n_layer, default=n_head[0])
    head_dim = m.int("attention.key_length", default=n_embd // max(n_head[0], 1))
    vocab = m.optional("vocab_size")
    if vocab is None:
        tokens = model.get("tokenizer.ggml.tokens")
        if tokens is not None:
            vocab = len(tokens)
        elif "token_embd.weight" in model.tensors:
            vocab = model.tensors["token_embd.weight"].shape[1]
        else:
            raise FormatError(model.path, "cannot tell the vocabulary size (no vocab_size, tokens or token_embd)")
    spec = ModelSpec(
        arch=model.arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=int(vocab),
        n_ctx_train=m.int("context_length", default=4096),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_expert=m.int("expert_count"),
        n_expert_used=m.int("expert_used_count"),
        n_ff_exp=m.int("expert_feed_forward_length", default=0),
        n_ff_shexp=n_ff_shexp,
        n_ff_dense=m.int("feed_forward_length", default=0),
        rms_eps=m.float("attention.layer_norm_rms_epsilon", default=1e-6),
        router=router,
        layers=layers,
        hparams=hparams or {},
    )
    if spec.n_expert <= 0 or not 0 < spec.n_expert_used <= spec.n_expert:
        raise FormatError(model.path, f"bad expert counts: {spec.n_expert} experts, {spec.n_expert_used} used")
    attach_expert_tensors(model, spec)
    return spec


def attach_expert_tensors(model: "GGUFModel", spec: ModelSpec) -> None:
    """Find the 3-D expert tensors of every MoE layer (separate gate/up/down or merged gate_up)."""
    for il in spec.moe_layers:
        p = f"blk.{il}."
        names = {
            "gate": p + "ffn_gate_exps.weight",
            "up": p + "ffn_up_exps.weight",
            "gate_up": p + "ffn_gate_up_exps.weight",
            "down": p + "ffn_down_exps.weight",
        }
        have = {k: v for k, v in names.items() if v in model.tensors}
        if "down" in have and "gate_up" in have:
            spec.expert_tensors[il] = {"gate_up": have["gate_up"], "down": have["down"]}
        elif "down" in have and "gate" in have and "up" in have:
            spec.expert_tensors[il] = {"gate": have["gate"], "up": have["up"], "down": have["down"]}
        else:
            raise FormatError(model.path, f"layer {il} is a MoE layer but its expert tensors are missing "
                                          f"(expected {names['gate']} / {names['up']} / {names['down']})")
        for role, name in spec.expert_tensors[il].items():
            shape = model.tensors[name].shape
            if len(shape) != 3 or shape[2] != spec.n_expert:
                raise FormatError(model.path, f"expert tensor {name} has shape {list(shape)}, "
                                              f"expected 3 dimensions with {spec.n_expert} experts last")
