"""``repack inspect``: what is in a model file and what it needs to run all-GPU."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import click

from sparkpack.formats.archs import model_spec
from sparkpack.formats.experts import expert_nbytes, expert_tensor_names
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.memory import kv_cache_bytes, longest_call, recurrent_state_bytes, runtime_bytes

from sparkpack.formats.units import fmt_size

from .profile_info import is_profile_file, print_profile_report, profile_report

GROUPS = ("routed experts", "shared expert", "router", "attention", "dense ffn", "embeddings", "output", "norms",
          "mtp head")


def tensor_group(name: str, expert_names: set[str], head_names: frozenset[str] = frozenset()) -> str:
    """Coarse role of a tensor, for the quant-type and byte breakdown (the MTP head's blocks are
    one group of their own: a run loads them only to draft)."""
    if name in head_names:
        return "mtp head"
    if name in expert_names or name.endswith("_exps.weight"):
        return "routed experts"
    if "shexp" in name:
        return "shared expert"
    if "ffn_gate_inp" in name or "exp_probs_b" in name:
        return "router"
    if name.startswith("token_embd"):
        return "embeddings"
    if name.startswith("output.") :
        return "output"
    if "norm" in name:
        return "norms"
    if ".attn_" in name or ".ssm_" in name:
        return "attention"
    if ".ffn_" in name:
        return "dense ffn"
    return "norms" if name.startswith("output_norm") else "attention"


def gguf_report(path: Path, ctx: int) -> dict[str, Any]:
    model = GGUFModel(path)
    spec = model_spec(model)
    experts = expert_tensor_names(spec)
    head = spec.head_tensor_names()
    by_group: dict[str, dict[str, Any]] = {g: {"bytes": 0, "types": defaultdict(int)} for g in GROUPS}
    for t in model.tensors.values():
        g = by_group[tensor_group(t.name, experts, head)]
        g["bytes"] += t.nbytes
        g["types"][t.type_name] += 1
    tensor_bytes = sum(t.nbytes for t in model.tensors.values())
    expert_bytes = by_group["routed experts"]["bytes"]
    head_bytes = by_group["mtp head"]["bytes"]
    kv = kv_cache_bytes(spec, ctx, prefill_chunk=longest_call(spec, ctx, "auto"))  # (a GPU session's rings)
    state = recurrent_state_bytes(spec)
    runtime = runtime_bytes(spec, ctx)
    per_expert = {il: expert_nbytes(model, spec, il) for il in spec.moe_layers}
    report = {
        "file": str(path),
        "file_bytes": model.file_size,
        "arch": spec.arch,
        "name": model.get("general.name"),
        "layers": spec.n_layer,
        "layer_kinds": spec.layer_counts(),
        "n_embd": spec.n_embd,
        "vocab": spec.n_vocab,
        "experts": spec.n_expert,
        "experts_used": spec.n_expert_used,
        "moe_layers": len(spec.moe_layers),
        "expert_ffn": spec.n_ff_exp,
        "shared_expert_ffn": spec.n_ff_shexp,
        "router": spec.router,
        "bytes_per_expert": max(per_expert.values()) if per_expert else 0,
        "tensor_count": len(model.tensors),
        "tensor_bytes": tensor_bytes,
        "expert_bytes": expert_bytes,
        "other_bytes": tensor_bytes - expert_bytes - head_bytes,
        "mtp_layers": list(spec.nextn.layers) if spec.nextn is not None else [],
        "mtp_bytes": head_bytes,
        "groups": {g: {"bytes": v["bytes"], "types": dict(v["types"])} for g, v in by_group.items() if v["bytes"]},
        "ctx": ctx,
        "kv_cache_bytes": kv,
        "recurrent_state_bytes": state,
        "runtime_overhead_bytes": runtime,
        "vram_all_gpu_bytes": tensor_bytes - head_bytes + kv + state + runtime,
    }
    model.close()
    return report


def print_report(r: dict[str, Any]) -> None:
    echo = click.echo
    echo(f"{r['file']}  ({fmt_size(r['file_bytes'])})")
    echo(f"  arch            {r['arch']}" + (f"  ({r['name']})" if r.get("name") else ""))
    kinds = ", ".join(f"{v} {k}" for k, v in sorted(r["layer_kinds"].items()))
    echo(f"  layers          {r['layers']}  ({kinds})")
    echo(f"  embedding       {r['n_embd']}, vocab {r['vocab']}")
    echo(f"  experts         {r['experts']} per layer, top-{r['experts_used']}, router {r['router']}, "
         f"expert ffn {r['expert_ffn']}" + (f", shared expert ffn {r['shared_expert_ffn']}"
                                            if r["shared_expert_ffn"] else ""))
    echo(f"  one expert      {fmt_size(r['bytes_per_expert'])}")
    echo("")
    echo(f"  {'tensor group':<16} {'bytes':>12}  quant types")
    for g, v in r["groups"].items():
        types = ", ".join(f"{t} x{n}" for t, n in sorted(v["types"].items()))
        echo(f"  {g:<16} {fmt_size(v['bytes']):>12}  {types}")
    share = r["expert_bytes"] / r["tensor_bytes"] if r["tensor_bytes"] else 0
    echo("")
    echo(f"  expert weights  {fmt_size(r['expert_bytes'])} ({share:.1%} of {fmt_size(r['tensor_bytes'])})")
    echo(f"  other weights   {fmt_size(r['other_bytes'])}")
    if r["mtp_layers"]:
        blocks = ", ".join(f"blk.{il}" for il in r["mtp_layers"])
        echo(f"  MTP head        {fmt_size(r['mtp_bytes'])} ({blocks}; loaded only to draft, not counted below)")
    else:
        echo("  MTP head        none")
    echo(f"  VRAM all-GPU    {fmt_size(r['vram_all_gpu_bytes'])} at ctx {r['ctx']} "
         f"(KV {fmt_size(r['kv_cache_bytes'])}, recurrent state {fmt_size(r['recurrent_state_bytes'])}, "
         f"runtime {fmt_size(r['runtime_overhead_bytes'])})")


@click.command("inspect")
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--ctx", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Context length for the KV-cache estimate.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def inspect_cmd(model: Path, ctx: int, as_json: bool) -> None:
    """Show a model's (or a .sparkpack's) architecture, experts, quant types and VRAM needs, or
    what a routing profile (MODEL.profile.json) holds: its model, tokens, skew and coverage."""
    if model.is_dir():  # a .sparkpack (Pack.open explains what is wrong with any other directory)
        from .pack_info import pack_report, print_pack_report

        report, show = pack_report(model), print_pack_report
    elif model.is_file() and is_profile_file(model):
        report, show = profile_report(model), print_profile_report
    else:
        report, show = gguf_report(model, ctx), print_report
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        show(report)
