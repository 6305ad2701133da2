"""Load: 8 concurrent streaming clients, each a bounded loop of requests, some closing their
stream midway. Every request completes or is cancelled cleanly, the server stays up, its memory
stays flat from one round to the next, and every greedy completion equals the one served alone
(requests interleave, so each prompt rewinds the cache to what it shares with the previous one:
qwen35moe's DeltaNet checkpoints are restored under load)."""
from __future__ import annotations

import re
import signal

import httpx
import openai
import pytest

from tests.serve_proc import API_KEY, ServerProcess, streaming_clients

CLIENTS = 8
REQUESTS = 3  # per client and round
MAX_TOKENS = 12
SYSTEM = "You are a careful assistant. Answer in one short sentence."
QUESTIONS = ["What is a mixture of experts?", "Why is the sky blue?", "Name a prime number.",
             "What does a compiler do?", "How far is the moon?"]


def request(i: int, j: int) -> list[dict]:
    """Client i's j-th conversation: a shared system prompt, then a question."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[(i + j) % len(QUESTIONS)]}]


@pytest.fixture(scope="module")
def server(synth_model):
    proc = ServerProcess(synth_model("qwen35moe"), "--ctx", "1024", "--prefill-chunk", "16")
    yield proc
    assert proc.stop(signal.SIGINT) == 0  # Ctrl-C ends it as SIGTERM does: exit 0


@pytest.mark.slow
def test_concurrent_streams_some_cancelled(server):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0)
    serial = {}
    for q in range(len(QUESTIONS)):
        r = client.chat.completions.create(model="x", messages=request(q, 0), max_tokens=MAX_TOKENS)
        serial[q] = r.choices[0].message.content

    results: list[tuple[int, str, bool]] = []  # (question, text, cancelled)

    def round_of_load() -> None:
        results.extend(streaming_clients(client, CLIENTS, REQUESTS,
                                         lambda i, j: ((i + j) % len(QUESTIONS), request(i, j)), MAX_TOKENS))
        assert httpx.get(server.base + "/health").status_code == 200

    round_of_load()  # warm: allocator pools, graph of the code paths
    rss = server.rss()
    round_of_load()
    round_of_load()
    grown = server.rss() - rss
    assert grown < 32 * 1024**2, f"RSS grew by {grown / 1024**2:.1f} MiB over two rounds"
    assert len(results) == 3 * CLIENTS * REQUESTS
    for q, text, cancelled in results:
        if cancelled:
            assert serial[q].startswith(text)
        else:
            assert text == serial[q]
    metrics = httpx.get(server.base + "/metrics").text
    counts = {m.group(1): float(m.group(2))
              for m in re.finditer(r'sparkpack_requests_total\{outcome="(\w+)",route="chat"\} (\S+)', metrics)}
    n_cancelled = sum(c for _, _, c in results)
    # a stream closed after its last token may have finished first
    assert n_cancelled - 2 <= counts.get("cancelled", 0) <= n_cancelled
    assert sum(counts.values()) == len(results) + len(QUESTIONS)
