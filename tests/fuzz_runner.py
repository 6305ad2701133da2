"""Run fuzz cases (tests/fuzzing.py) in worker processes, each case under a time and memory bound.

A worker builds the clean inputs once, limits its address space (``RLIMIT_AS``) to what it uses
after a warm-up case plus ``--mem-gib``, then runs the case indices it is sent, one JSON result a
line. A case past ``--case-seconds`` is interrupted (SIGALRM) and counted a ``hang``; a worker
silent for twice that is killed and its case counted a ``hang``; a ``MemoryError`` is a
``blowup``; a worker that dies of a signal (SIGABRT, SIGSEGV) is a ``crash``. The parent restarts
dead workers and carries on.

    python -m tests.fuzz_runner --cases 10000 --seed 1 --workers 2
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BAD = ("traceback", "noisy", "accepted", "hang", "blowup", "crash")


class _CaseTimeout(BaseException):
    pass


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(root: Path, seed: int, case_seconds: int, mem_gib: float) -> None:
    """Read case indices on stdin, answer one JSON line each on the original stdout."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # commands' stray output (C libraries included) goes nowhere
    os.dup2(devnull, 2)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(REPO))
    from tests.fuzzing import Bench, Result, run_case

    bench = Bench(root)
    scratch = root / f"scratch-{os.getpid()}"
    run_case(bench, seed, 0, scratch)  # warm-up: imports, kernels, caches
    limit = _vm_size() + int(mem_gib * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    def alarm(signum, frame):
        raise _CaseTimeout()

    signal.signal(signal.SIGALRM, alarm)
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        index = int(line)
        t0 = time.monotonic()
        signal.alarm(case_seconds)
        try:
            r = run_case(bench, seed, index, scratch)
        except _CaseTimeout:
            r = Result("?", "hang", f"past {case_seconds} s")
        except MemoryError:
            r = Result("?", "blowup", f"MemoryError past +{mem_gib} GiB")
        except Exception as e:  # noqa: BLE001 - an escape outside a command: a bug in the case or the code
            r = Result("?", "traceback", f"{type(e).__name__}: {str(e)[:200]}")
        finally:
            signal.alarm(0)
        out.write(json.dumps({"index": index, "kind": r.kind, "outcome": r.outcome, "detail": r.detail,
                              "seconds": round(time.monotonic() - t0, 3)}) + "\n")


@dataclass
class Report:
    counts: Counter = field(default_factory=Counter)  # (kind, outcome) -> n
    bad: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def outcomes(self) -> Counter:
        c: Counter = Counter()
        for (_, outcome), n in self.counts.items():
            c[outcome] += n
        return c

    def table(self) -> str:
        kinds = sorted({k for k, _ in self.counts})
        outs = ["ok", "refused", *BAD]
        rows = [f"{'kind':<10}" + "".join(f"{o:>10}" for o in outs)]
        for k in kinds:
            rows.append(f"{k:<10}" + "".join(f"{self.counts.get((k, o), 0):>10}" for o in outs))
        total = self.outcomes()
        rows.append(f"{'total':<10}" + "".join(f"{total.get(o, 0):>10}" for o in outs))
        return "\n".join(rows)


class _Worker:
    def __init__(self, root: Path, seed: int, case_seconds: int, mem_gib: float):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fuzz_runner", "--worker", "--root", str(root), "--seed", str(seed),
             "--case-seconds", str(case_seconds), "--mem-gib", str(mem_gib)],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        ready = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not ready:
            raise RuntimeError("a fuzz worker failed to start")
        self.index: int | None = None
        self.since = 0.0

    def send(self, index: int) -> None:
        self.index, self.since = index, time.monotonic()
        self.proc.stdin.write(f"{index}\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def run(indices: list[int], seed: int, root: Path, workers: int = 2, case_seconds: int = 30, mem_gib: float = 4.0,
        log=lambda line: None) -> Report:
    """Run the cases ``indices`` of ``seed``; ``log`` gets each bad case's JSON line."""
    sys.path.insert(0, str(REPO))
    from tests.fuzzing import Bench

    Bench(root)  # build the clean inputs once, before the workers share them
    report, t0 = Report(), time.monotonic()
    todo = list(reversed(indices))
    pool = [_Worker(root, seed, case_seconds, mem_gib) for _ in range(max(1, min(workers, len(indices))))]
    sel = selectors.DefaultSelector()
    for w in pool:
        sel.register(w.proc.stdout, selectors.EVENT_READ, w)  # type: ignore[arg-type]

    def record(res: dict) -> None:
        report.counts[(res["kind"], res["outcome"])] += 1
        if res["outcome"] in BAD:
            report.bad.append(res)
            log(json.dumps(res))

    def replace(w: _Worker) -> _Worker:
        sel.unregister(w.proc.stdout)
        w.kill()
        fresh = _Worker(root, seed, case_seconds, mem_gib)
        sel.register(fresh.proc.stdout, selectors.EVENT_READ, fresh)  # type: ignore[arg-type]
        pool[pool.index(w)] = fresh
        return fresh

    for w in pool:
        if todo:
            w.send(todo.pop())
    while any(w.index is not None for w in pool):
        for key, _ in sel.select(timeout=1.0):
            w = key.data
            line = w.proc.stdout.readline()
            if line:
                record(json.loads(line))
                w.index = None
            else:  # the worker died in the middle of a case
                code = w.proc.wait()
                outcome = "crash" if code < 0 and -code != signal.SIGKILL else "blowup" if code < 0 else "crash"
                record({"index": w.index, "kind": "?", "outcome": outcome,
                        "detail": f"worker died ({signal.Signals(-code).name if code < 0 else code})"})
                w = replace(w)
            if todo and w.index is None:
                w.send(todo.pop())
        for w in list(pool):
            if w.index is not None and time.monotonic() - w.since > 2 * case_seconds + 30:
                record({"index": w.index, "kind": "?", "outcome": "hang", "detail": "worker silent; killed"})
                w = replace(w)
                if todo:
                    w.send(todo.pop())
    for w in pool:
        w.proc.stdin.close()  # type: ignore[union-attr]
        w.kill()
    report.seconds = time.monotonic() - t0
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=10000)
    ap.add_argument("--first", type=int, default=1, help="first case index (0 is the warm-up)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--case-seconds", type=int, default=30)
    ap.add_argument("--mem-gib", type=float, default=4.0)
    ap.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "sparkpack-fuzz",
                    help="where the clean inputs are built (kept between runs) and cases run")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.root, a.seed, a.case_seconds, a.mem_gib)
        return
    report = run(list(range(a.first, a.first + a.cases)), a.seed, a.root, a.workers, a.case_seconds, a.mem_gib,
                 log=lambda line: print(line, flush=True))
    print(report.table())
    print(f"{sum(report.counts.values())} cases in {report.seconds:.0f} s (seed {a.seed}, {a.workers} workers, "
          f"{a.case_seconds} s and +{a.mem_gib} GiB per case)")
    sys.exit(1 if report.bad else 0)


if __name__ == "__main__":
    main()
