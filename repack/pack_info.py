"""What ``repack inspect`` shows for a ``.sparkpack``: identity, placement and shard sizes."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from sparkpack.formats.sparkpack import HEADER_SHARD, HOT_SHARD, Pack

from sparkpack.formats.units import fmt_size


def pack_report(path: Path) -> dict[str, Any]:
    pack = Pack.open(path)
    m = pack.manifest
    cold = [r for r in pack.records.values() if not r.hot]
    per_layer = {str(il): int(pack.hot[il].sum()) for il in sorted(pack.parts)}
    name = pack.metadata.get("general.name")
    return {
        "pack": str(path),
        "format_version": pack.version,
        "checksum": pack.algorithm,
        "arch": pack.arch,
        "name": name if isinstance(name, str) else None,
        "source_file": m.source.file_name,
        "source_bytes": pack.identity.file_size,
        "layers": pack.n_layer,
        "experts_per_layer": pack.n_expert,
        "moe_layers": len(pack.parts),
        "hot_experts": int(pack.hot.sum()),
        "total_experts": len(pack.records),
        "hot_per_layer": per_layer,
        "uniform_placement": m.placement.uniform,
        "profile": m.placement.profile,
        "expected_cold_hit_rate": m.placement.expected_cold_hit_rate,
        "hot_shard_bytes": m.shards[HOT_SHARD].nbytes,
        "header_bytes": m.shards[HEADER_SHARD].nbytes,
        "cold_shards": len(cold),
        "cold_stored_bytes": sum(r.stored_nbytes for r in cold),
        "cold_raw_bytes": sum(r.nbytes for r in cold),
        "compression": pack.compression,
    }


def print_pack_report(r: dict[str, Any]) -> None:
    echo = click.echo
    echo(f"{r['pack']}  (sparkpack v{r['format_version']}, {r['checksum']} checksums, from {r['source_file']}, "
         f"{fmt_size(r['source_bytes'])})")
    echo(f"  arch            {r['arch']}" + (f"  ({r['name']})" if r.get("name") else ""))
    echo(f"  layers          {r['layers']} ({r['moe_layers']} MoE, {r['experts_per_layer']} experts each)")
    share = r["hot_experts"] / max(r["total_experts"], 1)
    echo(f"  hot experts     {r['hot_experts']} of {r['total_experts']} ({share:.1%})")
    how = "uniform (no profile)" if r["uniform_placement"] else f"from profile {r['profile']}"
    echo(f"  placement       {how}")
    counts = sorted(set(r["hot_per_layer"].values()))
    echo(f"  hot per layer   min {counts[0] if counts else 0}, max {counts[-1] if counts else 0}")
    if r.get("expected_cold_hit_rate"):
        rate = r["expected_cold_hit_rate"]
        echo(f"  cold-hit rate   generated {rate['generated']:.1%}, prompt {rate['prompt']:.1%} (under the profile)")
    echo(f"  hot shard       {fmt_size(r['hot_shard_bytes'])}")
    comp = ""
    if r["compression"] and r["cold_raw_bytes"]:
        share = r["cold_stored_bytes"] / r["cold_raw_bytes"]
        comp = ", zstd saved nothing" if share >= 1 else f", zstd {share:.1%} of raw"
    echo(f"  cold shards     {r['cold_shards']} files, {fmt_size(r['cold_stored_bytes'])}{comp}")
