"""Does a server that starts with no profile learn its user's placement, and keep it across a restart?

    python bench/learning_bench.py MODEL.gguf --corpus PATH [--corpus PATH ...] [--system-prompt FILE]
           [--vram 14GiB] [--requests 30] [--after-restart 10] [--max-tokens 128] [--ctx 32768]
           [--out DIR] [--spark-arg=--cache-slots=160 ...]

On the GPU machine, after ``. bench/device_env.sh`` (MODEL: the full-size synthetic Qwen3.6-35B-A3B
Q4_K_M with the reference skew, ``repack synth --arch qwen35moe --preset qwen3.6-35b-a3b --quant
Q4_K_M --skew reference``). The corpus (files or folders the calibrate readers understand, e.g.
the agent conversations and SWE-bench tasks of ../shared/corpora) is split by conversation: a
conversation's content id decides its half, so the split is the same on every run. Chats that
end on an assistant turn lose it (the server writes the answer); ``--system-prompt`` (an agent's
system prompt) is put in front of chats that have none, as a coding agent would.

Three servers at ``--vram``, each fed the same held-out conversations in the same order (greedy,
``--max-tokens``), through the openai client:

* live: ``--profile OUT/live.profile.json`` that does not exist yet (uniform placement; learning
  on, the default), ``--requests`` conversations; then SIGTERM (the profile is written) and a
  restart on that profile for ``--after-restart`` more;
* offline: ``repack calibrate`` on the training half writes ``OUT/offline.profile.json``, served
  with ``--no-learn`` (the placement stays the offline one) on all of them.

Per request, from /metrics differences: the cold share (routings served by experts outside the
hot set: cache slots or host memory; what placement decides), the miss rate (served from host
memory) and the decode rate the server measured. Targets (issue 30): within 20 requests the live
cold share is at most 1.25x the offline one (5-request means), and after the restart it starts
there. Writes ``learning_bench.json`` and ``learning_bench.md`` to ``--out`` and prints the table.
``--device cpu`` with a store option (``--spark-arg=--hot-fraction=0.5``) runs the whole path
on a tiny model (tests/test_learning_bench.py does).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_bench import API_KEY, Server, write_results  # noqa: E402

TARGET = 1.25  # live cold share / offline cold share
WITHIN = 20  # requests
WINDOW = 5  # requests averaged when comparing


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--corpus", type=Path, action="append", required=True, help="conversations (repeatable)")
    p.add_argument("--system-prompt", type=Path, help="an agent's system prompt, for chats without one")
    p.add_argument("--vram", default="14GiB")
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--requests", type=int, default=30, help="held-out conversations before the restart")
    p.add_argument("--after-restart", type=int, default=10, help="held-out conversations after it")
    p.add_argument("--max-tokens", type=int, default=128, help="generated tokens per request")
    p.add_argument("--calibrate-tokens", type=int, default=None, help="repack calibrate --max-tokens on the training half")
    p.add_argument("--spark-arg", action="append", default=[], help="extra spark-run option for every server")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    return p.parse_args(argv)


# --- the conversations ------------------------------------------------------------------------

def held_out(conv_id: str) -> bool:
    """Which half a conversation is in, from its content id (``calibrate.conversation``)."""
    return int(hashlib.sha256(conv_id.encode()).hexdigest()[:8], 16) % 2 == 1


def conversations(paths: list[Path], system: str | None, fits=lambda messages: True
                  ) -> tuple[list[list[dict]], list[list[dict]]]:
    """(training, held-out) chats as request messages, in corpus order; held-out ones that do
    not ``fit`` the context with their answer are left out (the server would refuse them)."""
    from sparkpack.calibrate.readers import read_corpus

    train, test = [], []
    for path in paths:
        convs, _ = read_corpus(path)
        for conv in convs:
            if conv.kind != "chat" or not conv.messages:
                continue
            messages = [dict(m) for m in conv.messages]
            while messages and messages[-1]["role"] == "assistant":
                messages.pop()
            if not messages:
                continue
            if system is not None and messages[0]["role"] != "system":
                messages.insert(0, {"role": "system", "content": system})
            if not held_out(conv.id):
                train.append(messages)
            elif fits(messages):
                test.append(messages)
    return train, test


def fits_context(model: Path, ctx: int, max_tokens: int):
    """Whether a chat rendered with the model's template leaves ``max_tokens`` of ``ctx``."""
    from sparkpack.calibrate.conversation import Conversation
    from sparkpack.calibrate.render import ChatRenderer, RenderError
    from sparkpack.formats.gguf_file import GGUFModel
    from sparkpack.runtime.chat_template import ChatTemplate
    from sparkpack.runtime.tokenizer import GGUFTokenizer

    gguf = GGUFModel(model)
    tok = GGUFTokenizer.from_metadata(gguf)
    template = gguf.get("tokenizer.chat_template")
    renderer = ChatRenderer(tok, ChatTemplate.from_tokenizer(template, tok).render if template else None)

    def fits(messages: list[dict]) -> bool:
        try:
            return len(renderer.render(Conversation(messages, "bench")).ids) + max_tokens <= ctx
        except RenderError:
            return False
    return fits


