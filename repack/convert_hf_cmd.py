"""``repack convert-hf``: transformers checkpoint directory -> GGUF, as llama.cpp would convert it."""
from __future__ import annotations

from pathlib import Path

import click


@click.command("convert-hf")
@click.argument("hf_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path, dir_okay=False), required=True,
              help="GGUF file to write.")
@click.option("--outtype", type=click.Choice(["f32", "f16", "bf16", "q8_0"]), default="f32", show_default=True,
              help="Type of the weight matrices; norms, routers and conv kernels stay f32.")
def convert_hf_cmd(hf_dir: Path, out: Path, outtype: str) -> None:
    """Convert a Qwen3-MoE, Qwen3.5/3.6-MoE or Laguna transformers model to GGUF."""
    from sparkpack.repack.convert_hf import convert

    path = convert(hf_dir, out, outtype)
    click.echo(f"wrote {path} ({path.stat().st_size} bytes, {outtype})")
