"""``spark-run --serve``'s command line: help, misuse, and failures that are one line and exit 1."""
from __future__ import annotations

import socket
from dataclasses import dataclass

import httpx
import pytest

from sparkpack.runtime.server.serve import client_settings
from tests.serve_proc import ServerProcess
from tests.commands import run_cli


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def spark_run(monkeypatch, capsys, *args: str) -> Ran:
    """spark-run in this process, through its real entry point (one-line errors, exit codes)."""
    return Ran(*run_cli(list(args), monkeypatch, capsys))


def test_help_shows_a_serve_example(monkeypatch, capsys):
    out = spark_run(monkeypatch, capsys, "--serve", "--help")
    assert out.returncode == 0 and "spark-run model.gguf --serve" in out.stdout and "--api-key-file" in out.stdout


@pytest.mark.parametrize("args,message", [
    (["--serve", "-p", "hi"], "--serve takes its prompts from HTTP requests"),
    (["--serve", "--api-key", "a", "--api-key-file", "pyproject.toml"], "either --api-key or --api-key-file"),
    (["--serve", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["-p", "hi", "--cache-ram", "1GiB"], "use them with --serve"),
])
def test_misuse_is_one_line(synth_model, monkeypatch, capsys, args, message):
    out = spark_run(monkeypatch, capsys, str(synth_model("qwen3moe")), "--device", "cpu", *args)
    assert out.returncode == 1 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_taken_port_and_a_missing_model_are_one_line_errors(synth_model, tmp_path, monkeypatch, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = spark_run(monkeypatch, capsys, str(synth_model("qwen3moe")), "--serve", "--device", "cpu", "--port",
                        str(port))
    assert out.returncode == 1 and f"127.0.0.1:{port}: cannot listen there" in out.stderr
    out = spark_run(monkeypatch, capsys, str(tmp_path / "missing.gguf"), "--serve", "--device", "cpu", "--port", "0")
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1].startswith("spark-run: error: ")
    assert "Traceback" not in out.stderr
    out = spark_run(monkeypatch, capsys, str(synth_model("qwen3moe")), "--serve", "--device", "cpu", "--port", "0",
                    "--cache-dir", "pyproject.toml")  # a file, not a folder
    assert out.returncode == 2 and "pyproject.toml' is a file" in out.stderr and len(out.stderr.splitlines()) == 1
    out = spark_run(monkeypatch, capsys, str(synth_model("qwen3moe")), "--serve", "--device", "cpu", "--port", "0",
                    "--cache-dir", "/proc/sparkpack-states")  # a folder that cannot be made
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 1 and "/proc/sparkpack-states" in last and "cannot use it as --cache-dir" in last
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_api_key_file_client_settings_and_the_default_output_cap(synth_model, tmp_path):
    """--max-tokens caps the requests that set no cap of their own (Codex sets none)."""
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    server = ServerProcess(synth_model("qwen3moe"), "--api-key-file", str(key), "--max-tokens", "3", "--ctx", "64",
                           api_key=None)
    auth = {"Authorization": "Bearer s3cret"}
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert httpx.post(server.base + "/v1/chat/completions", json=body).status_code == 401
        ok = httpx.post(server.base + "/v1/chat/completions", json=body, headers=auth)
        assert ok.status_code == 200
        printed = "".join(server.stdout)
        assert f"OPENAI_BASE_URL={server.base}/v1" in printed and f"ANTHROPIC_BASE_URL={server.base}" in printed
        assert 'wire_api = "responses"' in printed and "s3cret" in printed
        uncapped = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}
        r = httpx.post(server.base + "/v1/chat/completions", json=uncapped, headers=auth).json()
        assert r["usage"]["completion_tokens"] == 3 and r["choices"][0]["finish_reason"] == "length"
        r = httpx.post(server.base + "/v1/chat/completions", json={**uncapped, "max_tokens": 5}, headers=auth).json()
        assert r["usage"]["completion_tokens"] == 5
        r = httpx.post(server.base + "/v1/responses", json={"input": "hi"}, headers=auth).json()
        assert r["usage"]["output_tokens"] == 3 and r["status"] == "incomplete"
        # the context still caps a request whose prompt leaves room for fewer than 3 tokens
        def counted(text: str) -> int:
            return httpx.post(server.base + "/v1/messages/count_tokens", headers=auth,
                              json={"messages": [{"role": "user", "content": text}]}).json()["input_tokens"]

        text = next(t for t in ("x " * k for k in range(64)) if counted(t) >= 62)
        assert counted(text) < 64
        r = httpx.post(server.base + "/v1/chat/completions", headers=auth,
                       json={**uncapped, "messages": [{"role": "user", "content": text}]}).json()
        assert r["usage"]["completion_tokens"] == 64 - counted(text) < 3 and r["choices"][0]["finish_reason"] == "length"
    finally:
        assert server.stop() == 0


def test_client_settings_name_the_model_and_context():
    text = client_settings("qwen3.6-35b", "http://127.0.0.1:8080", 65536, None)
    assert 'model = "qwen3.6-35b"' in text and "model_context_window = 65536" in text
    assert 'base_url = "http://127.0.0.1:8080/v1"' in text and "model_auto_compact_token_limit = 55705" in text


def test_while_loading_health_and_routes_answer_503_in_their_dialect():
    """Before the model is in, /health says loading and every route a retryable 503."""
    from fastapi.testclient import TestClient

    from sparkpack.runtime.server.app import create_app
    from sparkpack.runtime.options import ServeOptions

    client = TestClient(create_app(ServeOptions()))
    assert client.get("/health").status_code == 503
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error" and "loading" in r.json()["error"]["message"]
    r = client.post("/v1/messages", json={"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"


def test_a_stopped_engine_makes_health_answer_503(synth_model):
    """An engine whose thread has stopped (``close``; a failure no guard caught): /health says so
    with a 503, so that a supervisor restarts the server (the engine refuses jobs then too:
    test_server_parallel)."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from sparkpack.runtime.generate import Session
    from sparkpack.runtime.models import load_model
    from sparkpack.runtime.options import ServeOptions
    from sparkpack.runtime.server.app import create_app
    from sparkpack.runtime.server.engine import Engine

    app = create_app(ServeOptions())
    engine = Engine(Session(load_model(synth_model("qwen3moe"))), frozenset())
    app.state.served = SimpleNamespace(engine=engine)
    client = TestClient(app)
    assert client.get("/health").json() == {"status": "ok"}
    engine.close()
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "error"


@pytest.mark.parametrize("ctx", [32768, 65536, 131072, 262144])
def test_claude_code_settings_compact_inside_the_context(ctx):
    """Claude Code's auto-compaction threshold, as it computes it from the printed variables
    (2.1.197 to 2.1.332: the window raised to at least 100k, less the 20k kept for its answer; the
    lower of that less a 13k buffer and the percentage of it), lands inside --ctx with room for the
    summary's answer. bench/agents_check.sh shows the real client compacting."""
    from sparkpack.runtime.server.client_settings import claude_code_compaction

    env = claude_code_compaction(ctx)
    counted = max(int(env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"]), 100_000) - 20_000
    threshold = min(counted * int(env["CLAUDE_AUTOCOMPACT_PCT_OVERRIDE"]) // 100, counted - 13_000)
    assert ctx // 2 < threshold <= ctx * 0.85
    assert f"CLAUDE_CODE_AUTO_COMPACT_WINDOW={env['CLAUDE_CODE_AUTO_COMPACT_WINDOW']}" in \
        client_settings("m", "http://127.0.0.1:8080", ctx, None)
