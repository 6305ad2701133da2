"""``repack convert-hf``: transformers checkpoint directory -> GGUF, as llama.cpp would convert it."""
from __future__ import annotations

from pathlib import Path

import click

from sparkpack.formats.errors import SparkpackError

from .convert_hf.common import OUTTYPES
from .outputs import check_output, reported_as

# The llama.cpp file types people run. Their blocks come from gguf-py's quantizers or not at all:
# a K-quant quantizer written here would be a second, unrefereed implementation of llama.cpp's.
K_MIXES = ("q4_k_m", "q5_k_m", "q6_k")


def missing_quantizers(mix: str) -> list[str]:
    """Block types of file type ``mix`` that the installed gguf-py cannot quantize."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    from sparkpack.formats.quant_mix import MIXES

    needed = {MIXES[mix.upper()], T.Q6_K}  # *_M mixes give some layers Q6_K; Q6_K is the output type
    missing = []
    for qtype in sorted(needed, key=lambda t: t.name):
        try:
            quantize(np.zeros((1, 256), np.float32), qtype)
        except NotImplementedError:
            missing.append(qtype.name)
    return missing


def refuse_k_mix(mix: str) -> SparkpackError:
    from importlib.metadata import version

    missing = missing_quantizers(mix)
    why = (f"gguf-py {version('gguf')} has no quantizer for {', '.join(missing)}" if missing
           else "convert-hf does not write llama.cpp's K-quant mixes")
    return SparkpackError(None, f"--outtype {mix}: {why}; available: {', '.join(OUTTYPES)} (convert to f16, then "
                                f"run llama.cpp's llama-quantize M.gguf OUT.gguf {mix.upper()})")


@click.command("convert-hf")
@click.argument("hf_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path, dir_okay=False), required=True,
              help="GGUF file to write.")
@click.option("--outtype", type=click.Choice([*OUTTYPES, *K_MIXES], case_sensitive=False), default="f32",
              show_default=True, help="Type of the weight matrices; norms, routers and conv kernels stay f32. "
              "K-quant mixes need gguf-py quantizers for their blocks.")
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
def convert_hf_cmd(hf_dir: Path, out: Path, outtype: str, force: bool) -> None:
    """Convert a Qwen3-MoE, Qwen3.5/3.6-MoE or Laguna transformers model to GGUF."""
    from sparkpack.repack.convert_hf import convert

    outtype = outtype.lower()
    if outtype in K_MIXES:
        raise refuse_k_mix(outtype)
    check_output(out, force)
    with reported_as(out):
        path = convert(hf_dir, out, outtype)
    click.echo(f"wrote {path} ({path.stat().st_size} bytes, {outtype})")
