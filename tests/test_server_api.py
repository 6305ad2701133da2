"""The server through real clients: a ``spark-run --serve`` subprocess on a tiny qwen35moe model on
the CPU, the official ``openai`` and ``anthropic`` SDKs, and raw HTTP for malformed requests.

A tiny random model writes random text, so tool calls, reasoning and stop strings are driven
through the test hooks (tests/hooked_server.py): the engine teacher-forces a given text's tokens through
the real model (only the choice of each token is overridden), and the route -> engine -> parser ->
SSE path runs for real. The same hooks dump each request's prompt logits and token ids.
"""
from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import anthropic
import httpx
import numpy as np
import openai
import pytest
from sparkpack.runtime.options import DEFAULT_PARALLEL
from sparkpack.runtime.server.request_split import RequestSplit
from sparkpack.runtime.tokenizer import GGUFTokenizer
from tests.hooked_server import FAIL, FORCED
from tests.serve_proc import API_KEY, ENV, ServerProcess, fresh_session, kept_tokens, one_thread

CALL = 16  # --prefill-chunk: prefix reuse happens at multiples of it
CTX = 512
READ_FILE = {"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                              "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                             "required": ["path"]}}}
CALL_TEXT = '<think>\nI should read it.\n</think>\n\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'


@pytest.fixture(scope="module")
def model_path(synth_model):
    return synth_model("qwen35moe")


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    hooks = tmp_path_factory.mktemp("hooks")
    proc = ServerProcess(model_path, "--ctx", str(CTX), "--prefill-chunk", str(CALL), hooks=hooks)
    yield proc
    # Ctrl-C/SIGTERM with a stream in flight: the stream ends properly, the process exits 0
    chunks: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", proc.base + "/v1/chat/completions", headers=proc.headers, timeout=60,
                          json={"messages": [{"role": "user", "content": "go"}], "max_tokens": 300, "stream": True}) as r:
            for line in r.iter_lines():
                chunks.append(line)
                if line == "data: [DONE]":
                    return

    reader = threading.Thread(target=stream)
    reader.start()
    while not any('"content": "' in c and '"content": ""' not in c for c in chunks):
        assert proc.proc.poll() is None
        threading.Event().wait(0.05)
    assert proc.stop(signal.SIGTERM) == 0, "".join(proc.stderr)
    reader.join(30)
    assert chunks[-1] == "data: [DONE]" and any('"finish_reason": "stop"' in c for c in chunks)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from sparkpack.formats.gguf_file import GGUFModel

    return GGUFTokenizer.from_metadata(GGUFModel(model_path))


def last_dump(server) -> tuple[dict, np.ndarray]:
    n = max(int(p.stem) for p in server.hooks.glob("*.json"))
    return json.loads((server.hooks / f"{n}.json").read_text()), np.load(server.hooks / f"{n}.npy")


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_health_models_tokenizer_and_metrics(server, oai):
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}
    [model] = oai.models.list().data
    assert model.id == "qwen35moe-Q8_0-0.0-0" and model.owned_by == "sparkpack" and model.context_length == CTX
    ids = server.post("/tokenize", json={"content": "hello world"}).json()["tokens"]
    assert ids and server.post("/detokenize", json={"tokens": ids}).json()["content"] == "hello world"
    oai.chat.completions.create(model="anything", messages=user("hi"), max_tokens=2)
    text = httpx.get(server.base + "/metrics").text
    for name in ("sparkpack_requests_total", "sparkpack_prompt_tokens_total", "sparkpack_generated_tokens_total",
                 "sparkpack_time_to_first_token_seconds_bucket", "sparkpack_prefill_tokens_per_second_bucket",
                 "sparkpack_decode_tokens_per_second_bucket", "sparkpack_prefix_cache_hit_tokens_total"):
        assert name in text, name
    assert 'sparkpack_requests_total{outcome="length",route="chat"}' in text
    # the host memory the sessions' state checkpoints take (a qwen35moe model's DeltaNet states)
    held = re.search(r"^sparkpack_state_checkpoint_host_bytes (\S+)$", text, re.M)
    assert held is not None and float(held.group(1)) > 0, text


