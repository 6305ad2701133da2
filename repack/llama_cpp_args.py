"""llama.cpp arguments that keep as many expert layers on the GPU as a VRAM budget allows, for users
who run the same GGUF in llama.cpp.

How llama.cpp places tensors (read at commit 0c1e570, the copy in llama-cpp-python 0.3.36):
- ``-ngl N`` puts the last N repeating layers and, when N exceeds their count, the output layer on
  the GPU; the input layer (``token_embd``) always stays in host memory
  (``llama-model.cpp``: ``dev_input = cpu``). A model without ``output.weight`` gets a duplicate of
  ``token_embd`` as its output, on the output's device.
- ``-ot/--override-tensor PATTERN=BUFT,...`` (``common/arg.cpp``): the value is split at commas,
  each item at its first ``=``; BUFT must name a buffer type of a loaded device (``CPU``,
  ``CUDA0``, ...). When loading, every tensor name is tried against the patterns in order with
  ``std::regex_search`` (ECMAScript, unanchored) and the first match decides
  (``llama-model-loader.cpp``).
- ``--n-cpu-moe N`` adds, for every block index ``i < N``, the pattern
  ``blk\\.i\\.ffn_(up|down|gate|gate_up)_(ch|)exps`` to CPU (``common/common.h``: dense layers of
  those indices simply match nothing).
- KV cache (``llama-context.cpp``, ``llama-kv-cache*.cpp``): ``n_ctx`` is padded to a multiple of
  256; every attention layer holds K and V rows of ``n_head_kv x head_dim`` values for each
  cell (F16 by default, ``-ctk/-ctv`` change it); sliding-window layers hold
  ``pad(min(n_ctx, n_swa + n_ubatch), 256)`` cells (``n_ubatch`` 512, one sequence); recurrent
  (DeltaNet) layers hold one sequence's conv and SSM state in F32.

A budget is then: every GPU tensor (all but the input layer and the expert tensors sent to the
CPU) + the KV cache and recurrent state + a reserve for llama.cpp's compute buffers and the CUDA
context, which llama.cpp sizes only when it builds its graph (its own ``--fit`` keeps 1 GiB free
per device by default: ``--fit-target 1024``).

Which layers: every MoE layer serves exactly ``top-k`` routings per token whatever the traffic
(a profile's per-layer totals are all equal), so moving a whole layer's experts costs the same
share of routings for any layer, and the profile cannot prefer one layer over another. What a
choice can win is bytes: keep the most layers on the GPU, smallest expert tensors first (a
Q4_K_M file has larger Q6_K ``ffn_down_exps`` in some layers), and among equal sizes the later
layers, as ``--n-cpu-moe`` does. The profile gives the expected cold-hit rate of the choice, and
what the same expert bytes buy when single experts are placed (``spark-run``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from sparkpack.formats.archs import FULL, LINEAR, SLIDING, ModelSpec
from sparkpack.formats.memory import recurrent_state_bytes
from sparkpack.formats.placement import expert_scores, plan_greedy
from sparkpack.formats.profile import SIDES, Profile
from sparkpack.formats.quants import row_nbytes

EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"  # llama.cpp's LLM_FFN_EXPS_REGEX
CTX_PAD = 256
UBATCH = 512  # llama.cpp's default n_ubatch
INPUT_TENSORS = ("token_embd.weight",)  # input layer: kept in host memory
KV_TYPES = {"f16": 1, "q8_0": 8}  # -ctk/-ctv value -> GGML type id
DEFAULT_RESERVE = 1 << 30


def layer_pattern(layers: list[int]) -> str:
    """One regex matching the expert tensors of ``layers`` (block indices) and nothing else:
    the alternation is closed by ``\\.`` so ``blk.1`` never matches inside ``blk.12``. Plain
    ECMAScript that Python's ``re`` reads alike (no commas or ``=``, which ``-ot`` splits at)."""
    return r"blk\.(" + "|".join(str(il) for il in sorted(layers)) + r")" + EXPS_REGEX


def override_matches(value: str, names: list[str]) -> dict[str, str]:
    """Which buffer type an ``-ot`` value gives each tensor name, as llama.cpp applies it
    (split at commas and the first ``=``; first pattern that ``regex_search``es wins)."""
    rules = []
    for item in value.split(","):
        pattern, _, buft = item.partition("=")
        rules.append((re.compile(pattern), buft))
    out = {}
    for name in names:
        for rx, buft in rules:
            if rx.search(name):
                out[name] = buft
                break
    return out


def expert_tensors(names: list[str], moe_layers: list[int]) -> dict[int, list[str]]:
    """Per MoE layer, the tensors llama.cpp's expert pattern matches (the bytes an override moves)."""
    return {il: [n for n in names if re.search(layer_pattern([il]), n)] for il in moe_layers}


