"""Decode speed of the tiered expert store at partial residency, against all-GPU, in one process.

The model is loaded once (dense weights on the GPU); for each configuration a fresh expert store
replaces the previous one, the same held-out prompt is prefilled and the same number of tokens
is decoded greedily. Every configuration must reproduce the all-GPU run's tokens and every step's
logits bit for bit (same kernels, only the residency differs); a mismatch fails the script.
Then ``spark-run --vram`` runs in its own process to measure the peak VRAM under a budget.

    python bench/store_bench.py M.gguf --profile P.json --prompts held_out.jsonl \
        [--tokens 64] [--prompt-tokens 256] [--vram 14GiB] [--only S ...] [--skip S ...] [--json out.json]

Configurations: all-GPU; calibrated placement (the profile) at hot fractions 0.8/0.6/0.4/0.2
with zero-copy and async misses; the naive offload (uniform placement, blocking copies from
the file: ``bench/naive_store.py``); and exactness probes at 10% residency with and without
cache slots.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sparkpack.calibrate.readers import read_corpus
from sparkpack.calibrate.render import ChatRenderer
from sparkpack.runtime.chat_template import ChatTemplate
from sparkpack.runtime.generate import Session
from sparkpack.runtime.models import StoreOptions, load_model, open_store, plan_store
from sparkpack.runtime.tokenizer import GGUFTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: bench/ importable
from bench.naive_store import NaiveStore  # noqa: E402


@dataclass
class Config:
    name: str
    hot_fraction: float
    calibrated: bool
    mode: str  # the store's, or "naive" (bench/naive_store.py)
    cache_slots: int | None = None  # None: the default (formats.placement.default_cache_slots)


def configs(fractions: list[float], slots: list[int]) -> list[Config]:
    out = [Config("all-GPU", 1.0, False, "zerocopy", 0)]
    for n in slots:
        out += [Config(f"calibrated {f:.0%} zero-copy, {n} slots", f, True, "zerocopy", n) for f in (0.6, 0.2)]
    for f in fractions:
        out.append(Config(f"calibrated {f:.0%} zero-copy", f, True, "zerocopy"))
        out.append(Config(f"calibrated {f:.0%} async", f, True, "async"))
    out += [Config("naive 60% (uniform, blocking copies)", 0.6, False, "naive"),
            Config("naive 20% (uniform, blocking copies)", 0.2, False, "naive"),
            Config("uniform 60% zero-copy", 0.6, False, "zerocopy"),
            Config("calibrated 60% naive", 0.6, True, "naive"),
            Config("calibrated 10% zero-copy, no slots", 0.1, True, "zerocopy", 0),
            Config("calibrated 10% async, no slots", 0.1, True, "async", 0),
            Config("calibrated 10% async", 0.1, True, "async")]
    return out


def held_out_prompt(model, path: Path, n_tokens: int) -> list[int]:
    """The first ``n_tokens`` of the held-out corpus, rendered with the model's chat template."""
    tok = GGUFTokenizer.from_metadata(model.gguf)
    template = model.gguf.get("tokenizer.chat_template")
    renderer = ChatRenderer(tok, ChatTemplate.from_tokenizer(template, tok).render if template else None)
    convs, _ = read_corpus(path)
    ids: list[int] = []
    for conv in convs:
        ids += renderer.render(conv).ids
        if len(ids) >= n_tokens:
            break
    return ids[:n_tokens]


def run(model, prompt: list[int], n_tokens: int) -> tuple[list[int], torch.Tensor, Session]:
    """Greedy decode in the runtime's loop (``Session.decode``, as ``generate``); returns the
    tokens, the logits each was picked from and the session (its timing)."""
    session = Session(model)
    steps: list[torch.Tensor] = []
    tokens = list(session.decode(session.feed(list(prompt)), n_tokens + 1, torch.argmax, seen=steps))
    return tokens[:n_tokens], torch.stack(steps[:n_tokens]), session


