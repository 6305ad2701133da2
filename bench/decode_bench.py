"""All-GPU decode and prefill speed of the runtime, in llama-bench's terms (CUDA).

    python bench/decode_bench.py M.gguf [--depths 128 1024 4096] [--prefill 512 4096] [--tokens 64]
                                        [--prefill-chunks 2048 512 4096]

Decode: prefill ``depth`` tokens, then time ``--tokens`` greedy steps (tok/s at that KV depth)
three ways: the runtime's loop (``Session.decode``, what ``generate`` and ``spark-run`` run: graph
replays, each launched before the host reads the token it feeds), graph replays with the token
read back before each launch (``sync``: the loop of sessions 1-13), and eager steps. Prefill:
tok/s of a fresh prompt of each length (median of 5 calls, each recorded) in a session like
``spark-run``'s (calls of up to 512 tokens replayed from CUDA graphs) and of the session's first
call (which captured them), in calls of each ``--prefill-chunks`` size (default: the runtime's),
with the device memory each call's temporaries took and the graphs' pool next to what the VRAM
plan counts for them. Also: the graph and eager steps
must give the same tokens and logits, and the runtime's loop the same tokens.
Writes JSON to $OUT/decode_bench.json (or --json).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from sparkpack.formats.memory import PREFILL_CHUNK, PREFILL_GRAPH_TOKENS, prefill_activation_bytes, prefill_graph_bytes
from sparkpack.runtime.generate import Session
from sparkpack.runtime.models import SessionOptions, StoreOptions, load_model


def prompt(n: int, n_vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(100, n_vocab - 100, (n,), generator=g).tolist()


def warm_session(model, depth: int, graphs: bool, ctx: int) -> tuple[Session, list[int], torch.Tensor]:
    """A session fed ``depth`` prompt tokens and two greedy steps (the first captures the graph)."""
    session = Session(model, ctx=ctx, graphs=graphs)
    ids = prompt(depth, model.spec.n_vocab)
    logits = session.feed(ids)
    for _ in range(2):
        ids.append(int(torch.argmax(logits)))
        logits = session.feed(ids)
    torch.cuda.synchronize()
    return session, ids, logits


def decode(model, depth: int, n: int, graphs: bool, ctx: int) -> tuple[float, list[int], torch.Tensor]:
    """tok/s, tokens and logits of ``n`` greedy steps, each token read back before the next step."""
    session, ids, logits = warm_session(model, depth, graphs, ctx)
    out, steps = [], []
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(torch.argmax(logits))
        out.append(tok)
        ids.append(tok)
        logits = session.feed(ids)
        steps.append(logits)
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0), out, torch.stack(steps)


def decode_ahead(model, depth: int, n: int, ctx: int) -> tuple[float, list[int]]:
    """tok/s and tokens of ``n`` greedy steps of the runtime's decode loop (``Session.decode``)."""
    session, _, logits = warm_session(model, depth, True, ctx)
    t0 = time.perf_counter()
    out = list(session.decode(logits, n + 1, torch.argmax))  # n + 1 tokens: n steps
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0), out[:n]


def pool_bytes(pool) -> int:
    """Device memory held by one CUDA graph memory pool (its segments)."""
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", ())) == tuple(pool))


