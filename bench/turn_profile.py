"""Where a served agent turn's time goes, call by call, in one process (no HTTP).

    python bench/turn_profile.py MODEL.gguf --prompts DIR [--vram 14GiB] [--ctx 32768] [--json F]

The conversation of ``bench/serve_bench.py`` (a 17k-token agent system prompt, then the same
conversation plus an answer and 300 new tokens), fed as the server feeds it: ``Session.prompt``
on the rendered ids, with spark-run's options. For turn 1, turn 2 and a fresh repeat of turn 1
it prints every eager forward call: its tokens, whether it staged its cold experts, its seconds
(the device synchronized around it), and the Triton kernels compiled during it (new entries in
Triton's on-disk cache: a call that compiles is paying for a shape the warm-up missed; a kernel
an earlier process compiled shows nothing). What the calls do not add up to is host time
between them (rendering, tokenizing, bookkeeping). For Qwen3.5/3.6, whose prompt calls are all
eager; the all-attention models' padded calls replay CUDA graphs, which this does not see.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import ANSWER, build_turns  # noqa: E402  (the same conversation as the served benchmark)

from sparkpack.runtime.cli import chat_ids  # noqa: E402  (the one-shot run's rendering)
from sparkpack.runtime.models.base import MoEModel  # noqa: E402
from sparkpack.runtime.options import open_model, open_session, run_options  # noqa: E402
from sparkpack.runtime.tokenizer import GGUFTokenizer  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cache_root() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))


def cache_entries() -> set[str]:
    root = cache_root()
    return {p.name for p in root.iterdir()} if root.is_dir() else set()


def kernel_names(entries: set[str]) -> list[str]:
    """The kernels Triton compiled into these cache entries (each entry's metadata JSON names it)."""
    names = []
    for e in sorted(entries):
        for f in (cache_root() / e).glob("*.json"):
            try:
                meta = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(meta, dict) and "name" in meta:
                names.append(str(meta["name"]))
    return names


class CallLog:
    """Wraps ``model.forward`` and ``model.forward_calls``: one row per call or group of calls
    (a staging session's, run layer by layer)."""

    def __init__(self, model: MoEModel):
        self.model, self.rows = model, []
        self._forward, self._forward_calls = model.forward, model.forward_calls
        model.forward = self._timed
        model.forward_calls = self._timed_group

    def _timed(self, ids, *a, **kw):
        n = len(ids)
        return self._row(n, self.model.experts.staged_prefill(n) and n > 1, 1, lambda: self._forward(ids, *a, **kw))

    def _timed_group(self, calls, *a, **kw):
        rows = sum(c.ids.numel() for c in calls)
        return self._row(sum(c.n for c in calls), self.model.experts.staged_prefill(rows), len(calls),
                         lambda: self._forward_calls(calls, *a, **kw))

    def _row(self, n: int, staged: bool, calls: int, run):
        before = cache_entries()
        sync()
        t0 = time.perf_counter()
        out = run()
        sync()
        self.rows.append({"tokens": n, "calls": calls, "staged": bool(staged), "seconds": time.perf_counter() - t0,
                          "compiled": kernel_names(cache_entries() - before)})
        return out

    def take(self) -> list[dict]:
        rows, self.rows = self.rows, []
        return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--vram", default="14GiB")
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--turn1-tokens", type=int, default=17000)
    p.add_argument("--turn2-tokens", type=int, default=300)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    from serve_bench import parse_size

    vram = parse_size(args.vram) if args.device == "cuda" else None
    opts = run_options(args.model, device=args.device, vram=vram, ctx=args.ctx, use_store=True)
    t0 = time.perf_counter()
    model = open_model(opts)
    tok = GGUFTokenizer.from_metadata(model.gguf)
    template = model.gguf.get("tokenizer.chat_template")
    session = open_session(model, opts.session, tok.control_ids)
    loaded = time.perf_counter() - t0
    entries = cache_entries()
    warm = session.warm_up()
    print(f"loaded in {loaded:.1f} s, warm-up {warm:.1f} s ({len(cache_entries() - entries)} kernels compiled)")

    turns = build_turns(list(args.prompts.glob("*.md")), lambda s: len(tok.encode(s)),
                        lambda s, n: tok.decode(tok.encode(s)[:n]), args.turn1_tokens, args.turn2_tokens)

    def ids_of(messages: list[dict]) -> tuple[list[int], float]:
        t = time.perf_counter()
        ids = chat_ids(tok, template, messages)
        return ids, time.perf_counter() - t

    log = CallLog(model)
    result = {"model": args.model.name, "vram": args.vram, "warm_up_s": warm, "phases": []}

    def phase(name: str, messages: list[dict], then_decode: int = 0, host_profile: bool = False) -> None:
        ids, render_s = ids_of(messages)
        prof = cProfile.Profile() if host_profile else None
        t = time.perf_counter()
        if prof is not None:
            prof.enable()
        logits = session.prompt(ids)
        sync()
        wall = time.perf_counter() - t
        if prof is not None:
            prof.disable()
        calls = log.take()
        row = {"name": name, "tokens": len(ids), "kept": session.reused, "render_s": render_s, "prompt_s": wall,
               "calls": calls, "host_s": wall - sum(c["seconds"] for c in calls)}
        if then_decode:
            t = time.perf_counter()
            out = list(session.decode(logits, then_decode, torch.argmax))
            row["decode_tok_s"] = len(out) / (time.perf_counter() - t)
            log.take()
        result["phases"].append(row)
        print(f"== {name}: {len(ids)} tokens, kept {session.reused}; render+tokenize {render_s:.3f} s, "
              f"prompt {wall:.3f} s ({row['host_s']:.3f} s outside calls)")
        for c in calls:
            what = "call" if c["calls"] == 1 else f"group of {c['calls']} calls"
            print(f"   {what} {c['tokens']:>5} tokens"
                  f"{' staged' if c['staged'] else '       '} {c['seconds']:.3f} s"
                  + (f"  (compiled: {', '.join(c['compiled'])})" if c["compiled"] else ""))
        if prof is not None:  # where the host time went (the calls' own time included)
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)

    phase("turn 1", turns.turn1(), then_decode=64, host_profile=True)
    phase("turn 2 (fixed answer)", turns.turn2(ANSWER))
    if args.device == "cuda":  # the short last call: which kernels its time goes to
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as kp:
            phase("turn 2 again (all but its last call kept), under the profiler", turns.turn2(ANSWER))
        print(kp.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    phase("turn 2 again (all but its last call kept)", turns.turn2(ANSWER))
    session.reset()
    phase("turn 1, fresh session state", turns.turn1())
    phase("turn 2 (fixed answer), second time", turns.turn2(ANSWER))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
