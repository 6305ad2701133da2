"""The real coding agents against a real ``spark-run --serve``, end to end, on tiny models of every
arch: ``bash bench/agents_check.sh`` installs the pinned clients and runs this.

    python bench/agents_check.py --clients DIR [--archs qwen3moe,qwen35moe,laguna]
           [--only claude-code-2.1.332,codex,...] [--ctx 65536] [--record DIR] [--out DIR]

``DIR`` holds what agents_check.sh installed (``claude-code-VERSION/``, ``codex/``, ``opencode/``,
``aider/`` with their executables). For each arch a synthetic model is written (``repack synth``),
one server started on the CPU through tests/hooked_server.py (spark-run --serve with replies
that can be forced), and each client run in turn
through ``agents_proxy`` (which scripts the replies: a tiny random model writes random text) with
a throwaway HOME and work folder, non-interactively:

* a first prompt (``hello``);
* in the continued session (``-c`` / ``resume``): a forced tool call that writes a file, the
  tool's result and an answer (``write``: the file must hold the text asked for);
* continued again: a forced read of that file (``read``: the tool's result sent back must hold
  that text);
* Claude Code also: a background subagent (the Agent tool; the subagent writes its own file),
  ``/compact``, and a prompt after the compaction;
* Aider has no tool calls: its edit (a whole-file reply) is the tool, and ``--restore-chat-history``
  continues the chat.

A client passes on an arch when every step exits 0, each step's check holds, and every request
after the first of the conversation reports cached prompt tokens. The table of client x arch
(pass/fail, requests, cached tokens of the later turns) is printed and written to ``--out``.
Not part of the test suite: it downloads the clients and takes many minutes on the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from agents_proxy import Exchange, ProxyThread, Recorder, Turn  # noqa: E402

from sparkpack.runtime.server.client_settings import claude_code_env, codex_config  # noqa: E402
from sparkpack.runtime.server.output import ToolSyntax, tool_syntax_for  # noqa: E402
from tests.serve_proc import ServerProcess  # noqa: E402

ARCHS = ("qwen3moe", "qwen35moe", "laguna")
KEY = "agents-check"
FILE, SUB_FILE = "agents_check.txt", "agents_check_sub.txt"
STEP_TIMEOUT_S = 1800


# --- what the model is made to write --------------------------------------------------------------

def tool_call_text(syntax: ToolSyntax, name: str, args: dict) -> str:
    """A tool call as the model writes it in its own syntax, after a short reasoning (a prompt
    that opened ``<think>`` gets it closed; one that did not gets a whole block)."""
    if syntax is ToolSyntax.HERMES_JSON:
        call = f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'
    elif syntax is ToolSyntax.QWEN_XML:
        params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                         for k, v in args.items())
        call = f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    else:
        params = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}"
                         "</arg_value>\n" for k, v in args.items())
        call = f"<tool_call>{name}\n{params}</tool_call>"
    return f"<think>\nThe user asked for a tool call.\n</think>\n\n{call}"


def example_of(schema: dict):
    """The smallest value a JSON schema accepts (a structured-output request gets valid JSON)."""
    kind = schema.get("type")
    if "enum" in schema:
        return schema["enum"][0]
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        return {k: example_of(props[k]) for k in schema.get("required", list(props))}
    if kind == "array":
        return []
    if kind in ("integer", "number"):
        return 0
    if kind == "boolean":
        return False
    return "agents check"


def structured_schema(body: dict) -> dict | None:
    """The JSON schema a request asks its answer to follow, in any dialect."""
    for fmt in ((body.get("output_config") or {}).get("format"), (body.get("response_format") or {}),
                ((body.get("text") or {}).get("format"))):
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            return fmt.get("schema") or (fmt.get("json_schema") or {}).get("schema") or {}
    return None


@dataclass
class Script:
    """The replies of one marked prompt: ``calls(turn)`` for each step (a tool call's name and
    arguments, or None for text), then ``answer``."""

    calls: list[Callable[[Turn], tuple[str, dict] | None]]
    answer: str


def pick(turn: Turn, *names: str) -> str:
    return next(n for n in names if n in turn.tools)


def write_call(path: Path, text: str) -> Callable[[Turn], tuple[str, dict]]:
    def call(turn: Turn) -> tuple[str, dict]:
        if "Write" in turn.tools:
            return "Write", {"file_path": str(path), "content": text}
        if "write" in turn.tools:
            return "write", {"filePath": str(path), "content": text}
        name = pick(turn, "exec_command", "shell")
        return name, {"cmd": f"printf %s '{text}' > {path}"} if name == "exec_command" else \
            {"command": ["bash", "-lc", f"printf %s '{text}' > {path}"]}
    return call


def read_call(path: Path) -> Callable[[Turn], tuple[str, dict]]:
    def call(turn: Turn) -> tuple[str, dict]:
        if "Read" in turn.tools:
            return "Read", {"file_path": str(path)}
        if "read" in turn.tools:
            return "read", {"filePath": str(path)}
        name = pick(turn, "exec_command", "shell")
        return name, {"cmd": f"cat {path}"} if name == "exec_command" else {"command": ["bash", "-lc", f"cat {path}"]}
    return call


def agent_call(prompt: str) -> Callable[[Turn], tuple[str, dict]]:
    def call(turn: Turn) -> tuple[str, dict]:
        args = {"description": "Write the helper file", "prompt": prompt, "subagent_type": "general-purpose"}
        if "run_in_background" in (turn.tools.get("Agent") or {}).get("properties", {}):
            args["run_in_background"] = True
        return "Agent", args
    return call


def scripts(work: Path, token: str) -> dict[str, Script]:
    return {
        "hello": Script([], "Hello from sparkpack."),
        "write": Script([write_call(work / FILE, token)], f"I wrote {FILE}."),
        "read": Script([read_call(work / FILE)], f"I read {FILE}."),
        "agent": Script([agent_call(f"Write the helper file. [{KEY}:sub]")], "A helper is writing its file."),
        "sub": Script([write_call(work / SUB_FILE, token + "-sub")], f"I wrote {SUB_FILE}."),
        "aider-write": Script([], f"{FILE}\n```\n{token}\n```\n"),
    }


DEFAULT_REPLY = "<summary>\nThe user is running the sparkpack agents check.\n</summary>"


def make_reply(syntax: ToolSyntax, table: dict[str, Script]) -> Callable[[Turn, str], str]:
    def reply(turn: Turn, path: str) -> str:
        schema = structured_schema(turn.body)
        if schema is not None:
            return json.dumps(example_of(schema), separators=(",", ":"))  # the grammar allows no free blanks
        script = table.get(turn.script) if turn.script else None
        if script is None:
            return DEFAULT_REPLY
        if turn.results < len(script.calls):
            step = script.calls[turn.results](turn)
            if step is not None:
                return tool_call_text(syntax, *step)
        return script.answer
    return reply


def opencode_config(name: str, base: str, key: str, ctx: int) -> dict:
    """README's ``opencode.json`` (OpenCode assumes no context limit without one)."""
    return {"$schema": "https://opencode.ai/config.json",
            "provider": {"sparkpack": {"npm": "@ai-sdk/openai-compatible", "name": "sparkpack",
                                       "options": {"baseURL": f"{base}/v1", "apiKey": key},
                                       "models": {name: {"name": name, "tool_call": True,
                                                         "limit": {"context": ctx, "output": 8192}}}}}}