def write_corpus(path: Path, chats: list[list[dict]]) -> Path:
    """The training half as an OpenAI-chat JSONL that ``repack calibrate`` reads."""
    path.write_text("".join(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in chats), encoding="utf-8")
    return path


# --- servers and requests ---------------------------------------------------------------------

def spark_server(args: argparse.Namespace, name: str, *extra: str) -> Server:
    placement = ["--vram", args.vram] if args.device == "cuda" else []
    cmd = [sys.executable, "-m", "sparkpack.runtime.cli", str(args.model), "--serve", "--port", "0", "--device",
           args.device, "--ctx", str(args.ctx), "--temperature", "0", "--api-key", API_KEY, *placement,
           *args.spark_arg, *extra]
    return Server(name, cmd)


def scrape(base: str) -> dict[str, float]:
    """/metrics as ``{name{labels}: value}``."""
    import httpx

    out = {}
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def settled(base: str, served: int, timeout: float = 600.0) -> dict[str, float]:
    """/metrics once the engine is done with request ``served`` (its response reaches the client
    before the engine counts it): the job counted and two scrapes in a row alike."""
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        now = scrape(base)
        if now.get("sparkpack_queue_wait_seconds_count", 0) >= served and now == last:
            return now
        last = now
        time.sleep(0.1)
    raise RuntimeError(f"the server did not finish request {served} within {timeout} s")


ROUTINGS = {k: f'sparkpack_expert_routings_total{{served="{k}"}}' for k in ("hot", "cached", "missed")}


@dataclass
class Row:
    """One request as the metrics saw it."""

    server: str
    phase: str  # "live", "restart", "offline"
    index: int  # held-out conversation number
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cold_share: float | None  # routings not served by the hot set
    miss_rate: float | None  # routings served from host memory
    decode_tok_s: float | None
    generated_cold: float | None = None  # live only: generated-side share outside the hot set
    experts_moved: float | None = None  # live only: re-placed so far
    replace_seconds: float | None = None  # live only: engine time spent re-placing so far


def run_requests(server: Server, phase: str, chats: list[tuple[int, list[dict]]], args: argparse.Namespace,
                 log) -> list[Row]:
    import openai

    client = openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=3600)
    rows, before = [], settled(server.base, 0)
    for n, (index, messages) in enumerate(chats, 1):
        r = client.chat.completions.create(model="bench", messages=messages, max_tokens=args.max_tokens,
                                           temperature=0)
        now = settled(server.base, n)
        d = {k: now.get(v, 0) - before.get(v, 0) for k, v in ROUTINGS.items()}
        total = sum(d.values())
        rate_sum = now.get("sparkpack_decode_tokens_per_second_sum", 0) - before.get(
            "sparkpack_decode_tokens_per_second_sum", 0)
        rate_n = now.get("sparkpack_decode_tokens_per_second_count", 0) - before.get(
            "sparkpack_decode_tokens_per_second_count", 0)
        gen = now.get('sparkpack_cold_hit_rate{side="generated"}')
        details = r.usage.prompt_tokens_details
        row = Row(server.name, phase, index, r.usage.prompt_tokens, getattr(details, "cached_tokens", 0) or 0,
                  r.usage.completion_tokens, 1 - d["hot"] / total if total else None,
                  d["missed"] / total if total else None, rate_sum / rate_n if rate_n else None,
                  gen, now.get("sparkpack_replaced_experts_total"), now.get("sparkpack_replacement_seconds_total"))
        log(f"  {phase} #{index}: {row.prompt_tokens} prompt ({row.cached_tokens} cached), cold {_f(row.cold_share)}, "
            f"miss {_f(row.miss_rate)}, decode {_f(row.decode_tok_s, '.1f')} tok/s")
        rows.append(row)
        before = now
    return rows


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


# --- verdict and table ------------------------------------------------------------------------

