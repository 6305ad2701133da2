"""``repack synth``: write a synthetic GGUF with a real model's shapes, metadata and quant mix."""
from __future__ import annotations

import os
from pathlib import Path

import click

from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.quant_mix import MIXES
from sparkpack.formats.units import fmt_size

from .synth.presets import ARCH_NAMES, PRESET_NAMES
from .outputs import check_output, reported_as


class SkewParam(click.ParamType):
    name = "S|reference"

    def convert(self, value, param, ctx):  # type: ignore[override]
        if isinstance(value, float) or value == "reference":
            return value
        try:
            s = float(value)
        except ValueError:
            self.fail(f"{value!r} is neither a number nor 'reference'", param, ctx)
        if not s >= 0:
            self.fail(f"{value!r} must be >= 0", param, ctx)
        return s


@click.command("synth")
@click.option("--arch", required=True, type=click.Choice(ARCH_NAMES), help="GGUF architecture.")
@click.option("--preset", default="tiny", show_default=True, type=click.Choice(PRESET_NAMES),
              help="Model shapes: 'tiny' (any arch) or the full-size model of the arch "
                   "(qwen35moe: qwen3.6-35b-a3b, laguna: laguna-xs2, qwen3moe: qwen3-30b-a3b).")
@click.option("--quant", default="Q8_0", show_default=True, type=click.Choice(list(MIXES)),
              help="llama.cpp file type; *_M mixes follow llama-quant.cpp's per-tensor rules.")
@click.option("--types-of", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None,
              help="A real GGUF of the preset's model (e.g. a dynamic quant): take each tensor's type from "
                   "its header instead of --quant's rules.")
@click.option("--skew", default="0", show_default=True, type=SkewParam(),
              help="Routing skew S >= 0: router row e is scaled by exp(S*g_e), g_e ~ N(0,1) per layer, so "
                   "some experts win top-k more often, input-dependently. 'reference' picks S so the top 60% "
                   "of experts take ~93% of routings on random inputs (S=0.282 for 256 experts top-8, "
                   "0.408 for 128 top-8).")
@click.option("--seed", default=0, show_default=True, help="Random seed (same seed, same bytes).")
@click.option("--layers", "n_layer", type=click.IntRange(min=1), default=None,
              help="Keep only the first N layers of the preset (smaller files with real shapes).")
@click.option("--mtp", is_flag=True,
              help="Append the multi-token-prediction head (qwen35moe), as Qwen3.5/3.6 MTP GGUFs carry it.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="Generator processes [default: CPU count, at most 16].")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path, dir_okay=False),
              help="Output .gguf path (written to a temp name, then renamed).")
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
def synth_cmd(arch: str, preset: str, quant: str, types_of: Path | None, skew, seed: int, n_layer: int | None, mtp: bool,
              jobs: int | None, output: Path, force: bool) -> None:
    """Write a synthetic GGUF: real tensor names, shapes, metadata, tokenizer and chat template of
    ARCH, random weights in valid quant blocks."""
    from .synth import write_synthetic

    if jobs is None:
        jobs = min(os.cpu_count() or 1, 16)
    check_output(output, force)
    try:
        with reported_as(output):
            path = write_synthetic(output, arch, preset, quant, seed=seed, skew=skew, n_layer=n_layer, jobs=jobs,
                                   progress=True, types_of=types_of, mtp=mtp)
    except ValueError as e:
        raise SparkpackError(output, str(e)) from None
    click.echo(f"wrote {path} ({fmt_size(path.stat().st_size)})")
