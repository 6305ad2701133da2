"""Where a decode step's time goes: torch.profiler over a few greedy steps (CUDA).

    python bench/profile_decode.py M.gguf [--hot-fraction 1.0] [--steps 8] [--prompt 64] [--prefill 512]
    python bench/profile_decode.py M.gguf --batch 1 2 4 [--hot-fraction 1.0]

Prints wall time per token, kernel launches per token, and the top operators by host time and
by device time, so launch overhead and slow kernels can be told apart (``--steps 0`` skips
decode); then the same for one prefill of ``--prefill`` tokens.

``--batch``: how a batched decode step (issue 46: ``--parallel``'s step, a verify's rows) scales
with its rows instead: per batch size, the captured step's time (``BatchGraphs``, as the server
replays it) next to one sequence's, and the device time per kernel of an eager batched step, so
the kernels whose cost grows with the rows stand out.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from sparkpack.runtime.generate import Session
from sparkpack.runtime.models import StoreOptions, load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--hot-fraction", type=float, default=1.0)
    ap.add_argument("--mode", default="auto")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--prefill", type=int, default=512, help="prompt length of the profiled prefill (0: none)")
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes: profile batched steps instead")
    args = ap.parse_args()
    t0 = time.perf_counter()
    model = load_model(args.model, device="cuda", dtype=torch.bfloat16,
                       store=StoreOptions(hot_fraction=args.hot_fraction, miss_mode=args.mode))
    print(f"load {time.perf_counter() - t0:.1f} s", flush=True)
    if args.batch:
        batch_scaling(model, args.batch, args.steps, args.prompt, args.rows)
        return
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
        host_share(session, ids, logits, args.steps)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                ids.append(int(torch.argmax(logits)))
                logits = session.feed(ids)
            torch.cuda.synchronize()
        report(prof, args.steps, "token", args.rows)
    n = args.prefill
    if not n:
        return
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
    end_step = model.experts.end_step
    model.experts.end_step = lambda n_tokens: None  # its count read waits for the device: not yet
    t0 = time.perf_counter()
    model.forward(list(range(300, 300 + n)), session.cache, last_only=True)  # host time to issue the call
    issued = time.perf_counter() - t0
    torch.cuda.synchronize()
    del model.experts.end_step
    end_step(n)
    print(f"prefill {n} tokens: host issued the call in {issued * 1e3:.1f} ms, "
          f"done at {(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
    session.reset()
    host_functions(lambda: session.feed(list(range(300, 300 + n))), args.rows)
    session.reset()
    syncs = sync_points(lambda: session.feed(list(range(300, 300 + n))))
    print("host syncs in one prefill call: " + (", ".join(f"{k} x{v}" for k, v in syncs.items()) or "none"))
    session.reset()
    undo = label_sections(model)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        session.feed(list(range(300, 300 + n)))
        torch.cuda.synchronize()
    undo()
    report(prof, 1, "prefill", args.rows)
    sections = [e for e in prof.key_averages() if e.key.startswith("§") and e.cpu_time_total > 0]  # (not GPU rows)
    print("host time by section (a section's total includes the sections inside it):")
    for e in sorted(sections, key=lambda e: -e.cpu_time_total):
        print(f"  {e.key[1:]:24} {e.count:4} calls {e.cpu_time_total / 1e3:8.2f} ms")


def profiled(call, rows: int) -> tuple[float, str]:
    """Wall seconds of ``call`` (synchronized on both ends) under cProfile, and its top ``rows``
    functions by own time (a wait shows as the call that waits)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    prof.enable()
    call()
    torch.cuda.synchronize()
    prof.disable()
    seconds = time.perf_counter() - t0
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(rows)
    return seconds, "\n".join(out.getvalue().splitlines()[4:])


def host_functions(call, rows: int) -> None:
    """Where the host's time goes in ``call`` (cProfile, by own time): a prefill issues ~750-1400
    kernels, and when issuing them takes longer than running them the Python side is the limit."""
    print("prefill host time by function (own time):\n" + profiled(call, rows)[1])


def host_share(session, ids: list[int], logits, steps: int) -> None:
    """How much of a decode step is the host's, between replays: the captured step replayed back
    to back (the device's time alone) against whole steps (argmax, the store's bookkeeping, the
    session), and where a whole step's host time goes. Leaves the session's state advanced past
    ``ids``: reset it after."""
    graph = session.graph
    if graph is None or graph.graph is None:
        print("no captured step: host share not measured")
        return
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        graph.graph.replay()
    torch.cuda.synchronize()
    replay = (time.perf_counter() - t0) / steps

    def whole_steps():
        nonlocal logits
        for _ in range(steps):
            ids.append(int(torch.argmax(logits)))
            logits = session.feed(ids)

    seconds, table = profiled(whole_steps, 18)
    print(f"replays alone: {replay * 1e3:.2f} ms/token; whole steps (cProfile on): "
          f"{seconds / steps * 1e3:.2f} ms/token")
    print(table)


