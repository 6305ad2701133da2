"""A real ``spark-run MODEL --serve`` subprocess for the server tests (one per test module).

It listens on a free port (``--port 0``) on the CPU (with ``hooks``, started through
tests/hooked_server.py); ``start`` returns once /health answers 200 and the client settings are
printed. ``stop`` sends SIGTERM and returns the exit status.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

API_KEY = "test-key"
# The servers compute with one thread: on these 2 shared cores that is 3x faster than two, and a
# CPU matmul's bits depend on the thread count, so references are computed with one thread too.
ENV = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "OMP_NUM_THREADS": "1"}


@contextlib.contextmanager
def one_thread():
    """Compute an in-process reference as the servers do (see ``ENV``)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def fresh_session(model_path: Path, call: int, ctx: int):
    """An in-process session as the server opens one on ``model_path`` (CPU, ``--prefill-chunk
    call``): same breaks (the tokenizer's control tokens), so its bits are the server's."""
    from sparkpack.formats.gguf_file import GGUFModel
    from sparkpack.runtime.generate import Session
    from sparkpack.runtime.models import load_model
    from sparkpack.runtime.tokenizer import GGUFTokenizer

    breaks = GGUFTokenizer.from_metadata(GGUFModel(model_path)).control_ids
    return Session(load_model(model_path), prefill_chunk=call, ctx=ctx, breaks=breaks)


def kept_tokens(previous: list[int], ids: list[int], call: int, breaks: frozenset[int]) -> int:
    """What the server keeps of prompt ``ids`` after prompt ``previous`` (computed whole, then a
    reply): the last place a fresh session ends a call of ``previous`` (``call_end``) that is
    inside the common prefix and before ``ids``' last token, and where a fresh session feeding
    ``ids`` ends one too (it may not, at the first token that differs)."""
    from sparkpack.runtime.call_plan import call_end

    def cuts_of(seq: list[int]) -> list[int]:
        cuts = [0]
        while (end := call_end(seq, cuts[-1], call, breaks)) <= len(seq):
            cuts.append(end)
        return cuts

    common = next((i for i, (a, b) in enumerate(zip(previous, ids)) if a != b), min(len(previous), len(ids)))
    theirs = set(cuts_of(ids))
    return max(c for c in cuts_of(previous) if c <= min(common, len(ids) - 1) and (c < common or c in theirs))


class ServerProcess:
    def __init__(self, model: Path, *args: str, hooks: Path | None = None, api_key: str | None = API_KEY,
                 device: str = "cpu", env: dict[str, str] | None = None):
        # with ``hooks``: the same server with tests/hooked_server.py's hooks writing into that folder
        cmd = ([sys.executable, "-m", "sparkpack.runtime.cli", str(model), "--serve"] if hooks is None else
               [sys.executable, str(Path(__file__).with_name("hooked_server.py")), str(hooks), str(model)])
        cmd += ["--port", "0", "--device", device, "--temperature", "0", *args]
        if api_key is not None:
            cmd += ["--api-key", api_key]
        self.api_key = api_key
        self.hooks = hooks
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**ENV, **(env or {})})
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._readers = [threading.Thread(target=self._drain, args=(s, out), daemon=True)
                         for s, out in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr))]
        for t in self._readers:
            t.start()
        self.base = self._wait_ready()

    def _drain(self, stream, out: list[str]) -> None:
        for line in stream:
            out.append(line)

    def _wait_ready(self, timeout: float = 120.0) -> str:
        end = time.monotonic() + timeout
        base = None
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"spark-run --serve exited {self.proc.returncode}: {''.join(self.stderr)}")
            if base is None:
                m = re.search(r"listening on (http://\S+),", "".join(self.stderr))
                base = m.group(1) if m else None
            if base is not None and any("serving" in line for line in self.stdout):
                if httpx.get(base + "/health").status_code == 200:
                    return base
            time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError(f"spark-run --serve was not ready after {timeout} s: {''.join(self.stderr)}")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, path: str, **kw) -> httpx.Response:
        kw.setdefault("timeout", 120)
        return httpx.post(self.base + path, headers={**self.headers, **kw.pop("headers", {})}, **kw)

    def openai(self):
        """The official OpenAI client on this server (no retries: a test sees the first answer)."""
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key=self.api_key, max_retries=0)

    def anthropic(self):
        import anthropic

        return anthropic.Anthropic(base_url=self.base, api_key=self.api_key, max_retries=0)

    def rss(self) -> int:
        """The server's resident memory in bytes (Linux)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for t in self._readers:
            t.join(5)
        return self.proc.returncode


def stream_text(client, messages: list[dict], max_tokens: int, close_after: int | None = None) -> str:
    """A streamed chat completion's text through the openai client; ``close_after``: the client
    closes the stream after that many chunks (a user gone midway)."""
    stream = client.chat.completions.create(model="x", messages=messages, max_tokens=max_tokens, stream=True)
    text = ""
    for n, chunk in enumerate(stream, 1):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if close_after is not None and n == close_after:
            stream.close()
            break
    return text


def streaming_clients(client, clients: int, requests: int, ask: Callable[[int, int], tuple[int, list[dict]]],
                      max_tokens: int) -> list[tuple[int, str, bool]]:
    """``clients`` threads, client i streaming its requests j one after another (``ask(i, j)``:
    a key and the messages), a quarter of them (``(i + j) % 4 == 0``) closing their stream after
    3 chunks: ``(key, text, cancelled)`` of every request; the first client error is raised."""
    results: list[tuple[int, str, bool]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run_client(i: int) -> None:
        try:
            for j in range(requests):
                key, messages = ask(i, j)
                cancel = (i + j) % 4 == 0
                text = stream_text(client, messages, max_tokens, 3 if cancel else None)
                with lock:
                    results.append((key, text, cancel))
        except BaseException as e:  # reported by the calling thread
            errors.append(e)

    threads = [threading.Thread(target=run_client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors:
        raise errors[0]
    return results


def replies_and_metrics(model: Path, option_sets: list[list[str]], ask: Callable[["ServerProcess"], str]
                        ) -> tuple[list[str], str]:
    """``ask(server)`` on a fresh ``spark-run --serve`` per set of options, in order: the replies,
    and the last server's ``/metrics`` text."""
    replies, metrics = [], ""
    for args in option_sets:
        server = ServerProcess(model, *args)
        try:
            replies.append(ask(server))
            metrics = httpx.get(server.base + "/metrics").text
        finally:
            server.stop()
    return replies, metrics
