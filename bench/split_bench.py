"""Throughput and peak memory of ``repack split``, ``verify`` and ``join`` on one GGUF.

Each step runs the real command in its own child process; its peak RSS comes from ``os.wait4``
(that child's rusage alone), so the numbers are the command's, not this script's. GB/s is the
GGUF's size over the step's wall time. The join output is compared with the source byte for byte.

    python bench/split_bench.py MODEL.gguf [--compress] [--hot-fraction 0.5] [--workdir DIR]

Run from the repository root. The page cache is not dropped (that needs root): run once to warm
it, or drop it yourself, and say which when reporting numbers.
"""
from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_child(cmd: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS in bytes) of one child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    return seconds, usage.ru_maxrss * 1024


def cold_bytes(pack: Path) -> tuple[int, int]:
    """(expert bytes, bytes on disk) over the cold shards, from the manifest."""
    manifest = json.loads((pack / "manifest.json").read_text())
    raw = stored = 0
    for layer in manifest["experts"]:
        for e in layer["experts"]:
            if not e["hot"]:
                raw += layer["expert_nbytes"]
                stored += e["stored_nbytes"]
    return raw, stored


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--compress", action="store_true")
    ap.add_argument("--hot-fraction", default="0.5")
    ap.add_argument("--profile", type=Path)
    ap.add_argument("--workdir", type=Path, help="where the pack and joined GGUF go (default: beside the model)")
    ap.add_argument("--keep", action="store_true", help="keep the pack and the joined GGUF")
    a = ap.parse_args()

    size = a.model.stat().st_size
    work = Path(tempfile.mkdtemp(prefix="split_bench-", dir=a.workdir or a.model.parent))
    pack, joined = work / "model.sparkpack", work / "joined.gguf"
    repack = [sys.executable, "-m", "sparkpack.repack.cli"]
    split = repack + ["split", str(a.model), "-o", str(pack), "--hot-fraction", a.hot_fraction]
    if a.compress:
        split.append("--compress")
    if a.profile:
        split += ["--profile", str(a.profile)]
    rows = []
    try:
        rows.append(("split", *run_child(split)))
        rows.append(("verify", *run_child(repack + ["verify", str(pack)])))
        rows.append(("join", *run_child(repack + ["join", str(pack), "-o", str(joined)])))
        same = filecmp.cmp(a.model, joined, shallow=False)
        n_files = sum(len(f) for _, _, f in os.walk(pack))
        raw, stored = cold_bytes(pack)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"model {a.model.name}: {size / 2**30:.2f} GiB, pack files {n_files}, "
          f"compress {'zstd' if a.compress else 'off'}, join byte-identical: {'yes' if same else 'NO'}")
    if raw:
        print(f"cold shards: {raw / 2**30:.3f} GiB of expert bytes stored in {stored / 2**30:.3f} GiB "
              f"(ratio {raw / stored:.3f}, {1 - stored / raw:.1%} saved)")
    print(f"{'step':<7} {'seconds':>8} {'GB/s':>6} {'peak RSS MiB':>12}")
    for step, seconds, rss in rows:
        print(f"{step:<7} {seconds:>8.2f} {size / seconds / 1e9:>6.2f} {rss / 2**20:>12.0f}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