SECTIONS = ("block", "attn", "delta_net", "ffn", "route_logits", "norm", "add_norm", "attend")
PART_SECTIONS = (("proj", "project"), ("proj", "present"), ("attention", "step"))  # (the model's part, its method)


def label_sections(model) -> "callable":
    """Wrap the model's per-layer methods (on this instance only) in profiler ranges, so the
    profile says how much host time each part of a layer takes (Python included, which the
    per-operator rows do not count). Returns a function that removes the wrappers."""
    from torch.profiler import record_function

    def wrap(name, fn):
        def inner(*a, **k):
            with record_function("§" + name):
                return fn(*a, **k)
        return inner

    targets = [(model, n) for n in SECTIONS if hasattr(model, n)]
    targets += [(getattr(model, part), n) for part, n in PART_SECTIONS]
    targets.append((model.experts, "moe"))
    for obj, n in targets:
        setattr(obj, n, wrap(n, getattr(obj, n)))
    return lambda: [delattr(obj, n) for obj, n in targets]


def sync_points(fn) -> dict[str, int]:
    """Where ``fn`` makes the host wait for the device (torch's sync debug mode), by source line."""
    import collections
    import warnings

    found: collections.Counter = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            found[f"{Path(w.filename).name}:{w.lineno}"] += 1
    return dict(found)


def batch_steps(model, sizes: list[int], steps: int, prompt: int, kernels: bool = True) -> dict[int, dict]:
    """Per batch size B: B sequences fed ``prompt`` tokens each, then their captured batched step
    timed (``step_ms``, as the server replays it) and, with ``kernels``, an eager one profiled
    (``kernels``: device us a step by kernel name)."""
    from sparkpack.runtime.graph import BatchGraphs

    def sync() -> None:
        if model.device.type == "cuda":
            torch.cuda.synchronize()

    out: dict[int, dict] = {}
    for B in sizes:
        sessions = [Session(model, ctx=prompt + 4 * steps + 64) for _ in range(B)]
        for b, s in enumerate(sessions):
            s.feed(list(range(100 + 7 * b, 100 + 7 * b + prompt)))
        caches = [s.cache for s in sessions]
        graphs = BatchGraphs(model, capture=model.device.type == "cuda")  # (the CPU: a smoke run)
        for _ in range(3):  # the first captures
            graphs.step([5] * B, caches)
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            graphs.step([5] * B, caches)
        sync()
        out[B] = {"step_ms": (time.perf_counter() - t0) / steps * 1e3}
        if kernels:
            model.decode_batch([5] * B, caches)  # (eager: compiled already by the capture's warm-up)
            sync()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    model.decode_batch([5] * B, caches)
                sync()
            per: dict[str, float] = {}
            for e in prof.events():
                if e.device_type.name == "CUDA":
                    name = e.name.split("(")[0][:48]
                    per[name] = per.get(name, 0.0) + e.time_range.elapsed_us() / steps
            out[B]["kernels"] = per
        del graphs, sessions, caches
        if model.device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def batch_scaling(model, sizes: list[int], steps: int, prompt: int, rows: int) -> None:
    """``batch_steps`` printed: each size's captured step, then the ``rows`` kernels that take the
    most device time, per size, so those whose cost grows with the rows stand out."""
    res = batch_steps(model, sizes, steps, prompt)
    for B in sizes:
        ms = res[B]["step_ms"]
        print(f"B={B}: captured step {ms:.2f} ms, {B / ms * 1e3:.1f} tok/s together", flush=True)
    kernels = {B: res[B]["kernels"] for B in sizes}
    names = sorted({n for per in kernels.values() for n in per}, key=lambda n: -max(k.get(n, 0.0) for k in kernels.values()))
    print("device us per eager batched step, by kernel:")
    print(f"{'kernel':48} " + " ".join(f"{'B=' + str(B):>9}" for B in sizes))
    for n in names[:rows]:
        print(f"{n:48} " + " ".join(f"{kernels[B].get(n, 0.0):9.1f}" for B in sizes))
    print(f"{'total':48} " + " ".join(f"{sum(kernels[B].values()):9.1f}" for B in sizes))


def report(prof, per: int, unit: str, rows: int) -> None:
    """Launch count, then the top operators by host time and by device time."""
    ka = prof.key_averages()
    launches = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    print(f"kernel launches per {unit}: {launches / per:.0f}")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))
    print(ka.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=60))

if __name__ == "__main__":
    main()
