"""Chunked prefill in a ``--parallel`` server (``runtime.server.parallel``, ``--step-tokens``): a
long prompt is prefilled a few calls per decode step, so a running stream keeps receiving tokens
while it is computed and a short request arriving meanwhile is answered first; with
``--step-tokens 0`` (the prompt whole) neither holds. Greedy replies equal a one-at-a-time
server's bit for bit, and a client gone midway through a prefill frees its session, whose state
the next request keeps. Real server processes, the official openai client; order of events, no
timing."""
from __future__ import annotations

import re
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.serve_proc import API_KEY, ServerProcess

CALL = "16"  # --prefill-chunk: a long prompt is many calls
OPTIONS = ["--ctx", "4096", "--prefill-chunk", CALL]
LONG_WORDS = 500  # the long prompt: about 2,400 tokens, 150 calls
FORCED = "sparkpack_test_output"  # tests/hooked_server.py: the reply's text, teacher-forced


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def long_text(seed: int) -> str:
    return " ".join(f"word{seed + i}" for i in range(LONG_WORDS))


def prefilling(server: ServerProcess) -> int:
    m = re.search(r"^sparkpack_prefilling_sequences (\S+)", httpx.get(server.base + "/metrics").text, re.M)
    return int(float(m.group(1)))


def wait_for_prefill(server: ServerProcess, thread: threading.Thread) -> None:
    """Until a prompt is being prefilled (or the thread that sent it is gone)."""
    while not prefilling(server) and thread.is_alive():
        time.sleep(0.005)


