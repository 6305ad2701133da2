"""``repack split``: GGUF -> ``.sparkpack`` with the hot experts chosen under a VRAM budget."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from sparkpack.formats.archs import model_spec
from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.memory import MemoryTarget
from sparkpack.formats.placement import Budget, ResidencyPlan, plan_residency
from sparkpack.formats.units import SIZE, fmt_size

from .outputs import check_output, reported_as

DEFAULT_HOT_FRACTION = 0.5


def print_plan(plan: ResidencyPlan, n_experts: int, profile_name: str | None, found: bool = False) -> None:
    echo = lambda s="": click.echo(s, err=True)  # noqa: E731 - stdout stays clean for scripts
    if plan.uniform:
        echo("no profile: placing experts uniformly (the same number per layer, arbitrary experts); "
             "run `repack calibrate` for a placement that follows your traffic")
    else:
        echo(f"placement from profile {profile_name}" + (" (found beside the model)" if found else "")
             + ": experts ranked by expected hits per byte, decode-weighted")
    n_hot = int(plan.hot.sum())
    echo(f"  hot experts     {n_hot} of {n_experts} ({n_hot / max(n_experts, 1):.1%}), {fmt_size(plan.hot_bytes)}")
    if plan.vram is not None:
        used = plan.dense_bytes + plan.kv_bytes + plan.state_bytes + plan.overhead_bytes + plan.pool_bytes \
            + plan.staging_bytes
        echo(f"  VRAM budget     {fmt_size(plan.vram)}, planned {fmt_size(used)}:")
        echo(f"    non-expert weights {fmt_size(plan.dense_bytes)}")
        echo(f"    hot experts        {fmt_size(plan.hot_bytes)}")
        echo(f"    KV cache           {fmt_size(plan.kv_bytes)}")
        if plan.state_bytes:
            echo(f"    recurrent state    {fmt_size(plan.state_bytes)}")
        echo(f"    cache slots        {plan.cache_slots} x {fmt_size(plan.cache_slot_bytes)}")
        echo(f"    runtime overhead   {fmt_size(plan.overhead_bytes)}")
        if plan.staging_bytes:
            echo(f"    prompt staging     2 x {fmt_size(plan.staging_bytes // 2)}")
    else:
        echo(f"  expert budget   {fmt_size(plan.expert_budget or 0)} (hot fraction; VRAM not checked)")
    if plan.cold_hit_rate:
        echo(f"  expected cold-hit rate  generated {plan.cold_hit_rate['generated']:.1%}, "
             f"prompt {plan.cold_hit_rate['prompt']:.1%} of routings")


def budget_json(plan: ResidencyPlan) -> dict[str, Any]:
    """Where the VRAM goes, as the pack's manifest records it; ``experts`` is what was left for
    hot experts."""
    return {"vram": plan.vram, "non_expert": plan.dense_bytes, "kv_cache": plan.kv_bytes,
            "recurrent_state": plan.state_bytes, "cache_slots": plan.cache_slots,
            "cache_slot_bytes": plan.cache_slot_bytes, "runtime": plan.overhead_bytes, "staging": plan.staging_bytes,
            "experts": plan.expert_budget}


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
@click.option("--cache-slots", type=click.IntRange(0), help="VRAM slots for streamed experts [max(4 x top-k, half of one token's routings over all MoE layers)].")
@click.option("--compress", is_flag=True, help="zstd-compress cold shards (decompressed on load).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists (the old pack stays until the new one is done).")
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Output directory (default MODEL.sparkpack).")
def split_cmd(model_path: Path, profile_path: Path | None, vram: int | None, hot_fraction: float | None, ctx: int,
              cache_slots: int | None, compress: bool, force: bool, output: Path | None) -> None:
    """Rewrite a GGUF as a hot shard plus per-expert cold shards (a .sparkpack directory).

    Experts are placed with --profile, else with MODEL.profile.json beside the model when it
    belongs to this model (`repack calibrate` writes it there), else uniformly."""
    from sparkpack.formats.pack_writer import check_packable, write_pack
    from sparkpack.formats.profile import choose_profile, model_identity

    if vram is not None and hot_fraction is not None:
        raise SparkpackError(None, "give either --vram or --hot-fraction, not both")
    out = output or model_path.with_name(model_path.stem + ".sparkpack")
    check_output(out, force)  # (first clears a killed split's temporary or moved-aside pack)
    model = GGUFModel(model_path)
    spec = model_spec(model)
    check_packable(model, spec)  # before the plan is printed: nothing is said about a file we refuse
    choice = choose_profile(profile_path, model_path, model_identity(model), spec)
    if choice.warning:
        click.echo(f"warning: {choice.warning}", err=True)
    profile = choice.profile
    # what spark-run on a GPU will hold at this context (bf16, its default prefill calls)
    budget = Budget(vram, None if vram is not None else DEFAULT_HOT_FRACTION if hot_fraction is None else hot_fraction,
                    cache_slots)
    plan = plan_residency(spec, model.tensors, budget, MemoryTarget.gpu(spec, ctx), profile=profile,
                          profile_name=str(choice.path) if profile else None, where=model.path)
    print_plan(plan, len(spec.moe_layers) * spec.n_expert, str(choice.path) if profile else None,
               found=profile is not None and profile_path is None)
    info = {"uniform": plan.uniform, "profile": choice.path.name if choice.path else None,
            "budget": budget_json(plan), "ctx": ctx, "hot_bytes": plan.hot_bytes,
            "expected_cold_hit_rate": plan.cold_hit_rate}
    total = sum(t.nbytes for t in model.tensors.values())
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="split", file=sys.stderr,
              disable=None) as bar, reported_as(out):
        write_pack(model, spec, out, plan.hot, compress=compress, force=force, plan_info=info, progress=bar.update)
    if compress:
        click.echo(compression_line(out), err=True)
    click.echo(f"wrote {out}")
