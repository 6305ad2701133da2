"""A real coding-agent session replayed through the server as successive requests.

The conversation is SWE-bench agent traffic nobody here wrote (../shared/corpora/lucebox-hub,
bench_agent.jsonl): the agent's system prompt, the issue and task, and the files it read. Each
recorded ``<tool_result>`` becomes a turn of the agent loop: the model's reply is a tool call
(teacher-forced through the real model, parsed by the server, sent back by the client in OpenAI
form as an agent does), followed by the recorded result as the tool message. Each turn must keep
all of the previous prompt but its last few tokens (its calls end before the template's control
tokens: the new tokens, those few and the previous answer are all that is computed), and the last turn's logits must be a fresh one-shot
run's, bit for bit, on qwen35moe, whose DeltaNet states come back from checkpoints.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.runtime.tokenizer import GGUFTokenizer
from tests.serve_proc import API_KEY, ServerProcess, fresh_session, kept_tokens, one_thread

CORPUS = Path(__file__).resolve().parents[1] / ".." / "shared" / "corpora" / "lucebox-hub" / "bench_agent.jsonl"
RECORD = "agent_8k_01"  # three files read: four turns
CALL = 64
CTX = 8192
RESULT = re.compile(r'<tool_result tool="(\w+)" (\w+)="([^"]*)">\n(.*?)</tool_result>', re.S)
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": {
    "type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}}}
         for name, arg in (("read_file", "path"), ("shell", "command"))]


@pytest.fixture(scope="module")
def record() -> dict:
    if not CORPUS.is_file():
        pytest.skip(f"real agent traffic not found at {CORPUS} (expected the shared/ folder beside the repository)")
    for line in CORPUS.read_text().splitlines():
        rec = json.loads(line)
        if rec["id"] == RECORD:
            return rec
    pytest.skip(f"{RECORD} is not in {CORPUS}")


def forced_call(name: str, arg: str, value: str) -> str:
    """The call as the model's template writes one (Qwen3 hermes form)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {arg: value}}, ensure_ascii=False) + "\n</tool_call>"


@pytest.mark.slow
def test_agent_session_reuses_each_prefix_and_ends_on_a_fresh_runs_bits(record, synth_model, tmp_path):
    system, user = record["messages"][0]["content"], record["messages"][1]["content"]
    results = RESULT.findall(user)
    assert len(results) == 3
    opening = RESULT.sub("", user)  # the issue and the task, the files left for the turns
    model = synth_model("qwen35moe")
    breaks = GGUFTokenizer.from_metadata(GGUFModel(model)).control_ids
    server = ServerProcess(model, "--ctx", str(CTX), "--prefill-chunk", str(CALL), hooks=tmp_path)
    try:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": opening}]
        previous: dict | None = None
        cached_total = 0
        for turn in range(len(results) + 1):
            tool, arg, value, output = results[turn] if turn < len(results) else (None,) * 4
            extra = {"sparkpack_test_output": forced_call(tool, arg, value)} if tool else {}
            r = client.chat.completions.create(model="agent", messages=messages, tools=TOOLS,
                                               max_tokens=200 if extra else 8,
                                               extra_body=extra)
            dump = json.loads((tmp_path / f"{turn + 1}.json").read_text())
            prompt = dump["prompt"]
            cached = r.usage.prompt_tokens_details.cached_tokens
            cached_total += cached
            assert r.usage.prompt_tokens == len(prompt)
            if previous is None:
                assert cached == 0
            else:
                assert cached == kept_tokens(previous["prompt"], prompt, CALL, breaks)
                # all of the previous prompt but the few tokens after its last control token
                # (the assistant header) or, when that came too soon, after the one before
                tail = len(previous["prompt"]) - cached
                assert 0 < tail <= CALL // 8 + 8, tail
            previous = dump
            if turn == len(results):
                break
            [call] = r.choices[0].message.tool_calls
            assert (call.function.name, json.loads(call.function.arguments)) == (tool, {arg: value})
            messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": output}]
        assert len(previous["prompt"]) > 4000  # the whole session is in the last prompt
        metrics = httpx.get(server.base + "/metrics").text
        assert f"sparkpack_prefix_cache_hit_tokens_total {float(cached_total)}" in metrics
        logits = np.load(tmp_path / f"{len(results) + 1}.npy")
        with one_thread():
            fresh = fresh_session(model, CALL, CTX).feed(previous["prompt"])
        assert np.array_equal(logits, fresh.float().numpy())
    finally:
        assert server.stop() == 0
