"""Where a long prefill's time goes (CUDA): first vs warm calls, and the kernels of a warm chunk.

    python bench/prefill_profile.py M.gguf [--tokens 8192] [--chunk 2048] [--hot-fraction 0.6]
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import torch

from sparkpack.runtime.generate import Session
from sparkpack.runtime.models import StoreOptions, load_model


def ids_of(n: int, n_vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, n_vocab - 100, (n,), generator=g).tolist()


def timed_feed(session: Session, ids: list[int]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    session.feed(ids)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--hot-fraction", type=float, default=None)
    ap.add_argument("--ctx", type=int, default=None)
    ap.add_argument("--profile-chunk", action="store_true")
    a = ap.parse_args()
    t0 = time.perf_counter()
    opts = StoreOptions(hot_fraction=a.hot_fraction, ctx=a.ctx or max(a.tokens) + 64, prefill_chunk=a.chunk)
    model = load_model(a.model, device="cuda", dtype=torch.bfloat16, store=opts)
    torch.cuda.synchronize()
    print(f"load {time.perf_counter() - t0:.1f} s; hot_fraction={a.hot_fraction}", flush=True)
    st = model.store

    def streamed() -> int:
        st.flush()  # learn the deferred calls' counts first
        return st.stats.bytes_streamed

    for n in a.tokens:
        s = Session(model, ctx=n + 64, prefill_chunk=a.chunk)
        ids = ids_of(n, model.spec.n_vocab, n)
        b0 = streamed()
        first = timed_feed(s, ids)
        b1 = streamed()
        s.reset()
        warm = timed_feed(s, ids)
        b2 = streamed()
        print(f"n={n} chunk={a.chunk}: first {n / first:.0f} tok/s ({first:.2f} s, {(b1 - b0) / 1e9:.1f} GB streamed), "
              f"warm {n / warm:.0f} tok/s ({warm:.2f} s, {(b2 - b1) / 1e9:.1f} GB)", flush=True)
    if a.profile_chunk:
        s = Session(model, ctx=a.chunk * 2 + 64, prefill_chunk=a.chunk)
        ids = ids_of(a.chunk * 2, model.spec.n_vocab, 7)
        timed_feed(s, ids[: a.chunk])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            wall = timed_feed(s, ids)
        agg: dict[str, float] = defaultdict(float)
        cnt: dict[str, int] = defaultdict(int)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                agg[ev.name[:90]] += ev.device_time_total / 1e3 if hasattr(ev, "device_time_total") else ev.cuda_time_total / 1e3
                cnt[ev.name[:90]] += 1
        total = sum(agg.values())
        print(f"second chunk of {a.chunk} at depth {a.chunk}: wall {wall * 1e3:.1f} ms, GPU kernels {total:.1f} ms")
        for name, ms in sorted(agg.items(), key=lambda kv: -kv[1])[:30]:
            print(f"  {ms:8.2f} ms {cnt[name]:5d}x  {name}")


if __name__ == "__main__":
    main()
