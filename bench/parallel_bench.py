"""Concurrent requests (issue 46): decode speed with 1, 2 and 4 streams at once, the time to
first token of a short request that arrives during another stream's long reply, and what a long
prompt's prefill costs the others, sparkpack's server next to llama-server on the same file, one
command.

    python bench/parallel_bench.py MODEL.gguf --prompts DIR [--vram 14GiB|all] [--parallel 4]
           [--streams 1 2 4] [--decode-tokens 256] [--prompt-tokens 300] [--long-prompt-tokens 6000]
           [--out DIR] [--llama-server BIN] [--n-cpu-moe auto|N] [--spark-arg=--step-tokens=N]

On the GPU machine, from the repo root after ``. bench/device_env.sh``. Each stream is a greedy
streaming chat request through the openai client on its own prompt (``--prompt-tokens`` cut from
the agents' prompts in ``DIR``); the streams start together. Reported per stream count: the
aggregate decode rate (every stream's tokens after its first, over the span from the first
stream's first token to the last stream's last) and the mean per-stream rate. Then a long stream
(4x ``--decode-tokens``) runs and, a second in, a ``--prompt-tokens`` request asks for one
token: its time to first token next to the same request on the idle server. Last, during another
long stream a ``--long-prompt-tokens`` request asks for one token and, half a second later, the
short one does: the short request's time to first token during that prefill, the long prompt's
own, and the running stream's longest wait between two tokens (how long it stalled; chunked
prefill, ``--step-tokens``, bounds it). sparkpack runs as
``spark-run --serve --parallel N`` (``--vram all``: no budget, every expert on the GPU);
llama-server with ``-np N`` (its continuous batching) and ``--n-cpu-moe`` fitting the same
memory (``serve_bench.choose_n_cpu_moe``; 0 with ``--vram all``). Targets (issue 46): 4 streams
give 2.5x one stream's aggregate all-GPU and 1.8x at ``--vram 14GiB``; the short request's first
token within 2x of its idle one.

Writes ``parallel_bench.json`` and ``.md`` to ``--out`` and prints the table.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_bench as sb  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sb.server_arguments(p, ctx=8192)
    p.add_argument("--parallel", type=int, default=4, help="spark-run's --parallel and llama-server's -np")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--long-prompt-tokens", type=int, default=6000,
                   help="the long prompt prefilled while a stream runs (within --ctx)")
    args = sb.checked(p, p.parse_args(argv))
    if max(args.prompt_tokens, args.long_prompt_tokens) + 64 > args.ctx:
        p.error(f"--prompt-tokens and --long-prompt-tokens must leave room in --ctx {args.ctx} for the template "
                f"and the reply")
    return args


@functools.lru_cache(maxsize=1)
def tokenizer(model: Path) -> sb.Tokenizer:
    return sb.Tokenizer(model)


def prompts(args: argparse.Namespace, n: int, tokens: int | None = None) -> list[list[dict]]:
    """``n`` different conversations whose system prompts are ``tokens`` (``--prompt-tokens``)
    tokens of the model's own tokenizer, cut from the agents' prompts (the two servers get the
    same text)."""
    size = args.prompt_tokens if tokens is None else tokens
    words = " ".join(f.read_text(encoding="utf-8") for f in sorted(args.prompts.glob("*.md"))).split()
    while len(words) < 2 * size:  # (a word is at least one token: ``size`` words hold ``size`` tokens)
        words += words
    out = []
    for i in range(n):
        start = (i * 997) % max(1, len(words) - size)
        text = tokenizer(args.model).cut(" ".join(words[start:start + size]), size)
        out.append([{"role": "system", "content": text},
                    {"role": "user", "content": f"Task {i}: summarise the instructions above as a numbered list."}])
    return out


def together(base: str, convs: list[list[dict]], max_tokens: int) -> list[sb.Stream]:
    """The streams started at once (one thread each), as the clients saw them."""
    results: list[sb.Stream | None] = [None] * len(convs)

    def run(i: int) -> None:
        results[i] = sb.chat(base, convs[i], max_tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(convs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r is not None]


def rates(streams: list[sb.Stream]) -> dict:
    firsts = [s.first for s in streams if s.first is not None]
    lasts = [s.last for s in streams if s.last is not None]
    after_first = sum(max(0, s.tokens - 1) for s in streams)
    span = max(lasts) - min(firsts) if firsts and lasts else 0.0
    each = [r for r in (s.decode_tok_s for s in streams) if r is not None]
    return {"streams": len(streams), "tokens": [s.tokens for s in streams],
            "aggregate_tok_s": after_first / span if span > 0 else None,
            "per_stream_tok_s": sum(each) / len(each) if each else None}


def interrupted_first_token(base: str, args: argparse.Namespace, convs: list[list[dict]]) -> dict:
    """A short request's time to first token idle, then during another stream's long reply."""
    idle = sb.timed(base, convs[1], 1).seconds
    long = threading.Thread(target=sb.chat, args=(base, convs[0], args.decode_tokens * 4))
    long.start()
    time.sleep(1.0)
    busy = sb.timed(base, convs[1], 1).seconds
    long.join()
    return {"idle_first_token_s": idle, "busy_first_token_s": busy}


def during_prefill(base: str, args: argparse.Namespace, convs: list[list[dict]]) -> dict:
    """A long prompt sent during a long reply, and a short request half a second after it."""
    long_prompt = prompts(args, 1, args.long_prompt_tokens)[0]
    running: list[sb.Stream] = []
    reply = threading.Thread(target=lambda: running.append(sb.chat(base, convs[0], args.decode_tokens * 4)))
    reply.start()
    time.sleep(1.0)
    long: list[sb.Timed] = []
    prefill = threading.Thread(target=lambda: long.append(sb.timed(base, long_prompt, 1)))
    prefill.start()
    time.sleep(0.5)
    short = sb.timed(base, convs[1], 1).seconds
    prefill.join()
    reply.join()
    return {"short_during_prefill_s": short, "long_prompt_first_token_s": long[0].seconds,
            "long_prompt_tokens": long[0].prompt_tokens, "running_stream_longest_gap_s": running[0].gap}


def measure(server: sb.Server, args: argparse.Namespace) -> dict:
    convs = prompts(args, max(max(args.streams), 2))
    server.start()
    try:
        sb.chat(server.base, convs[0], 8)  # warm: the first request compiles/captures what it needs
        rows = [rates(together(server.base, convs[:n], args.decode_tokens)) for n in args.streams]
        return {"server": server.name, "rows": rows, **interrupted_first_token(server.base, args, convs),
                **during_prefill(server.base, args, convs)}
    finally:
        server.stop()


def spark(args: argparse.Namespace) -> sb.Server:
    server = sb.spark_server(args)
    if args.vram == "all" and "--vram" in server.cmd:  # no budget: every expert on the GPU
        i = server.cmd.index("--vram")
        del server.cmd[i:i + 2]
    server.cmd += ["--parallel", str(args.parallel)]
    server.name = f"sparkpack --parallel {args.parallel}"
    return server


def markdown(results: list[dict], args: argparse.Namespace) -> str:
    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lines = [f"{args.model.name}, --vram {args.vram}, {args.decode_tokens} tokens a stream", "",
             "| server | streams | aggregate tok/s | per stream tok/s | of 1 stream |",
             "| --- | --- | --- | --- | --- |"]
    for r in results:
        one = r["rows"][0]["aggregate_tok_s"]
        for row in r["rows"]:
            agg = row["aggregate_tok_s"]
            lines.append(f"| {r['server']} | {row['streams']} | {f(agg, '.1f')} | {f(row['per_stream_tok_s'], '.1f')} "
                         f"| {f(agg / one if agg and one else None, '.2f')}x |")
    lines += ["", "| server | short request's first token, idle | during a long reply |", "| --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r['server']} | {r['idle_first_token_s']:.3f} s | {r['busy_first_token_s']:.3f} s |")
    lines += ["", "| server | long prompt (tokens) | its first token | a short request's first token during it "
              "| a running stream's longest stall |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r['server']} | {r['long_prompt_tokens']} | {r['long_prompt_first_token_s']:.3f} s "
                     f"| {r['short_during_prefill_s']:.3f} s | {r['running_stream_longest_gap_s']:.3f} s |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    results = [measure(spark(args), args)]
    if args.llama_server is not None and args.llama_server.is_file():
        if args.vram == "all":
            n = 0
        elif args.n_cpu_moe == "auto":
            from sparkpack.formats.archs import model_spec
            from sparkpack.formats.gguf_file import GGUFModel

            n_layer = model_spec(GGUFModel(args.model)).n_layer
            n = sb.choose_n_cpu_moe(args, n_layer, sb.parse_size(args.vram), print, slots=args.parallel)
        else:
            n = int(args.n_cpu_moe)
        results.append(measure(sb.llama_server(args, n, slots=args.parallel), args))
    table = markdown(results, args)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "parallel_bench.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "parallel_bench.md").write_text(table)
    return {"results": results}


if __name__ == "__main__":
    main()