def kv_cache_bytes(spec: ModelSpec, ctx: int, kv_type: str = "f16") -> int:
    """K and V cache of llama.cpp at ``ctx`` (one sequence), plus recurrent state."""
    n_ctx = -(-ctx // CTX_PAD) * CTX_PAD
    n_swa = spec.sliding_window
    swa_cells = min(n_ctx, -(-(n_swa + UBATCH) // CTX_PAD) * CTX_PAD)
    qtype = KV_TYPES[kv_type]
    total = 0
    for il, kind in enumerate(spec.layers):
        if kind.attention in (FULL, SLIDING):
            cells = swa_cells if kind.attention == SLIDING and n_swa else n_ctx
            total += 2 * cells * row_nbytes(spec.n_head_kv[il] * spec.head_dim, qtype)
    if any(kind.attention == LINEAR for kind in spec.layers):
        total += recurrent_state_bytes(spec)  # F32 conv + SSM state per DeltaNet layer (n_embd_r, n_embd_s)
    return total


@dataclass
class LlamaCppPlan:
    vram: int
    reserve: int
    ctx: int
    kv_type: str
    gpu_weights: int  # every tensor on the GPU except the experts kept there
    kv: int
    expert_layer_bytes: dict[int, int]
    gpu_layers: list[int]  # MoE layers whose experts stay on the GPU
    cpu_layers: list[int]
    n_cpu_moe: int | None  # the --n-cpu-moe N that fits (None: not even N = all)
    n_cpu_moe_layers: list[int]
    cold_rate: dict[str, float] | None  # per side, from the profile: routings in CPU layers
    n_cpu_moe_cold_rate: dict[str, float] | None
    per_expert_cold_rate: dict[str, float] | None  # single experts placed in the same expert bytes

    @property
    def gpu_bytes(self) -> int:
        return self.gpu_weights + self.kv + sum(self.expert_layer_bytes[il] for il in self.gpu_layers)

    @property
    def pattern(self) -> str | None:
        return f"{layer_pattern(self.cpu_layers)}=CPU" if self.cpu_layers else None

    def args(self) -> list[str]:
        out = ["-ngl", "999", "-c", str(self.ctx)]
        if self.kv_type != "f16":
            out += ["-ctk", self.kv_type, "-ctv", self.kv_type]
        if self.pattern:
            out += ["-ot", self.pattern]
        return out


def plan_llama_cpp(tensors: dict[str, int], spec: ModelSpec, vram: int, ctx: int, kv_type: str = "f16",
                   reserve: int = DEFAULT_RESERVE, profile: Profile | None = None) -> LlamaCppPlan:
    """The expert layers to keep on the GPU under ``vram`` (``tensors``: name -> bytes)."""
    names = list(tensors)
    moe = list(spec.moe_layers)
    by_layer = expert_tensors(names, moe)
    layer_bytes = {il: sum(tensors[n] for n in by_layer[il]) for il in moe}
    expert_names = {n for ns in by_layer.values() for n in ns}
    # (llama.cpp loads an MTP head only to draft, --spec-type draft-mtp: not in these arguments' runs)
    skip = expert_names | set(INPUT_TENSORS) | spec.head_tensor_names()
    gpu_weights = sum(b for n, b in tensors.items() if n not in skip)
    if "output.weight" not in tensors:  # tied output: a copy of token_embd on the GPU
        gpu_weights += sum(tensors.get(n, 0) for n in INPUT_TENSORS)
    kv = kv_cache_bytes(spec, ctx, kv_type)
    left = vram - reserve - gpu_weights - kv
    order = sorted(moe, key=lambda il: (layer_bytes[il], -il))
    gpu: list[int] = []
    for il in order:
        if left >= layer_bytes[il]:
            gpu.append(il)
            left -= layer_bytes[il]
    cpu = sorted(set(moe) - set(gpu))
    n_cpu, prefix = None, []
    for n in range(spec.n_layer + 1):
        on_cpu = [il for il in moe if il < n]
        if sum(layer_bytes[il] for il in moe if il >= n) <= vram - reserve - gpu_weights - kv:
            n_cpu, prefix = n, on_cpu
            break
    return LlamaCppPlan(vram, reserve, ctx, kv_type, gpu_weights, kv, layer_bytes, sorted(gpu), cpu, n_cpu, prefix,
                        _cold(profile, cpu, moe), _cold(profile, prefix, moe) if n_cpu is not None else None,
                        _per_expert(profile, spec, layer_bytes, sorted(gpu)))


def _cold(profile: Profile | None, cpu: list[int], moe: list[int]) -> dict[str, float] | None:
    if profile is None:
        return None
    out = {}
    for side in SIDES:
        c = profile.counts[side]
        total = c[moe].sum()
        if total > 0:
            out[side] = float(c[cpu].sum() / total)
    return out


def _per_expert(profile: Profile | None, spec: ModelSpec, layer_bytes: dict[int, int],
                gpu: list[int]) -> dict[str, float] | None:
    """Cold-hit rate of the profile's single-expert placement in the bytes the GPU layers take."""
    if profile is None:
        return None
    c, t = profile.counts, profile.tokens
    per_expert = {il: b // spec.n_expert for il, b in layer_bytes.items()}
    hot = plan_greedy(expert_scores(c["prompt"], c["generated"], t["prompt"], t["generated"]), per_expert,
                      sum(layer_bytes[il] for il in gpu))
    out = {}
    for side in SIDES:
        total = c[side][list(layer_bytes)].sum()
        if total > 0:
            out[side] = float(np.where(hot, 0.0, c[side])[list(layer_bytes)].sum() / total)
    return out
