"""``repack split``: GGUF -> ``.sparkpack`` with the hot experts chosen under a VRAM budget."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from sparkpack.formats.archs import ModelSpec, model_spec
from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.experts import expert_nbytes, expert_tensor_names
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.memory import kv_cache_bytes, recurrent_state_bytes, runtime_bytes

from sparkpack.formats.placement import Plan, default_cache_slots, make_plan
from sparkpack.formats.units import SIZE, fmt_size

from .outputs import check_output, reported_as

DEFAULT_HOT_FRACTION = 0.5


@dataclass
class Budget:
    """Where the VRAM goes; ``experts`` is what is left for hot experts."""

    vram: int | None
    non_expert: int
    kv_cache: int
    recurrent_state: int
    cache_slots: int
    cache_slot_bytes: int
    runtime: int
    experts: int

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def compute_budget(model: GGUFModel, spec: ModelSpec, vram: int | None, hot_fraction: float | None, ctx: int,
                   cache_slots: int) -> Budget:
    experts = expert_tensor_names(spec)
    per_expert = {il: expert_nbytes(model, spec, il) for il in spec.moe_layers}
    non_expert = sum(t.nbytes for t in model.tensors.values() if t.name not in experts)
    kv, state, runtime = kv_cache_bytes(spec, ctx), recurrent_state_bytes(spec), runtime_bytes(spec, ctx)
    slot = max(per_expert.values(), default=0)
    fixed = non_expert + kv + state + cache_slots * slot + runtime
    if vram is not None:
        if vram < fixed:
            raise SparkpackError(model.path, f"VRAM budget {fmt_size(vram)} is too small: non-expert weights "
                                             f"{fmt_size(non_expert)}, KV cache {fmt_size(kv)}, recurrent state "
                                             f"{fmt_size(state)}, {cache_slots} cache slots {fmt_size(cache_slots * slot)} "
                                             f"and runtime (prefill included) {fmt_size(runtime)} need {fmt_size(fixed)}")
        left = vram - fixed
    else:
        frac = DEFAULT_HOT_FRACTION if hot_fraction is None else hot_fraction
        left = int(frac * sum(per_expert.values()) * spec.n_expert + 0.5)
    return Budget(vram, non_expert, kv, state, cache_slots, slot, runtime, left)


def print_plan(plan: Plan, budget: Budget, n_experts: int, profile_name: str | None, found: bool = False) -> None:
    echo = lambda s="": click.echo(s, err=True)  # noqa: E731 - stdout stays clean for scripts
    if plan.uniform:
        echo("no profile: placing experts uniformly (the same number per layer, arbitrary experts); "
             "run `repack calibrate` for a placement that follows your traffic")
    else:
        echo(f"placement from profile {profile_name}" + (" (found beside the model)" if found else "")
             + ": experts ranked by expected hits per byte, decode-weighted")
    echo(f"  hot experts     {plan.n_hot} of {n_experts} ({plan.n_hot / max(n_experts, 1):.1%}), "
         f"{fmt_size(plan.hot_bytes)}")
    if budget.vram is not None:
        used = (budget.non_expert + budget.kv_cache + budget.recurrent_state + budget.cache_slots * budget.cache_slot_bytes
                + budget.runtime + plan.hot_bytes)
        echo(f"  VRAM budget     {fmt_size(budget.vram)}, planned {fmt_size(used)}:")
        echo(f"    non-expert weights {fmt_size(budget.non_expert)}")
        echo(f"    hot experts        {fmt_size(plan.hot_bytes)}")
        echo(f"    KV cache           {fmt_size(budget.kv_cache)}")
        if budget.recurrent_state:
            echo(f"    recurrent state    {fmt_size(budget.recurrent_state)}")
        echo(f"    cache slots        {budget.cache_slots} x {fmt_size(budget.cache_slot_bytes)}")
        echo(f"    runtime overhead   {fmt_size(budget.runtime)}")
    else:
        echo(f"  expert budget   {fmt_size(budget.experts)} (hot fraction; VRAM not checked)")
    if plan.cold_hit_rate:
        echo(f"  expected cold-hit rate  generated {plan.cold_hit_rate['generated']:.1%}, "
             f"prompt {plan.cold_hit_rate['prompt']:.1%} of routings")


def compression_line(pack_path: Path) -> str:
    """What ``--compress`` did, in words: random or already dense weights do not shrink, and
    a user who asked for compression should hear that it bought nothing."""
    from sparkpack.formats.sparkpack import Pack

    cold = [r for r in Pack.open(pack_path).records.values() if not r.hot]
    raw, stored = sum(r.nbytes for r in cold), sum(r.stored_nbytes for r in cold)
    if not cold:
        return "zstd: nothing to compress (every expert is hot)"
    if stored >= raw:
        return (f"zstd saved nothing: cold shards are {fmt_size(stored)} compressed against {fmt_size(raw)} raw "
                "(these weights do not compress; split without --compress)")
    return f"zstd: cold shards {fmt_size(stored)}, {stored / raw:.1%} of {fmt_size(raw)} raw"


@click.command("split")
@click.argument("model_path", metavar="MODEL.gguf", type=click.Path(path_type=Path))
@click.option("--profile", "profile_path", type=click.Path(path_type=Path),
              help="Routing profile (repack calibrate) [MODEL.profile.json when it belongs to MODEL].")
@click.option("--vram", type=SIZE, help="GPU memory to plan for, e.g. 14GiB.")
@click.option("--hot-fraction", type=click.FloatRange(0.0, 1.0), help="Share of expert bytes to keep hot "
              f"(instead of --vram; default {DEFAULT_HOT_FRACTION} when neither is given).")
@click.option("--ctx", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Context length the KV cache is sized for.")
@click.option("--cache-slots", type=click.IntRange(0), help="VRAM slots for streamed experts (default 2 x top-k).")
@click.option("--compress", is_flag=True, help="zstd-compress cold shards (decompressed on load).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists (the old pack stays until the new one is done).")
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Output directory (default MODEL.sparkpack).")
def split_cmd(model_path: Path, profile_path: Path | None, vram: int | None, hot_fraction: float | None, ctx: int,
              cache_slots: int | None, compress: bool, force: bool, output: Path | None) -> None:
    """Rewrite a GGUF as a hot shard plus per-expert cold shards (a .sparkpack directory).

    Experts are placed with --profile, else with MODEL.profile.json beside the model when it
    belongs to this model (`repack calibrate` writes it there), else uniformly."""
    from sparkpack.formats.pack_writer import write_pack
    from sparkpack.formats.profile import choose_profile, model_identity

    if vram is not None and hot_fraction is not None:
        raise SparkpackError(None, "give either --vram or --hot-fraction, not both")
    out = output or model_path.with_name(model_path.stem + ".sparkpack")
    check_output(out, force)
    model = GGUFModel(model_path)
    spec = model_spec(model)
    choice = choose_profile(profile_path, model_path, model_identity(model), spec)
    if choice.warning:
        click.echo(f"warning: {choice.warning}", err=True)
    profile = choice.profile
    slots = default_cache_slots(spec) if cache_slots is None else cache_slots
    budget = compute_budget(model, spec, vram, hot_fraction, ctx, slots)
    per_expert = {il: expert_nbytes(model, spec, il) for il in spec.moe_layers}
    plan = make_plan(spec.n_layer, spec.n_expert, per_expert, budget.experts,
                     profile.counts if profile else None, profile.tokens if profile else None)
    print_plan(plan, budget, len(spec.moe_layers) * spec.n_expert, str(choice.path) if profile else None,
               found=profile is not None and profile_path is None)
    info = {"uniform": plan.uniform, "profile": choice.path.name if choice.path else None,
            "budget": budget.as_json(), "ctx": ctx, "hot_bytes": plan.hot_bytes,
            "expected_cold_hit_rate": plan.cold_hit_rate}
    total = sum(t.nbytes for t in model.tensors.values())
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="split", file=sys.stderr,
              disable=None) as bar, reported_as(out):
        write_pack(model, spec, out, plan.hot, compress=compress, force=force, plan_info=info, progress=bar.update)
    if compress:
        click.echo(compression_line(out), err=True)
    click.echo(f"wrote {out}")
