"""A real ``spark-run MODEL --serve`` subprocess for the server tests (one per test module).

It listens on a free port (``--port 0``) on the CPU; ``start`` returns once /health answers 200
and the client settings are printed. ``stop`` sends SIGTERM and returns the exit status.
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


class ServerProcess:
    def __init__(self, model: Path, *args: str, hooks: Path | None = None, api_key: str | None = API_KEY,
                 device: str = "cpu", env: dict[str, str] | None = None):
        cmd = [sys.executable, "-m", "sparkpack.runtime.cli", str(model), "--serve", "--port", "0", "--device", device,
               "--temperature", "0", *args]
        if api_key is not None:
            cmd += ["--api-key", api_key]
        if hooks is not None:
            cmd += ["--test-hooks", str(hooks)]
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