def test_chat_plain_and_streamed_agree_and_report_usage(server, oai, tokenizer):
    plain = oai.chat.completions.create(model="x", messages=user("Say something."), max_tokens=5)
    choice = plain.choices[0]
    dump, _ = last_dump(server)
    assert choice.finish_reason == "length" and plain.usage.completion_tokens == 5 == len(dump["tokens"])
    assert plain.usage.prompt_tokens == len(dump["prompt"]) and plain.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(oai.chat.completions.create(model="x", messages=user("Say something."), max_tokens=5, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length"
    # llama-server's timings: what was computed of the prompt, in how long; the decode steps
    t = plain.model_extra["timings"]
    assert t["cache_n"] == plain.usage.prompt_tokens_details.cached_tokens
    assert t["prompt_n"] == plain.usage.prompt_tokens - t["cache_n"] > 0 and t["predicted_n"] == 5
    assert t["prompt_ms"] > 0 and t["predicted_ms"] > 0
    assert t["prompt_per_second"] == pytest.approx(t["prompt_n"] / t["prompt_ms"] * 1e3)
    assert t["predicted_per_second"] == pytest.approx(4 / t["predicted_ms"] * 1e3)
    assert chunks[-2].model_extra["timings"]["predicted_n"] == 5
    # where the request's time went (runtime.server.request_split), from the --parallel engine too
    assert {k for k in t if k.startswith("split_")} == set(RequestSplit().timings())
    assert t["split_prompt_ms"] > 0 and t["split_copies_running"] is False  # (no device copies on the CPU)
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == choice.message.content
    # the same prompt again: its whole calls are kept (the prompt ends inside the last one)
    kept = kept_tokens(dump["prompt"], dump["prompt"], CALL, tokenizer.control_ids)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == kept > 0


@pytest.mark.slow
def test_greedy_through_the_server_is_spark_run_p(server, oai, model_path, tokenizer):
    """Same prompt, same options: the server's tokens are the one-shot command's."""
    oai.chat.completions.create(model="x", messages=user("Tell me a story."), max_tokens=6, temperature=0)
    dump, _ = last_dump(server)
    run = subprocess.run([sys.executable, "-m", "sparkpack.runtime.cli", str(model_path), "-p", "Tell me a story.",
                          "--temperature", "0", "--max-tokens", "6", "--device", "cpu", "--ctx", str(CTX),
                          "--prefill-chunk", str(CALL)], capture_output=True, text=True, check=True, env=ENV)
    assert run.stdout == tokenizer.decode(dump["tokens"], skip_special=True) + "\n"


def test_a_follow_up_turn_reuses_the_prefix_with_the_bits_of_a_fresh_run(server, oai, model_path, tokenizer):
    first = oai.chat.completions.create(model="x", messages=user("Write a haiku about tests."), max_tokens=4)
    d1, _ = last_dump(server)
    messages = user("Write a haiku about tests.") + [
        {"role": "assistant", "content": first.choices[0].message.content}, *user("Another one.")]
    second = oai.chat.completions.create(model="x", messages=messages, max_tokens=2)
    d2, logits = last_dump(server)
    kept = kept_tokens(d1["prompt"], d2["prompt"], CALL, tokenizer.control_ids)
    # the first prompt's calls end before its last control tokens: all but its last few tokens stay
    assert second.usage.prompt_tokens_details.cached_tokens == kept > len(d1["prompt"]) // CALL * CALL
    with one_thread():
        fresh = fresh_session(model_path, CALL, CTX).feed(d2["prompt"])
    assert np.array_equal(logits, fresh.float().numpy())


@pytest.mark.slow
def test_tool_calls_and_reasoning(server, oai):
    kw = dict(model="x", messages=user("Read a.py"), tools=[READ_FILE], max_tokens=100, extra_body={FORCED: CALL_TEXT})
    msg = oai.chat.completions.create(**kw).choices[0]
    assert msg.finish_reason == "tool_calls"
    [call] = msg.message.tool_calls
    assert call.function.name == "read_file" and json.loads(call.function.arguments) == {"path": "a.py"}
    assert msg.message.reasoning_content == "I should read it." and not msg.message.content
    calls: dict[int, dict] = {}
    reasoning, finish = "", None
    for chunk in oai.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for tc in delta.tool_calls or []:
            c = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
            c["id"] = tc.id or c["id"]
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and reasoning == "I should read it."
    assert [c["name"] for c in calls.values()] == ["read_file"] and json.loads(calls[0]["arguments"]) == {"path": "a.py"}
    # tool_choice "none": the same text is plain text, no call parsed
    plain = oai.chat.completions.create(**{**kw, "tool_choice": "none"}).choices[0]
    assert plain.finish_reason == "stop" and not plain.message.tool_calls and "<tool_call>" in plain.message.content


def test_stop_strings_end_generation_at_the_token_that_completes_them(server, oai, claude, tokenizer):
    text = "alpha beta STOP gamma delta epsilon"
    upto = len(tokenizer.encode("alpha beta STOP"))
    r = oai.chat.completions.create(model="x", messages=user("go"), max_tokens=40, stop=["STOP"],
                                    extra_body={FORCED: text})
    assert r.choices[0].message.content == "alpha beta " and r.choices[0].finish_reason == "stop"
    assert len(last_dump(server)[0]["tokens"]) <= upto  # nothing generated past the stop
    m = claude.messages.create(model="x", max_tokens=40, messages=user("go"), stop_sequences=["STOP"],
                               extra_body={FORCED: text})
    assert m.content[0].text == "alpha beta " and m.stop_reason == "stop_sequence" and m.stop_sequence == "STOP"
    assert m.usage.output_tokens == len(last_dump(server)[0]["tokens"]) <= upto


def test_anthropic_messages_stream_thinking_and_tool_use(server, claude):
    tool = {"name": "read_file", "description": "Read a file",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
    plain = claude.messages.create(model="claude-x", max_tokens=4, messages=user("hi"))
    assert plain.content[0].type == "text" and plain.stop_reason == "max_tokens" and plain.usage.output_tokens == 4
    kinds = []
    with claude.messages.stream(model="claude-x", max_tokens=100, messages=user("Read a.py"), tools=[tool],
                                extra_body={FORCED: CALL_TEXT}) as stream:
        for event in stream:
            kinds.append(event.type if event.type != "content_block_delta" else event.delta.type)
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == "I should read it." and final.content[1].input == {"path": "a.py"}
    assert final.stop_reason == "tool_use"
    for kind in ("message_start", "content_block_start", "thinking_delta", "input_json_delta", "content_block_stop",
                 "message_delta", "message_stop"):
        assert kind in kinds, (kind, kinds)
    # what count_tokens says is what a request is charged; Claude Code's billing block is dropped
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
              {"type": "text", "text": "You are a coding agent."}]
    counted = claude.messages.count_tokens(model="claude-x", messages=user("hi"), system=system)
    assert counted.input_tokens == claude.messages.count_tokens(model="x", messages=user("hi"),
                                                                system=system[1:]).input_tokens
    m = claude.messages.create(model="x", max_tokens=1, messages=user("hi"), system=system)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted.input_tokens


READ_TOOL = {"name": "read_file", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}


def reused_through(tokenizer, prompt: list[int], cached: int, text: str) -> bool:
    """Whether the ``cached`` tokens kept of ``prompt`` reach past the end of ``text``."""
    return text in tokenizer.decode(prompt[:cached])


@pytest.mark.slow
def test_mid_conversation_system_messages_keep_the_prefix_before_them(server, claude, oai, tokenizer):
    """Claude Code's ``role: "system"`` messages (and OpenAI's later system/developer ones) are
    accepted and stay where they stand: the next turn reuses everything up to them."""
    reminder1, reminder2 = "Env: linux.", "Agent tool on."
    messages = [{"role": "user", "content": "Read a.py"}, {"role": "system", "content": reminder1}]
    kw = dict(model="x", system="You code.", tools=[READ_TOOL], thinking={"type": "disabled"})
    first = claude.messages.create(**kw, max_tokens=60, messages=messages,
                                   extra_body={FORCED: CALL_TEXT[CALL_TEXT.index("<tool_call>"):]})
    d1, _ = last_dump(server)
    assert f"<system-reminder>\n{reminder1}\n</system-reminder>" in tokenizer.decode(d1["prompt"])
    call = next(b for b in first.content if b.type == "tool_use")
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "x = 1"}]},
                 {"role": "system", "content": [{"type": "text", "text": reminder2}]}]
    second = claude.messages.create(**kw, max_tokens=3, messages=messages, extra_body={FORCED: "Done."})
    d2, _ = last_dump(server)
    cached = second.usage.cache_read_input_tokens
    assert cached == kept_tokens(d1["prompt"], d2["prompt"], CALL, tokenizer.control_ids)
    assert reused_through(tokenizer, d1["prompt"], cached, reminder1 + "\n</system-reminder>")
    messages += [{"role": "assistant", "content": [b.model_dump() for b in second.content]},
                 {"role": "user", "content": "Go on."}]
    third = claude.messages.create(**kw, max_tokens=2, messages=messages)
    d3, _ = last_dump(server)
    assert reused_through(tokenizer, d2["prompt"], third.usage.cache_read_input_tokens, reminder2 + "\n</system-reminder>")
    # the OpenAI routes: a later system or developer message no longer moves into the first one
    chat = [{"role": "system", "content": "You code."}, {"role": "user", "content": "Say hi."},
            {"role": "developer", "content": reminder1}]
    one = oai.chat.completions.create(model="x", messages=chat, max_tokens=2)
    d1, _ = last_dump(server)
    chat += [{"role": "assistant", "content": one.choices[0].message.content}, {"role": "user", "content": "Again."}]
    two = oai.chat.completions.create(model="x", messages=chat, max_tokens=2)
    assert reused_through(tokenizer, d1["prompt"], two.usage.prompt_tokens_details.cached_tokens,
                          reminder1 + "\n</system-reminder>")
    items = [{"role": "user", "content": "Say hi."}, {"role": "developer", "content": reminder2}]
    one = oai.responses.create(model="x", instructions="You code.", input=items, max_output_tokens=2)
    d1, _ = last_dump(server)
    items += [{"role": "assistant", "content": one.output_text}, {"role": "user", "content": "Again."}]
    two = oai.responses.create(model="x", instructions="You code.", input=items, max_output_tokens=2)
    assert reused_through(tokenizer, d1["prompt"], two.usage.input_tokens_details.cached_tokens,
                          reminder2 + "\n</system-reminder>")


