"""The all-GPU prefill of ``bench/decode_bench.py`` (its ``prefill``: a fresh prompt in a session
as ``spark-run`` runs one, median of 5) measured at several commits on one machine, one process
per commit and round, each importing that commit's ``sparkpack`` (a tree unpacked by
``bench/prefill_bisect.sh``). Prints one line per commit and round.

    python3 bench/prefill_bisect.py M.gguf TREE... [--tokens 512 4096] [--rounds 2] [--budget 520]
                                    [--profile] [--batch 1 2 4]

Why one machine and fresh processes: an eager 512-token call is launch-bound, and its time
differs by machine and by process, so a figure from another session's machine tells nothing;
rounds run the commits in alternating order (ABBA), so a drift of the machine shows as
disagreement between rounds rather than as a commit's cost. Each line also gives an eager
one-token step (host-bound: a proxy for launch overhead) and, with ``--profile``, what one
512-token prompt makes the host do (kernel launches, synchronizations, copies, allocations),
so a change in what a call launches or waits for is seen directly. It also gives the captured
decode (``decode_bench``'s loop) and, with ``--profile``, the device time per kernel of a decode
step, so a commit that slows one kernel is named; ``--batch`` adds the captured batched decode
step of each size (``profile_decode.batch_steps``: a ``--parallel`` step, a verify's rows), with
its kernels under ``--profile``. Packing a branch beside main compares a kernel change on both.

``--spark-run ARGS --prompt-file F`` measures instead what a user runs: each commit's own
``spark-run MODEL -p "$(cat F)" --temperature 0 --no-learn ARGS`` (e.g. ``--vram 14GiB``: decode
at partial residency, whose options have changed less across commits than the runtime's
internals), its decode and prefill tok/s from ``--stats-json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def launches(model, ids: list[int], ctx: int) -> dict:
    """What one fresh prompt of ``ids`` makes the host do, from torch.profiler's CUDA runtime
    events: kernel launches, synchronizations, copies and allocations, and the kernels run."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from sparkpack.runtime.generate import Session

    session = Session(model, ctx=ctx)
    session.feed(ids)
    session.reset()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        session.feed(ids)
        torch.cuda.synchronize()
    counts = {"launch": 0, "sync": 0, "memcpy": 0, "malloc": 0, "kernels": 0}
    for e in prof.events():
        name = e.name
        if e.device_type.name == "CUDA":
            counts["kernels"] += 1
        elif "LaunchKernel" in name:
            counts["launch"] += 1
        elif "Synchronize" in name:
            counts["sync"] += 1
        elif name.startswith(("cudaMemcpy", "cuMemcpy")):
            counts["memcpy"] += 1
        elif name.startswith(("cudaMalloc", "cuMemAlloc", "cudaHostAlloc")):
            counts["malloc"] += 1
    return counts


