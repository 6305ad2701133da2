"""Our decode/prefill speed next to llama.cpp's on the same GGUF, measured in the same device call.

    python bench/compare_llama.py decode_bench.json llama_bench_M.json [--md table.md]

Inputs: the JSON ``bench/decode_bench.py`` writes and the JSON ``llama-bench -o json`` writes
(``bench/llama_bench.sh``). Rows pair our decode at KV depth d with llama.cpp's tg at the same
depth d, and our prefill of n tokens with its pp n at depth 0. Prints a markdown table with the ratio ours / llama.cpp; exits 1 when a row of ours has
no llama.cpp counterpart, so a mismatched pair of runs is not silently half-compared.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def llama_rates(entries: list[dict]) -> dict[tuple[str, int, int], tuple[float, float]]:
    """``(kind, n, depth) -> (avg tok/s, stddev)`` from llama-bench's JSON (kind "pp" or "tg")."""
    out = {}
    for e in entries:
        n_prompt, n_gen, depth = int(e["n_prompt"]), int(e["n_gen"]), int(e.get("n_depth", 0))
        if n_prompt and not n_gen:
            out[("pp", n_prompt, depth)] = (float(e["avg_ts"]), float(e["stddev_ts"]))
        elif n_gen and not n_prompt:
            out[("tg", n_gen, depth)] = (float(e["avg_ts"]), float(e["stddev_ts"]))
    return out


def compare(ours: dict, llama: list[dict]) -> list[dict]:
    """One row per measurement of ours: what, our tok/s, llama.cpp's (avg, stddev), ratio."""
    rates = llama_rates(llama)
    rows = []
    for d in ours.get("decode", []):
        depth = int(d["depth"])
        tg = [k for k in rates if k[0] == "tg" and k[2] == depth]
        key = max(tg, key=lambda k: k[1], default=None)  # the longest tg run at this depth
        rows.append(_row(f"decode at depth {depth}", d["graph_tok_s"], key, rates.get(key)))
    for p in ours.get("prefill", []):
        n = int(p["tokens"])
        key = ("pp", n, 0)
        rows.append(_row(f"prefill {n}", p["tok_s"], key, rates.get(key)))
    return rows


def _row(what: str, tok_s: float, key, theirs) -> dict:
    label = None if key is None or theirs is None else f"{key[0]}{key[1]}" + (f" @ d{key[2]}" if key[2] else "")
    return {"what": what, "ours": float(tok_s), "llama": theirs, "llama_test": label,
            "ratio": float(tok_s) / theirs[0] if theirs else None}


def markdown(rows: list[dict], model: str) -> str:
    lines = [f"| {model} | ours tok/s | llama.cpp test | llama.cpp tok/s | ours / llama.cpp |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        theirs = "-" if r["llama"] is None else f"{r['llama'][0]:.1f} ± {r['llama'][1]:.1f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        lines.append(f"| {r['what']} | {r['ours']:.1f} | {r['llama_test'] or '-'} | {theirs} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ours", type=Path)
    ap.add_argument("llama", type=Path)
    ap.add_argument("--md", type=Path, help="also write the table here")
    args = ap.parse_args()
    try:
        ours = json.loads(args.ours.read_text())
        llama = json.loads(args.llama.read_text())
    except (OSError, ValueError) as e:
        sys.exit(f"compare_llama: cannot read {e.filename if isinstance(e, OSError) else 'input'}: {e}")
    rows = compare(ours, llama)
    table = markdown(rows, ours.get("model", args.ours.stem))
    print(table)
    if args.md:
        args.md.write_text(table + "\n")
    if any(r["ratio"] is None for r in rows):
        sys.exit("compare_llama: some rows have no llama.cpp counterpart (see '-')")


if __name__ == "__main__":
    main()
