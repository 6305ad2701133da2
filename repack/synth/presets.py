"""Model shapes for synthetic GGUFs: the real hyperparameters of each supported model, plus a tiny
preset per arch for tests.

Full-size values are the published configs as llama.cpp's converter writes them (see
docs FACTS.md and ``conversion/{qwen,laguna}.py``); the tiny presets keep every structural feature
(layer pattern, shared expert, leading dense layer, rows that force llama-quant.cpp's fallback
types) at a size that writes in well under a second.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Preset:
    arch: str
    name: str
    display_name: str
    n_layer: int
    n_embd: int
    n_vocab: int
    n_ctx: int
    n_head: tuple[int, ...]  # per layer
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int = 0
    n_ff_dense: int = 0
    rms_eps: float = 1e-6
    rope_base: float = 1e6
    rope_dim: int = 0
    special_start: int = 0  # token id of the first special token (real ids for full-size presets)
    extra: dict[str, Any] = field(default_factory=dict)

    def with_layers(self, n_layer: int) -> "Preset":
        """The same model cut to its first ``n_layer`` layers (benchmarks and tests of streaming)."""
        if not 0 < n_layer <= self.n_layer:
            raise ValueError(f"--layers must be in 1..{self.n_layer} for preset {self.name}")
        return replace(self, n_layer=n_layer, n_head=self.n_head[:n_layer])


def _heads(pattern: list[int], n_layer: int) -> tuple[int, ...]:
    return tuple(pattern[i % len(pattern)] for i in range(n_layer))


QWEN35_EXTRA = dict(ssm_conv_kernel=4, ssm_state_size=128, ssm_group_count=16, ssm_time_step_rank=32,
                    full_attention_interval=4, rope_sections=[11, 11, 10, 0])
LAGUNA_EXTRA = dict(sliding_window=512, leading_dense=1, rope_base_swa=10000.0, rope_dim_swa=128,
                    expert_weights_scale=2.5)

PRESETS: dict[tuple[str, str], Preset] = {}


def _add(p: Preset) -> None:
    PRESETS[(p.arch, p.name)] = p


_add(Preset("qwen35moe", "qwen3.6-35b-a3b", "Qwen3.6-35B-A3B (synthetic)", n_layer=40, n_embd=2048,
            n_vocab=248320, n_ctx=262144, n_head=_heads([16], 40), n_head_kv=2, head_dim=256, n_expert=256,
            n_expert_used=8, n_ff_exp=512, n_ff_shexp=512, rope_base=1e7, rope_dim=64, special_start=248044,
            extra=QWEN35_EXTRA))
_add(Preset("qwen35moe", "tiny", "Qwen3.6-MoE tiny (synthetic)", n_layer=4, n_embd=256, n_vocab=2048,
            n_ctx=4096, n_head=_heads([4], 4), n_head_kv=2, head_dim=64, n_expert=16, n_expert_used=4,
            n_ff_exp=256, n_ff_shexp=128, rope_base=1e7, rope_dim=16, special_start=1792,
            extra=dict(QWEN35_EXTRA, ssm_state_size=32, ssm_group_count=2, ssm_time_step_rank=4,
                       rope_sections=[3, 3, 2, 0])))
_add(Preset("laguna", "laguna-xs2", "Laguna XS.2 (synthetic)", n_layer=40, n_embd=2048, n_vocab=100352,
            n_ctx=131072, n_head=_heads([48, 64, 64, 64], 40), n_head_kv=8, head_dim=128, n_expert=256,
            n_expert_used=8, n_ff_exp=512, n_ff_shexp=512, n_ff_dense=8192, rope_base=500000.0, rope_dim=64,
            special_start=0, extra=LAGUNA_EXTRA))
_add(Preset("laguna", "tiny", "Laguna tiny (synthetic)", n_layer=5, n_embd=256, n_vocab=2048, n_ctx=4096,
            n_head=_heads([4, 8, 8, 8], 5), n_head_kv=2, head_dim=32, n_expert=16, n_expert_used=4,
            n_ff_exp=256, n_ff_shexp=128, n_ff_dense=512, rope_base=500000.0, rope_dim=16, special_start=0,
            extra=dict(LAGUNA_EXTRA, sliding_window=64, rope_dim_swa=32)))
_add(Preset("qwen3moe", "qwen3-30b-a3b", "Qwen3-30B-A3B (synthetic)", n_layer=48, n_embd=2048,
            n_vocab=151936, n_ctx=40960, n_head=_heads([32], 48), n_head_kv=4, head_dim=128, n_expert=128,
            n_expert_used=8, n_ff_exp=768, n_ff_dense=6144, rope_base=1e6, rope_dim=128, special_start=151643))
_add(Preset("qwen3moe", "tiny", "Qwen3-MoE tiny (synthetic)", n_layer=4, n_embd=256, n_vocab=2048,
            n_ctx=4096, n_head=_heads([4], 4), n_head_kv=2, head_dim=64, n_expert=16, n_expert_used=4,
            n_ff_exp=96, n_ff_dense=512, rope_base=1e6, rope_dim=64, special_start=1792))

ARCH_NAMES = sorted({a for a, _ in PRESETS})
PRESET_NAMES = sorted({p for _, p in PRESETS})


def get_preset(arch: str, name: str) -> Preset:
    try:
        return PRESETS[(arch, name)]
    except KeyError:
        valid = ", ".join(p for a, p in PRESETS if a == arch) or "none"
        raise ValueError(f"preset {name!r} does not exist for arch {arch!r} (valid: {valid})") from None
