"""Calibration at prefill speed (CUDA): ``repack calibrate`` tok/s and peak RSS, all-GPU and under a
``--vram`` budget, next to the all-GPU prefill tok/s of the very same token windows.

    python bench/calibrate_speed.py --corpus C.jsonl [--corpus D.jsonl] [--model M.gguf] [--vram 14GiB]
                                    [--max-tokens N] [--ctx 4096] [--json out.json] [--md out.md]

The model defaults to the full-size qwen3.6-35b-a3b synthetic Q4_K_M that bench/gpu_session.sh
writes (``$BENCH_DIR/qwen36-q4km.gguf``, default /var/tmp/sparkpack-bench), written here with
the same command when it is missing. For every corpus:
  - prefill: one child process opens the model all-GPU as ``repack calibrate`` does, warms a
    session up and times a fresh prompt of each window calibration replays (the corpus rendered
    with the model's template, cut at ``--ctx``, up to ``--max-tokens``): the speed a user's
    prompts of the same tokens get; and one prompt of the first 8192 of those tokens;
  - calibrate: the real command in a child process per configuration (all-GPU, ``--vram``), its
    replay tok/s as it prints them (warm-up apart), its wall time and its peak RSS (VmHWM, which
    counts file-backed pages too).
Prints a markdown table (and writes it to --md), and the numbers as JSON (--json or
$OUT/calibrate_speed.json). Targets (issue 31): calibration >= 70% of the all-GPU prefill tok/s
all-GPU, >= 50% under --vram 14GiB.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"all-GPU": 0.7, "vram": 0.5}

# A child running a repack command in its own process, reporting the resident set it started from
# (torch and the runtime imported) and its peak (/proc/self/status) on stderr; the RSS test's too.
PEAK_RSS = """
import json, sys
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
import sparkpack.runtime.calibration
from sparkpack.repack.cli import main
base = status("VmRSS:")
sys.argv = ["repack", *sys.argv[1:]]
try:
    main()
finally:
    print("RSS", json.dumps({"base": base, "peak": status("VmHWM:")}), file=sys.stderr)
"""


def default_model() -> Path:
    """bench/gpu_session.sh's model, written with its command when missing."""
    path = Path(os.environ.get("BENCH_DIR", "/var/tmp/sparkpack-bench")) / "qwen36-q4km.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "sparkpack.repack.cli", "synth", "--arch", "qwen35moe", "--preset",
                        "qwen3.6-35b-a3b", "--quant", "Q4_K_M", "-j", "16", "--skew", "reference", "-o", str(path)],
                       check=True, stdout=subprocess.DEVNULL, cwd=REPO)
    return path


def windows(router, corpus: Path, ctx: int, max_tokens: int | None) -> list[list[int]]:
    """The token windows ``repack calibrate`` replays from ``corpus``, in order."""
    from sparkpack.calibrate.readers import read_corpus
    from sparkpack.calibrate.render import ChatRenderer, RenderError

    renderer = ChatRenderer(router.tokenizer, router.render_chat)
    out, n = [], 0
    for conv in read_corpus(corpus)[0]:
        try:
            ids = renderer.render(conv).ids
        except RenderError:
            continue
        if max_tokens is not None:
            ids = ids[: max_tokens - n]
        out += [ids[w: w + ctx] for w in range(0, len(ids), ctx)]
        n += len(ids)
        if max_tokens is not None and n >= max_tokens:
            break
    return [w for w in out if w]


def prefill_child(a: argparse.Namespace) -> None:
    """All-GPU prefill tok/s of each corpus's windows, and of one prompt of 8192 of its tokens: the
    model opened as calibrate opens it, its router's session used without the routing tap."""
    import torch

    from sparkpack.runtime.calibration import open_router
    from sparkpack.runtime.options import run_options
    from sparkpack.runtime.generate import Session

    router = open_router(run_options(a.model, device=a.device, ctx=a.ctx, prefill_chunk=a.prefill_chunk, no_learn=True))
    session = router.session
    sync = torch.cuda.synchronize if router.model.device.type == "cuda" else (lambda: None)
    if router.model.device.type == "cuda":
        session.warm_up()
    long = Session(router.model, prefill_chunk=a.prefill_chunk, ctx=8192 + 64, checkpoints=0)

    def timed(s: Session, ids: list[int]) -> float:
        s.reset()
        sync()
        t0 = time.perf_counter()
        s.feed(ids)
        sync()
        return time.perf_counter() - t0

    result = {}
    for corpus in a.corpus:
        wins = windows(router, corpus, a.ctx, a.max_tokens)
        seconds = sum(timed(session, w) for w in wins)
        tokens = sum(map(len, wins))
        flat = [t for w in wins for t in w][:8192]
        timed(long, flat)  # its calls' shapes compiled and captured first
        result[str(corpus)] = {"tokens": tokens, "windows": len(wins), "tok_s": tokens / seconds,
                               "one_prompt_tokens": len(flat), "one_prompt_tok_s": len(flat) / timed(long, flat)}
    print("PREFILL " + json.dumps(result), flush=True)


