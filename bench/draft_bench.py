"""Speculative decoding on the GPU (issue 47): what a verify step costs next to a plain decode step,
and decode speed as a function of the drafts' acceptance.

    python bench/draft_bench.py M.gguf [--vram all|14GiB] [--depth 512] [--tokens 128]
                                [--acceptance 0.5 0.7 0.9] [--draft-tokens 4] [--json OUT.json]

Verify cost: after ``--depth`` prompt tokens, the median time of a plain captured decode step
(each token read back before the next step) and of a captured verify step of 2..5 rows (K = 1..4
drafted tokens), each followed by the rollback of all but its first row (the DeltaNet state copy
back included: the costliest keep), and the ratio of the two.

Decode speed vs acceptance: the plain greedy reply of ``--tokens`` tokens (the runtime's loop,
``Session.decode``) against the same reply drafted by ``bench/forced_drafter.py``, which proposes
the model's own next tokens each with probability p (else a wrong token): on random weights no
real drafter's acceptance means anything, so the acceptance is set, and the speed reported for it
(marked forced in the output). Every drafted reply must equal the plain one token for token.

``--vram all``: every expert on the GPU; a size (``14GiB``): the run's budget as ``spark-run --vram``
plans it (one process per budget: the allocator's cap stays set). Writes JSON to
$OUT/draft_bench_<vram>.json (or --json).
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.forced_drafter import ForcedDrafter, known_continuation  # noqa: E402
from sparkpack.formats.units import parse_size  # noqa: E402
from sparkpack.runtime.generate import Session, continue_tokens  # noqa: E402
from sparkpack.runtime.options import open_model, run_options  # noqa: E402
from sparkpack.runtime.speculative import Speculation  # noqa: E402


def prompt(n: int, n_vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(100, n_vocab - 100, (n,), generator=g).tolist()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def verify_cost(model, ids: list[int], ctx: int, max_k: int, reps: int = 20) -> dict:
    """Median seconds of a plain step and of verify steps of K = 1..max_k drafts."""
    session = Session(model, ctx=ctx)
    logits = session.feed(ids)
    seq = list(ids)
    plain = []
    for i in range(reps + 2):  # (the first steps capture)
        seq.append(int(torch.argmax(logits)))
        t0 = time.perf_counter()
        logits = session.feed(seq)
        int(torch.argmax(logits))
        dt = time.perf_counter() - t0
        if i >= 2:
            plain.append(dt)
    out = {"plain_step_s": statistics.median(plain), "verify": []}
    g = torch.Generator().manual_seed(1)
    for k in range(1, max_k + 1):
        times = []
        for i in range(reps + 1):
            tokens = [seq[-1]] + torch.randint(100, model.spec.n_vocab - 100, (k,), generator=g).tolist()
            t0 = time.perf_counter()
            rows, _ = session.verify(tokens)
            torch.argmax(rows, dim=-1).tolist()
            session.keep(1)
            dt = time.perf_counter() - t0
            seq = list(session.fed) + [int(torch.argmax(rows[0]))]
            if i >= 1:  # (the first captures)
                times.append(dt)
        med = statistics.median(times)
        out["verify"].append({"k": k, "rows": k + 1, "verify_step_s": med, "vs_plain_step": med / out["plain_step_s"]})
        print(f"  verify K={k} ({k + 1} rows): {med * 1e3:7.2f} ms = {med / out['plain_step_s']:.2f} plain steps "
              f"({out['plain_step_s'] * 1e3:.2f} ms)", flush=True)
    return out


def decode_rate(model, ids: list[int], ctx: int, n: int, drafter=None, max_k: int = 4) -> tuple[float, list[int], dict]:
    """Greedy tok/s of ``n`` tokens after ``ids`` (drafted by ``drafter`` when given), the tokens,
    and the drafting's counts."""
    session = Session(model, ctx=ctx)
    if drafter is not None:
        session.draft = Speculation(drafter, max_k)
    session.warm_up()
    logits = session.feed(ids)
    out: list[int] = []
    dt = timed(lambda: out.extend(continue_tokens(session, logits, None, n, ())))
    stats = session.draft.stats.as_json() if session.draft is not None else {}
    return n / dt, out, stats


def draft_arguments(doc: str) -> argparse.ArgumentParser:
    """The options this bench and ``mtp_bench.py`` share (model, residency, depth, lengths, output)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--vram", default="all", help="all, or a budget as spark-run --vram takes it")
    ap.add_argument("--depth", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run on a tiny model (no timing worth reading)")
    return ap


def main() -> None:
    ap = draft_arguments(__doc__)
    ap.add_argument("--acceptance", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    args = ap.parse_args()
    ctx = args.depth + args.tokens + 64
    budget = {} if args.vram == "all" else {"vram": parse_size(args.vram)}
    opts = run_options(args.model, device=args.device, ctx=ctx, no_learn=True,
                       hot_fraction=1.0 if args.vram == "all" else None, **budget)
    model = open_model(opts)
    ids = prompt(args.depth, model.spec.n_vocab)
    res: dict = {"model": args.model.name, "vram": args.vram,
                 "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                 "depth": args.depth, "tokens": args.tokens}
    print(f"{args.model.name} at --vram {args.vram}, depth {args.depth}", flush=True)
    res["cost"] = verify_cost(model, ids, ctx, args.draft_tokens)
    base, plain, _ = decode_rate(model, ids, ctx, args.tokens)
    res["plain_tok_s"] = base
    print(f"  plain decode: {base:.1f} tok/s", flush=True)
    res["forced"] = []
    oracle = known_continuation(ids, plain)
    for p in args.acceptance:
        tps, got, st = decode_rate(model, ids, ctx, args.tokens, ForcedDrafter(oracle, p, model.spec.n_vocab),
                                   args.draft_tokens)
        same = got == plain
        res["forced"].append({"p": p, "tok_s": tps, "speedup": tps / base, "identical": same, **st})
        print(f"  forced p={p}: {tps:.1f} tok/s = {tps / base:.2f}x plain (kept {st['accepted']}/{st['drafted']}, "
              f"{st['tokens_per_verify']:.2f} tokens per verify, last K {st['k']}), identical {same}", flush=True)
    path = args.json or Path(os.environ.get("OUT", ".")) / f"draft_bench_{args.vram}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    if not all(f["identical"] for f in res["forced"]):
        raise SystemExit("a drafted reply differs from the plain one")


if __name__ == "__main__":
    main()
