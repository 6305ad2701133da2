"""Served speed of an agent session: sparkpack's server next to llama.cpp's llama-server, one command.

    python bench/serve_bench.py MODEL.gguf --prompts DIR [--vram 14GiB] [--out DIR]
           [--llama-server BIN] [--n-cpu-moe auto|N] [--ctx 32768] [--spark-arg=--hot-fraction=0.6 ...]

On the GPU machine, from the repo root after ``. bench/device_env.sh`` (wheels carried: see the
report of issue 27). ``DIR`` holds the coding agents' system prompts (lucebox-hub's
``agent_prompts/*.md``): their text, repeated and cut to ``--turn1-tokens`` (17k), is turn 1's
system prompt; turn 2 is the same conversation plus an answer (``ANSWER``: a fixed text, the
same for both servers) and ``--turn2-tokens`` (300) new tokens of a user message. For each
server (a fresh ``spark-run MODEL --serve`` at ``--vram``, then llama-server with ``--n-cpu-moe
N`` experts' layers on the CPU, N chosen so that its GPU memory fits the same budget unless
given), through the openai client, streaming:

* time to first token of turn 1 and of turn 2 (turn 2 / turn 1: the prefix reuse; target < 10%),
  as the wall time of a one-token request (a random model's tokens may spell no text, and then no
  stream chunk would mark them), and the part of it the server spent on the prompt (both servers
  report it in llama-server's ``timings``): the rest is request handling and the first token;
* decode tok/s of ``--decode-tokens`` greedy tokens after turn 1's prompt, between the first and
  the last token received (the client's view; llama-server sends no chunk for a token that spells
  nothing, so also from two whole requests: N tokens and 1 token on the same cached prompt), next
  to a one-shot ``spark-run -p`` on the same prompt in a fresh process (its own decode tok/s;
  target: the server within 3%).

Writes ``serve_bench.json`` and ``serve_bench.md`` to ``--out`` and prints the table. Without a
llama-server binary (``$LLAMA_BUILD/bin/llama-server``, built by ``bench/llama_bench.sh
--build-only``) its column is left out. ``--device cpu`` with small token counts runs the whole
path on a tiny model (tests/test_serve_bench.py does).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

API_KEY = "bench"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    server_arguments(p, ctx=32768)
    p.add_argument("--turn1-tokens", type=int, default=17000)
    p.add_argument("--turn2-tokens", type=int, default=300)
    p.add_argument("--answer-tokens", type=int, default=64, help="tokens generated after turn 1 (before turn 2)")
    p.add_argument("--decode-tokens", type=int, default=256)
    return checked(p, p.parse_args(argv))


def server_arguments(p: argparse.ArgumentParser, ctx: int) -> None:
    """The options of a benchmark of both servers on agent prompts (this one, conversations_bench.py)."""
    p.add_argument("model", type=Path, help="the GGUF both servers load")
    p.add_argument("--prompts", type=Path, required=True, help="folder of agent system prompts (*.md)")
    p.add_argument("--vram", default="14GiB", help="spark-run's --vram, and llama-server's GPU memory budget")
    p.add_argument("--ctx", type=int, default=ctx)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--spark-arg", action="append", default=[], help="extra spark-run option (repeatable)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="extra option of the server only, not the one-shot run (repeatable; e.g. --serve-arg=--parallel=1)")
    p.add_argument("--llama-server", type=Path, default=None, help="[$LLAMA_BUILD/bin/llama-server when built]")
    p.add_argument("--n-cpu-moe", default="auto", help="llama-server's --n-cpu-moe, or auto: the least that fits --vram")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))


def checked(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``server_arguments``' values checked, llama-server's binary found where it was built."""
    if args.n_cpu_moe != "auto" and not args.n_cpu_moe.isdigit():
        p.error(f"--n-cpu-moe must be a number or auto, not {args.n_cpu_moe!r}")
    if args.llama_server is None:
        built = Path(os.environ.get("LLAMA_BUILD", "/tmp/llama-build")) / "bin" / "llama-server"
        args.llama_server = built if built.is_file() else None
    return args


