"""``repack report``: see what a profile learned and what a hot set makes of it, as one HTML page
(or JSON for scripts)."""
from __future__ import annotations

import json
from pathlib import Path

import click
import numpy as np

from sparkpack.formats.archs import model_spec
from sparkpack.formats.atomic_file import write_atomic
from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.experts import expert_nbytes
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.placement import default_cache_slots, make_plan
from sparkpack.formats.profile import Profile, default_profile_path, model_identity
from sparkpack.formats.sparkpack import Pack, is_pack
from sparkpack.formats.units import SIZE

from .outputs import check_output, reported_as
from .report_data import Report, hit_timeline


@click.command("report")
@click.argument("path", metavar="MODEL|PACK|PROFILE", type=click.Path(path_type=Path))
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Profile to show [MODEL.profile.json beside the model or pack].")
@click.option("--vram", type=SIZE, help="Overlay the hot set repack split would plan for this budget (needs the GGUF).")
@click.option("--hot-fraction", type=click.FloatRange(0.0, 1.0), help="Overlay the hot set for this share of expert bytes.")
@click.option("--ctx", default=4096, show_default=True, help="With --vram: context the KV cache is planned for.")
@click.option("--cache-slots", type=click.IntRange(0), help="With --vram: cache slots planned for [the runtime's default].")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False, path_type=Path),
              help="A routing trace (repack calibrate --trace) to draw the hot set's hit rate over time.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="HTML file to write [NAME.report.html beside the input].")
@click.option("--force", is_flag=True, help="Replace the HTML file if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the numbers as JSON instead of writing the page.")
def report_cmd(path: Path, profile_path: Path | None, vram: int | None, hot_fraction: float | None, ctx: int,
               cache_slots: int | None, trace_path: Path | None, output: Path | None, force: bool,
               as_json: bool) -> None:
    """Routing heatmap, hot set, coverage curve and prompt/generated skew of a profile.

    \b
    repack report model.gguf                       # model.profile.json -> model.report.html
    repack report model.sparkpack                  # the pack's hot set over the profile beside it
    repack report model.gguf --vram 14GiB --trace held.trace -o report.html
    repack report model.profile.json --json
    """
    if vram is not None and hot_fraction is not None:
        raise SparkpackError(None, "give either --vram or --hot-fraction, not both")
    report = load_report(path, profile_path, vram, hot_fraction, ctx, cache_slots)
    note = ""
    if trace_path is not None:
        note = add_timeline(report, trace_path)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=1))
        return
    out = output or path.with_name(path.name.removesuffix(".json").removesuffix(".profile").removesuffix(".gguf")
                                   .removesuffix(".sparkpack") + ".report.html")
    check_output(out, force)  # before the figures are drawn
    from .report_page import render

    html, _ = render(report, note)
    with reported_as(out):
        write_atomic(out, html)
    click.echo(f"wrote {out}")


def load_report(path: Path, profile_path: Path | None, vram: int | None, hot_fraction: float | None, ctx: int,
                cache_slots: int | None) -> Report:
    """Profile, expert sizes and hot set from a GGUF, a pack or a profile file."""
    if not path.exists():
        raise SparkpackError(path, "no such model, pack or profile")
    if is_pack(path):
        pack = Pack.open(path)
        prof = _profile_for(path, profile_path)
        if prof.identity != pack.identity or (prof.n_layer, prof.n_expert) != (pack.n_layer, pack.n_expert):
            raise SparkpackError(profile_path or default_profile_path(path),
                                 f"profile is for another model ({prof.identity.short()}), not this pack's "
                                 f"({pack.identity.short()})")
        if vram is not None:
            raise SparkpackError(path, "--vram needs the GGUF (a pack's budget was planned when it was split); "
                                       "use --hot-fraction, or report on the GGUF")
        nbytes = {il: int(pack.records[(il, 0)].nbytes) for il in sorted(pack.parts)}
        hot, source = pack.hot.copy(), "the pack's placement"
        return _with_fraction(Report(path.name, prof, sorted(pack.parts), nbytes, True, hot, source), hot_fraction)
    if path.suffix == ".json":
        prof = Profile.load(path)
        if vram is not None:
            raise SparkpackError(path, "--vram needs the model (report on the GGUF with --profile)")
        moe = prof.moe_layers
        return _with_fraction(Report(path.name, prof, moe, {il: 1 for il in moe}, False, None, None), hot_fraction)
    gguf = GGUFModel(path)
    spec = model_spec(gguf)
    prof = _profile_for(path, profile_path)
    prof.check_model(model_identity(gguf), spec, profile_path or default_profile_path(path))
    nbytes = {il: expert_nbytes(gguf, spec, il) for il in spec.moe_layers}
    report = Report(path.name, prof, list(spec.moe_layers), nbytes, True, None, None)
    if vram is not None:
        from .split_cmd import compute_budget

        slots = default_cache_slots(spec) if cache_slots is None else cache_slots
        budget = compute_budget(gguf, spec, vram, None, ctx, slots)
        plan = make_plan(spec.n_layer, spec.n_expert, nbytes, budget.experts, prof.counts, prof.tokens)
        report.hot, report.hot_source = plan.hot, f"repack split's plan for --vram {vram / 1024**3:.3g}GiB at ctx {ctx}"
    return _with_fraction(report, hot_fraction)


def _profile_for(path: Path, profile_path: Path | None) -> Profile:
    where = profile_path or default_profile_path(path)
    if not where.exists():
        raise SparkpackError(where, "no such profile (learn one with repack calibrate or spark-run, or give --profile)")
    return Profile.load(where)


def _with_fraction(report: Report, hot_fraction: float | None) -> Report:
    if hot_fraction is not None:
        p = report.profile
        total = sum(report.nbytes.values()) * p.n_expert
        plan = make_plan(p.n_layer, p.n_expert, report.nbytes, int(hot_fraction * total + 0.5), p.counts, p.tokens)
        report.hot, report.hot_source = plan.hot, f"the profile's plan for --hot-fraction {hot_fraction:g}"
    return report


def add_timeline(report: Report, trace_path: Path) -> str:
    from sparkpack.calibrate.trace import read_trace

    if report.hot is None:
        raise SparkpackError(trace_path, "a hit rate over time needs a hot set: report on a pack, or give --vram or "
                                         "--hot-fraction")
    tr = read_trace(trace_path)
    if tr.meta.get("identity") != report.profile.identity.to_json():
        raise SparkpackError(trace_path, "trace was recorded on another model")
    if tr.moe_layers != report.moe_layers or tr.n_expert != report.profile.n_expert:
        raise SparkpackError(trace_path, "trace does not match the model's MoE layers or expert count")
    if tr.n_tokens == 0:
        raise SparkpackError(trace_path, "trace holds no tokens")
    report.timeline = hit_timeline(np.asarray(tr.ids), np.asarray(tr.generated), report.hot[report.moe_layers])
    return f"Trace {trace_path.name}: {tr.n_tokens} tokens ({int(np.asarray(tr.generated).sum())} generated-side)."
