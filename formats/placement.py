"""Which experts go to the GPU (hot) under a byte budget, and the one VRAM plan around it. Pure:
numbers in, a plan out.

``plan_residency`` is what both ``repack split`` and the runtime's store (``runtime.models
.plan_store``) plan with: the dense weights, KV cache, state and runtime temporaries the runtime
will hold (``formats.memory``), then the cache slots, then hot experts in what is left; the store
then allocates exactly its ``pool_bytes``, and its two staging buffers for long prompts
(``staging_bytes``) where it will stage them. With a profile the choice is one greedy ranking
across all layers by expected hits per byte, not a fixed share per layer: a layer whose routing
is concentrated needs few hot experts, a flat one many. Hits are per-token routing rates, generated side weighted ``GEN_WEIGHT`` and prompt side
``1 - GEN_WEIGHT``: during decode every cold miss stalls a token, while prompt processing copies an
expert once for a whole batch, so decode traffic is what placement must serve first.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .archs import ModelSpec
from .errors import SparkpackError
from .experts import expert_tensor_names
from .memory import (MemoryTarget, dense_bytes, expert_slot_bytes, group_bytes, head_bytes, kv_cache_bytes,
                     recurrent_state_bytes, runtime_bytes)
from .profile import Profile
from .quants import KERNEL_QTYPES
from .units import fmt_size

GEN_WEIGHT = 0.8
# Re-placement hysteresis: a cold expert replaces hot ones only when it earns SWAP_MARGIN more
# hits than they do together (``plan_swaps``). The learned counts of an expert at the edge of a
# full-size model's hot set (~0.01 routings a token, ~2900 in the default memory of ~290k
# tokens) wobble by ~2% on stationary traffic: 10% is five of those, while a swap the traffic
# really asks for (a new repository, another language) moves scores by far more.
SWAP_MARGIN = 0.1


@dataclass
class Plan:
    hot: np.ndarray  # bool [n_layer, n_expert]; rows of non-MoE layers are all False
    expert_budget: int  # bytes allowed for hot experts
    hot_bytes: int
    uniform: bool  # True when chosen without a profile
    cold_hit_rate: dict[str, float]  # side -> share of routings that land on cold experts (profile only)

    @property
    def n_hot(self) -> int:
        return int(self.hot.sum())


def expert_scores(prompt: np.ndarray, generated: np.ndarray, prompt_tokens: float, generated_tokens: float,
                  gen_weight: float = GEN_WEIGHT) -> np.ndarray:
    """Expected hits per token of each expert, decode-weighted (see module docstring)."""
    def rate(c: np.ndarray, t: float) -> np.ndarray:
        return c / t if t > 0 else (c / c.sum() if c.sum() > 0 else np.zeros_like(c))

    return gen_weight * rate(generated, generated_tokens) + (1 - gen_weight) * rate(prompt, prompt_tokens)


def plan_greedy(scores: np.ndarray, expert_nbytes: dict[int, int], budget: int) -> np.ndarray:
    """Hot mask taking experts in decreasing hits-per-byte order while they fit in ``budget``.

    Ties break by (layer, expert) so a plan is reproducible.
    """
    hot = np.zeros(scores.shape, dtype=bool)
    cand = [(-scores[il, e] / nb, il, e, nb) for il, nb in expert_nbytes.items() for e in range(scores.shape[1])]
    cand.sort()
    used = 0
    for _, il, e, nb in cand:
        if used + nb <= budget:
            hot[il, e] = True
            used += nb
    return hot


@dataclass(frozen=True)
class Swaps:
    """Moves that bring a running hot set closer to what the learned scores ask for."""

    promote: list[tuple[int, int]]  # (layer, expert) cold -> hot
    demote: list[tuple[int, int]]  # (layer, expert) hot -> cold
    gain: float  # expected hits per token the moves add

    def __bool__(self) -> bool:
        return bool(self.promote or self.demote)


def plan_swaps(hot: np.ndarray, scores: np.ndarray, expert_nbytes: dict[int, int], budget: int,
               margin: float = SWAP_MARGIN, max_promote: int | None = None) -> Swaps:
    """Which experts to swap between the GPU and host memory, given the hot set now, the learned
    ``scores`` (expected hits per token, ``expert_scores``), per-layer expert sizes and the
    byte budget. Pure: the store applies the moves (between requests).

    Hot experts are first dropped, least hits per byte first, while the set is over ``budget``
    (the budget shrank). Then the cold experts are taken in decreasing hits per byte: one that
    fits in the free bytes is promoted if it earns anything; one that does not fit replaces the
    hot experts with the fewest hits per byte until it fits, and only if it earns more than
    ``(1 + margin)`` times their hits together. The first candidate that fails that test ends
    the search (with equal sizes no later, weaker candidate can pass).

    Why the margin: on stationary traffic the learned scores still wobble with sampling noise,
    and two experts of nearly equal use would trade places again and again, each time paying a
    copy for nothing. With the margin a swap needs a real difference, and undoing it needs the
    same difference the other way, which stationary traffic does not produce. What it can cost
    is bounded: a hot expert kept over a better cold one earns at least ``1 / (1 + margin)`` of
    what the cold one would. ``max_promote`` caps the copies of one call (the idle time
    between requests is finite); the strongest moves come first."""
    layers = sorted(expert_nbytes)
    nb = np.zeros(scores.shape[0], dtype=np.int64)
    nb[layers] = [expert_nbytes[il] for il in layers]
    hot = np.asarray(hot, dtype=bool).copy()
    is_moe = np.zeros(scores.shape, dtype=bool)
    is_moe[layers] = True
    density = np.where(is_moe, scores / np.maximum(nb, 1)[:, None], 0.0)
    used = int((hot * nb[:, None]).sum())

    def by_density(mask: np.ndarray, descending: bool) -> list[tuple[int, int]]:
        il, e = np.nonzero(mask)
        order = np.lexsort((e, il, -density[il, e] if descending else density[il, e]))
        return list(zip(il[order].tolist(), e[order].tolist()))

    demote: list[tuple[int, int]] = []
    victims = by_density(hot & is_moe, descending=False)  # weakest first
    while used > budget and victims:
        il, e = victims.pop(0)
        demote.append((il, e))
        used -= int(nb[il])
    promote: list[tuple[int, int]] = []
    gain = 0.0
    for il, e in by_density(~hot & is_moe, descending=True):
        if max_promote is not None and len(promote) >= max_promote:
            break
        if scores[il, e] <= 0:
            break
        need = used + int(nb[il]) - budget
        taken = []
        while need > 0 and len(taken) < len(victims):
            v = victims[len(taken)]
            taken.append(v)
            need -= int(nb[v[0]])
        if need > 0:
            continue  # cannot fit even with every hot expert gone (a larger layer's expert)
        lost = float(sum(scores[v] for v in taken))
        if taken and scores[il, e] <= (1.0 + margin) * lost:
            break
        del victims[: len(taken)]
        demote += taken
        promote.append((il, e))
        used += int(nb[il]) - sum(int(nb[v[0]]) for v in taken)
        gain += float(scores[il, e]) - lost
    return Swaps(promote, demote, gain)


def plan_swaps_in_place(hot: np.ndarray, scores: np.ndarray, slot_units: dict[int, int], margin: float = SWAP_MARGIN,
                        max_promote: int | None = None, across_layers: bool = True) -> Swaps:
    """``plan_swaps`` for a running store, whose device pool cannot be laid out again: an
    expert is promoted only into the slot a demoted expert of the same slot size frees
    (``slot_units``: MoE layer -> units one of its experts takes in the pool), so the pool, and
    the byte budget it was planned for, stay exactly as they are. Experts of one size trade
    places among themselves, across layers (Q4_K_M files hold two sizes: layers whose
    ``ffn_down`` is Q6_K and the rest); the budget does not move between sizes.
    ``across_layers`` False: only within a layer (a store that stages long calls copies each
    layer's cold experts as one host-pool range, which a swap across layers would break:
    ``runtime.expert_staging``).

    ``promote[i]`` takes the slot of ``demote[i]``; the strongest moves of all sizes come first,
    so a capped call (``max_promote``) makes the moves an uncapped one would start with."""
    moves: list[tuple[float, tuple[int, int], tuple[int, int], float]] = []
    groups = [(u, [il for il, v in slot_units.items() if v == u]) for u in sorted(set(slot_units.values()))]
    if not across_layers:
        groups = [(u, [il]) for u, layers in groups for il in layers]
    for size, layers in groups:
        mine = np.zeros_like(hot, dtype=bool)
        mine[layers] = np.asarray(hot, dtype=bool)[layers]
        held = int(mine.sum()) * size
        s = plan_swaps(mine, scores, {il: size for il in layers}, held, margin, max_promote)
        # equal sizes and a full budget: every promotion took exactly one slot (plan_swaps)
        assert len(s.promote) == len(s.demote)
        for p, d in zip(s.promote, s.demote):
            moves.append((-float(scores[p]) / size, p, d, float(scores[p] - scores[d])))
    moves.sort()
    moves = moves[:max_promote] if max_promote is not None else moves
    return Swaps([p for _, p, _, _ in moves], [d for _, _, d, _ in moves], sum(g for *_, g in moves))


def plan_uniform(shape: tuple[int, int], expert_nbytes: dict[int, int], budget: int) -> np.ndarray:
    """Without routing data: the same number of experts in every MoE layer (the first k)."""
    hot = np.zeros(shape, dtype=bool)
    per_k = sum(expert_nbytes.values())
    k = min(shape[1], budget // per_k) if per_k else 0
    for il in expert_nbytes:
        hot[il, :k] = True
    return hot


def cold_hit_rates(hot: np.ndarray, counts: dict[str, np.ndarray]) -> dict[str, float]:
    """Share of each side's routings that would need a cold expert."""
    out = {}
    for side, c in counts.items():
        total = float(c.sum())
        out[side] = float(c[~hot].sum()) / total if total > 0 else 0.0
    return out