def parse_size(text: str) -> int:
    """``14GiB`` / ``512MiB`` / ``2GB`` / bytes -> bytes (as spark-run reads --vram)."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?)B?\s*", text, re.I)
    if not m:
        raise ValueError(f"not a size: {text!r}")
    power = " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


# --- the conversation -------------------------------------------------------------------------

USER_1 = "Here is the repository state. Find why the test suite fails and propose a minimal fix."
# Turn 1's answer as turn 2 sends it back: the same text to both servers. A random model's own
# answer re-renders to other tokens than it generated (64 tokens came back as ~700 at 80cc85b,
# and as another count for llama-server), so turn 2's new tokens would differ between servers.
ANSWER = ("The failure comes from the parser: it drops the last field when a line ends without a "
          "newline. I will change `split_fields` to keep a trailing field and add a test for it.")


@dataclass
class Turns:
    system: str
    user1: str
    user2: str

    def turn1(self) -> list[dict]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.user1}]

    def turn2(self, answer: str) -> list[dict]:
        return self.turn1() + [{"role": "assistant", "content": answer}, {"role": "user", "content": self.user2}]


def build_turns(prompt_files: list[Path], count: Callable[[str], int], cut: Callable[[str, int], str],
                turn1_tokens: int, turn2_tokens: int) -> Turns:
    """Turn 1's system prompt: the agent prompts, repeated until long enough, cut to
    ``turn1_tokens`` minus the user message (``count``/``cut`` tokenize with the model's
    tokenizer); turn 2's user message: ``turn2_tokens`` of the last prompt's text."""
    texts = [f.read_text(encoding="utf-8") for f in sorted(prompt_files)]
    if not texts:
        raise SystemExit("no *.md prompts found")
    body = "\n\n".join(texts)
    system = body
    while count(system) < turn1_tokens:
        system += "\n\n" + body
    system = cut(system, max(turn1_tokens - count(USER_1), 1))
    user2 = cut("The tests still fail after that change. Here is what the log says:\n\n" + texts[-1][::-1][:40000][::-1],
                turn2_tokens)
    return Turns(system, USER_1, user2)


# --- servers ------------------------------------------------------------------------------------

@dataclass
class Server:
    name: str
    cmd: list[str]
    base: str = ""
    proc: subprocess.Popen | None = None
    log: Path | None = None

    def start(self, timeout: float = 900.0) -> None:
        import httpx

        self.log = Path(tempfile.mkstemp(prefix=f"{self.name}-", suffix=".log")[1])
        self.proc = subprocess.Popen(self.cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT, text=True)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            if not self.base:
                m = re.search(r"listening on (http://\S+),", self.log.read_text())
                self.base = m.group(1) if m else ""
            if self.base:
                try:
                    if httpx.get(self.base + "/health", timeout=5).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spark_server(args: argparse.Namespace) -> Server:
    cmd = [sys.executable, "-m", "sparkpack.runtime.cli", str(args.model), "--serve", "--port", "0", "--device",
           args.device, "--ctx", str(args.ctx), "--temperature", "0", "--api-key", API_KEY, *placement(args),
           *args.serve_arg, "--no-learn"]  # a benchmark writes no profile beside the model (later runs would place from it)
    return Server("sparkpack", cmd)


def placement(args: argparse.Namespace) -> list[str]:
    return (["--vram", args.vram] if args.device == "cuda" else []) + list(args.spark_arg)


def llama_server(args: argparse.Namespace, n_cpu_moe: int, slots: int | None = 1) -> Server:
    """llama-server on the same file; ``slots`` None: its default slots (and host prompt cache).
    ``-c`` is the context of all slots together (each slot gets its share unless the KV is
    unified), so N slots get N x ``--ctx``: each sequence the context spark-run gives it."""
    port = free_port()
    cmd = [str(args.llama_server), "-m", str(args.model), "--host", "127.0.0.1", "--port", str(port),
           "-ngl", "99", "--n-cpu-moe", str(n_cpu_moe), "-c", str(args.ctx * (slots or 1)), "-fa", "on", "--jinja",
           "--api-key", API_KEY, "--temp", "0", "--no-ui", *(["-np", str(slots)] if slots is not None else [])]
    s = Server(f"llama-server-ncmoe{n_cpu_moe}", cmd)
    s.base = f"http://127.0.0.1:{port}"
    return s


def gpu_memory_of(pid: int) -> int | None:
    """Bytes of GPU memory the process holds (nvidia-smi), None when it does not say."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    for line in out.splitlines():
        p, mib = (x.strip() for x in line.split(","))
        if p == str(pid):
            return int(mib) * 1024**2
    return None


