"""The MTP head's drafting cost on the GPU (issue 47), next to a plain decode step and a verify step,
and the decode speed that cost allows at a given acceptance.

    python bench/mtp_bench.py M.gguf [--vram all|14GiB] [--depth 512] [--tokens 128]
                              [--draft-tokens 4] [--reps 20] [--json OUT.json]

``M.gguf`` carries the head (``repack synth --arch qwen35moe --preset qwen3.6-35b-a3b --mtp``, or an
``...-MTP`` file). After ``--depth`` prompt tokens, the median time of ``MtpDrafter.propose`` for
K = 1..4 drafts right after a verify step that kept one row (the head pairs that row, then drafts
K - 1 tokens more from its own output), beside ``bench/draft_bench.py``'s costs of a plain
captured step and of a verify step of K + 1 rows.

On random weights the head's acceptance means nothing, so two figures are reported apart: the
measured ``--draft mtp`` decode speed (with the acceptance it got, and whether its tokens equal
the plain run's: they must), and, marked projected, the speed the measured costs give at
acceptance a = 0.5/0.7/0.9 (each draft kept with probability a until the first miss: a verify
yields (1 - a^(K+1)) / (1 - a) tokens for one verify step plus one proposal), best K shown.
Writes JSON to $OUT/mtp_bench_<vram>.json (or --json).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.draft_bench import decode_rate, draft_arguments, prompt, timed, verify_cost  # noqa: E402
from sparkpack.formats.units import parse_size  # noqa: E402
from sparkpack.runtime.generate import Session  # noqa: E402
from sparkpack.runtime.models.mtp import MtpDrafter  # noqa: E402
from sparkpack.runtime.options import open_model, run_options  # noqa: E402
from sparkpack.runtime.speculative import Speculation  # noqa: E402


def draft_cost(model, ids: list[int], ctx: int, max_k: int, reps: int = 20) -> list[float]:
    """Median seconds of ``propose`` for K = 1..max_k, each after a verify step that kept one row."""
    session = Session(model, ctx=ctx)
    drafter = MtpDrafter(model)
    spec = session.draft = Speculation(drafter, max_k)
    seq = list(ids) + [int(torch.argmax(session.feed(ids)))]
    drafter.propose(seq, 1, spec.hidden())  # the prompt's rows
    out = []
    for k in range(1, max_k + 1):
        times = []
        for i in range(reps + 1):
            rows, hidden = session.verify([seq[-1]])
            session.keep(1)
            spec.kept(hidden, 1)
            seq.append(int(torch.argmax(rows[0])))
            dt = timed(lambda: drafter.propose(seq, k, spec.hidden()))
            if i >= 1:
                times.append(dt)
        out.append(statistics.median(times))
    return out


def tokens_per_verify(a: float, k: int) -> float:
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def main() -> None:
    ap = draft_arguments(__doc__)
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per figure")
    args = ap.parse_args()
    max_k = args.draft_tokens
    ctx = args.depth + args.tokens + 2 * (args.reps + 1) * max_k + 64
    budget = {} if args.vram == "all" else {"vram": parse_size(args.vram)}
    opts = run_options(args.model, device=args.device, ctx=ctx, no_learn=True, draft="mtp", draft_tokens=max_k,
                       hot_fraction=1.0 if args.vram == "all" else None, **budget)
    model = open_model(opts)
    ids = prompt(args.depth, model.spec.n_vocab)
    print(f"{args.model.name} at --vram {args.vram}, depth {args.depth}", flush=True)
    cost = verify_cost(model, ids, ctx, max_k, args.reps)
    plain_s = cost["plain_step_s"]
    drafts = draft_cost(model, ids, ctx, max_k, args.reps)
    res: dict = {"model": args.model.name, "vram": args.vram, "depth": args.depth, "tokens": args.tokens,
                 "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                 "plain_step_s": plain_s, "per_k": []}
    for v, d in zip(cost["verify"], drafts):
        step = v["verify_step_s"] + d
        res["per_k"].append({"k": v["k"], "propose_s": d, "verify_step_s": v["verify_step_s"], "round_s": step,
                             "round_vs_plain_step": step / plain_s})
        print(f"  K={v['k']}: propose {d * 1e3:7.2f} ms + verify {v['verify_step_s'] * 1e3:7.2f} ms "
              f"= {step / plain_s:.2f} plain steps ({plain_s * 1e3:.2f} ms)", flush=True)
    res["projected"] = []
    for a in (0.5, 0.7, 0.9):
        best = max(res["per_k"], key=lambda r: tokens_per_verify(a, r["k"]) / r["round_s"])
        speedup = tokens_per_verify(a, best["k"]) / best["round_s"] * plain_s
        res["projected"].append({"acceptance": a, "k": best["k"], "speedup": speedup, "tok_s": speedup / plain_s})
        print(f"  projected at acceptance {a}: {speedup:.2f}x plain with K={best['k']} (from the measured costs)",
              flush=True)
    base, plain, _ = decode_rate(model, ids, ctx, args.tokens)
    tps, got, st = decode_rate(model, ids, ctx, args.tokens, MtpDrafter(model), max_k)
    res["measured"] = {"plain_tok_s": base, "mtp_tok_s": tps, "identical": got == plain, **st,
                       "note": "random weights: this acceptance says nothing of a trained head"}
    print(f"  measured: plain {base:.1f} tok/s, --draft mtp {tps:.1f} tok/s (kept {st['accepted']}/{st['drafted']} "
          f"on random weights), identical {got == plain}", flush=True)
    path = args.json or Path(os.environ.get("OUT", ".")) / f"mtp_bench_{args.vram}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    if got != plain:
        raise SystemExit("the --draft mtp reply differs from the plain one")


if __name__ == "__main__":
    main()
