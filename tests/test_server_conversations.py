"""Many conversations, one server (issue 42): a real ``spark-run --serve`` and the official
openai and anthropic clients, on tiny models of the three archs.

Two agent conversations with the same real system prompt (a Codex CLI one from
../shared/corpora/lucebox-hub) take turns with a short side request of another system prompt,
as a main thread, a subagent and a title request do: A1, A2, side, A3, B1, A4, B2, A5. Every
main turn resumes from its own conversation (at least the previous turn's prompt but the tail
after its last whole call), B1 resumes the shared system prompt, and every request's prompt
logits and greedy tokens are a fresh session's (the server's bits: tests/serve_proc.py). Then,
on qwen35moe: a host tier too small for any state recomputes, correctly; a restart with
``--cache-dir`` resumes from the folder; a corrupted or truncated file is ignored (one log line
each) and recomputed.
"""
from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import numpy as np
import openai
import pytest

from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.runtime.generate import generate
from sparkpack.runtime.tokenizer import GGUFTokenizer
from tests.serve_proc import API_KEY, ServerProcess, fresh_session, kept_tokens, one_thread

pytestmark = pytest.mark.slow  # every test starts real servers (spark-run --serve processes)

PROMPTS = Path(__file__).resolve().parents[1] / ".." / "shared" / "corpora" / "lucebox-hub" / "agent_prompts"
CALL = 64
CTX = 8192
SEQUENCE = ["A", "A", "side", "A", "B", "A", "B", "A"]
ASKS = {"A": ["Fix the failing test in utils.py.", "Now run the linter.", "Explain the change.", "Add a test.",
              "Commit it."],
        "B": ["Write a README for the parser module.", "Shorten it."]}


@pytest.fixture(scope="module")
def system_prompt() -> str:
    path = PROMPTS / "codex_gpt5_codex.md"
    if not path.is_file():
        pytest.skip(f"real agent prompts not found at {PROMPTS} (expected the shared/ folder beside the repository)")
    return path.read_text()[:3000]


class Conversations:
    """The clients' side: each conversation's messages, its last prompt, and the checks."""

    def __init__(self, server: ServerProcess, model: Path, hooks: Path, system: str):
        self.server, self.model, self.hooks, self.system = server, model, hooks, system
        self.oai = openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0)
        self.claude = anthropic.Anthropic(base_url=server.base, api_key=API_KEY, max_retries=0)
        self.messages: dict[str, list[dict]] = {"A": [], "B": []}
        self.asked: dict[str, int] = {"A": 0, "B": 0}
        self.prompts: dict[str, list[int]] = {}
        self.served = 0
        self.breaks = GGUFTokenizer.from_metadata(GGUFModel(model)).control_ids
        self.tokenizer = GGUFTokenizer.from_metadata(GGUFModel(model))

    def turn(self, name: str, max_tokens: int = 6) -> tuple[int, list[int]]:
        """One request of conversation ``name`` (A through the openai client, B through the
        anthropic one, the side request a title call); returns (cached tokens, prompt ids)."""
        if name == "side":
            r = self.oai.chat.completions.create(model="m", max_tokens=4, messages=[
                {"role": "system", "content": "Write a 5-word title for the conversation."},
                {"role": "user", "content": "Fix the failing test in utils.py."}])
            cached, answer = r.usage.prompt_tokens_details.cached_tokens, None
        else:
            msgs = self.messages[name]
            msgs.append({"role": "user", "content": ASKS[name][self.asked[name]]})
            self.asked[name] += 1
            if name == "A":
                r = self.oai.chat.completions.create(
                    model="m", max_tokens=max_tokens, messages=[{"role": "system", "content": self.system}, *msgs])
                cached, answer = r.usage.prompt_tokens_details.cached_tokens, r.choices[0].message.content
            else:
                r = self.claude.messages.create(model="m", max_tokens=max_tokens, system=self.system, messages=msgs)
                cached = r.usage.cache_read_input_tokens
                answer = "".join(b.text for b in r.content if b.type == "text")
            msgs.append({"role": "assistant", "content": answer or "ok"})
        self.served += 1
        dump = json.loads((self.hooks / f"{self.served}.json").read_text())
        prompt = dump["prompt"]
        logits = np.load(self.hooks / f"{self.served}.npy")
        with one_thread():
            fresh = fresh_session(self.model, CALL, CTX)
            assert np.array_equal(logits, fresh.feed(prompt).float().numpy()), f"request {self.served} ({name})"
            tokens = list(generate(fresh.model, self.tokenizer, prompt, None, len(dump["tokens"]) + 1,
                                   session=fresh_session(self.model, CALL, CTX)))
        assert dump["tokens"] == tokens[:len(dump["tokens"])], f"request {self.served} ({name})"
        return cached, prompt

    def main_turn(self, name: str) -> int:
        """A main turn: resumed from its own conversation's previous turn."""
        previous = self.prompts.get(name)
        cached, prompt = self.turn(name)
        if previous is not None:
            want = kept_tokens(previous, prompt, CALL, self.breaks)
            assert cached >= want > 0, (name, cached, want)
        self.prompts[name] = prompt
        return cached

    def first_message_end(self, prompt: list[int]) -> int:
        """Where the system prompt's calls end: before the control token that closes it."""
        from sparkpack.runtime.call_plan import call_end

        cuts = [0]
        while (end := call_end(prompt, cuts[-1], CALL, self.breaks)) < len(prompt):
            cuts.append(end)
        return next(c for c in cuts if c > 0 and prompt[c] in self.breaks)


def metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(server.base + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


# (--parallel 1, the serial engine, takes its cache in-process: test_request_path, test_conversation_cache)
@pytest.mark.parametrize("arch,parallel", [("qwen3moe", 4), ("laguna", 4), ("qwen35moe", 4)])
def test_conversations_taking_turns_each_resume_their_own(synth_model, arch, parallel, tmp_path, system_prompt):
    """With ``--parallel 4`` (the default) each request runs in one of 4 sessions: a session whose
    live sequence keeps the most of the prompt, else, when the cache keeps more, the session left
    longest ago, resumed from the cache; with ``--parallel 1`` the one session, resumed from the
    cache at every switch. Either way each request gives a fresh session's bits."""
    model = synth_model(arch)
    server = ServerProcess(model, "--ctx", str(CTX), "--prefill-chunk", str(CALL), "--parallel", str(parallel),
                           hooks=tmp_path)
    try:
        conv = Conversations(server, model, tmp_path, system_prompt)
        for name in SEQUENCE:
            if name == "side":
                conv.turn(name)
                continue
            first_b = name == "B" and "B" not in conv.prompts
            cached = conv.main_turn(name)
            if first_b:  # a new conversation with A's system prompt: resumed from its end
                shared = conv.first_message_end(conv.prompts["B"])
                assert cached >= shared > 1000, (cached, shared)
        hits = metric(server, "sparkpack_conversation_cache_requests_total{result=\"hit\"}")
        live = metric(server, "sparkpack_conversation_cache_requests_total{result=\"live\"}")
        if parallel == 1:
            assert hits >= 4
        else:  # every turn but A1 and the side request resumed, some from the cache
            assert hits >= 1 and hits + live >= 6, (hits, live)
        assert metric(server, "sparkpack_conversation_cache_entries{tier=\"host\"}") >= 3
        log = "".join(server.stderr)
        assert log.count("sparkpack.cache INFO: resumed") >= 6 and "host tier" in log
    finally:
        assert server.stop() == 0


def test_eviction_restart_and_bad_files(synth_model, tmp_path, system_prompt):
    model = synth_model("qwen35moe")
    args = ("--ctx", str(CTX), "--prefill-chunk", str(CALL))
    hooks = tmp_path / "hooks"
    # a host tier that holds no state: a switch recomputes, with a fresh run's bits
    server = ServerProcess(model, *args, "--cache-ram", "1KiB", hooks=hooks / "1")
    try:
        conv = Conversations(server, model, hooks / "1", system_prompt)
        conv.main_turn("A")
        conv.main_turn("B")
        cached, prompt = conv.turn("A")
        # A1's state was evicted: only the system prompt B1 shares is kept (the live sequence's)
        assert cached <= conv.first_message_end(prompt) < kept_tokens(conv.prompts["A"], prompt, CALL, conv.breaks)
        assert metric(server, "sparkpack_conversation_cache_evictions_total") >= 2
    finally:
        assert server.stop() == 0
    folder = tmp_path / "states"
    server = ServerProcess(model, *args, "--cache-dir", str(folder), hooks=hooks / "2")
    try:
        conv = Conversations(server, model, hooks / "2", system_prompt)
        conv.main_turn("A")
        conv.main_turn("A")
    finally:
        assert server.stop() == 0
    files = sorted(folder.glob("*.spkv"))
    assert files
    # restarted: the third turn resumes the second's state from the folder
    server = ServerProcess(model, *args, "--cache-dir", str(folder), hooks=hooks / "3")
    try:
        conv.server, conv.hooks, conv.served = server, hooks / "3", 0
        conv.oai = openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0)
        conv.main_turn("A")
        assert "disk tier" in "".join(server.stderr)
    finally:
        assert server.stop() == 0
    for f in sorted(folder.glob("*.spkv")):  # an entry file cut short
        f.write_bytes(f.read_bytes()[:-10])
        break
    for f in sorted(folder.glob("blocks/*.spkb")):  # every part's tensors corrupted
        data = bytearray(f.read_bytes())
        data[-100] ^= 0x55
        f.write_bytes(data)
    server = ServerProcess(model, *args, "--cache-dir", str(folder), hooks=hooks / "4")
    try:
        conv.server, conv.hooks, conv.served = server, hooks / "4", 0
        conv.oai = openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0)
        cached, _ = conv.turn("A")  # checked against a fresh run inside
        assert cached == 0
        log = "".join(server.stderr)
        assert "ignoring conversation cache file" in log and "truncated" in log and "checksum" in log
        assert "Traceback" not in log
    finally:
        assert server.stop() == 0