def free_memory(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def vram_run(model_path: Path, profile: Path, vram: str, prompt: list[int], n_tokens: int, out: Path) -> dict:
    """spark-run under ``--vram`` in its own process: the peak it reports is the whole program's."""
    stats = out / "vram_run.json"
    cmd = [sys.executable, "-m", "sparkpack.runtime.cli", str(model_path), "--vram", vram, "--profile", str(profile),
           "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", str(n_tokens), "--temperature", "0",
           "--device", "cuda", "--stats-json", str(stats)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    print(p.stderr.strip()[-2000:])
    if p.returncode != 0:
        raise SystemExit(f"spark-run --vram {vram} failed (rc {p.returncode})")
    return json.loads(stats.read_text())


def measure(model, cfg: Config, args: argparse.Namespace, prompt: list[int], cuda: bool) -> dict:
    """Swap in a fresh store for ``cfg``, warm up, then time prefill + greedy decode."""
    t0 = time.perf_counter()
    naive = cfg.mode == "naive"
    opts = StoreOptions(hot_fraction=cfg.hot_fraction, cache_slots=cfg.cache_slots,
                        miss_mode="async" if naive else cfg.mode, profile=args.profile if cfg.calibrated else None)
    if naive:
        src, residency = plan_store(model.gguf, None, model.spec, model.device, model.dtype, opts)
        store = NaiveStore(src, model.spec, model.device, model.dtype, residency.hot, residency.cache_slots)
    else:
        store, residency = open_store(model.gguf, None, model.spec, model.device, model.dtype, opts)
    if not cfg.calibrated and residency.source.find("uniform") < 0:
        raise SystemExit(f"{cfg.name}: expected uniform placement, got {residency.source}")
    model.experts = model.store = store
    model.residency = residency
    load_s = time.perf_counter() - t0
    run(model, prompt[:16], 4)  # warm-up: Triton compiles, allocator settles (not timed)
    store.reset_stats()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    tokens, logits, session = run(model, prompt, args.tokens)
    t = session.timing
    store.flush()
    s = store.stats.as_json()
    d = store.describe()
    row = {"name": cfg.name, "hot_fraction": d["hot_fraction"], "mode": "naive" if naive else d["mode"],
           "cache_slots": d["cache_slots"],
           "decode_tok_s": t.decode_tokens / t.decode_seconds, "prefill_tok_s": t.prefill_tokens / t.prefill_seconds,
           "hot_per_token": s["hot_hits_per_token"], "cached_per_token": s["cache_hits_per_token"],
           "missed_per_token": s["misses_per_token"], "bytes_streamed": s["bytes_streamed"],
           "stream_gb_s": s["bytes_streamed"] / (t.decode_seconds + t.prefill_seconds + t.capture_seconds) / 1e9,
           "capture_s": t.capture_seconds, "host_ms_per_token": 1e3 * s["step_seconds"] / max(s["tokens"], 1),
           "pool_gib": d["device_pool_bytes"] / 1024**3, "load_s": load_s,
           "expected_cold_rate": residency.expected_cold_rate, "tokens": tokens, "logits": logits}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--profile", type=Path, required=True, help="calibrated on another prompt set")
    ap.add_argument("--prompts", type=Path, required=True, help="held-out corpus the prompt comes from")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.8, 0.6, 0.4, 0.2])
    ap.add_argument("--vram", default="14GiB", help="the spark-run --vram budget measured after the table ('': none)")
    ap.add_argument("--slots", type=int, nargs="*", default=[], help="also run 60%%/20%% zero-copy with these slot counts")
    ap.add_argument("--only", nargs="*", help="run only configurations whose name contains one of these")
    ap.add_argument("--skip", nargs="*", help="and of those, none whose name contains one of these")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script on a tiny model")
    ap.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "store_bench.json")
    args = ap.parse_args()

    cuda = args.device == "cuda"
    t0 = time.perf_counter()
    model = load_model(args.model, device=args.device, dtype=torch.bfloat16 if cuda else torch.float32,
                       store=StoreOptions(hot_fraction=1.0, cache_slots=0, miss_mode="zerocopy"))
    prompt = held_out_prompt(model, args.prompts, args.prompt_tokens)
    print(f"loaded {args.model.name} in {time.perf_counter() - t0:.1f} s; prompt {len(prompt)} tokens from "
          f"{args.prompts.name}, {args.tokens} decoded; profile {args.profile.name}", flush=True)
    rows, ref, failed = [], None, []
    cfgs = configs(args.fractions, args.slots)
    if args.only:
        cfgs = [c for c in cfgs if c.name == "all-GPU" or any(s in c.name for s in args.only)]
    if args.skip:
        cfgs = [c for c in cfgs if c.name == "all-GPU" or not any(s in c.name for s in args.skip)]
    # The prompt's prefill kernels that read host memory are compiled once here, not inside the
    # first partial store's timed prefill (its 16-token warm-up takes the per-pair kernels: that
    # prefill read 50 tok/s instead of ~1500). A throwaway store, so no row inherits what it learnt.
    measure(model, Config("compile", 0.5, True, "zerocopy"), args, prompt, cuda)
    for cfg in cfgs:
        model.experts = model.store = None
        free_memory(cuda)
        t0 = time.perf_counter()
        try:
            row = measure(model, cfg, args, prompt, cuda)
        except Exception as e:  # one broken configuration must not hide the others' numbers
            print(f"{cfg.name:38} FAILED: {type(e).__name__}: {e}", flush=True)
            failed.append(cfg.name)
            continue
        if ref is None:
            ref = (row.pop("tokens"), row.pop("logits"))
            row["identical"] = True
        else:
            row["identical"] = row.pop("tokens") == ref[0] and torch.equal(row.pop("logits"), ref[1])
        row["vs_all_gpu"] = row["decode_tok_s"] / rows[0]["decode_tok_s"] if rows else 1.0
        rows.append(row)
        load_s, same = row["load_s"], row["identical"]
        print(f"{cfg.name:38} decode {row['decode_tok_s']:7.1f} tok/s ({row['vs_all_gpu']:6.1%})  prefill "
              f"{row['prefill_tok_s']:7.1f}  hot/cached/missed per token {row['hot_per_token']:.1f}/"
              f"{row['cached_per_token']:.1f}/{row['missed_per_token']:.2f}  host {row['host_ms_per_token']:.2f} ms/token  pool {row['pool_gib']:.2f} GiB  "
              f"load {load_s:.1f} s  identical {same}", flush=True)
    model.experts = model.store = None
    del model
    free_memory(cuda)
    vr = vram_run(args.model, args.profile, args.vram, prompt, args.tokens, args.json.parent) if cuda and args.vram else {}
    result = {"model": args.model.name, "profile": args.profile.name, "prompts": args.prompts.name,
              "prompt_tokens": len(prompt), "decode_tokens": args.tokens, "rows": rows, "vram_run": vr,
              "device": torch.cuda.get_device_name() if cuda else "cpu"}
    args.json.write_text(json.dumps(result, indent=1, default=float) + "\n")
    print(table(result))
    bad = [r["name"] for r in rows if not r["identical"]]
    if bad or failed:
        raise SystemExit(f"outputs differ from all-GPU: {bad}; failed: {failed}")


