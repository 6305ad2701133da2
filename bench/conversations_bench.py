"""Many conversations, one server (issue 42): sparkpack's server next to llama-server on agent
traffic that switches between conversations, one command.

    python bench/conversations_bench.py MODEL.gguf --prompts DIR [--vram 14GiB] [--ctx 65536]
           [--conv-tokens 40000] [--shared-tokens 15000] [--turn-tokens 300] [--out DIR]
           [--llama-server BIN] [--n-cpu-moe auto|N] [--spark-arg=--cache-ram=8GiB ...]

On the GPU machine, from the repo root after ``. bench/device_env.sh``. Two conversations, A and
B, share a system prompt of ``--shared-tokens`` (the coding agents' prompts in ``DIR``, repeated
and cut, as a second session or a subagent of the same agent shares it), then each has its own
first user message up to ``--conv-tokens``; every later turn adds a fixed answer and
``--turn-tokens`` of a new user message. A short side request (another system prompt: a title
call) comes between. The sequence, each request a one-token greedy request through the openai
client (its wall time is the time to first token):

    A1, A2, side, A3, B1, A4, B2, A5, then (sparkpack) a restart with --cache-dir and A6

Reported per request: prompt and cached tokens, time to first token, for each server (a fresh
``spark-run --serve`` with ``--cache-dir`` in a temporary folder, then llama-server with
``--n-cpu-moe N`` at the same GPU memory, as ``serve_bench.py`` chooses it, with its default
slots and host prompt cache, ``--cache-ram``, unless ``--llama-cache-ram`` sets it: what an agent
user of llama-server gets). llama-server's column comes when its binary is there
(``$LLAMA_BUILD/bin/llama-server``, built by ``bench/llama_bench.sh --build-only``). Targets (issue 42):
every main turn after a side request or the other conversation within 1.5x of A2 (a
same-conversation turn); B1 computes only what follows the shared system prompt; A6 after the
restart under 1 s; the server's RSS within ``--cache-ram`` plus the expert pool (its
``sparkpack_conversation_cache_bytes``, ``sparkpack_expert_host_bytes`` and
``sparkpack_state_checkpoint_host_bytes``, the sessions' own state copies, are reported beside
the RSS).

A second table splits each sparkpack request's time as its server saw it (``timings.split_*``:
``runtime.server.request_split``): the queue, the cache's resume, the prompt's calls, the first
token, what the cache's threads did beside it, whether the previous turn's copies out were still
running, the allocator's cudaMallocs and retries, Triton compiles (both engines fill it; with
``--parallel`` above 1 the process-wide counts cover whatever ran beside the request).

Writes ``conversations_bench.json`` and ``.md`` to ``--out`` and prints the tables. ``--device
cpu`` with small token counts runs the whole path on a tiny model (tests/test_serve_bench.py).
"""
from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve_bench as sb  # noqa: E402

SEQUENCE = ["A1", "A2", "side", "A3", "B1", "A4", "B2", "A5"]
SIDE = [{"role": "system", "content": "Write a 5-word title for the conversation below. Reply with the title only."},
        {"role": "user", "content": "Fix the failing test in the parser module."}]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sb.server_arguments(p, ctx=65536)
    p.add_argument("--conv-tokens", type=int, default=40000, help="each conversation's first prompt")
    p.add_argument("--shared-tokens", type=int, default=15000, help="the system prompt A and B share")
    p.add_argument("--turn-tokens", type=int, default=300, help="a later turn's new user message")
    p.add_argument("--llama-cache-ram", type=int, default=None, help="llama-server's --cache-ram in MiB [its default]")
    p.add_argument("--pause", type=float, default=0.0,
                   help="seconds between requests (an agent running its tools between turns) [0: back to back]")
    args = sb.checked(p, p.parse_args(argv))
    if args.shared_tokens >= args.conv_tokens:
        p.error("--shared-tokens must be less than --conv-tokens")
    return args