def least_that_fits(fits: Callable[[int], bool], high: int) -> int:
    """The smallest n in [0, high] with ``fits(n)`` (fits is monotone: more layers on the CPU
    never need more GPU memory); ``high`` when none smaller does."""
    lo, hi = 0, high
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def choose_n_cpu_moe(args: argparse.Namespace, n_layer: int, budget: int, log: Callable[[str], None],
                     slots: int | None = 1) -> int:
    """``--n-cpu-moe`` for llama-server (with ``slots``, as ``llama_server``) under the same GPU
    memory as ``--vram``: started once per probe (its memory after loading and one short request,
    as nvidia-smi counts it)."""
    def fits(n: int) -> bool:
        server = llama_server(args, n, slots)
        try:
            server.start()
            chat(server.base, [{"role": "user", "content": "hi"}], 1)
            used = gpu_memory_of(server.proc.pid)
        except RuntimeError as e:  # out of memory at load: does not fit
            log(f"  --n-cpu-moe {n}: failed to start ({str(e).splitlines()[0]})")
            return False
        finally:
            server.stop()
        log(f"  --n-cpu-moe {n}: {used / 1024**3 if used else float('nan'):.2f} GiB")
        return used is not None and used <= budget
    return least_that_fits(fits, n_layer)


# --- measurements -------------------------------------------------------------------------------

@dataclass
class Stream:
    """One streamed request as the client saw it."""

    tokens: int = 0  # completion tokens (usage, else chunks with text)
    first: float | None = None  # when the first token's text arrived
    last: float | None = None
    text: str = ""
    gap: float = 0.0  # the longest wait between two chunks with text (a stream stalled)

    @property
    def decode_tok_s(self) -> float | None:
        if self.tokens < 2 or self.first is None or self.last is None or self.last <= self.first:
            return None
        return (self.tokens - 1) / (self.last - self.first)


def chat(base: str, messages: list[dict], max_tokens: int) -> Stream:
    """A greedy streaming chat request through the openai client."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=3600)
    out, chunks = Stream(), 0
    for chunk in client.chat.completions.create(model="bench", messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        now = time.perf_counter()
        if chunk.usage is not None:
            out.tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            delta = choice.delta
            piece = (delta.content or "") + (getattr(delta, "reasoning_content", None) or "")
            if piece or delta.tool_calls:
                chunks += 1
                out.text += delta.content or ""
                out.first = out.first or now
                out.gap = max(out.gap, now - (out.last or now))
                out.last = now
    out.tokens = out.tokens or chunks
    return out


@dataclass
class Timed:
    """One non-streamed request: its wall time and usage."""

    seconds: float
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    prompt_seconds: float | None = None  # the server's own prompt time (llama-server's ``timings``)


def timed(base: str, messages: list[dict], max_tokens: int) -> Timed:
    """A greedy request, whole: with ``max_tokens=1`` its wall time is the time to first token
    whatever text the token spells (a random model's tokens may spell none, and a server sends
    no chunk for them)."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=3600)
    t0 = time.perf_counter()
    r = client.chat.completions.create(model="bench", messages=messages, max_tokens=max_tokens, temperature=0)
    dt = time.perf_counter() - t0
    details = r.usage.prompt_tokens_details if r.usage else None
    prompt_ms = ((r.model_extra or {}).get("timings") or {}).get("prompt_ms")
    return Timed(dt, r.usage.prompt_tokens if r.usage else None, getattr(details, "cached_tokens", None),
                 r.usage.completion_tokens if r.usage else None, None if prompt_ms is None else prompt_ms / 1e3)