def prefill(model, n: int, ctx: int, chunk: int = PREFILL_CHUNK, reps: int = 5) -> dict:
    """tok/s of ``reps`` prefills of ``n`` tokens in a session as ``spark-run`` runs one (short
    calls replayed from CUDA graphs: ``runtime.graph.PrefillGraphs``), the device memory a
    prefill added at its peak over what the session held before it (its temporaries), the tok/s
    of the session's first such prefill (which captured its graphs), the bytes those graphs
    keep in their pool and the tokens per call the session used. Eager prefills of the all-attention shapes were host-bound, and their
    times scattered by machine and process (58-108 ms for one 512-token Qwen3-30B call); the
    median of the repetitions is reported, llama-bench averages 5."""
    # compile first, with a full chunk: the MoE kernels' tile shape (and so what Triton compiles)
    # depends on the tokens per chunk
    Session(model, ctx=ctx, graphs=False, prefill_chunk=chunk).feed(prompt(min(n, chunk), model.spec.n_vocab))
    session = Session(model, ctx=ctx, prefill_chunk=chunk)
    ids = prompt(n, model.spec.n_vocab)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    session.feed(ids)
    torch.cuda.synchronize()
    first = n / (time.perf_counter() - t0)
    graphs = session.prefill
    pool = pool_bytes(graphs.pool) if graphs is not None and graphs.pool is not None else 0
    rates, peak = [], 0
    for _ in range(reps):
        session.reset()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        session.feed(ids)
        torch.cuda.synchronize()
        rates.append(n / (time.perf_counter() - t0))
        peak = max(peak, torch.cuda.max_memory_allocated() - base)
    calls = min(chunk, PREFILL_GRAPH_TOKENS) if graphs is not None else chunk
    return {"rates": rates, "peak": peak, "first": first, "pool": pool, "calls": calls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--depths", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--prefill", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--prefill-chunks", type=int, nargs="+", default=[PREFILL_CHUNK],
                    help="prompt tokens per forward call; the first is the one compared with llama.cpp")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--eager-tokens", type=int, default=16)
    ap.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "decode_bench.json")
    args = ap.parse_args()
    ctx = max(args.depths) + args.tokens + 8
    t0 = time.perf_counter()
    model = load_model(args.model, device="cuda", dtype=torch.bfloat16,
                       store=StoreOptions(hot_fraction=1.0, cache_slots=0, miss_mode="zerocopy"),
                       session=SessionOptions(ctx=ctx))
    print(f"loaded {args.model.name} in {time.perf_counter() - t0:.1f} s", flush=True)
    res: dict = {"model": args.model.name, "device": torch.cuda.get_device_name(), "decode": [], "prefill": []}
    for depth in args.depths:
        a_tps, a_tok = decode_ahead(model, depth, args.tokens, ctx)
        g_tps, g_tok, g_log = decode(model, depth, args.tokens, True, ctx)
        e_tps, e_tok, e_log = decode(model, depth, args.eager_tokens, False, ctx)
        k = args.eager_tokens
        same = g_tok[:k] == e_tok and torch.equal(g_log[:k], e_log) and a_tok == g_tok
        res["decode"].append({"depth": depth, "graph_tok_s": a_tps, "sync_tok_s": g_tps, "eager_tok_s": e_tps,
                              "graph_equals_eager": same})
        print(f"decode at depth {depth:5}: {a_tps:7.1f} tok/s (graph, one step ahead; {g_tps:7.1f} reading each "
              f"token first), eager {e_tps:6.1f} tok/s, identical {same}", flush=True)
    res["decode_vram_peak_allocated"] = torch.cuda.max_memory_allocated()  # (prefill rows reset the peak)
    res["decode_vram_peak_reserved"] = torch.cuda.max_memory_reserved()
    for chunk in args.prefill_chunks:
        key = "prefill" if chunk == args.prefill_chunks[0] else f"prefill_chunk_{chunk}"
        for n in args.prefill:
            r = prefill(model, n, ctx, chunk)
            tps = statistics.median(r["rates"])
            planned = prefill_activation_bytes(model.spec, chunk, ctx)
            res.setdefault(key, []).append({"tokens": n, "tok_s": tps, "tok_s_each": r["rates"], "chunk": chunk,
                                            "call_tokens": r["calls"], "first_call_tok_s": r["first"],
                                            "temporaries_peak": r["peak"], "temporaries_planned": planned,
                                            "graph_pool": r["pool"], "graph_pool_planned": prefill_graph_bytes(model.spec)})
            print(f"prefill {n:5} tokens in chunks of {chunk:4} (calls of {r['calls']}): {tps:8.1f} tok/s (median of "
                  f"{', '.join(f'{x:.0f}' for x in r['rates'])}; first call, capturing: {r['first']:.0f}), "
                  f"temporaries {r['peak'] / 2**20:.0f} MiB (planned {planned / 2**20:.0f}), graph pool "
                  f"{r['pool'] / 2**20:.0f} MiB (planned {prefill_graph_bytes(model.spec) / 2**20:.0f})", flush=True)
    args.json.write_text(json.dumps(res, indent=1) + "\n")
    if not all(d["graph_equals_eager"] for d in res["decode"]):
        raise SystemExit("graph replay and eager decode differ")


if __name__ == "__main__":
    main()