def make_plan(n_layer: int, n_expert: int, expert_nbytes: dict[int, int], budget: int,
              profile_counts: dict[str, np.ndarray] | None = None,
              profile_tokens: dict[str, float] | None = None, gen_weight: float = GEN_WEIGHT) -> Plan:
    """The plan for ``budget`` bytes of hot experts; greedy when counts are given, else uniform."""
    shape = (n_layer, n_expert)
    budget = max(0, int(budget))
    if profile_counts is None:
        hot = plan_uniform(shape, expert_nbytes, budget)
        rates: dict[str, float] = {}
    else:
        tokens = profile_tokens or {}
        scores = expert_scores(profile_counts["prompt"], profile_counts["generated"],
                               tokens.get("prompt", 0.0), tokens.get("generated", 0.0), gen_weight)
        hot = plan_greedy(scores, expert_nbytes, budget)
        rates = cold_hit_rates(hot, profile_counts)
    hot_bytes = sum(int(hot[il].sum()) * nb for il, nb in expert_nbytes.items())
    return Plan(hot, budget, hot_bytes, profile_counts is None, rates)


def default_cache_slots(spec: ModelSpec) -> int:
    """Half of one token's routings over all MoE layers (shared by all layers): on held-out
    traffic a calibrated hot set still misses a few experts per layer per token, and those
    repeat across tokens, so the cache must hold several tokens' misses (BENCHMARKS.md)."""
    return max(4 * spec.n_expert_used, len(spec.moe_layers) * spec.n_expert_used // 2)


@dataclass(frozen=True)
class Budget:
    """What the user asked to fit: ``vram`` (size everything to it) or ``hot_fraction`` (that share
    of the expert bytes hot), and ``cache_slots`` (None: ``default_cache_slots``)."""

    vram: int | None = None
    hot_fraction: float | None = None
    cache_slots: int | None = None


@dataclass
class ResidencyPlan:
    """Which experts start on the GPU and how many cache slots there are, with where a ``--vram``
    budget goes: what ``repack split`` writes into a pack and the store allocates (its device
    pool is ``pool_bytes``: each hot expert at its layer's slot size, each cache slot at the
    largest)."""

    hot: np.ndarray  # bool [n_layer, n_expert]
    cache_slots: int
    source: str  # where the hot set came from, for the user
    slot_bytes: dict[int, int]  # MoE layer -> device bytes of one of its experts
    vram: int | None = None
    dense_bytes: int = 0
    head_bytes: int = 0  # the MTP head, when the run loads it (formats.memory.head_bytes)
    kv_bytes: int = 0
    state_bytes: int = 0
    overhead_bytes: int = 0  # the runtime's: fixed overhead and prefill temporaries
    staging_bytes: int = 0  # the store's two staging buffers for long prompts (0: it does not stage)
    expert_budget: int | None = None  # bytes a budget left for hot experts
    hot_bytes: int = 0
    cold_hit_rate: dict[str, float] = field(default_factory=dict)  # side -> share of routings on cold experts
    expected_cold_rate: float | None = None  # of decode-side routings (prompt-side without them)
    uniform: bool = True  # placed without a profile

    @property
    def cache_slot_bytes(self) -> int:
        return max(self.slot_bytes.values(), default=0)

    @property
    def cache_bytes(self) -> int:
        return self.cache_slots * self.cache_slot_bytes

    @property
    def pool_bytes(self) -> int:
        return self.hot_bytes + self.cache_bytes

    def as_json(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("hot", "slot_bytes")}
        return {**d, "hot_experts": int(self.hot.sum()), "cache_slot_bytes": self.cache_slot_bytes,
                "cache_bytes": self.cache_bytes, "pool_bytes": self.pool_bytes}


def plan_residency(spec: ModelSpec, tensors: dict, budget: Budget, target: MemoryTarget, *,
                   profile: Profile | None = None, profile_name: str | None = None,
                   pack_hot: np.ndarray | None = None, where: object = None,
                   gen_weight: float = GEN_WEIGHT) -> ResidencyPlan:
    """The hot set and cache slots for a model (``tensors``: its tensor index) run as ``target``.
    Precedence: ``budget.vram`` (size everything to fit; a budget that cannot hold the rest is
    one error naming what needs what), then ``budget.hot_fraction``, then the pack's own
    placement ``pack_hot``, then all hot (a GGUF with no budget runs all-GPU). Cache slots are
    as many as asked but never more than there are cold experts, as the store allocates them.
    ``gen_weight``: the weight of generated-side routings in a profile's scores (``expert_scores``)."""
    shape = (spec.n_layer, spec.n_expert)
    sizes = expert_slot_bytes(spec, tensors)
    slot = max(sizes.values(), default=0)
    slots = default_cache_slots(spec) if budget.cache_slots is None else int(budget.cache_slots)
    counts = profile.counts if profile is not None else None
    tokens = profile.tokens if profile is not None else None
    what = f"profile {os.path.basename(profile_name)}" if profile_name else "uniform placement (no profile)"

    stages = target.staged_chunk > 0 and all(int(tensors[n].qtype) in KERNEL_QTYPES
                                             for il in sizes for n in spec.expert_tensors[il].values())

    def done(hot: np.ndarray, source: str, stage: bool = True, **kw) -> ResidencyPlan:
        n_cold = sum(int((~hot[il]).sum()) for il in sizes)
        hot_bytes = sum(int(hot[il].sum()) * nb for il, nb in sizes.items())
        return ResidencyPlan(hot, min(slots, n_cold), source, sizes, hot_bytes=hot_bytes,
                             staging_bytes=staging_bytes(hot, sizes, target.host_bytes) if stage and stages else 0,
                             cold_hit_rate=cold_hit_rates(hot, counts) if counts is not None else {},
                             expected_cold_rate=_expected_cold_rate(hot, profile), uniform=profile is None, **kw)

    if budget.vram is not None:
        dense = dense_bytes(tensors, expert_tensor_names(spec) | spec.head_tensor_names(), target)
        head = head_bytes(spec, tensors, target)
        kv = kv_cache_bytes(spec, target.ctx, target.kv_bytes_per_value, target.prefill_chunk)
        state = recurrent_state_bytes(spec) * (1 + target.draft_tokens)  # (a drafting session's row copies)
        runtime = runtime_bytes(spec, target.ctx, target.prefill_chunk)
        fixed = dense + head + kv + state + runtime + slots * slot
        if budget.vram < fixed:
            with_head = f", the MTP head {fmt_size(head)}" if head else ""
            raise SparkpackError(where, f"VRAM budget {fmt_size(budget.vram)} is too small: non-expert weights "
                                        f"{fmt_size(dense)}{with_head}, KV cache {fmt_size(kv)} at ctx {target.ctx}, recurrent "
                                        f"state {fmt_size(state)}, runtime (prefill chunks of {target.prefill_chunk}) "
                                        f"{fmt_size(runtime)} and {slots} cache slots {fmt_size(slots * slot)} need "
                                        f"{fmt_size(fixed)}")
        left = budget.vram - fixed
        hot = make_plan(*shape, sizes, left, counts, tokens, gen_weight).hot
        # (staged calls are prefill_chunk calls: their temporaries are in ``runtime`` already;
        # a group of them holds its residual rows too)
        rows = group_bytes(spec, target.ctx, target.prefill_chunk, target.dtype_bytes)
        staged = _staged_plan(hot, lambda b: make_plan(*shape, sizes, b, counts, tokens, gen_weight).hot, left, sizes,
                              target.host_bytes, rows) if stages else None
        if staged is not None:
            hot, left = staged
            runtime += rows
        return done(hot, f"--vram budget, {what}", stage=staged is not None, vram=budget.vram, dense_bytes=dense,
                    head_bytes=head, kv_bytes=kv, state_bytes=state, overhead_bytes=runtime, expert_budget=left)
    if budget.hot_fraction is not None:
        left = int(budget.hot_fraction * sum(sizes.values()) * spec.n_expert + 0.5)
        plan = make_plan(*shape, sizes, left, counts, tokens, gen_weight)
        return done(plan.hot, f"--hot-fraction {budget.hot_fraction:g}, {what}", expert_budget=left)
    if pack_hot is not None:
        return done(np.asarray(pack_hot, dtype=bool), "the pack's placement")
    hot = np.zeros(shape, dtype=bool)
    hot[list(sizes)] = True
    return done(hot, "all experts on the device")


def staging_bytes(hot: np.ndarray, sizes: dict[int, int], host_bytes: int | None = None) -> int:
    """The store's two staging buffers (``runtime.expert_staging``) for hot set ``hot``: each the
    largest layer's cold experts, laid out as the host pool lays them (``sizes``: device bytes of
    one expert per MoE layer). 0 when nothing is cold or the cold experts do not fit in
    ``host_bytes`` of pinned host memory (the disk tier stages nothing)."""
    cold = {il: int((~hot[il]).sum()) * nb for il, nb in sizes.items()}
    total = sum(cold.values())
    if not total or (host_bytes is not None and total > host_bytes):
        return 0
    return 2 * max(cold.values())


def _staged_plan(hot: np.ndarray, plan: Callable[[int], np.ndarray], left: int, sizes: dict[int, int],
                 host_bytes: int | None, rows: int = 0, rounds: int = 16) -> tuple[np.ndarray, int] | None:
    """A hot set that leaves room for staging: ``(hot, bytes left for hot experts)``, or None when
    the store will not stage: nothing cold, cold experts beyond the host RAM, or buffers that do
    not fit (long prompts are then read zero-copy). ``plan(budget)`` is the hot set for a budget;
    ``host_bytes`` the pinned host memory for cold experts; ``rows`` what a group of staged calls
    holds besides the buffers (``formats.memory.group_bytes``), reserved with them.

    The buffers' size depends on the hot set (the largest layer's cold experts), which depends
    on what the buffers leave: plan, reserve what that hot set needs, plan again within the
    rest, until a plan fits in what was reserved before it. The reserve only grows and is
    bounded by the all-cold need; after ``rounds`` the bound is reserved."""
    reserve = 0
    for _ in range(rounds):
        need = staging_bytes(hot, sizes, host_bytes)
        if not need:
            return None
        if need + rows <= reserve:
            return hot, left - reserve
        reserve = need + rows
        if reserve > left:
            return None
        hot = plan(left - reserve)
    reserve = 2 * max(sizes.values()) * hot.shape[1] + rows
    if reserve > left:
        return None
    hot = plan(left - reserve)
    return (hot, left - reserve) if staging_bytes(hot, sizes, host_bytes) else None


def _expected_cold_rate(hot: np.ndarray, profile: Profile | None) -> float | None:
    """Share of the profile's decode-side routings (prompt-side when it has none) on cold experts."""
    if profile is None:
        return None
    side = "generated" if profile.counts["generated"].sum() > 0 else "prompt"
    return cold_hit_rates(hot, {side: profile.counts[side]})[side] if profile.counts[side].sum() > 0 else None
