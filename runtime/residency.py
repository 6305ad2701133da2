"""Which experts start on the GPU and how many cache slots there are, under a VRAM budget.

On a GPU the runtime holds dense matrices as their GGUF bytes, as ``repack split`` counts them;
tensors it expands (norms, vectors, types without a kernel, and everything on the CPU) count at
the compute dtype's size. Everything else is counted the same way (``formats.memory``), and the
hot set is the same greedy, hits-per-byte choice across layers (``formats.placement``).
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sparkpack.formats.archs import ModelSpec
from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.memory import KV_BYTES_PER_VALUE, PREFILL_CHUNK, kv_cache_bytes, recurrent_state_bytes, runtime_bytes
from sparkpack.formats.placement import default_cache_slots, make_plan
from sparkpack.formats.profile import Profile, choose_profile, model_identity


@dataclass
class StoreOptions:
    """What the user asked of the expert store (spark-run's flags)."""

    vram: int | None = None
    hot_fraction: float | None = None
    cache_slots: int | None = None
    profile: Path | None = None
    mode: str = "auto"
    host_bytes: int | None = None
    ctx: int = 4096
    kv_type: str = "auto"  # KV cache element type (runtime.cache.KV_TYPES)
    prefill_chunk: int = PREFILL_CHUNK  # prompt tokens per forward call (their temporaries are planned for)


@dataclass
class Residency:
    hot: np.ndarray  # bool [n_layer, n_expert]
    cache_slots: int
    source: str  # where the hot set came from, for the user
    vram: int | None = None
    dense_bytes: int = 0
    kv_bytes: int = 0
    state_bytes: int = 0
    overhead_bytes: int = 0
    hot_bytes: int = 0
    cache_bytes: int = 0
    expected_cold_rate: float | None = None

    def as_json(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "hot"}
        d["hot_experts"] = int(self.hot.sum())
        return d


def load_profile(path: Path | None, model_path: Path, identity, spec: ModelSpec) -> tuple[Profile | None, str | None]:
    """An explicit profile (must match the model), else ``MODEL.profile.json`` when it exists and
    matches, else none; a default that is there but does not match is named in one line."""
    choice = choose_profile(path, model_path, identity, spec)
    if choice.warning:
        print(f"warning: {choice.warning}", file=sys.stderr)
    return choice.profile, str(choice.path) if choice.path is not None else None


def plan_residency(spec: ModelSpec, tensors: dict, expert_names: set[str], slot_bytes: dict[int, int],
                   dtype_bytes: int, *, pack_hot: np.ndarray | None = None, profile: Profile | None = None,
                   profile_name: str | None = None, vram: int | None = None, hot_fraction: float | None = None,
                   cache_slots: int | None = None, ctx: int = 4096, kv_type: str = "auto", prefill_chunk: int = PREFILL_CHUNK, where: object = None,
                   quantized_dense: bool = False) -> Residency:
    """The hot set and slot count. Precedence: ``vram`` (size everything to fit), then
    ``hot_fraction`` (that share of expert bytes), then the pack's own placement, then all hot
    (a GGUF with no budget runs all-GPU). ``quantized_dense``:
    the runtime holds dense matrices as their GGUF bytes (``runtime.weights.held_quantized``)."""
    shape = (spec.n_layer, spec.n_expert)
    slots = default_cache_slots(spec) if cache_slots is None else int(cache_slots)
    slot = max(slot_bytes.values(), default=0)
    all_bytes = sum(slot_bytes.values()) * spec.n_expert
    counts = profile.counts if profile is not None else None
    tokens = profile.tokens if profile is not None else None
    what = f"profile {os.path.basename(profile_name)}" if profile_name else "uniform placement (no profile)"
    if vram is not None:
        from .weights import held_quantized

        dense = sum(t.nbytes if quantized_dense and held_quantized(t.name, t.shape, t.qtype)
                    else math.prod(t.shape) * dtype_bytes for t in tensors.values() if t.name not in expert_names)
        kv_value = dtype_bytes if kv_type == "auto" else KV_BYTES_PER_VALUE[kv_type]
        kv, state = kv_cache_bytes(spec, ctx, kv_value), recurrent_state_bytes(spec)
        runtime = runtime_bytes(spec, ctx, prefill_chunk)
        fixed = dense + kv + state + runtime
        left = vram - fixed - slots * slot
        if left < 0:
            raise SparkpackError(where, f"VRAM budget {vram / 1024**3:.2f} GiB is too small: dense weights "
                                        f"{dense / 1024**3:.2f} GiB, KV cache {kv / 1024**3:.2f} GiB at ctx {ctx}, "
                                        f"state and runtime (prefill chunks of {prefill_chunk}) "
                                        f"{(state + runtime) / 1024**3:.2f} GiB and "
                                        f"{slots} cache slots {slots * slot / 1024**3:.2f} GiB need "
                                        f"{(fixed + slots * slot) / 1024**3:.2f} GiB")
        plan = make_plan(*shape, slot_bytes, left, counts, tokens)
        return Residency(plan.hot, slots, f"--vram budget, {what}", vram, dense, kv, state, runtime,
                         plan.hot_bytes, slots * slot, expected_cold_rate=_cold_rate(plan.hot, profile))
    if hot_fraction is not None:
        plan = make_plan(*shape, slot_bytes, int(hot_fraction * all_bytes + 0.5), counts, tokens)
        return Residency(plan.hot, slots, f"--hot-fraction {hot_fraction:g}, {what}", hot_bytes=plan.hot_bytes,
                         cache_bytes=slots * slot, expected_cold_rate=_cold_rate(plan.hot, profile))
    if pack_hot is not None:
        hot = np.asarray(pack_hot, dtype=bool)
        return Residency(hot, slots, "the pack's placement", hot_bytes=_hot_bytes(hot, slot_bytes),
                         cache_bytes=slots * slot, expected_cold_rate=_cold_rate(hot, profile))
    hot = np.zeros(shape, dtype=bool)
    hot[list(slot_bytes)] = True
    return Residency(hot, 0, "all experts on the device", hot_bytes=all_bytes)


def _hot_bytes(hot: np.ndarray, slot_bytes: dict[int, int]) -> int:
    return sum(int(hot[il].sum()) * nb for il, nb in slot_bytes.items())


def _cold_rate(hot: np.ndarray, profile: Profile | None) -> float | None:
    if profile is None:
        return None
    c = profile.counts["generated"] if profile.counts["generated"].sum() > 0 else profile.counts["prompt"]
    total = float(c.sum())
    return float(c[~hot].sum()) / total if total else None


def identity_of(source) -> object:
    """The GGUF identity a profile must match: a pack carries its source GGUF's."""
    pack = getattr(source, "pack", None)
    return pack.identity if pack is not None else model_identity(source)