def aider_metadata(name: str, ctx: int) -> dict:
    """README's ``.aider.model.metadata.json``."""
    return {f"openai/{name}": {"max_input_tokens": ctx, "max_output_tokens": 8192, "litellm_provider": "openai",
                               "mode": "chat"}}


# --- the clients -----------------------------------------------------------------------------------

@dataclass
class Step:
    name: str
    argv: list[str]
    check: Callable[[list[Exchange]], str | None] = lambda exchanges: None  # a problem, or None


@dataclass
class Client:
    name: str
    steps: Callable[[Path, str, str], list[Step]]  # (work, model name, token)
    env: Callable[[Path, str, str, int], dict[str, str]]  # (home, base, model name, ctx)
    growing: Callable[[Path, str, str], list[Step]] | None = None  # a conversation that must compact by itself


def file_holds(path: Path, text: str) -> Callable[[list[Exchange]], str | None]:
    def check(exchanges: list[Exchange]) -> str | None:
        if not path.exists():
            return f"{path.name} was not written"
        got = path.read_text().strip()
        return None if got == text else f"{path.name} holds {got[:60]!r}, not {text!r}"
    return check


def result_sent_back(text: str) -> Callable[[list[Exchange]], str | None]:
    def check(exchanges: list[Exchange]) -> str | None:
        from agents_proxy import turn_of

        if any(text in r for ex in exchanges if isinstance(ex.body, dict)
               for r in turn_of(ex.path, ex.body).result_texts):
            return None
        return f"no tool result holding {text!r} came back"
    return check


