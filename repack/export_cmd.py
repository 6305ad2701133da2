"""``repack export``: placement for other runtimes; today llama.cpp's tensor overrides."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import click

from sparkpack.formats.archs import model_spec
from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.profile import choose_profile, model_identity
from sparkpack.formats.units import SIZE, fmt_size

from .llama_cpp_args import DEFAULT_RESERVE, KV_TYPES, plan_llama_cpp


@click.command("export")
@click.argument("model_path", metavar="MODEL.gguf", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--llama-cpp", "llama_cpp", is_flag=True, help="Print llama.cpp arguments (-ot / --n-cpu-moe).")
@click.option("--vram", type=SIZE, required=True, help="GPU memory llama.cpp may use, e.g. 14GiB.")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Routing profile for the expected cold-hit rates [MODEL.profile.json when present].")
@click.option("--ctx", type=click.IntRange(min=1), default=4096, show_default=True, help="llama.cpp's -c.")
@click.option("--kv-type", type=click.Choice(list(KV_TYPES)), default="f16", show_default=True,
              help="llama.cpp's -ctk/-ctv.")
@click.option("--reserve", type=SIZE, default=str(DEFAULT_RESERVE), show_default="1GiB",
              help="Left for llama.cpp's compute buffers and the CUDA context.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def export_cmd(model_path: Path, llama_cpp: bool, vram: int, profile_path: Path | None, ctx: int, kv_type: str,
               reserve: int, as_json: bool) -> None:
    """Arguments that keep as many expert layers on the GPU as VRAM allows in another runtime.

    \b
    repack export model.gguf --llama-cpp --vram 14GiB
    repack export model.gguf --llama-cpp --vram 14GiB --profile model.profile.json --ctx 32768
    """
    if not llama_cpp:
        raise SparkpackError(None, "choose a runtime to export for: --llama-cpp")
    gguf = GGUFModel(model_path)
    spec = model_spec(gguf)
    choice = choose_profile(profile_path, model_path, model_identity(gguf), spec)
    if choice.warning:
        click.echo(f"warning: {choice.warning}", err=True)
    profile, where = choice.profile, choice.path
    plan = plan_llama_cpp({n: t.nbytes for n, t in gguf.tensors.items()}, spec, vram, ctx, kv_type, reserve, profile)
    if vram - reserve < plan.gpu_weights + plan.kv:
        raise SparkpackError(model_path, f"--vram {fmt_size(vram)} is too small for llama.cpp even with every expert "
                                         f"in host memory: other weights {fmt_size(plan.gpu_weights)}, KV cache "
                                         f"{fmt_size(plan.kv)} at -c {ctx}, reserve {fmt_size(reserve)}")
    if as_json:
        click.echo(json.dumps({
            "model": str(model_path), "profile": str(where) if profile else None, "vram": vram, "reserve": reserve,
            "ctx": ctx, "kv_type": kv_type, "gpu_weights": plan.gpu_weights, "kv_cache": plan.kv,
            "expert_layer_bytes": {str(k): v for k, v in plan.expert_layer_bytes.items()},
            "gpu_layers": plan.gpu_layers, "cpu_layers": plan.cpu_layers, "gpu_bytes": plan.gpu_bytes,
            "args": plan.args(), "n_cpu_moe": plan.n_cpu_moe,
            "expected_cold_hit_rate": plan.cold_rate, "n_cpu_moe_cold_hit_rate": plan.n_cpu_moe_cold_rate,
            "per_expert_cold_hit_rate": plan.per_expert_cold_rate}, indent=1))
        return
    echo = lambda s="": click.echo(s, err=True)  # noqa: E731 - stdout carries only the arguments
    n_moe = len(spec.moe_layers)
    echo(f"llama.cpp on {fmt_size(vram)}: {len(plan.gpu_layers)} of {n_moe} MoE layers keep their experts on the GPU "
         f"({fmt_size(plan.gpu_bytes)} of weights and KV cache + {fmt_size(reserve)} reserve)")
    echo(f"  other weights {fmt_size(plan.gpu_weights)}, KV cache {fmt_size(plan.kv)} at -c {ctx}, expert layers "
         f"{fmt_size(sum(plan.expert_layer_bytes[il] for il in plan.gpu_layers))}")
    if plan.cold_rate:
        rates = ", ".join(f"{side} {r:.1%}" for side, r in plan.cold_rate.items())
        echo(f"  expected cold-hit rate (routings computed on the CPU): {rates}")
        if plan.per_expert_cold_rate:
            rates = ", ".join(f"{side} {r:.1%}" for side, r in plan.per_expert_cold_rate.items())
            echo(f"  the same expert bytes placed expert by expert (spark-run): {rates}")
    else:
        echo(f"  expected cold-hit rate: {len(plan.cpu_layers) / n_moe:.1%} of routings (no profile: every layer "
             "serves the same share)")
    if plan.n_cpu_moe is not None and plan.cpu_layers != plan.n_cpu_moe_layers:
        echo(f"  --n-cpu-moe {plan.n_cpu_moe} would fit too, with {len(plan.n_cpu_moe_layers)} layers on the CPU")
    click.echo(shlex.join(plan.args()))