def table(res: dict) -> str:
    lines = ["| configuration | hot | cache slots | miss path | decode tok/s | vs all-GPU | prefill tok/s | "
             "hot / cached / missed per token | GB/s streamed | identical |",
             "|" + " --- |" * 10]
    for r in res["rows"]:
        lines.append(f"| {r['name']} | {r['hot_fraction']:.0%} | {r['cache_slots']} | {r['mode']} | "
                     f"{r['decode_tok_s']:.1f} | {r['vs_all_gpu']:.1%} | {r['prefill_tok_s']:.1f} | "
                     f"{r['hot_per_token']:.1f} / {r['cached_per_token']:.1f} / {r['missed_per_token']:.2f} | "
                     f"{r['stream_gb_s']:.2f} | {'yes' if r['identical'] else 'NO'} |")
    v = res["vram_run"]
    if not v:
        return "\n".join(lines)
    st = v.get("store", {})
    lines.append("")
    lines.append(f"spark-run --vram: {st.get('hot_experts')}/{st.get('experts')} hot, {st.get('cache_slots')} slots, "
                 f"decode {v.get('decode_tok_s') or 0:.1f} tok/s, peak allocated "
                 f"{v.get('vram_peak_allocated', 0) / 1024**3:.2f} GiB, reserved {v.get('vram_peak_reserved', 0) / 1024**3:.2f} GiB")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
