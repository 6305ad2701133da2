"""Synthetic GGUF models with the real shapes, metadata, tokenizer and quant mix of the supported
MoE archs, random weights and optionally skewed routing: test and benchmark inputs that need no
download. ``write_synthetic`` is the API; ``repack synth`` the command."""
from __future__ import annotations

import os
from pathlib import Path

from sparkpack.formats.quant_mix import MIXES, mix_qtypes
from .routing_skew import reference_skew

from .metadata import add_metadata
from .presets import ARCH_NAMES, PRESET_NAMES, PRESETS, Preset, get_preset
from .tensors import MTP_PLANS, tensor_plan
from .types_from import types_from
from .writer import write_gguf

__all__ = ["write_synthetic", "resolve_skew", "Preset", "PRESETS", "ARCH_NAMES", "PRESET_NAMES", "MIXES"]


def resolve_skew(skew: float | str, preset: Preset) -> float:
    """A number, or "reference": the skew at which the top 60% of experts take ~93% of routings."""
    if isinstance(skew, str):
        if skew == "reference":
            return reference_skew(preset.n_expert, preset.n_expert_used)
        try:
            skew = float(skew)
        except ValueError:
            raise ValueError(f"skew must be a number >= 0 or 'reference', got {skew!r}") from None
    if not skew >= 0:
        raise ValueError(f"skew must be >= 0, got {skew}")
    return float(skew)


def write_synthetic(path: str | os.PathLike[str], arch: str, preset: str | Preset = "tiny", quant: str = "Q8_0",
                    seed: int = 0, skew: float | str = 0.0, *, n_layer: int | None = None, jobs: int = 1,
                    progress: bool = False, types_of: str | os.PathLike[str] | None = None,
                    mtp: bool = False) -> Path:
    """Write a synthetic ``arch`` model of ``preset`` shapes in quant mix ``quant`` to ``path``.

    ``n_layer`` cuts a preset to its first layers; ``jobs`` > 1 generates in that many processes
    (the bytes do not depend on it). ``types_of``: a real GGUF of the preset's model whose
    per-tensor types (and file type) replace the mix's (``types_from``); ``mtp`` appends the
    multi-token-prediction head (qwen35moe).
    """
    p = preset if isinstance(preset, Preset) else get_preset(arch, preset)
    if p.arch != arch:
        raise ValueError(f"preset {p.name!r} is for arch {p.arch!r}, not {arch!r}")
    if quant not in MIXES:
        raise ValueError(f"unknown quant {quant!r} (known: {', '.join(MIXES)})")
    if n_layer is not None:
        p = p.with_layers(n_layer)
    if mtp and arch not in MTP_PLANS:
        raise ValueError(f"--mtp: {arch} files carry no MTP head (only {', '.join(MTP_PLANS)})")
    s = resolve_skew(skew, p)
    plans = tensor_plan(p, mtp)
    n_mtp = int(mtp)
    file_type = None
    if types_of is not None:
        qtypes, file_type = types_from(types_of, plans)
        quant = f"types-of:{Path(types_of).name}"
    else:  # llama-quantize counts the head's block with the trunk's (its n_layer_all)
        qtypes = mix_qtypes([(t.name, t.shape) for t in plans], quant, p.n_layer + n_mtp,
                            p.n_head[0] // p.n_head_kv)
    return write_gguf(Path(path), lambda w: add_metadata(w, p, quant, s, seed, file_type, n_mtp), plans, qtypes,
                      arch=arch, seed=seed, skew=s, jobs=max(1, jobs), progress=progress)
