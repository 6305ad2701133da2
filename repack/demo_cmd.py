"""``repack demo``: the whole pipeline on a small synthetic model and the bundled sample corpus.

Each step runs the real command in a child process and prints it first, so the demo doubles as
a walk-through of what a user types on a real model: synth stands in for a downloaded GGUF.
"""
from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import click

from sparkpack.formats.errors import SparkpackError

REPO_CORPORA = Path(__file__).resolve().parents[1] / "corpora"

RANDOM_WEIGHTS = (
    "The demo model has random weights: what it writes is gibberish (tokens like [FILL598]), by design.\n"
    "Look instead at what sparkpack does with it: the skew calibration finds (top 60% of experts vs 60%),\n"
    "the expected cold-hit rate of the placement, the hits per token and the speed spark-run reports at\n"
    "exit, and `verify` (a pack is the GGUF's exact bytes; every placement gives the all-GPU outputs).")


def _run(argv: list[str], shown: str) -> None:
    click.secho(f"\n$ {shown}", bold=True)
    r = subprocess.run(argv)
    if r.returncode != 0:
        raise SparkpackError(None, f"demo step failed (exit {r.returncode}): {shown}")


@click.command("demo")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path("sparkpack-demo"),
              show_default=True, help="Where the demo model, profile and pack are written.")
@click.option("--corpus", type=click.Path(exists=True, path_type=Path), default=None,
              help="Traffic to calibrate on [the bundled corpora/ folder].")
@click.option("--arch", type=click.Choice(["qwen35moe", "laguna", "qwen3moe"]), default="qwen35moe",
              show_default=True)
@click.option("--hot-fraction", default=0.5, show_default=True, help="Share of expert bytes kept on the GPU.")
def demo_cmd(workdir: Path, corpus: Path | None, arch: str, hot_fraction: float) -> None:
    """Synthesize a small MoE model, calibrate it on sample traffic, split it into a pack, verify
    the pack and generate from it. Random weights: the text is gibberish, the pipeline is real."""
    corpus = corpus or REPO_CORPORA
    if not corpus.exists():
        raise SparkpackError(corpus, "sample corpus not found; pass --corpus with a folder of chats or prompts")
    click.secho(RANDOM_WEIGHTS, bold=True)
    workdir.mkdir(parents=True, exist_ok=True)
    model, pack = workdir / f"{arch}-tiny.gguf", workdir / f"{arch}-tiny.sparkpack"
    repack, spark = [sys.executable, "-m", "sparkpack.repack.cli"], [sys.executable, "-m", "sparkpack.runtime.cli"]
    q = shlex.quote
    # --force: the demo is meant to be run again in the same folder. calibrate writes
    # MODEL.profile.json beside the model, where split (and spark-run) find it on their own.
    steps = [
        (["synth", "--arch", arch, "--preset", "tiny", "--quant", "Q4_K_M", "--skew", "1.0", "-o", str(model),
          "--force"], "repack"),
        (["inspect", str(model)], "repack"),
        (["calibrate", str(model), "--corpus", str(corpus), "--max-tokens", "20000", "--force"], "repack"),
        (["split", str(model), "--hot-fraction", str(hot_fraction), "--force", "-o", str(pack)], "repack"),
        (["verify", str(pack)], "repack"),
        ([str(pack), "-p", "Explain what a mixture-of-experts model is.", "--max-tokens", "24",
          "--temperature", "0", "--store"], "spark-run"),
    ]
    for args, prog in steps:
        _run((repack if prog == "repack" else spark) + args, " ".join([prog] + [q(a) for a in args]))
    click.secho(f"\nDone. The model, its routing profile and the pack are in {workdir}/.", bold=True)