class Events:
    """What the client threads saw, in the order they saw it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.log: list[str] = []
        self.texts: dict[str, str] = {}

    def add(self, name: str) -> None:
        with self.lock:
            self.log.append(name)

    def stream(self, client: openai.OpenAI, name: str, messages: list[dict], max_tokens: int,
               extra: dict | None = None, until: threading.Event | None = None) -> None:
        """Stream a chat completion, logging ``name`` at each chunk with text (``name:first`` at
        the first); ``until``: close the stream once it is set."""
        self.add(f"{name}:sent")
        stream = client.chat.completions.create(model="x", messages=messages, max_tokens=max_tokens, stream=True,
                                                extra_body=extra)
        text = ""
        for chunk in stream:
            piece = chunk.choices[0].delta.content if chunk.choices else None
            if piece:
                self.add(f"{name}:first" if not text else name)
                text += piece
            if until is not None and until.is_set():
                stream.close()
                break
        self.texts[name] = text


@pytest.mark.slow
@pytest.mark.parametrize("step_tokens", ["16", "0"])
def test_a_long_prompt_is_prefilled_between_decode_steps(synth_model, tmp_path, step_tokens):
    """A stream runs; a long prompt arrives, then, while it is prefilled, a short one. Chunked
    (``--step-tokens 16``: one call a step), the running stream receives a token for about every
    call of the long prompt before that prompt's first token, and the short request's first token
    comes before it; whole (``0``), the stream stalls for the prompt and the short request waits."""
    server = ServerProcess(synth_model("qwen3moe"), *OPTIONS, "--parallel", "3", "--step-tokens", step_tokens,
                           hooks=tmp_path)
    try:
        client, ev, done = client_of(server), Events(), threading.Event()
        running = threading.Thread(target=ev.stream, args=(client, "run", ask("Tell me a story."), 3000,
                                                           {FORCED: long_text(0)}, done))
        running.start()
        while "run:first" not in ev.log and running.is_alive():
            time.sleep(0.005)
        long = threading.Thread(target=ev.stream, args=(client, "long", ask(long_text(1000)), 4, {FORCED: "yes no"}))
        long.start()
        wait_for_prefill(server, long)
        short = threading.Thread(target=ev.stream, args=(client, "short", ask("Hi"), 4, {FORCED: "hello there"}))
        short.start()
        long.join(300)
        short.join(300)
        done.set()
        running.join(300)
        assert ev.texts["long"] == "yes no" and ev.texts["short"] == "hello there"
        log = ev.log
        calls = LONG_WORDS * 4 // int(CALL)  # fewer than the long prompt's calls (about 4.8 tokens a word)
        between = log[log.index("long:sent"):log.index("long:first")].count("run")
        if step_tokens == "0":
            assert between < calls // 2, between
        else:
            assert between >= calls // 2, between
            assert log.index("short:first") < log.index("long:first")
        assert httpx.get(server.base + "/health").status_code == 200
        assert prefilling(server) == 0
    finally:
        assert server.stop(signal.SIGINT) == 0


@pytest.mark.slow
def test_greedy_replies_through_chunked_prefill_and_a_prefill_given_up(synth_model):
    """Greedy replies of a long and a short prompt sent while another request streams, each
    prompt prefilled in chunks, equal a one-at-a-time server's; a client gone midway through a
    long prompt's prefill ends as cancelled, frees its session (the server goes on), and the same
    prompt sent again keeps the part computed (more than nothing, less than the whole: it was
    given up midway) and gives the serial reply. (The qwen35moe shape, whose DeltaNet checkpoints
    a chunk boundary must keep; test_chunked_prefill takes every arch's chunked prompts in-process.)"""
    path = synth_model("qwen35moe")
    prompts = {"run": ask("Why is the sky blue?"), "long": ask(long_text(2000)), "short": ask("Name a prime.")}
    tokens = {"run": 24, "long": 6, "short": 6}
    serial_server = ServerProcess(path, *OPTIONS, "--parallel", "1")
    try:
        client = client_of(serial_server)
        serial = {k: client.chat.completions.create(model="x", messages=m, max_tokens=tokens[k]).choices[0]
                  .message.content for k, m in prompts.items()}
    finally:
        assert serial_server.stop(signal.SIGTERM) == 0
    server = ServerProcess(path, *OPTIONS, "--parallel", "2", "--step-tokens", CALL)
    try:
        client, ev = client_of(server), Events()
        running = threading.Thread(target=ev.stream, args=(client, "run", prompts["run"], tokens["run"]))
        running.start()
        long = threading.Thread(target=ev.stream, args=(client, "long", prompts["long"], tokens["long"]))
        long.start()
        wait_for_prefill(server, long)
        ev.stream(client, "short", prompts["short"], tokens["short"])
        long.join(300)
        running.join(300)
        assert ev.texts == serial

        given_up = ask(long_text(3000))
        stream = client.chat.completions.create(model="x", messages=given_up, max_tokens=6, stream=True)
        assert next(iter(stream)).choices[0].delta.role == "assistant"  # (sent before the prefill)
        while not prefilling(server):
            time.sleep(0.005)
        stream.close()  # the client goes away midway through the prefill
        while prefilling(server):
            time.sleep(0.01)
        metrics = httpx.get(server.base + "/metrics").text
        assert re.search(r'sparkpack_requests_total\{outcome="cancelled",route="chat"\} 1\.0', metrics), metrics
        again = client.chat.completions.create(model="x", messages=given_up, max_tokens=6)
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert 0 < cached < again.usage.prompt_tokens - 2 * int(CALL), (cached, again.usage.prompt_tokens)
        serial_server = ServerProcess(path, *OPTIONS, "--parallel", "1")
        try:
            want = client_of(serial_server).chat.completions.create(model="x", messages=given_up, max_tokens=6)
        finally:
            assert serial_server.stop(signal.SIGTERM) == 0
        assert again.choices[0].message.content == want.choices[0].message.content
        assert httpx.get(server.base + "/health").status_code == 200
    finally:
        assert server.stop(signal.SIGINT) == 0


def test_step_tokens_needs_a_parallel_server(synth_model):
    """--step-tokens shares a step between prompts and running replies: refused in one line
    without --serve, with --parallel 1, and below 0."""
    from tests.procs import SPARK_RUN, error_lines, run

    path = str(synth_model("qwen3moe"))
    res = run([*SPARK_RUN, path, "-p", "hi", "--step-tokens", "64"])
    assert res.returncode == 1 and error_lines(res.stderr) == [
        "spark-run: error: --step-tokens is the prompt tokens a server prefills per decode step: use it with --serve"]
    res = run([*SPARK_RUN, path, "--serve", "--port", "0", "--parallel", "1", "--step-tokens", "64"])
    assert res.returncode == 1 and error_lines(res.stderr) == [
        "spark-run: error: --step-tokens interleaves a prompt with other requests' decode steps: "
        "it needs --parallel 2 or more"]
    res = run([*SPARK_RUN, path, "--serve", "--port", "0", "--step-tokens", "-1"])
    assert res.returncode == 2 and "--step-tokens" in res.stderr and "Traceback" not in res.stderr