def kernel_times(model, ctx: int, steps: int = 4) -> dict[str, float]:
    """Device microseconds per decode step by kernel name (eager steps at depth 128: the kernels
    a captured step replays), the largest first: which kernel a slower commit spends it in."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(HERE))
    import decode_bench

    session, ids, logits = decode_bench.warm_session(model, 128, False, ctx)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            ids.append(int(torch.argmax(logits)))
            logits = session.feed(ids)
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            name = e.name.split("(")[0][:60]
            per[name] = per.get(name, 0.0) + e.time_range.elapsed_us() / steps
    return dict(sorted(((k, round(v, 1)) for k, v in per.items()), key=lambda kv: -kv[1])[:30])


def measure(model_path: Path, tokens: list[int], profile_prompt: bool, batch: list[int]) -> dict:
    """One commit in this process (``sparkpack`` from PYTHONPATH): decode_bench's prefill rates,
    an eager one-token step, and optionally the launch counts of one 512-token prompt."""
    import torch

    import sparkpack.runtime as runtime
    from sparkpack.runtime.models import SessionOptions, StoreOptions, load_model

    sys.path.insert(0, str(HERE))
    import decode_bench  # the measurement BENCHMARKS.md's prefill rows come from

    ctx = max(max(tokens) + 72, 1024)
    t0 = time.perf_counter()
    model = load_model(model_path, device="cuda", dtype=torch.bfloat16,
                       store=StoreOptions(hot_fraction=1.0, cache_slots=0, miss_mode="zerocopy"),
                       session=SessionOptions(ctx=ctx))
    out: dict = {"runtime": str(Path(runtime.__file__).parent), "load_s": time.perf_counter() - t0}
    for n in tokens:
        r = decode_bench.prefill(model, n, ctx)
        out[f"prefill_{n}"] = statistics.median(r["rates"])
        out[f"prefill_{n}_each"] = [round(x) for x in r["rates"]]
        out[f"prefill_{n}_calls"] = r["calls"]
    tps, _, _ = decode_bench.decode(model, 128, 8, False, ctx)
    out["eager_step_ms"] = 1000 / tps
    out["decode_tok_s"] = decode_bench.decode_ahead(model, 128, 256, ctx)[0]  # (decode_bench's graph row)
    if batch:  # batched decode steps (issue 46: --parallel's, a verify's rows)
        import profile_decode

        steps = profile_decode.batch_steps(model, batch, 16, 128, kernels=profile_prompt)
        out["batch_step_ms"] = {str(B): r["step_ms"] for B, r in steps.items()}
        if profile_prompt:
            out["batch_kernels_us"] = {str(B): dict(sorted(((k, round(v, 1)) for k, v in r["kernels"].items()),
                                                           key=lambda kv: -kv[1])[:30]) for B, r in steps.items()}
    if profile_prompt:
        try:
            out["kernels_us"] = kernel_times(model, ctx)
        except Exception as e:
            out["kernels_us"] = f"profiler failed: {e}"
        try:
            out["launches_512"] = launches(model, decode_bench.prompt(512, model.spec.n_vocab), ctx)
        except Exception as e:  # (the profiler is a diagnosis: its failure must not lose the rates)
            out["launches_512"] = f"profiler failed: {e}"
    return out


def one_shot(model_path: Path, tree: Path, prompt_file: Path, spark_args: list[str], timeout: float) -> dict:
    """``tree``'s ``spark-run -p`` on the prompt in ``prompt_file`` (its stats), checking that the
    tree's runtime ran."""
    import tempfile

    stats = Path(tempfile.mkstemp(suffix=".json")[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree / "site"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    code = ("import sys, sparkpack.runtime as r; print('runtime', r.__file__, file=sys.stderr); "
            "from sparkpack.runtime.cli import main; sys.argv[0] = 'spark-run'; main()")
    cmd = [sys.executable, "-c", code, str(model_path), "-p", prompt_file.read_text(), "--temperature", "0",
           "--no-learn", "--stats-json", str(stats), *spark_args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise RuntimeError(p.stderr[-2000:])
    ran = next((line.split(" ", 1)[1] for line in p.stderr.splitlines() if line.startswith("runtime ")), "")
    if not ran.startswith(str(tree)):
        raise SystemExit(f"{tree.name}: imported {ran}, not the tree's runtime")
    s = json.loads(stats.read_text())
    stats.unlink()
    return {k: s.get(k) for k in ("decode_tok_s", "decode_tokens", "prefill_tok_s", "prefill_tokens")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("trees", type=Path, nargs="*", help="unpacked commits (each with site/ on its PYTHONPATH)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget", type=float, default=520.0,
                    help="seconds (from $BISECT_START, a Unix time, else from now) after which no new run starts")
    ap.add_argument("--profile", action="store_true", help="also count one 512-token prompt's launches")
    ap.add_argument("--batch", type=int, nargs="*", default=[],
                    help="also time captured batched decode steps of these sizes (e.g. 1 2 4)")
    ap.add_argument("--one", action="store_true", help="(internal) measure this process's commit")
    ap.add_argument("--spark-run", default=None,
                    help="measure each commit's spark-run -p with these options instead (one string, e.g. '--vram 14GiB')")
    ap.add_argument("--prompt-file", type=Path, default=None, help="--spark-run's prompt (a text file)")
    ap.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "prefill_bisect.json")
    args = ap.parse_args()
    if args.spark_run is not None and args.prompt_file is None:
        ap.error("--spark-run needs --prompt-file")
    if args.one:
        print(json.dumps(measure(args.model, args.tokens, args.profile, args.batch)), flush=True)
        return
    start = time.perf_counter() - (time.time() - float(os.environ.get("BISECT_START", time.time())))
    results = []
    for r in range(args.rounds):
        order = args.trees if r % 2 == 0 else list(reversed(args.trees))
        for tree in order:
            if time.perf_counter() - start > args.budget:
                print(f"budget of {args.budget:.0f} s spent: {tree.name} round {r + 1} not run", flush=True)
                continue
            if args.spark_run is not None:
                try:
                    res = one_shot(args.model, tree, args.prompt_file, args.spark_run.split(),
                                   max(60.0, args.budget + 60 - (time.perf_counter() - start)))
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    print(f"{tree.name} round {r + 1}: failed\n{e}", flush=True)
                    continue
                res.update(commit=tree.name, round=r + 1)
                results.append(res)
                print(f"{tree.name} round {r + 1}: spark-run -p {args.spark_run}: decode {res['decode_tok_s']:.1f} tok/s "
                      f"({res['decode_tokens']} tokens), prefill {res['prefill_tok_s']:.1f} tok/s "
                      f"({res['prefill_tokens']} tokens)", flush=True)
                continue
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [str(tree / "site"), *filter(None, [os.environ.get("PYTHONPATH")])]))
            cmd = [sys.executable, __file__, str(args.model), "--one", "--tokens", *map(str, args.tokens)]
            cmd += ["--profile"] if args.profile and r == 0 else []
            cmd += ["--batch", *map(str, args.batch)] if args.batch else []
            try:  # (a run cut off by the budget loses that run only)
                p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                   timeout=max(60.0, args.budget + 60 - (time.perf_counter() - start)))
            except subprocess.TimeoutExpired:
                print(f"{tree.name} round {r + 1}: cut off at the budget", flush=True)
                continue
            if p.returncode:
                print(f"{tree.name} round {r + 1}: failed\n{p.stderr[-2000:]}", flush=True)
                continue
            res = json.loads(p.stdout.strip().splitlines()[-1])
            if not res["runtime"].startswith(str(tree)):  # (the commit's own code, not this checkout's)
                raise SystemExit(f"{tree.name}: imported {res['runtime']}, not the tree's runtime")
            res.update(commit=tree.name, round=r + 1)
            results.append(res)
            rates = "  ".join(f"prefill {n}: {res[f'prefill_{n}']:8.1f} tok/s ({res[f'prefill_{n}_each']})"
                              for n in args.tokens)
            print(f"{tree.name} round {r + 1}: {rates}  eager step {res['eager_step_ms']:.1f} ms  "
                  f"decode {res['decode_tok_s']:.1f} tok/s  load {res['load_s']:.0f} s" + "".join(
                      f"  B={B} step {ms:.2f} ms" for B, ms in res.get("batch_step_ms", {}).items()) + (f"  launches {res['launches_512']}" if "launches_512" in res else ""),
                  flush=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
