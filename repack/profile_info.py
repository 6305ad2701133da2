"""What ``repack inspect`` shows for a routing profile: whose it is, what it saw, and what placing
experts by it would buy.

Coverage is the share of routings that the hot set ``repack split`` would pick (the same greedy,
decode-weighted ranking) serves at 20-80% of experts hot, taking every expert as the same size:
the profile alone does not know the model's byte sizes, and within a model they differ little.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from sparkpack.calibrate.evaluate import FRACTIONS, top_share, too_few_tokens
from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.placement import make_plan
from sparkpack.formats.profile import PROFILE_VERSION, SIDES, Profile, model_identity
from sparkpack.formats.units import fmt_size

PROFILE_SUFFIX = ".profile.json"


def is_profile_file(path: Path) -> bool:
    """A JSON object, not a GGUF (which starts with its magic): the cheap test before loading."""
    with open(path, "rb") as f:
        return f.read(64).lstrip()[:1] == b"{"


def model_beside(path: Path) -> Path | None:
    """``m.gguf`` for ``m.profile.json`` (where calibrate writes it), when that file exists."""
    if not path.name.endswith(PROFILE_SUFFIX):
        return None
    gguf = path.with_name(path.name[: -len(PROFILE_SUFFIX)] + ".gguf")
    return gguf if gguf.is_file() else None


def profile_report(path: Path) -> dict[str, Any]:
    from sparkpack.formats.gguf_file import GGUFModel

    prof = Profile.load(path)
    moe = prof.moe_layers
    both = prof.counts["prompt"] + prof.counts["generated"]
    tokens = sum(prof.tokens.values())
    # every token routes the same number of experts in each MoE layer: the counts say how many
    per_token = float(both[moe[0]].sum() / tokens) if moe and tokens else 0.0
    k = int(round(per_token))
    coverage = {}
    for f in FRACTIONS:
        plan = make_plan(prof.n_layer, prof.n_expert, {il: 1 for il in moe}, round(f * len(moe) * prof.n_expert),
                         prof.counts, prof.tokens)
        coverage[f"{f:.0%}"] = {side: 1.0 - rate for side, rate in plan.cold_hit_rate.items()}
    beside = model_beside(path)
    matches = None
    if beside is not None:
        try:
            model = GGUFModel(beside)
            matches = model_identity(model) == prof.identity
            model.close()
        except SparkpackError:
            matches = False
    return {
        "profile": str(path),
        "version": PROFILE_VERSION,
        "arch": prof.arch,
        "layers": prof.n_layer,
        "moe_layers": len(moe),
        "experts_per_layer": prof.n_expert,
        "experts_per_token": k,
        "identity": prof.identity.to_json(),
        "model_beside": str(beside) if beside is not None else None,
        "model_beside_matches": matches,
        "tokens": {side: prof.tokens[side] for side in SIDES},
        "top60_share": top_share(both, moe),
        "coverage": coverage,
        "too_few_tokens": too_few_tokens(tokens, prof.n_expert, k) if k else "no routings counted",
    }


def print_profile_report(r: dict[str, Any]) -> None:
    echo = click.echo
    ident = r["identity"]
    echo(f"{r['profile']}  (sparkpack profile v{r['version']})")
    echo(f"  model           {r['arch']}, {r['layers']} layers ({r['moe_layers']} MoE), {r['experts_per_layer']} "
         f"experts per layer, top-{r['experts_per_token']}")
    echo(f"  recorded on     a GGUF of {fmt_size(ident['file_size'])} ({ident['file_size']} bytes), header "
         f"{ident['header_hash'].split(':')[-1][:12]}")
    if r["model_beside"] is not None:
        echo(f"  beside it       {Path(r['model_beside']).name}: "
             + ("this model" if r["model_beside_matches"] else "ANOTHER model (split and spark-run will ignore it)"))
    t = r["tokens"]
    echo(f"  tokens          {t['prompt']:.0f} prompt-side, {t['generated']:.0f} generated-side")
    echo(f"  skew            top 60% of experts take {r['top60_share']:.1%} of routings (uniform routing: 60%)")
    echo("  coverage        routings served by the hot set split would pick, by share of experts hot:")
    echo("                  " + f"{'hot':<10}" + "".join(f"{k:>8}" for k in r["coverage"]))
    for side in SIDES:
        echo("                  " + f"{side:<10}" + "".join(f"{v[side]:>8.1%}" for v in r["coverage"].values()))
    if r["too_few_tokens"]:
        echo(f"  warning         {r['too_few_tokens']}")