IMAGE = "[image omitted: this model reads text only]"
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


def test_images_and_documents_become_placeholders_and_the_conversation_goes_on(server, claude, oai, tokenizer):
    source = {"type": "base64", "media_type": "image/png", "data": PNG}
    content = [{"type": "text", "text": "What is in these?"}, {"type": "image", "source": source},
               {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "notes"}}]
    raw = claude.messages.with_raw_response.create(model="x", max_tokens=2, messages=[{"role": "user", "content": content}])
    assert raw.headers["x-sparkpack-omitted"] == "1 document, 1 image" and raw.parse().stop_reason == "max_tokens"
    prompt = tokenizer.decode(last_dump(server)[0]["prompt"])
    assert f"What is in these?\n{IMAGE}\n[document omitted: this model reads text only]" in prompt
    with claude.messages.with_streaming_response.create(model="x", max_tokens=2, stream=True, messages=[
            {"role": "user", "content": "Read it"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read_file", "input": {"path": "a.png"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "image", "source": source}]}]}],
            tools=[READ_TOOL]) as streamed:
        assert streamed.headers["x-sparkpack-omitted"] == "1 image"
        assert "message_stop" in "".join(streamed.iter_text())
    url = f"data:image/png;base64,{PNG}"
    raw = oai.chat.completions.with_raw_response.create(model="x", max_tokens=2, messages=[
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]}])
    assert raw.headers["x-sparkpack-omitted"] == "1 image" and raw.parse().choices[0].finish_reason == "length"
    raw = oai.responses.with_raw_response.create(model="x", max_output_tokens=2, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": url},
        {"type": "input_file", "filename": "a.pdf", "file_data": "data:application/pdf;base64,JVBERi0="}]}])
    assert raw.headers["x-sparkpack-omitted"] == "1 document, 1 image"
    assert IMAGE in tokenizer.decode(last_dump(server)[0]["prompt"])
    assert "x-sparkpack-omitted" not in oai.chat.completions.with_raw_response.create(
        model="x", max_tokens=1, messages=user("hi")).headers
    wait_for_line(server, 'POST /v1/responses 200 .* omitted="1 document, 1 image"')


