"""``spark-run MODEL`` without a prompt: the chat, driven in a real pseudo-terminal (readline line
editing and history, a real SIGINT during a reply) and through a pipe (commands, empty lines)."""
from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import time

import pytest

from tests.procs import ENV, REPO, SPARK_RUN, default_sigint, run

# max-tokens: replies long enough (greedy never stops early on this model) to be interrupted
CHAT = ["--temperature", "0", "--threads", "1", "--device", "cpu"]


class Terminal:
    """A child process on the slave side of a pty; reads what it shows, types into it."""

    def __init__(self, argv: list[str]):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=REPO, env=ENV,
                                     start_new_session=True, preexec_fn=default_sigint)
        os.close(slave)
        self.seen = ""

    def read_until(self, pattern: str, timeout: float = 60) -> str:
        """Everything shown up to the first match of ``pattern`` after what was already consumed."""
        deadline = time.monotonic() + timeout
        while not (m := re.search(pattern, self.seen)):
            if time.monotonic() > deadline or self.proc.poll() is not None and not self._ready(0):
                raise AssertionError(f"never saw {pattern!r}; the terminal shows:\n{self.seen[-3000:]}")
            if self._ready(0.05):
                try:
                    self.seen += os.read(self.master, 65536).decode("utf-8", "replace")
                except OSError:  # the child closed the terminal
                    pass
        shown, self.seen = self.seen[: m.end()], self.seen[m.end():]
        return shown

    def _ready(self, timeout: float) -> bool:
        return bool(select.select([self.master], [], [], timeout)[0])

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def close(self) -> int:
        code = self.proc.wait(timeout=60)
        os.close(self.master)
        return code


@pytest.mark.slow
def test_chat_in_a_terminal(synth_model):
    term = Terminal([*SPARK_RUN, str(synth_model("qwen3moe")), *CHAT, "--max-tokens", "2000"])
    try:
        term.read_until(r"/system TEXT")  # the banner lists the commands
        term.read_until(r"> ")
        term.type("hello\r")
        term.read_until(r"\[FILL")  # the reply is coming
        term.proc.send_signal(signal.SIGINT)  # Ctrl-C during the reply
        term.read_until(r"\[reply stopped\]")
        term.read_until(r"> ")  # the conversation goes on
        term.type("\r\r")  # empty lines do not end it
        term.read_until(r"> ")
        term.read_until(r"> ")
        # line editing: "/hlp", two steps left, "e" -> "/help" (without readline: "/hlp^[[D^[[De")
        term.type("/hlp\x1b[D\x1b[De\r")
        shown = term.read_until(r"/exit +end the chat")
        assert "^[[D" not in shown
        term.read_until(r"> ")
        term.type("\x1b[A\r")  # history: up arrow recalls "/help"
        term.read_until(r"/exit +end the chat")
        term.read_until(r"> ")
        term.type("and again\r")  # a reply after the stopped one: the session still works
        term.read_until(r"\[FILL")
        term.proc.send_signal(signal.SIGINT)
        term.read_until(r"\[reply stopped\]")
        term.read_until(r"> ")
        # readline shows the prompt just before it waits for a key; a SIGINT in between is only
        # seen at the next key (CPython's readline), a window no hand on a keyboard can hit
        time.sleep(0.5)
        term.proc.send_signal(signal.SIGINT)  # Ctrl-C at the prompt ends the chat
        tail = term.read_until(r"\[prefill .*\]")  # the speed line at exit
        assert "Traceback" not in tail
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
            term.proc.wait()


@pytest.mark.slow
def test_sigterm_during_a_reply_ends_the_program(synth_model):
    """SIGTERM is not absorbed like a Ctrl-C during a reply: spark-run ends, in one line, 143."""
    term = Terminal([*SPARK_RUN, str(synth_model("qwen3moe")), *CHAT, "--max-tokens", "2000"])
    try:
        term.read_until(r"> ")
        term.type("hello\r")
        term.read_until(r"\[FILL")
        term.proc.send_signal(signal.SIGTERM)
        tail = term.read_until(r"spark-run: terminated \(SIGTERM\)")
        assert "Traceback" not in tail and "[reply stopped]" not in tail
        assert term.close() == 143
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
            term.proc.wait()


@pytest.mark.slow
def test_chat_commands_are_not_sent_to_the_model(synth_model, tmp_path):
    """Through a pipe: /system, /reset, /help and unknown commands are handled locally, empty
    lines are skipped, /exit ends the chat (what follows it is never read)."""
    from sparkpack.runtime.cli import chat_ids, load_tokenizer
    from sparkpack.runtime.options import RunOptions, open_model

    model_path = synth_model("qwen3moe")
    lines = ["hello", "", "/system be brief", "/bogus", "/help", "/reset", "again", "/exit", "never sent"]
    res = run([*SPARK_RUN, str(model_path), *CHAT, "--max-tokens", "3", "--stats-json", str(tmp_path / "s.json")],
              input="\n".join(lines) + "\n")
    assert res.returncode == 0, res.stderr
    assert "[system message set]" in res.stderr and "[conversation cleared]" in res.stderr
    assert "[unknown command /bogus" in res.stderr and "/system TEXT" in res.stderr
    assert len(res.stdout.splitlines()) == 2  # two replies: "hello" and "again"
    # the second reply saw the system message and not the cleared turn, and no command text
    model = open_model(RunOptions(model_path=model_path, device="cpu", dtype="float32"))
    tok = load_tokenizer(model)
    import json

    stats = json.loads((tmp_path / "s.json").read_text())
    first = chat_ids(tok, model.gguf.get("tokenizer.chat_template"), [{"role": "user", "content": "hello"}])
    second = chat_ids(tok, model.gguf.get("tokenizer.chat_template"),
                      [{"role": "system", "content": "be brief"}, {"role": "user", "content": "again"}])
    assert stats["prefill_tokens"] == len(first) + len(second)
