"""What ``--vram`` leaves for hot experts at each context: the plan ``repack split --vram`` and
``spark-run --vram`` share (``formats.placement.plan_residency``), read from the GGUF alone.

    python bench/vram_plan.py MODEL.gguf [--vram 14GiB] [--ctx 32768 65536 131072] [--kv auto q8_0]

One line per context and KV type: the KV cache the session allocates, the hot experts' bytes,
or the one-line refusal when the budget cannot hold the rest. Runs anywhere (no torch).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from sparkpack.formats.archs import model_spec
from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.memory import MemoryTarget, kv_cache_bytes
from sparkpack.formats.placement import Budget, plan_residency
from sparkpack.formats.units import parse_size

GIB = 2**30


def plans(model: Path, vram: int, contexts: list[int], kv_types: list[str]) -> list[dict]:
    gguf = GGUFModel(model)
    spec = model_spec(gguf)
    rows = []
    for ctx in contexts:
        for kv in kv_types:
            target = MemoryTarget.gpu(spec, ctx, kv)
            row = {"ctx": ctx, "kv": kv,
                   "kv_bytes": kv_cache_bytes(spec, ctx, target.kv_bytes_per_value, target.prefill_chunk)}
            try:
                row["hot_bytes"] = plan_residency(spec, gguf.tensors, Budget(vram=vram), target).hot_bytes
            except SparkpackError as e:
                row["refused"] = str(e)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--vram", default="14GiB")
    p.add_argument("--ctx", type=int, nargs="+", default=[32768, 65536, 131072])
    p.add_argument("--kv", nargs="+", default=["auto", "q8_0"], choices=["auto", "q8_0"])
    args = p.parse_args(argv)
    rows = plans(args.model, parse_size(args.vram), args.ctx, args.kv)
    for r in rows:
        left = f"hot experts {r['hot_bytes'] / GIB:.2f} GiB" if "hot_bytes" in r else f"refused: {r['refused']}"
        print(f"--ctx {r['ctx']} --kv-type {r['kv']}: KV cache {r['kv_bytes'] / GIB:.2f} GiB, {left}")
    return rows


if __name__ == "__main__":
    main()