@dataclass
class Conversations:
    """The requests' messages: ``messages(name)`` for A1..A6, B1.., side."""

    system: str
    first: dict[str, str]  # conversation -> its first user message
    later: list[str]  # the later turns' user messages, in order of use

    def messages(self, name: str) -> list[dict]:
        if name == "side":
            return SIDE
        conv, turn = name[0], int(name[1:])
        out = [{"role": "system", "content": self.system}, {"role": "user", "content": self.first[conv]}]
        for t in range(1, turn):
            out += [{"role": "assistant", "content": sb.ANSWER},
                    {"role": "user", "content": self.later[(t - 1) * 2 + (conv == "B")]}]
        return out


def build_conversations(texts: list[str], tok: sb.Tokenizer, conv_tokens: int, shared_tokens: int,
                        turn_tokens: int) -> Conversations:
    """The shared system prompt (the prompts repeated and cut), each conversation's own first user
    message (the prompts' paragraphs in another order, so the two differ from their first token
    on), the later turns' messages (slices of the paragraphs)."""
    if not texts:
        raise SystemExit("no *.md prompts found")
    body = "\n\n".join(texts)
    system = body
    while tok.count(system) < shared_tokens:
        system += "\n\n" + body
    system = tok.cut(system, shared_tokens)
    paragraphs = [p for p in body.split("\n\n") if p.strip()]

    def text(offset: int, n: int) -> str:
        rotated = paragraphs[offset % len(paragraphs):] + paragraphs[:offset % len(paragraphs)]
        out = f"Task {offset}: read this and act on it.\n\n" + "\n\n".join(rotated)
        while tok.count(out) < n:
            out += "\n\n" + "\n\n".join(rotated)
        return tok.cut(out, n)

    own = conv_tokens - shared_tokens
    return Conversations(system, {"A": text(1, own), "B": text(len(paragraphs) // 2, own)},
                         [text(7 * i + 3, turn_tokens) for i in range(12)])


@dataclass
class Request:
    name: str
    seconds: float
    prompt_tokens: int | None
    cached_tokens: int | None
    split: dict | None = None  # sparkpack's ``timings.split_*``: where the server spent the request's time


def ask(base: str, messages: list[dict], name: str) -> Request:
    """A one-token greedy request: its wall time is the time to first token. Cached tokens from
    the usage (sparkpack, llama-server's recent builds) or llama-server's ``timings.cache_n``."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key=sb.API_KEY, max_retries=0, timeout=3600)
    t0 = time.perf_counter()
    r = client.chat.completions.create(model="bench", messages=messages, max_tokens=1, temperature=0)
    dt = time.perf_counter() - t0
    details = r.usage.prompt_tokens_details if r.usage else None
    timings = (r.model_extra or {}).get("timings") or {}
    cached = getattr(details, "cached_tokens", None)
    if cached is None:
        cached = timings.get("cache_n")
    split = {k.removeprefix("split_"): v for k, v in timings.items() if k.startswith("split_")} or None
    return Request(name, dt, r.usage.prompt_tokens if r.usage else None, cached, split)


def rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


HOST_METRICS = {"cache_host_bytes": r'^sparkpack_conversation_cache_bytes\{tier="host"\} (\S+)',
                "expert_host_bytes": r'^sparkpack_expert_host_bytes (\S+)',
                "checkpoint_host_bytes": r'^sparkpack_state_checkpoint_host_bytes (\S+)'}


def host_bytes(base: str) -> dict[str, float | None]:
    """The server's conversation cache in host RAM, its expert store's cold experts' host memory
    and its sessions' state checkpoints, from /metrics (what its RSS should stay within, besides
    the process itself)."""
    import httpx

    text = httpx.get(base + "/metrics").text
    found = {k: re.search(pattern, text, re.M) for k, pattern in HOST_METRICS.items()}
    return {k: float(m.group(1)) if m else None for k, m in found.items()}


def run_sequence(server: sb.Server, convs: Conversations, restart: bool, pause: float = 0.0) -> dict:
    """The sequence on a fresh server; with ``restart``, stopped and started again for A6.
    ``pause``: seconds between requests, in which what a server does after a request (copies
    out, memory reserved again) is off the next one's path."""
    server.start()
    try:
        requests = []
        for i, name in enumerate(SEQUENCE):
            if i and pause:
                time.sleep(pause)
            requests.append(ask(server.base, convs.messages(name), name))
        held = host_bytes(server.base) if server.name == "sparkpack" else dict.fromkeys(HOST_METRICS)
        memory = {"rss_bytes": rss(server.proc.pid), **held}
    finally:
        rc = server.stop()
    out = {"server": server.name, "exit": rc, "requests": [r.__dict__ for r in requests], **memory}
    if restart:
        server.base = ""
        server.start()
        try:
            out["restart"] = ask(server.base, convs.messages("A6"), "A6 (restarted)").__dict__
        finally:
            server.stop()
    return out


def summary(result: dict) -> dict:
    """The issue's targets from one server's requests."""
    by = {r["name"]: r for r in result["requests"]}
    same = by["A2"]["seconds"]
    switched = ["A3", "A4", "B2", "A5"]
    return {"worst_switch_over_same": max(by[n]["seconds"] for n in switched) / same,
            "b1_cached": by["B1"]["cached_tokens"]}


def markdown(result: dict) -> str:
    cols = [c for c in (result.get("sparkpack"), result.get("llama")) if c]
    head = ["sparkpack --serve" + (f" ({result['vram']})" if result["device"] == "cuda" else "")]
    if result.get("llama"):
        head.append(f"llama-server --n-cpu-moe {result['n_cpu_moe']} (default slots, --cache-ram)")
    lines = [f"| {result['model']}: request | " + " | ".join(f"{h}: prompt (cached), first token s" for h in head)
             + " |", "| --- |" + " --- |" * len(head)]
    for i, name in enumerate(SEQUENCE):
        cells = []
        for c in cols:
            r = c["requests"][i]
            cells.append(f"{r['prompt_tokens']} ({r['cached_tokens']}), {r['seconds']:.3f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    restart = result["sparkpack"].get("restart")
    if restart:
        lines.append(f"| A6 after a restart with --cache-dir (target < 1 s) | {restart['prompt_tokens']} "
                     f"({restart['cached_tokens']}), {restart['seconds']:.3f} |" + " - |" * (len(head) - 1))
    lines.append("| worst main turn after a switch / A2 (target <= 1.5) | "
                 + " | ".join(f"{summary(c)['worst_switch_over_same']:.2f}" for c in cols) + " |")
    lines.append(f"| B1 cached / shared system prompt ({result['shared_tokens']} tokens) | "
                 + " | ".join(str(summary(c)["b1_cached"]) for c in cols) + " |")
    s = result["sparkpack"]
    gib = [sb.num(s.get(k) and s[k] / 1024**3, ".2f") for k in ("rss_bytes", *HOST_METRICS)]
    lines.append("| sparkpack RSS after A5 / conversation cache / cold experts / state checkpoints in host RAM (GiB) | "
                 + " / ".join(gib) + " |" + " - |" * (len(head) - 1))
    return "\n".join(lines)


SPLIT_COLUMNS = [("queue_ms", "queue"), ("resume_ms", "resume"), ("prompt_ms", "prompt"),
                 ("first_token_ms", "first token"), ("rest_ms", "rest")]


def _phases(ms: dict | None) -> str:
    return " ".join(f"{k} {v:.1f}" for k, v in (ms or {}).items()) or "-"


def split_markdown(result: dict) -> str:
    """Where each sparkpack request's time went, in ms (the server's ``timings.split_*``): the
    queue (the previous request's after-work included), the cache's resume, ``Session.prompt``
    (its calls and the device's wait), the first token and the rest; ``outside`` is the client's
    wall time less all of those (HTTP, the template, tokenizing); ``beside`` the seconds the
    cache's writer and reserve worked meanwhile; whether the previous request's state was still
    being copied out when it began; the device allocator's cudaMallocs and retries; the Triton
    kernels compiled on its path (their names in the JSON); the expert bytes it streamed; the
    engine's work after the previous request by step (``Engine.after_work``: sink, cache,
    metrics, between) and, within ``cache``, its state snapshot by phase
    (``ConversationCache.last_keep``): what a request right after it queues behind."""
    s = result["sparkpack"]
    rows = [(r["name"], r) for r in s["requests"]] + ([("A6 (restarted)", s["restart"])] if s.get("restart") else [])
    head = ["request", "client"] + [label for _, label in SPLIT_COLUMNS] + ["outside", "beside", "copies running",
                                                                             "allocs / retries", "compiled",
                                                                             "streamed MB", "previous after-work",
                                                                             "previous snapshot"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, r in rows:
        sp = r.get("split")
        if not sp:
            continue
        inside = sum(sp.get(k, 0.0) for k, _ in SPLIT_COLUMNS)
        cells = [name, f"{r['seconds'] * 1e3:.1f}"] + [f"{sp.get(k, 0.0):.1f}" for k, _ in SPLIT_COLUMNS]
        cells += [f"{r['seconds'] * 1e3 - inside:.1f}", f"{sp.get('background_ms', 0.0):.1f}",
                  "yes" if sp.get("copies_running") else "no", f"{sp.get('device_allocs', 0)} / {sp.get('alloc_retries', 0)}",
                  str(len(sp.get("compiled") or [])), f"{sp.get('streamed_bytes', 0) / 1e6:.0f}",
                  _phases(sp.get("previous_after_ms")), _phases(sp.get("previous_keep_ms"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    tok = sb.Tokenizer(args.model)
    convs = build_conversations([f.read_text(encoding="utf-8") for f in sorted(args.prompts.glob("*.md"))], tok,
                                args.conv_tokens, args.shared_tokens, args.turn_tokens)
    result: dict = {"model": args.model.name, "device": args.device, "vram": args.vram, "ctx": args.ctx,
                    "spark_args": args.spark_arg, "shared_tokens": args.shared_tokens}
    with tempfile.TemporaryDirectory(prefix="sparkpack-states-") as states:
        server = sb.spark_server(args)
        server.cmd += ["--cache-dir", states]
        log("== sparkpack --serve: A1, A2, side, A3, B1, A4, B2, A5, restart, A6")
        result["sparkpack"] = run_sequence(server, convs, restart=True, pause=args.pause)
    if args.llama_server is not None and shutil.which(str(args.llama_server)):
        from sparkpack.formats.archs import model_spec
        from sparkpack.formats.gguf_file import GGUFModel

        if args.n_cpu_moe == "auto":
            n_layer = model_spec(GGUFModel(args.model)).n_layer
            log(f"== llama-server: the least --n-cpu-moe within {args.vram}")
            n = sb.choose_n_cpu_moe(args, n_layer, sb.parse_size(args.vram), log, slots=None)
        else:
            n = int(args.n_cpu_moe)
        result["n_cpu_moe"] = n
        log(f"== llama-server --n-cpu-moe {n}: the same sequence")
        server = sb.llama_server(args, n, slots=None)
        if args.llama_cache_ram is not None:
            server.cmd += ["--cache-ram", str(args.llama_cache_ram)]
        result["llama"] = run_sequence(server, convs, restart=False, pause=args.pause)
    else:
        log("(no llama-server binary: its column is left out; bash bench/llama_bench.sh --build-only builds one)")
    sb.write_results(args.out, "conversations_bench", result, markdown(result) + "\n\n" + split_markdown(result))
    return result


if __name__ == "__main__":
    main()