def wait_for_line(server, pattern: str, after: int = 0, count: int = 1) -> list[str]:
    """The server's stderr lines from ``after`` on matching ``pattern``, once there are ``count``
    (a stream's line is written when the stream ends, which the client may see first)."""
    end = time.monotonic() + 30
    while time.monotonic() < end:
        found = [line for line in server.stderr[after:] if re.search(pattern, line)]
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no {count} log lines match {pattern!r}: {''.join(server.stderr[after:])[-3000:]}")


def test_each_request_is_one_log_line(server, claude, oai):
    start = len(server.stderr)
    ua = {"User-Agent": "claude-cli/2.1.197 (external, cli)"}
    m = claude.messages.create(model="x", max_tokens=3, messages=user("log me"), extra_headers=ua)
    prompt = m.usage.input_tokens + m.usage.cache_read_input_tokens
    wait_for_line(server, rf'sparkpack.server INFO: POST /v1/messages 200 client="claude-cli/2.1.197" prompt={prompt} '
                          rf'cached={m.usage.cache_read_input_tokens} ttft=[0-9.]+s output=3 finish=length time=[0-9.]+s$',
                  start)
    chunks = list(oai.chat.completions.create(model="x", messages=user("stream me"), max_tokens=4, stream=True,
                                              stream_options={"include_usage": True},
                                              extra_headers={"User-Agent": "codex_cli_rs/0.171.0 (Linux; x86_64)"}))
    u = chunks[-1].usage
    wait_for_line(server, rf'POST /v1/chat/completions 200 client="codex_cli_rs/0.171.0" prompt={u.prompt_tokens} '
                          rf'cached={u.prompt_tokens_details.cached_tokens} ttft=[0-9.]+s output=4 finish=length', start)
    # 4xx before the engine: the message the client got, in its dialect
    server.post("/v1/messages", json={"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]})
    wait_for_line(server, r'POST /v1/messages 400 client="python-httpx/[0-9.]+" time=[0-9.]+s '
                          r'error="messages.0.role: Unexpected role \\"tool\\"', start)
    server.post("/v1/chat/completions", json={"messages": user("word " * CTX)})
    wait_for_line(server, r"POST /v1/chat/completions 400 .*error=\"This model's maximum context length is", start)
    httpx.post(server.base + "/v1/messages", json={"max_tokens": 2, "messages": user("x")})
    wait_for_line(server, r'POST /v1/messages 401 .*error="invalid or missing API key', start)
    server.post("/v1/nothing", json={})
    wait_for_line(server, r'POST /v1/nothing 404 .*error="POST /v1/nothing: Not Found"', start)
    lines = [line for line in server.stderr[start:] if "sparkpack.server INFO: " in line]
    assert len(lines) == 6, lines  # one a request


@pytest.mark.slow
def test_responses_api(server, oai):
    r = oai.responses.create(model="x", input="Say hi", max_output_tokens=3)
    assert r.status == "incomplete" and r.output[0].type == "message" and r.usage.output_tokens == 3
    assert r.output_text == r.output[0].content[0].text
    tool = {"type": "function", "name": "read_file", "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
    events = list(oai.responses.create(model="x", input=[{"role": "developer", "content": "Be brief."},
                                                         {"role": "user", "content": "Read a.py"}],
                                       tools=[tool, {"type": "web_search"}], stream=True,
                                       extra_body={FORCED: CALL_TEXT}))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.delta" in kinds
    done = events[-1].response
    assert [o.type for o in done.output] == ["reasoning", "function_call"]
    assert done.output[1].name == "read_file" and json.loads(done.output[1].arguments) == {"path": "a.py"}
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        oai.responses.create(model="x", input="more", previous_response_id="resp_1")


def test_completions(server, oai):
    r = oai.completions.create(model="x", prompt="Once upon a time", max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    streamed = "".join(c.choices[0].text for c in oai.completions.create(model="x", prompt="Once upon a time",
                                                                          max_tokens=3, stream=True))
    assert streamed == r.choices[0].text
    ids = server.post("/tokenize", json={"content": "Once upon a time"}).json()["tokens"]
    assert oai.completions.create(model="x", prompt=ids, max_tokens=3).choices[0].text == r.choices[0].text


BAD = [  # (path, body bytes, what the message says)
    ("/v1/chat/completions", b"{not json", "not valid JSON"),
    ("/v1/chat/completions", b"\xff\xfe{}", "not valid UTF-8"),
    ("/v1/chat/completions", b"", "empty"),
    ("/v1/chat/completions", b"[]", "JSON object"),
    ("/v1/chat/completions", b'{"messages": "hi"}', "messages"),
    ("/v1/chat/completions", b'{"messages": []}', "messages"),
    ("/v1/chat/completions", b'{"model": "x"}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 2}', "n"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "seed": 100000000000000000000000}', "seed"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', "role"),
    ("/v1/completions", b'{"prompt": [999999]}', "vocabulary"),
    ("/v1/responses", b'{"input": 5}', "input"),
    ("/v1/messages", b'{"messages": [{"role": "user", "content": "x"}]}', "max_tokens"),
    ("/v1/messages", b"{bad", "not valid JSON"),
    ("/v1/messages", b'{"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}',
     'messages.0.role: Unexpected role "tool". The Messages API accepts'),
    ("/v1/messages", b'{"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}',
     "messages.0.content.0.tool_use_id: must be a string"),
    ("/v1/messages/count_tokens", b'{"messages": []}', "messages"),
]


@pytest.mark.parametrize("path,body,says", BAD, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(BAD)])
def test_bad_requests_get_a_4xx_in_the_route_dialect(server, path, body, says):
    r = server.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        message = body["error"]["message"]
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["type"] == "invalid_request_error"
        message = body["error"]["message"]
    assert says in message and "\n" not in message


def test_limits_auth_and_unknown_routes(server, oai, claude):
    too_long = "word " * CTX
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="x", messages=user(too_long), max_tokens=2)
    assert e.value.code == "context_length_exceeded" and f"{CTX} tokens" in str(e.value)
    n = claude.messages.count_tokens(model="x", messages=user(too_long)).input_tokens
    with pytest.raises(anthropic.BadRequestError) as e:  # Anthropic's words, which Claude Code compacts on
        claude.messages.create(model="x", max_tokens=2, messages=user(too_long))
    assert e.value.body["error"] == {"type": "invalid_request_error",
                                     "message": f"prompt is too long: {n} tokens > {CTX - 1} maximum"}
    host, port = server.base.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:  # a body declared over the limit is refused unread
        s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"x-api-key: " + API_KEY.encode() + b"\r\nContent-Length: 40000000\r\n\r\n{")
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < int(
                answer.lower().split(b"content-length: ")[1].split(b"\r\n")[0]):
            answer += s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413 ") and b'"request_too_large"' in answer and b"limit" in answer
    r = httpx.post(server.base + "/v1/messages", json={"max_tokens": 2, "messages": user("x")})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(server.base + "/v1/chat/completions", json={"messages": user("x")}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(server.base + "/v1/messages", json={"max_tokens": 1, "messages": user("x")},
                      headers={"x-api-key": API_KEY}).status_code == 200
    assert server.post("/v1/nothing", json={}).json()["error"]["type"] == "not_found_error"
    assert httpx.get(server.base + "/v1/chat/completions").status_code == 405
    # generation stops at the context's end with finish_reason length
    long_ok = "word " * (CTX // 2 - 20)
    r = oai.chat.completions.create(model="x", messages=user(long_ok), max_tokens=100000,
                                    extra_body={FORCED: "z " * CTX})
    assert r.choices[0].finish_reason == "length" and r.usage.prompt_tokens + r.usage.completion_tokens == CTX


def test_an_internal_error_is_a_500_logged_once_and_the_server_goes_on(server, oai, claude):
    with pytest.raises(openai.InternalServerError, match="boom"):
        oai.chat.completions.create(model="x", messages=user("hi"), max_tokens=2, extra_body={FAIL: "boom"})
    with pytest.raises(anthropic.InternalServerError, match="boom"):
        claude.messages.create(model="x", max_tokens=2, messages=user("hi"), extra_body={FAIL: "boom"})
    assert oai.chat.completions.create(model="x", messages=user("hi"), max_tokens=2).choices[0].finish_reason == "length"
    log = "".join(server.stderr)
    assert log.count("Traceback") == 2  # once per failure, and in each request's line
    assert len([line for line in server.stderr if " 500 " in line and "generation failed: RuntimeError: boom" in line]) == 2


@pytest.mark.slow
def test_a_client_that_goes_away_cancels_its_generation_and_its_queued_request(server, oai):
    def dumps() -> list[dict]:
        return [json.loads((server.hooks / f"{n}.json").read_text())
                for n in sorted(int(p.stem) for p in server.hooks.glob("*.json"))]

    before, start = len(dumps()), len(server.stderr)
    stream = oai.chat.completions.create(model="x", messages=user("long"), max_tokens=300, stream=True)
    got = sum(1 for _, _ in zip(range(4), stream))  # the role chunk, then 3 tokens
    stream.close()
    # a request queued behind running streams (as many as --parallel, the default), whose client
    # gives up before it starts
    running = [oai.chat.completions.create(model="x", messages=user(f"longer {i}"), max_tokens=1000, stream=True)
               for i in range(DEFAULT_PARALLEL)]
    for r in running:
        next(iter(r))
    with pytest.raises(httpx.TimeoutException):
        server.post("/v1/chat/completions", json={"messages": user("queued"), "max_tokens": 5}, timeout=0.3)
    for r in running:
        r.close()
    after = oai.chat.completions.create(model="x", messages=user("next"), max_tokens=2)
    assert after.choices[0].finish_reason == "length"
    first, *ran, last = dumps()[before:]  # the queued request never computed
    assert got == 4 and len(first["tokens"]) < 3 + 20 and len(last["tokens"]) == 2
    assert len(ran) == DEFAULT_PARALLEL and all(len(d["tokens"]) < 1000 for d in ran)
    metrics = httpx.get(server.base + "/metrics").text
    cancelled = 2 + DEFAULT_PARALLEL
    assert f'sparkpack_requests_total{{outcome="cancelled",route="chat"}} {cancelled:.1f}' in metrics
    # each logged as cancelled: the streams and the request given up on while queued; a stream
    # with what its client was sent (3 tokens at least, its first token's time), the queued one none
    lines = wait_for_line(server, r"POST /v1/chat/completions 200 .* finish=cancelled", start, cancelled)
    assert len(lines) == cancelled
    assert int(re.search(r" output=(\d+) ", lines[0])[1]) >= 3 and re.search(r" ttft=[0-9.]+s ", lines[0]), lines[0]
    queued = [ln for ln in lines if 'client="python-httpx' in ln]  # (server.post's; the streams are openai's)
    assert len(queued) == 1 and re.search(r" prompt=\d+ cached=\d+ ttft=- output=0 finish=cancelled", queued[0]), lines