def mean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def verdict(live: list[Row], restart: list[Row], offline: list[Row]) -> dict:
    """When the live cold share first comes within TARGET of the offline one (WINDOW-request means
    over the same conversations), and how the first WINDOW requests after the restart compare."""
    by = {r.index: r for r in offline}
    reached = None
    for i in range(len(live) - WINDOW + 1):
        part = live[i: i + WINDOW]
        ours, theirs = mean([r.cold_share for r in part]), mean([by[r.index].cold_share for r in part])
        if ours is not None and theirs is not None and ours <= TARGET * theirs:
            reached = i + WINDOW  # requests served when the window that passes ends
            break
    first = restart[:WINDOW]
    ours, theirs = mean([r.cold_share for r in first]), mean([by[r.index].cold_share for r in first])
    ratio = ours / theirs if ours is not None and theirs else None
    return {"reached_at_request": reached, "within_target": reached is not None and reached <= WITHIN,
            "restart_ratio": ratio, "restart_within_target": ratio is not None and ratio <= TARGET}


def markdown(result: dict) -> str:
    by = {r["index"]: r for r in result["offline"]}
    lines = [f"| {result['model']} ({result['vram']}) request | phase | prompt tokens (cached) | live cold share | "
             "offline cold share | live / offline | live miss rate | offline miss rate | live decode tok/s | "
             "offline decode tok/s | experts re-placed (s) |", "| --- |" + " --- |" * 10]
    for r in result["live"] + result["restart"]:
        o = by.get(r["index"], {})
        ratio = r["cold_share"] / o["cold_share"] if r["cold_share"] is not None and o.get("cold_share") else None
        lines.append(f"| {r['index']} | {r['phase']} | {r['prompt_tokens']} ({r['cached_tokens']}) | "
                     f"{_f(r['cold_share'])} | {_f(o.get('cold_share'))} | {_f(ratio, '.2f')} | {_f(r['miss_rate'])} | "
                     f"{_f(o.get('miss_rate'))} | {_f(r['decode_tok_s'], '.1f')} | {_f(o.get('decode_tok_s'), '.1f')} | "
                     f"{_f(r['experts_moved'], '.0f')} ({_f(r['replace_seconds'], '.2f')}) |")
    v = result["verdict"]
    lines.append("")
    lines.append(f"live within {TARGET}x of offline ({WINDOW}-request means) after {v['reached_at_request']} requests "
                 f"(target <= {WITHIN}: {'met' if v['within_target'] else 'NOT met'}); first {WINDOW} after the "
                 f"restart: {_f(v['restart_ratio'], '.2f')}x (target <= {TARGET}: "
                 f"{'met' if v['restart_within_target'] else 'NOT met'})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    args.out.mkdir(parents=True, exist_ok=True)
    system = args.system_prompt.read_text(encoding="utf-8") if args.system_prompt else None
    train, test = conversations(args.corpus, system, fits_context(args.model, args.ctx, args.max_tokens))
    need = args.requests + args.after_restart
    if len(test) < need or not train:
        raise SystemExit(f"the corpus has {len(train)} training and {len(test)} held-out chats; {need} held out needed")
    chats = list(enumerate(test[:need], 1))
    log(f"{len(train)} training and {len(test)} held-out conversations; replaying {need}")

    live_profile = args.out / "live.profile.json"
    live_profile.unlink(missing_ok=True)
    result: dict = {"model": args.model.name, "vram": args.vram, "device": args.device, "spark_args": args.spark_arg,
                    "train_conversations": len(train)}
    rows: dict[str, list[Row]] = {}
    for phase, part in (("live", chats[: args.requests]), ("restart", chats[args.requests:])):
        log(f"== {phase}: learning into {live_profile}")
        server = spark_server(args, phase, "--profile", str(live_profile))
        server.start()
        try:
            rows[phase] = run_requests(server, phase, part, args, log)
        finally:
            server.stop()

    offline = args.out / "offline.profile.json"
    log(f"== repack calibrate on the training half -> {offline}")
    cmd = [sys.executable, "-m", "sparkpack.repack.cli", "calibrate", str(args.model), "--corpus",
           str(write_corpus(args.out / "train.jsonl", train)), "-o", str(offline), "--force", "--quiet",
           "--device", args.device, "--ctx", str(args.ctx)]
    if args.calibrate_tokens:
        cmd += ["--max-tokens", str(args.calibrate_tokens)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    log("== offline: the calibrated profile, not learning")
    server = spark_server(args, "offline", "--profile", str(offline), "--no-learn")
    server.start()
    try:
        rows["offline"] = run_requests(server, "offline", chats, args, log)
    finally:
        server.stop()

    for phase, rs in rows.items():
        result[phase] = [asdict(r) for r in rs]
    result["verdict"] = verdict(rows["live"], rows["restart"], rows["offline"])
    write_results(args.out, "learning_bench", result, markdown(result))
    return result


if __name__ == "__main__":
    main()
