"""Throughput and peak memory of ``repack synth`` for one preset and quant mix.

Runs the real command in a child process (so its peak RSS, worker processes included, is read
from ``getrusage(RUSAGE_CHILDREN)``) and prints a one-line table. Needs only the project and its
gguf/numpy/tqdm/click dependencies.

    python bench/synth_bench.py --arch qwen35moe --preset qwen3.6-35b-a3b --quant Q4_K_M -o /tmp/m.gguf

Run from the repository root (the child is ``python -m repack.cli``). Where gguf is not installed
(the GPU machine's image), copy the venv's pure-Python ``gguf`` package into an ignored folder such
as ``build/synthdeps/`` and put that folder on ``PYTHONPATH``.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen35moe")
    ap.add_argument("--preset", default="qwen3.6-35b-a3b")
    ap.add_argument("--quant", default="Q4_K_M")
    ap.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 16))
    ap.add_argument("--layers", type=int, default=None, help="cut the preset to its first N layers")
    ap.add_argument("--keep", action="store_true", help="keep the written file")
    ap.add_argument("-o", "--output", type=Path, required=True)
    a = ap.parse_args()

    cmd = [sys.executable, "-m", "sparkpack.repack.cli", "synth", "--arch", a.arch, "--preset", a.preset, "--quant", a.quant,
           "--jobs", str(a.jobs), "-o", str(a.output)]
    if a.layers:
        cmd += ["--layers", str(a.layers)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - t0
    size = a.output.stat().st_size
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if not a.keep:
        a.output.unlink()
    print(f"{'arch':<10} {'preset':<16} {'quant':<7} {'jobs':>4} {'size GiB':>9} {'seconds':>8} {'GB/s':>6} "
          f"{'peak RSS MiB':>12}")
    print(f"{a.arch:<10} {a.preset:<16} {a.quant:<7} {a.jobs:>4} {size / 2**30:>9.2f} {seconds:>8.1f} "
          f"{size / seconds / 1e9:>6.2f} {peak_kib / 1024:>12.0f}")


if __name__ == "__main__":
    main()
