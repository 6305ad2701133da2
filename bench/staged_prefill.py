"""Prefill at partial residency with and without staged calls (CUDA), to pick the threshold.

    python bench/staged_prefill.py M.gguf (--hot-fraction F [--profile P] | --vram 14GiB [--profile P])
        [--tokens 512 1024 2048 4096 8192 32768] [--chunk 2048] [--all-gpu] [--no-off] [--md out.md] [--json out.json]

One process, one model at one residency: for each prompt length N, a fresh session prefills N
tokens with staging off (every call reads cold experts zero-copy) and on (every eager call
stages: ``runtime.expert_staging``), the second of two prefills timed (the first compiles and
captures what that length needs), with the bytes streamed host->device and the tokens per call
(the all-attention models take 512-token calls: captured unstaged, eager in groups staged).
Prompts up to ``--chunk`` tokens are one call each: where "on" overtakes "off" among them is the
crossover to set ``formats.memory.STAGE_TOKENS`` (``StoreOptions.stage_tokens``) to.
Under ``--vram`` both rows run on the staged plan's hot set (the buffers reserved either way).
``--all-gpu`` adds the all-GPU store's rates (a second store, same dense weights; needs the
memory of both). Both paths compute the same bits for the same calls (tests/test_staged_prefill.py).
Writes a markdown table (``--md``, default $OUT/staged_prefill.md) and JSON (``--json``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

from sparkpack.formats.units import fmt_size, parse_size
from sparkpack.runtime.generate import Session
from sparkpack.runtime.models import SessionOptions, StoreOptions, load_model, open_store

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: bench/ importable
from bench.prefill_profile import ids_of, timed_feed  # noqa: E402

NEVER = sys.maxsize  # a threshold no call reaches: staging off


def measure(model, n: int, chunk: int) -> dict:
    """tok/s of the second of two prefills of ``n`` tokens in a fresh session, and what it streamed."""
    store = model.store
    session = Session(model, ctx=n + 64, prefill_chunk=chunk)
    ids = ids_of(n, model.spec.n_vocab, n)
    first = timed_feed(session, ids)
    session.reset()
    store.flush()
    before = store.stats.bytes_streamed, store.stats.staged_bytes
    warm = timed_feed(session, ids)
    store.flush()
    s = store.stats
    return {"tokens": n, "tok_s": n / warm, "first_tok_s": n / first, "call_tokens": session.plan.call_tokens,
            "bytes_streamed": s.bytes_streamed - before[0], "staged_bytes": s.staged_bytes - before[1]}


def table(rows: list[dict], all_gpu: dict[int, float]) -> str:
    head = "| N | call size off/on | off tok/s | on tok/s | on/off | off streamed | on streamed |"
    lines = [head + (" all-GPU tok/s | on/all-GPU |" if all_gpu else ""),
             "|" + "---|" * (7 + 2 * bool(all_gpu))]
    for r in rows:
        on = r["on"]
        off = r.get("off")
        if off is None:  # --no-off
            line = f"| {r['tokens']} | -/{on['call_tokens']} | - | {on['tok_s']:.0f} | - | - | {fmt_size(on['bytes_streamed'])} |"
        else:
            line = (f"| {r['tokens']} | {off['call_tokens']}/{on['call_tokens']} | {off['tok_s']:.0f} | {on['tok_s']:.0f} | "
                    f"{on['tok_s'] / off['tok_s']:.2f} | {fmt_size(off['bytes_streamed'])} | {fmt_size(on['bytes_streamed'])} |")
        if all_gpu:
            line += f" {all_gpu[r['tokens']]:.0f} | {on['tok_s'] / all_gpu[r['tokens']]:.0%} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    budget = ap.add_mutually_exclusive_group(required=True)
    budget.add_argument("--hot-fraction", type=float)
    budget.add_argument("--vram", type=parse_size)
    ap.add_argument("--profile", type=Path)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 32768])
    ap.add_argument("--chunk", type=int, default=2048, help="prompt tokens per call (Session prefill_chunk)")
    ap.add_argument("--all-gpu", action="store_true", help="also time the all-GPU store")
    ap.add_argument("--no-off", action="store_true", help="time staging on only (zero-copy long prompts take minutes)")
    out = Path(os.environ.get("OUT", "."))
    ap.add_argument("--md", type=Path, default=out / "staged_prefill.md")
    ap.add_argument("--json", type=Path, default=out / "staged_prefill.json")
    a = ap.parse_args()
    ctx = max(a.tokens) + 64
    opts = StoreOptions(vram=a.vram, hot_fraction=a.hot_fraction, profile=a.profile, stage_tokens=1)
    session = SessionOptions(ctx=ctx, prefill_chunk=a.chunk)
    t0 = time.perf_counter()
    model = load_model(a.model, device="cuda", dtype=torch.bfloat16, store=opts, session=session)
    store, plan = model.store, model.residency
    d = store.describe()
    print(f"loaded {a.model.name} in {time.perf_counter() - t0:.0f} s: {d['hot_experts']}/{d['experts']} hot "
          f"({plan.source}), mode {d['mode']}, staging {fmt_size(d['staging_bytes'])}", flush=True)
    if store.staging is None:
        raise SystemExit("this residency stages nothing (all hot, disk tier, or no room for the buffers)")
    rows = []
    for n in a.tokens:
        row = {"tokens": n}
        for name, threshold in (("off", NEVER), ("on", 1))[1 if a.no_off else 0:]:
            store.staging.min_tokens = threshold
            row[name] = measure(model, n, a.chunk)
            r = row[name]
            print(f"N={n:6} staging {name:3}: {r['tok_s']:7.0f} tok/s (first {r['first_tok_s']:.0f}), calls of "
                  f"{r['call_tokens']}, {r['bytes_streamed'] / 1e9:.2f} GB streamed ({r['staged_bytes'] / 1e9:.2f} "
                  f"staged)", flush=True)
        rows.append(row)
    all_gpu: dict[int, float] = {}
    if a.all_gpu:
        model.experts = model.store = None
        del store
        gc.collect()
        torch.cuda.empty_cache()
        model.experts = model.store = open_store(model.gguf, None, model.spec, model.device, model.dtype,
                                                 StoreOptions(hot_fraction=1.0), session=session)[0]
        for n in a.tokens:
            all_gpu[n] = measure(model, n, a.chunk)["tok_s"]
            print(f"N={n:6} all-GPU: {all_gpu[n]:7.0f} tok/s", flush=True)
    md = table(rows, all_gpu)
    print(md)
    a.md.write_text(f"{a.model.name}, {plan.source}, staging buffers {fmt_size(d['staging_bytes'])}, "
                    f"{torch.cuda.get_device_name()}\n\n" + md)
    a.json.write_text(json.dumps({"model": a.model.name, "plan": plan.as_json(), "describe": d,
                                  "rows": rows, "all_gpu": all_gpu}, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
