"""Where a decode step's time goes: torch.profiler over a few greedy steps (CUDA).

    python bench/profile_decode.py M.gguf [--hot-fraction 1.0] [--steps 8] [--prompt 64] [--prefill 512]

Prints wall time per token, kernel launches per token, and the top operators by host time and
by device time, so launch overhead and slow kernels can be told apart (``--steps 0`` skips
decode); then the same for one prefill of ``--prefill`` tokens.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from runtime.generate import Session  # noqa: E402
from runtime.models import StoreOptions, load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--hot-fraction", type=float, default=1.0)
    ap.add_argument("--mode", default="auto")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--prefill", type=int, default=512, help="prompt length of the profiled prefill")
    args = ap.parse_args()
    t0 = time.perf_counter()
    model = load_model(args.model, device="cuda", dtype=torch.bfloat16,
                       store=StoreOptions(hot_fraction=args.hot_fraction, mode=args.mode))
    print(f"load {time.perf_counter() - t0:.1f} s", flush=True)
    session = Session(model)
    ids = list(range(100, 100 + args.prompt))
    t0 = time.perf_counter()
    logits = session.feed(ids)
    print(f"prefill {len(ids)} tokens: {time.perf_counter() - t0:.2f} s (first call, compiles included)", flush=True)
    if args.steps:
        for _ in range(4):
            ids.append(int(torch.argmax(logits)))
            logits = session.feed(ids)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            ids.append(int(torch.argmax(logits)))
            logits = session.feed(ids)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / args.steps
        print(f"decode: {dt * 1e3:.1f} ms/token ({1 / dt:.1f} tok/s) unprofiled", flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                ids.append(int(torch.argmax(logits)))
                logits = session.feed(ids)
            torch.cuda.synchronize()
        report(prof, args.steps, "token", args.rows)
    n = args.prefill
    session.reset()
    session.feed(list(range(200, 200 + n)))  # warm (compiles the prefill kernels)
    session.reset()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    session.feed(list(range(300, 300 + n)))
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    print(f"prefill {n} tokens (warm): {dt:.3f} s ({n / dt:.0f} tok/s)", flush=True)
    session.reset()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        session.feed(list(range(300, 300 + n)))
        torch.cuda.synchronize()
    report(prof, 1, "prefill", args.rows)


def report(prof, per: int, unit: str, rows: int) -> None:
    """Launch count, then the top operators by host time and by device time."""
    ka = prof.key_averages()
    launches = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    print(f"kernel launches per {unit}: {launches / per:.0f}")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))
    print(ka.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=60))

if __name__ == "__main__":
    main()