def claude_code(version: str, root: Path) -> Client:
    exe = str(root / f"claude-code-{version}" / "node_modules" / ".bin" / "claude")

    def steps(work: Path, model: str, token: str) -> list[Step]:
        # the tools a step uses (the whole default set doubles a prompt that a CPU computes for minutes)
        first = [exe, "-p", "--permission-mode", "acceptEdits", "--tools", "Agent,Read,Write",
                 "--allowedTools", "Agent,Read,Write", "--"]
        then = [exe, "-p", "-c", *first[2:]]
        return [Step("hello", first + [f"Say hello. [{KEY}:hello]"]),
                Step("write", then + [f"Write {FILE}. [{KEY}:write]"], file_holds(work / FILE, token)),
                Step("read", then + [f"Read {FILE}. [{KEY}:read]"], result_sent_back(token)),
                Step("agent", then + [f"Ask a helper. [{KEY}:agent]"], file_holds(work / SUB_FILE, token + "-sub")),
                Step("compact", then + ["/compact"]),
                Step("after-compact", then + [f"Say hello again. [{KEY}:hello]"])]

    def growing(work: Path, model: str, token: str) -> list[Step]:
        first, then = steps(work, model, token)[0], steps(work, model, token)[1].argv[:-1]
        return [first] + [Step(f"grow-{i}", then + [filler(i) + f" [{KEY}:hello]"]) for i in range(GROW_TURNS)] + \
            [Step("after", then + [f"Say hello again. [{KEY}:hello]"], compacted)]

    def env(home: Path, base: str, model: str, ctx: int) -> dict[str, str]:
        return {"HOME": str(home), "DISABLE_AUTOUPDATER": "1", "ANTHROPIC_BASE_URL": base,
                "ANTHROPIC_AUTH_TOKEN": KEY, **claude_code_env(model, ctx)}

    return Client(f"claude-code-{version}", steps, env, growing)


GROW_TURNS = 7
COMPACTION_ASKS = "create a detailed summary"  # Claude Code's compaction prompt says so (2.1.197, 2.1.332)


def filler(turn: int) -> str:
    """A long user message (a few thousand tokens) that grows the conversation."""
    return " ".join(f"Note {turn}.{i}: the conversation grows by this line so that it has to be compacted."
                    for i in range(60))


def compacted(exchanges: list[Exchange]) -> str | None:
    from agents_proxy import turn_of

    if any(isinstance(ex.body, dict) and COMPACTION_ASKS in turn_of(ex.path, ex.body).prompt for ex in exchanges):
        return None
    return "the conversation grew without a compaction"


