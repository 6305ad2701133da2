"""Long prompts and long context as a user gets them: a fresh ``spark-run`` per prompt length next
to llama-bench on the same GGUF, in one call.

    python bench/long_context.py MODEL.gguf [--lengths 8192 32768 131072] [--kv auto q8_0]
                                 [--decode-tokens 64] [--spark-arg=--vram=14GiB ...] [--llama-bench BIN]

For each prompt length N and KV type: ``spark-run MODEL --prompt-ids-file F -n 64 --ctx N+64
--kv-type KV --stats-json S`` in a fresh process (random ids; everything a user pays after the
model is loaded is in its numbers: the load-time warm-up is not, the first call's compiles and
captures are), giving prefill tok/s of the N-token prompt and decode tok/s of 64 tokens at depth
N. llama.cpp: ``llama-bench -p N -n 0`` (ppN) and ``-p 0 -n 64 -d N`` (tg64 at depth N), ``-fa 1
-ngl 99``, with ``-ctk/-ctv`` set to the same KV type, and any ``--llama-arg`` (e.g.
``--n-cpu-moe 20`` for the same VRAM). Prints a markdown table with the ratios and writes
``long_context.json`` / ``long_context.md`` to ``--out`` ($OUT).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# our KV types (--kv-type) -> llama.cpp's (-ctk/-ctv): ours "auto" is the compute dtype, bf16 on CUDA
LLAMA_KV = {"auto": "f16", "q8_0": "q8_0"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--kv", nargs="+", default=["auto", "q8_0"], choices=sorted(LLAMA_KV))
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--spark-arg", action="append", default=[], help="extra spark-run option (repeatable)")
    p.add_argument("--llama-arg", action="append", default=[], help="extra llama-bench option (repeatable)")
    p.add_argument("--llama-bench", type=Path,
                   default=Path(os.environ.get("LLAMA_BUILD", "/tmp/llama-build")) / "bin" / "llama-bench")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    return p.parse_args(argv)


def vocab_size(model: Path) -> int:
    from sparkpack.formats.archs import model_spec
    from sparkpack.formats.gguf_file import GGUFModel

    return model_spec(GGUFModel(model)).n_vocab


def spark(args: argparse.Namespace, n: int, kv: str, ids_file: Path) -> dict:
    stats = Path(tempfile.mkstemp(suffix=".json")[1])
    cmd = [sys.executable, "-m", "sparkpack.runtime.cli", str(args.model), "--prompt-ids-file", str(ids_file),
           "--max-tokens", str(args.decode_tokens), "--temperature", "0", "--ctx",
           str(n + args.decode_tokens + 16), "--kv-type", kv, "--stats-json", str(stats), *args.spark_arg,
           "--no-learn"]  # every length placed the same way: no profile learned between the runs
    t0 = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"}
    s = json.loads(stats.read_text())
    stats.unlink()
    return {"prefill_tok_s": s.get("prefill_tok_s"), "decode_tok_s": s.get("decode_tok_s"),
            "decode_tokens": s.get("decode_tokens"), "wall_s": wall,
            "vram_peak_reserved_gib": s["vram_peak_reserved"] / 2**30 if "vram_peak_reserved" in s else None,
            "warm_up": next((ln for ln in r.stderr.splitlines() if "warmed up" in ln), None)}


def llama(args: argparse.Namespace, flags: list[str], kv: str) -> float | None:
    if not args.llama_bench.is_file():
        return None
    cmd = [str(args.llama_bench), "-m", str(args.model), "-ngl", "99", "-fa", "1", "-r", "1", "-ctk", LLAMA_KV[kv],
           "-ctv", LLAMA_KV[kv], *flags, *args.llama_arg, "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if r.returncode != 0:
        print(f"llama-bench failed: {' '.join(cmd)}\n{r.stderr[-2000:]}", file=sys.stderr)
        return None
    rows = json.loads(r.stdout)
    return float(rows[0]["avg_ts"]) if rows else None


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def gib(x: float | None) -> str:
    return f"{x:.2f} GiB" if isinstance(x, (int, float)) else "-"


def num(x: float | None) -> str:
    return f"{x:.0f}" if isinstance(x, (int, float)) else "-"


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [f"model {args.model.name}; spark-run options {' '.join(args.spark_arg) or '(all-GPU)'}; "
             f"llama-bench options {' '.join(args.llama_arg) or '(all-GPU)'}", "",
             "| N | KV | ours prefill tok/s | llama ppN | ratio | ours decode tok/s @N | llama tg@N | ratio "
             "| our VRAM peak (torch reserved) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["spark"]
        if "error" in s:
            lines.append(f"| {r['n']} | {r['kv']} | {s['error']} | {num(r['llama_pp'])} | - | - | {num(r['llama_tg'])} | - "
                         f"| - |")
            continue
        lines.append(f"| {r['n']} | {r['kv']} | {num(s['prefill_tok_s'])} | {num(r['llama_pp'])} | "
                     f"{ratio(s['prefill_tok_s'], r['llama_pp'])} | {s['decode_tok_s']:.1f} | "
                     f"{num(r['llama_tg'])} | {ratio(s['decode_tok_s'], r['llama_tg'])} | {gib(s['vram_peak_reserved_gib'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    import random

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    n_vocab = vocab_size(args.model)
    if not args.llama_bench.is_file():
        print(f"no llama-bench at {args.llama_bench}: its columns are left out (build it in the same device "
              f"call: a build left running when a call ends dies with it)", file=sys.stderr)
    rows = []
    for n in args.lengths:
        rng = random.Random(n)
        ids_file = Path(tempfile.mkstemp(suffix=".ids")[1])
        ids_file.write_text(" ".join(str(rng.randrange(100, n_vocab - 100)) for _ in range(n)))
        for kv in args.kv:
            row = {"n": n, "kv": kv, "spark": spark(args, n, kv, ids_file)}
            row["llama_pp"] = llama(args, ["-p", str(n), "-n", "0"], kv)
            row["llama_tg"] = llama(args, ["-p", "0", "-n", str(args.decode_tokens), "-d", str(n)], kv)
            print(json.dumps(row), flush=True)
            rows.append(row)
        ids_file.unlink()
    md = markdown(rows, args)
    print(md)
    (args.out / "long_context.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "long_context.md").write_text(md)
    return rows


if __name__ == "__main__":
    main()