def calibrate(a: argparse.Namespace, corpus: Path, extra: list[str], out: Path) -> dict:
    """The real command in a child: replay tok/s, warm-up, wall time, peak RSS."""
    cmd = [sys.executable, "-c", PEAK_RSS, "calibrate", str(a.model), "--corpus", str(corpus), "-o", str(out),
           "--force", "--device", a.device, "--ctx", str(a.ctx), "--prefill-chunk", str(a.prefill_chunk), "--quiet",
           *extra]
    if a.max_tokens is not None:
        cmd += ["--max-tokens", str(a.max_tokens)]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"calibrate {' '.join(extra)} failed:\n{res.stderr[-3000:]}")
    replay = re.search(r"replay: (\d+) tokens in ([\d.]+) s \((\d+) tokens/s\)", res.stdout)
    warm = re.search(r"warmed up in ([\d.]+) s", res.stderr)
    rss = json.loads(res.stderr.split("RSS ", 1)[1].splitlines()[0])
    placed = [ln for ln in res.stderr.splitlines() if ln.startswith("experts:")]
    tokens, seconds = int(replay.group(1)), float(replay.group(2))
    return {"tokens": tokens, "seconds": seconds, "tok_s": float(replay.group(3)), "warm_up_s": float(warm.group(1)) if warm else None,
            "wall_s": wall, "peak_rss": rss["peak"], "base_rss": rss["base"], "store": placed[0] if placed else None}


def markdown(model: Path, rows: list[dict]) -> str:
    lines = [f"Calibration vs all-GPU prefill of the same windows, `{model.name}` "
             f"({model.stat().st_size / 2**30:.1f} GiB)", "",
             "| corpus | configuration | tokens | calibrate tok/s | prefill tok/s (same windows) | ratio | target "
             "| one 8k prompt tok/s | warm-up s | wall s | peak RSS GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        c, p = r["calibrate"], r["prefill"]
        ratio = c["tok_s"] / p["tok_s"]
        target = TARGETS["vram" if r["config"] != "all-GPU" else "all-GPU"]
        lines.append(f"| {Path(r['corpus']).name} | {r['config']} | {c['tokens']} | {c['tok_s']:.0f} | {p['tok_s']:.0f} "
                     f"| {ratio:.0%} | {'>=' if ratio >= target else '<'} {target:.0%} | {p['one_prompt_tok_s']:.0f} "
                     f"| {c['warm_up_s'] or 0:.1f} | {c['wall_s']:.1f} | {c['peak_rss'] / 2**30:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, action="append", required=True, help="a corpus file or folder (repeatable)")
    ap.add_argument("--model", type=Path, help="default: bench/gpu_session.sh's full-size qwen3.6 Q4_K_M")
    ap.add_argument("--vram", default="14GiB")
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the bench itself on a tiny model")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--md", type=Path)
    ap.add_argument("--prefill-child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.prefill_child:
        return prefill_child(a)
    a.model = a.model or default_model()
    argv = [sys.executable, __file__, "--prefill-child", "--model", str(a.model), "--ctx", str(a.ctx), "--device", a.device,
            "--prefill-chunk", str(a.prefill_chunk), *[x for c in a.corpus for x in ("--corpus", str(c))]]
    if a.max_tokens is not None:
        argv += ["--max-tokens", str(a.max_tokens)]
    res = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
    if res.returncode != 0:
        raise SystemExit(f"prefill child failed:\n{res.stderr[-3000:]}")
    prefill = json.loads(res.stdout.split("PREFILL ", 1)[1].splitlines()[0])
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    rows = []
    for corpus in a.corpus:
        for config, extra in (("all-GPU", []), (f"--vram {a.vram}", ["--vram", a.vram])):
            cal = calibrate(a, corpus, extra, out_dir / f"calibrate_speed_{len(rows)}.profile.json")
            rows.append({"corpus": str(corpus), "config": config, "calibrate": cal, "prefill": prefill[str(corpus)]})
            print(f"{corpus.name} {config}: {cal['tok_s']:.0f} tok/s (prefill {prefill[str(corpus)]['tok_s']:.0f}), "
                  f"peak RSS {cal['peak_rss'] / 2**30:.2f} GiB; {cal['store']}", flush=True)
    table = markdown(a.model, rows)
    print(table)
    if a.md is not None:
        a.md.write_text(table)
    (a.json or out_dir / "calibrate_speed.json").write_text(json.dumps({"model": str(a.model), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