def codex(root: Path) -> Client:
    exe = str(root / "codex" / "node_modules" / ".bin" / "codex")

    def steps(work: Path, model: str, token: str) -> list[Step]:
        run = [exe, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
        resume = run + ["resume", "--last"]
        return [Step("hello", run + [f"Say hello. [{KEY}:hello]"]),
                Step("write", resume + [f"Write {FILE}. [{KEY}:write]"], file_holds(work / FILE, token)),
                Step("read", resume + [f"Read {FILE}. [{KEY}:read]"], result_sent_back(token))]

    def env(home: Path, base: str, model: str, ctx: int) -> dict[str, str]:
        (home / ".codex").mkdir(parents=True, exist_ok=True)
        (home / ".codex" / "config.toml").write_text("check_for_update_on_startup = false\n"
                                                     + codex_config(model, base, ctx))
        return {"HOME": str(home), "OPENAI_API_KEY": KEY}

    return Client("codex", steps, env)


def opencode(root: Path) -> Client:
    exe = str(root / "opencode" / "node_modules" / ".bin" / "opencode")

    def steps(work: Path, model: str, token: str) -> list[Step]:
        run = [exe, "run", "-m", f"sparkpack/{model}"]
        return [Step("hello", run + [f"Say hello. [{KEY}:hello]"]),
                Step("write", run + ["-c", f"Write {FILE}. [{KEY}:write]"], file_holds(work / FILE, token)),
                Step("read", run + ["-c", f"Read {FILE}. [{KEY}:read]"], result_sent_back(token))]

    def env(home: Path, base: str, model: str, ctx: int) -> dict[str, str]:
        cache = os.environ.get("AGENTS_CHECK_CACHE")  # OpenCode installs its provider package at first use
        return {"HOME": str(home), "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
                "OPENCODE_PERMISSION": json.dumps({"*": "allow"}),
                **({"XDG_CACHE_HOME": str(Path(cache) / "opencode-home-cache")} if cache else {}),
                "OPENCODE_CONFIG_CONTENT": json.dumps(opencode_config(model, base, KEY, ctx))}

    return Client("opencode", steps, env)


def aider(root: Path) -> Client:
    exe = str(root / "aider" / "bin" / "aider")

    def steps(work: Path, model: str, token: str) -> list[Step]:
        run = [exe, "--model", f"openai/{model}", "--yes-always", "--no-git", "--no-check-update",
               "--no-show-model-warnings", "--no-pretty", "--no-stream", "--edit-format", "whole",
               "--model-metadata-file", str(work.parent / "aider-metadata.json")]
        return [Step("hello", run + ["--message", f"Say hello. [{KEY}:hello]"]),
                Step("write", run + ["--restore-chat-history", "--message", f"Write {FILE}. [{KEY}:aider-write]", FILE],
                     file_holds(work / FILE, token)),
                Step("read", run + ["--restore-chat-history", "--message", f"What does {FILE} hold? [{KEY}:hello]",
                                    FILE], result_in_prompt(token))]

    def env(home: Path, base: str, model: str, ctx: int) -> dict[str, str]:
        (home.parent / "aider-metadata.json").write_text(json.dumps(aider_metadata(model, ctx)))
        return {"HOME": str(home), "OPENAI_API_BASE": f"{base}/v1", "OPENAI_API_KEY": KEY}

    return Client("aider", steps, env)


def result_in_prompt(text: str) -> Callable[[list[Exchange]], str | None]:
    """Aider sends the files it edits in the prompt: the written text must come back."""
    def check(exchanges: list[Exchange]) -> str | None:
        last = [ex for ex in exchanges if isinstance(ex.body, dict) and ex.body.get("messages")]
        if last and text in json.dumps(last[-1].body["messages"]):
            return None
        return f"the file's text {text!r} did not come back in the prompt"
    return check


# --- running ----------------------------------------------------------------------------------------

@dataclass
class Outcome:
    client: str
    arch: str
    problems: list[str] = field(default_factory=list)
    requests: int = 0
    cached: list[int] = field(default_factory=list)  # cached tokens of each request after the first

    @property
    def passed(self) -> bool:
        return not self.problems


def run_client(client: Client, arch: str, model: str, server: ServerProcess, syntax: ToolSyntax, ctx: int,
               root: Path, record: Path | None, growing: bool = False) -> Outcome:
    out = Outcome(client.name + (" (auto-compact)" if growing else ""), arch)
    place = Path(tempfile.mkdtemp(prefix=f"{client.name}-{arch}-", dir=root))
    home, work = place / "home", place / "work"
    home.mkdir()
    work.mkdir()
    token = f"sparkpack-{client.name}-{arch}"
    recorder = Recorder(record / out.client / arch if record else None)
    proxy = ProxyThread(server.base, make_reply(syntax, scripts(work, token)), recorder)
    try:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_", "CLAUDE_"))},
               **client.env(home, proxy.base, model, ctx)}
        for step in (client.growing if growing else client.steps)(work, model, token):
            before = len(recorder.exchanges)
            started = time.monotonic()
            try:
                p = subprocess.run(step.argv, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                   text=True, timeout=STEP_TIMEOUT_S)
                rc, text = p.returncode, (p.stdout + p.stderr)
            except subprocess.TimeoutExpired as e:
                rc, text = -1, f"timed out after {STEP_TIMEOUT_S} s: {e.stdout or ''}{e.stderr or ''}"
            (place / f"{step.name}.log").write_text(text)
            new = recorder.exchanges[before:]
            bad = [ex for ex in new if ex.status != 200]
            problem = (f"exit {rc}: {text.strip()[-300:]}" if rc != 0 else
                       f"{len(bad)} requests answered {bad[0].status}: {bad[0].response[:200]!r}" if bad else
                       step.check(recorder.exchanges))
            print(f"  {client.name:22} {arch:10} {step.name:14} {'ok' if problem is None else 'FAIL'} "
                  f"({len(new)} requests, {time.monotonic() - started:.0f} s)", flush=True)
            if problem is not None:
                out.problems.append(f"{step.name}: {problem}")
                break
    finally:
        proxy.stop()
    ok = [ex for ex in recorder.exchanges if ex.status == 200]
    out.requests = len(recorder.exchanges)
    out.cached = [ex.cached for ex in ok[1:]]
    if out.passed and ok[1:] and not any(out.cached):
        out.problems.append("no later request reported cached tokens")
    return out