def measure(server: Server, turns: Turns, args: argparse.Namespace) -> dict:
    """On one fresh server: turn 1's time to first token (nothing cached), turn 1's answer, turn
    2's time to first token (turn 1's conversation cached), then decode after turn 1's prompt:
    streamed (the client's view, when the tokens spell text) and from two whole requests, ``N``
    tokens and 1 token on the same cached prompt: (N - 1) / (their time difference)."""
    server.start()
    try:
        first = timed(server.base, turns.turn1(), 1)
        chat(server.base, turns.turn1(), args.answer_tokens)  # the answer is generated (the cache holds it) ...
        second = timed(server.base, turns.turn2(ANSWER), 1)  # ... and comes back as an agent's text
        streamed = chat(server.base, turns.turn1(), args.decode_tokens)
        whole = timed(server.base, turns.turn1(), args.decode_tokens)
        one = timed(server.base, turns.turn1(), 1)
        metrics = ""
        if server.name == "sparkpack":
            import httpx

            metrics = httpx.get(server.base + "/metrics").text
        vram = gpu_memory_of(server.proc.pid) if args.device == "cuda" else None
    finally:
        rc = server.stop()
    peak = re.search(r"^sparkpack_vram_peak_bytes (\S+)", metrics, re.M)
    n = whole.completion_tokens or 0
    wall = (n - 1) / (whole.seconds - one.seconds) if n > 1 and whole.seconds > one.seconds else None
    return {"server": server.name, "exit": rc, "turn1_prompt_tokens": first.prompt_tokens,
            "turn1_ttft_s": first.seconds, "turn1_server_prompt_s": first.prompt_seconds,
            "turn2_prompt_tokens": second.prompt_tokens, "turn2_cached_tokens": second.cached_tokens,
            "turn2_ttft_s": second.seconds, "turn2_server_prompt_s": second.prompt_seconds,
            "turn2_over_turn1": second.seconds / first.seconds,
            "decode_tokens": streamed.tokens, "decode_tok_s": streamed.decode_tok_s, "decode_tok_s_whole": wall,
            "gpu_memory_bytes": vram, "vram_peak_allocated": float(peak.group(1)) if peak else None}