def table(outcomes: list[Outcome], archs: list[str]) -> str:
    clients = list(dict.fromkeys(o.client for o in outcomes))
    by = {(o.client, o.arch): o for o in outcomes}
    lines = ["| client | " + " | ".join(archs) + " |", "| --- |" + " --- |" * len(archs)]
    for c in clients:
        cells = []
        for a in archs:
            o = by.get((c, a))
            cells.append("-" if o is None else
                         f"{'pass' if o.passed else 'FAIL'}: {o.requests} requests, cached "
                         f"{sum(1 for x in o.cached if x)}/{len(o.cached)} later ones (max {max(o.cached, default=0)})")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=Path, required=True, help="what agents_check.sh installed")
    ap.add_argument("--claude-versions", default="2.1.332", help="comma-separated installed Claude Code versions")
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--only", default="", help="comma-separated client names (default: all)")
    ap.add_argument("--ctx", type=int, default=65536)
    ap.add_argument("--compaction-only", action="store_true", help="run only Claude Code's compacting conversation")
    ap.add_argument("--compact-ctx", type=int, default=32768,
                    help="Claude Code's conversation that must compact by itself runs on a server with this --ctx "
                         "(on the first arch; 0: skip it)")
    ap.add_argument("--threads", type=int, default=1, help="the server's CPU threads")
    ap.add_argument("--record", type=Path, help="write every request each client sent under this folder")
    ap.add_argument("--out", type=Path, default=None, help="folder for the logs and summary (default: a temp one)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="agents-check-"))
    out.mkdir(parents=True, exist_ok=True)
    clients = [claude_code(v, args.clients) for v in args.claude_versions.split(",") if v] + \
        [codex(args.clients), opencode(args.clients), aider(args.clients)]
    if args.only:
        wanted = set(args.only.split(","))
        clients = [c for c in clients if c.name in wanted]
    archs = args.archs.split(",")
    outcomes: list[Outcome] = []
    for arch in archs:
        model = out / f"{arch}.gguf"
        if not model.exists():
            subprocess.run(["repack", "synth", "--arch", arch, "-o", str(model), "-j", "1"], check=True,
                           stdout=subprocess.DEVNULL)
        if args.compaction_only:
            continue
        server = ServerProcess(model, "--ctx", str(args.ctx), "--threads", str(args.threads), hooks=out / "hooks",
                               api_key=KEY, env={"OMP_NUM_THREADS": str(args.threads)})
        try:
            syntax = tool_syntax_for(arch, "")
            for client in clients:
                outcomes.append(run_client(client, arch, model.name[:-5], server, syntax, args.ctx, out, args.record))
        finally:
            server.stop()
    growing = [c for c in clients if c.growing is not None]
    if growing and args.compact_ctx:
        arch = archs[0]
        server = ServerProcess(out / f"{arch}.gguf", "--ctx", str(args.compact_ctx), "--threads", str(args.threads),
                               hooks=out / "hooks", api_key=KEY, env={"OMP_NUM_THREADS": str(args.threads)})
        try:
            for client in growing:
                outcomes.append(run_client(client, arch, arch, server, tool_syntax_for(arch, ""), args.compact_ctx,
                                           out, args.record, growing=True))
        finally:
            server.stop()
    summary = table(outcomes, archs)
    problems = [f"{o.client} on {o.arch}: {p}" for o in outcomes for p in o.problems]
    (out / "summary.md").write_text(summary + "\n\n" + "\n".join(problems) + "\n")
    print(summary)
    for p in problems:
        print(p)
    print(f"logs: {out}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