def one_shot(args: argparse.Namespace, turns: Turns) -> dict:
    """A fresh ``spark-run -p`` on turn 1's prompt: its own decode and prefill rates."""
    stats = Path(tempfile.mkstemp(suffix=".json")[1])
    cmd = [sys.executable, "-m", "sparkpack.runtime.cli", str(args.model), "-p", turns.user1, "--system", turns.system,
           "--max-tokens", str(args.decode_tokens), "--temperature", "0", "--device", args.device, "--ctx",
           str(args.ctx), "--stats-json", str(stats), *placement(args), "--no-learn"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    s = json.loads(stats.read_text())
    return {"decode_tok_s": s.get("decode_tok_s"), "decode_tokens": s.get("decode_tokens"),
            "prefill_tok_s": s.get("prefill_tok_s"), "prefill_tokens": s.get("prefill_tokens")}


# --- report -------------------------------------------------------------------------------------

def num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def markdown(result: dict) -> str:
    """The table BENCHMARKS.md takes: one column per server."""
    cols = [r for r in (result.get("sparkpack"), result.get("llama")) if r]
    head = ["sparkpack --serve" + (f" ({result['vram']})" if result.get("device") == "cuda" else "")]
    if result.get("llama"):
        head.append(f"llama-server --n-cpu-moe {result['n_cpu_moe']}")
    rows = [
        ("turn 1: prompt tokens", [num(c["turn1_prompt_tokens"], "d") for c in cols]),
        ("turn 1: time to first token (s)", [num(c["turn1_ttft_s"], ".3f") for c in cols]),
        ("turn 1: the server's prompt time (timings.prompt_ms, s)", [num(c.get("turn1_server_prompt_s"), ".3f")
                                                                     for c in cols]),
        ("turn 2: prompt tokens (cached)", [f"{num(c['turn2_prompt_tokens'], 'd')} ({num(c['turn2_cached_tokens'], 'd')})"
                                            for c in cols]),
        ("turn 2: time to first token (s)", [num(c["turn2_ttft_s"], ".3f") for c in cols]),
        ("turn 2: the server's prompt time (timings.prompt_ms, s)", [num(c.get("turn2_server_prompt_s"), ".3f")
                                                                     for c in cols]),
        ("turn 2 / turn 1 (target < 0.10)", [num(c["turn2_over_turn1"], ".3f") for c in cols]),
        ("decode tok/s, streamed (openai client)", [num(c["decode_tok_s"], ".1f") for c in cols]),
        ("decode tok/s, whole requests (N - 1 tokens / time difference)",
         [num(c.get("decode_tok_s_whole"), ".1f") for c in cols]),
        ("GPU memory (nvidia-smi, GiB)", [num(c["gpu_memory_bytes"] and c["gpu_memory_bytes"] / 1024**3, ".2f")
                                         for c in cols]),
    ]
    shot = result.get("one_shot") or {}
    ours = result["sparkpack"].get("decode_tok_s") or result["sparkpack"].get("decode_tok_s_whole")
    ratio = ours / shot["decode_tok_s"] if shot.get("decode_tok_s") and ours else None
    lines = [f"| {result['model']} | " + " | ".join(head) + " |", "| --- |" + " --- |" * len(head)]
    lines += [f"| {name} | " + " | ".join(vals) + " |" for name, vals in rows]
    lines.append(f"| one-shot spark-run -p decode tok/s | {num(shot.get('decode_tok_s'), '.1f')} |"
                 + " |" * (len(head) - 1))
    lines.append(f"| served / one-shot decode (target >= 0.97) | {num(ratio, '.3f')} |" + " |" * (len(head) - 1))
    return "\n".join(lines)


@dataclass
class Tokenizer:
    """The model's own tokenizer, for sizing the prompts."""

    path: Path
    _tok: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        from sparkpack.formats.gguf_file import GGUFModel
        from sparkpack.runtime.tokenizer import GGUFTokenizer

        self._tok = GGUFTokenizer.from_metadata(GGUFModel(self.path))

    def count(self, text: str) -> int:
        return len(self._tok.encode(text))

    def cut(self, text: str, n: int) -> str:
        return self._tok.decode(self._tok.encode(text)[:n])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    tok = Tokenizer(args.model)
    turns = build_turns(list(args.prompts.glob("*.md")), tok.count, tok.cut, args.turn1_tokens, args.turn2_tokens)
    result: dict = {"model": args.model.name, "device": args.device, "vram": args.vram, "ctx": args.ctx,
                    "spark_args": args.spark_arg, "serve_args": args.serve_arg}
    log("== sparkpack --serve")
    result["sparkpack"] = measure(spark_server(args), turns, args)
    log("== one-shot spark-run -p")
    result["one_shot"] = one_shot(args, turns)
    if args.llama_server is not None and shutil.which(str(args.llama_server)):
        from sparkpack.formats.archs import model_spec
        from sparkpack.formats.gguf_file import GGUFModel

        n_layer = model_spec(GGUFModel(args.model)).n_layer
        if args.n_cpu_moe == "auto":
            log(f"== llama-server: the least --n-cpu-moe within {args.vram}")
            n = choose_n_cpu_moe(args, n_layer, parse_size(args.vram), log)
        else:
            n = int(args.n_cpu_moe)
        result["n_cpu_moe"] = n
        log(f"== llama-server --n-cpu-moe {n}")
        result["llama"] = measure(llama_server(args, n), turns, args)
    else:
        log("(no llama-server binary: its column is left out; bash bench/llama_bench.sh --build-only builds one)")
    write_results(args.out, "serve_bench", result, markdown(result))
    return result


def write_results(out: Path, name: str, result: dict, table: str) -> None:
    """``out/NAME.json`` and ``out/NAME.md``, and the table on stdout (the GPU call's output)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
