"""Corpus readers: each format on its sample in corpora/, malformed input, detection, real data."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sparkpack.calibrate.conversation import Conversation
from sparkpack.calibrate.readers import ReadStats, read_corpus
from sparkpack.formats.errors import SparkpackError

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "corpora"
REAL = REPO / ".." / "shared" / "corpora" / "lucebox-hub"


def read(path: Path, strict: bool = False) -> tuple[list[Conversation], ReadStats]:
    it, stats = read_corpus(path, strict=strict)
    return list(it), stats


def roles(c: Conversation) -> list[str]:
    return [m["role"] for m in c.messages]


def call(id_: str, name: str, arguments: str) -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


# --- each reader on its sample -----------------------------------------------------------------

def test_openai_chat_sample() -> None:
    convs, stats = read(SAMPLES / "openai_chat.jsonl")
    assert len(convs) == 3 and stats.images_skipped == 1 and not stats.skipped
    agent, image, pair = convs
    assert agent.source.endswith("openai_chat.jsonl:1")
    assert agent.messages == [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Why does test_parse fail?"},
        {"role": "assistant", "content": "", "tool_calls": [call("call_a1", "read_file", '{"path": "src/parse.py"}')]},
        {"role": "tool", "content": "def parse(s):\n    return int(s)\n", "tool_call_id": "call_a1", "name": "read_file"},
        {"role": "assistant", "content": "parse() calls int() without stripping whitespace."},
    ]
    assert agent.tools[0]["function"]["name"] == "read_file"
    assert image.messages == [{"role": "user", "content": "What is in this screenshot?"},
                              {"role": "assistant", "content": "A terminal showing a failing test."}]
    assert pair.messages == [{"role": "system", "content": "Answer in one word."},
                             {"role": "user", "content": "Capital of France?"},
                             {"role": "assistant", "content": "Paris", "reasoning_content": "The capital is Paris."}]


def test_anthropic_sample() -> None:
    convs, _ = read(SAMPLES / "anthropic_messages.jsonl")
    assert len(convs) == 2
    assert convs[0].messages == [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": "Listing them.", "reasoning_content": "I should run ls.",
         "tool_calls": [call("toolu_1", "run", '{"cmd": "ls"}')]},
        {"role": "tool", "content": "README.md\nsetup.py", "tool_call_id": "toolu_1", "name": "run"},
        {"role": "user", "content": "Which one is the docs?"},
        {"role": "assistant", "content": "README.md is the documentation."},
    ]
    assert convs[0].tools == [{"type": "function", "function": {
        "name": "run", "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]
    assert convs[1].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."},
                                 {"role": "assistant", "content": "Hi."}]


def test_claude_code_session_is_one_conversation() -> None:
    convs, stats = read(SAMPLES / "claude_code")
    assert len(convs) == 1 and stats.formats["claude_code"] == 1
    assert stats.skipped == {"sidechain event": 1}
    assert convs[0].messages == [
        {"role": "user", "content": "Fix the failing test in tests/test_parse.py"},
        {"role": "assistant", "content": "", "reasoning_content": "Run the test first.",
         "tool_calls": [call("toolu_01", "Bash", '{"command": "pytest tests/test_parse.py -q"}')]},
        {"role": "tool", "content": "1 failed: ValueError: invalid literal", "tool_call_id": "toolu_01", "name": "Bash"},
        {"role": "assistant", "content": "The parser must strip whitespace; I fixed it."},
    ]
    # a sidechain event is left out on purpose, not malformed: strict mode accepts the file
    assert len(read(SAMPLES / "claude_code", strict=True)[0]) == 1


def test_codex_rollout() -> None:
    convs, stats = read(SAMPLES / "codex")
    assert len(convs) == 1 and stats.formats["codex"] == 1
    m = convs[0].messages
    assert roles(convs[0]) == ["system", "user", "user", "assistant", "tool", "assistant", "user", "assistant",
                               "tool", "assistant"]
    assert m[0]["content"] == "<permissions>workspace-write</permissions>"
    assert m[3] == {"role": "assistant", "content": "", "reasoning_content": "**Counting lines** with wc.",
                    "tool_calls": [call("call_X1", "shell", '{"command":["wc","-l","main.py"]}')]}
    assert m[4]["tool_call_id"] == "call_X1" and m[4]["name"] == "shell" and "42 main.py" in m[4]["content"]
    assert m[5]["content"] == "main.py has 42 lines."
    assert m[7]["tool_calls"][0]["function"]["name"] == "apply_patch"
    assert json.loads(m[7]["tool_calls"][0]["function"]["arguments"])["input"].startswith("*** Begin Patch")
    assert m[8] == {"role": "tool", "content": "Success. Updated: M main.py", "tool_call_id": "call_X2",
                    "name": "apply_patch"}


def test_sharegpt_sample() -> None:
    convs, _ = read(SAMPLES / "sharegpt.json")
    assert [c.source.rsplit("#", 1)[1] for c in convs] == ["0", "1"]
    assert roles(convs[0]) == ["system", "user", "assistant", "user", "assistant"]
    assert convs[0].messages[4] == {"role": "assistant", "content": "101"}
    assert convs[1].messages == [
        {"role": "user", "content": "What time is it in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call("call_1", "get_time", '{"city": "Oslo"}')]},
        {"role": "tool", "content": '{"time": "14:05"}', "tool_call_id": "call_1", "name": "get_time"},
        {"role": "assistant", "content": "It is 14:05 in Oslo."},
    ]
    assert convs[1].tools[0]["function"]["name"] == "get_time"


def test_prompt_lists() -> None:
    convs, stats = read(SAMPLES / "prompts.jsonl")
    haiku, mt, alpaca, doc = convs
    assert haiku.messages == [{"role": "user", "content": "Write a haiku about autumn."}]
    assert haiku.needs_generation_prompt
    assert mt.messages == [{"role": "user", "content": "What is 12 * 13?"},
                           {"role": "user", "content": "Now divide it by 4."}]
    assert alpaca.messages[-1] == {"role": "assistant", "content": "Guten Morgen"}
    assert not alpaca.needs_generation_prompt
    assert doc.kind == "document" and doc.text.startswith("Raw pre-training") and doc.messages == []
    assert (stats.conversations, stats.documents) == (3, 1)


def test_parquet_rows_become_prompts() -> None:
    convs, _ = read(SAMPLES / "swe_tasks.parquet")
    assert [c.messages for c in convs] == [
        [{"role": "user", "content": "`parse(' 3')` raises ValueError instead of returning 3."}],
        [{"role": "user", "content": "The CLI prints a traceback when the config file is missing."}],
    ]
    assert convs[1].source.endswith("swe_tasks.parquet#1")


@pytest.mark.slow
def test_save_to_disk_and_arrow(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa

    rows = {"conversations": [[{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]],
            "extra": [1]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["a", "b"]})}).save_to_disk(
        str(tmp_path / "dd"))
    schema = pa.schema([("question", pa.string())])
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as f, pa.ipc.new_file(f, schema) as w:
        w.write_table(pa.table({"question": ["why?"]}))
    convs, stats = read(tmp_path)
    assert stats.formats["dataset"] == 3 and stats.files == 3  # saved folders are not walked into
    by_file = {Path(k).name: v for k, v in stats.per_file.items()}
    assert by_file == {"dd": 2, "saved": 1, "t.arrow": 1}
    assert [c.messages for c in convs if Path(c.source.split("#")[0]).name == "saved"] == [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]]
    assert [c.source.rsplit("#", 1)[1] for c in convs
            if Path(c.source.split("#")[0]).name == "dd"] == ["train/0", "train/1"]
    # the Arrow stream files datasets writes are readable on their own too
    stream_file = next((tmp_path / "saved").glob("*.arrow"))
    assert [c.messages for c in read(stream_file)[0]] == [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]]


# --- detection ---------------------------------------------------------------------------------

def test_detection_in_a_mixed_folder(tmp_path: Path) -> None:
    mixed = tmp_path / "mixed"
    shutil.copytree(SAMPLES, mixed)
    (mixed / "deep" / "er").mkdir(parents=True)
    (mixed / "deep" / "er" / "tool.py").write_text("def f():\n    return 1\n")
    (mixed / "model.bin").write_bytes(b"GGUF\x00\x01\x02" * 100)
    (mixed / ".git").mkdir()
    (mixed / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    convs, stats = read(mixed)
    per = {Path(k).relative_to(mixed).as_posix(): v for k, v in stats.per_file.items()}
    assert per == {"README.md": 1, "anthropic_messages.jsonl": 2, "claude_code/" + next(
        (mixed / "claude_code").iterdir()).name: 1, "codex/" + next((mixed / "codex").iterdir()).name: 1,
        "deep/er/tool.py": 1, "model.bin": 0, "notes.md": 1, "openai_chat.jsonl": 3, "prompts.jsonl": 4,
        "sharegpt.json": 2, "swe_tasks.parquet": 2}
    assert stats.formats == {"text": 3, "jsonl": 3, "claude_code": 1, "codex": 1, "json": 1, "dataset": 1,
                             "binary": 1}
    assert stats.skipped == {"binary file": 1, "sidechain event": 1}
    assert (stats.conversations, stats.documents) == (14, 4) and len(convs) == 18
    assert len({c.id for c in convs}) == 18


def test_ids_are_stable_and_content_based(tmp_path: Path) -> None:
    a, _ = read(SAMPLES / "openai_chat.jsonl")
    shutil.copy(SAMPLES / "openai_chat.jsonl", tmp_path / "moved.jsonl")
    b, _ = read(tmp_path / "moved.jsonl")
    assert [c.id for c in a] == [c.id for c in b] and a[0].source != b[0].source


# --- malformed input ---------------------------------------------------------------------------

GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.parametrize("name,body,reason,where,kept", [
    ("bad.jsonl", f"{GOOD}\n{{not json\n{GOOD}\n", "bad json", ":2", 2),
    ("types.jsonl", f'{GOOD}\n{{"messages": [{{"role": "user", "content": 5}}]}}\n', "wrong types", ":2", 1),
    ("roles.jsonl", f'{GOOD}\n{{"messages": [{{"role": "wizard", "content": "x"}}]}}\n', "unknown role", ":2", 1),
    ("empty_msgs.jsonl", f'{GOOD}\n{{"messages": []}}\n', "no messages", ":2", 1),
    ("other.jsonl", f'{GOOD}\n{{"foo": 1}}\n{GOOD}\n', "unknown format", ":2", 2),
    ("list.json", f'[{GOOD}, {{"foo": 1}}]', "unknown format", "#1", 1),
    # a truncated JSON document cannot be read in part: the whole file is skipped
    ("trunc.json", '[\n {"messages": [{"role": "user", "content": "hi"}]},\n {"messages": [', "bad json", ":3", 0),
    ("empty.jsonl", "", "empty file", "", 0),
    ("blank.md", "\n\n", "empty file", "", 0),
])
def test_malformed_is_counted_and_strict_raises(tmp_path: Path, name: str, body: str, reason: str,
                                                where: str, kept: int) -> None:
    path = tmp_path / name
    path.write_text(body)
    convs, stats = read(path)
    assert stats.skipped == {reason: 1}
    assert len(convs) == kept
    with pytest.raises(SparkpackError) as e:
        read(path, strict=True)
    assert str(e.value).startswith(f"{path}{where}: {reason}")


def test_wrong_types_in_jsonl_counts_each_line(tmp_path: Path) -> None:
    path = tmp_path / "types.jsonl"
    path.write_text(f'{GOOD}\n{{"messages": "hi"}}\n{{"messages": [{{"role": "user", "content": 5}}]}}\n[1]\n')
    convs, stats = read(path)
    assert len(convs) == 1 and stats.skipped == {"wrong types": 3}


def test_binary_file_skipped(tmp_path: Path) -> None:
    path = tmp_path / "weights.txt"
    path.write_bytes(bytes(range(256)) * 4)
    convs, stats = read(path)
    assert convs == [] and stats.skipped == {"binary file": 1}
    with pytest.raises(SparkpackError, match="binary file"):
        read(path, strict=True)


def test_bad_lines_inside_session_files(tmp_path: Path) -> None:
    src = (SAMPLES / "claude_code").iterdir().__next__().read_text().splitlines()
    path = tmp_path / "session.jsonl"
    path.write_text("\n".join(src[:4] + ['{"type": "user", "sessionId": "x", "message": {"role": "user", "con'] + src[4:]))
    convs, stats = read(path)
    assert len(convs) == 1 and len(convs[0].messages) == 4 and stats.skipped["bad json"] == 1
    with pytest.raises(SparkpackError, match=r"session\.jsonl:5: bad json"):
        read(path, strict=True)


def test_bad_parquet_and_missing_path(tmp_path: Path) -> None:
    (tmp_path / "x.parquet").write_bytes(b"PAR1 this is not parquet")
    convs, stats = read(tmp_path)
    assert convs == [] and stats.skipped == {"bad dataset": 1}
    with pytest.raises(SparkpackError, match="no such file"):
        read_corpus(tmp_path / "nope")


# --- the real corpora in ../shared -------------------------------------------------------------

@pytest.fixture(scope="module")
def real() -> tuple[list[Conversation], ReadStats]:
    if not REAL.is_dir():
        pytest.skip(f"real corpora not found at {REAL} (expected the shared/ folder beside the repository)")
    return read(REAL, strict=True)


def test_real_corpora_counts(real: tuple[list[Conversation], ReadStats]) -> None:
    convs, stats = real
    per = {Path(k).relative_to(REAL).as_posix(): v for k, v in stats.per_file.items()}
    assert per == {"SOURCE.md": 1, "bench_agent.jsonl": 6, "mt_bench_questions.jsonl": 80,
                   "swe_bench_verified.parquet": 500, **{f"agent_prompts/{p.name}": 1
                                                          for p in (REAL / "agent_prompts").glob("*.md")}}
    assert not stats.skipped


def test_real_agent_conversations(real: tuple[list[Conversation], ReadStats]) -> None:
    agent = [c for c in real[0] if "bench_agent" in c.source]
    # the recorded agent turns carry tool results inline in the user prompt, not as tool messages
    assert all(roles(c) == ["system", "user"] for c in agent)
    assert all("<tool_result" in c.messages[1]["content"] and "Codex" in c.messages[0]["content"] for c in agent)
    assert all(c.needs_generation_prompt for c in agent)


def test_real_mt_bench_and_swe_bench(real: tuple[list[Conversation], ReadStats]) -> None:
    mt = [c for c in real[0] if "mt_bench" in c.source]
    assert all(roles(c) == ["user", "user"] for c in mt)
    first = json.loads((REAL / "mt_bench_questions.jsonl").read_text().splitlines()[0])
    assert [m["content"] for m in mt[0].messages] == first["turns"]
    swe = [c for c in real[0] if "swe_bench" in c.source]
    assert all(roles(c) == ["user"] and len(c.messages[0]["content"]) > 20 for c in swe)
    assert swe[0].messages[0]["content"].startswith("Modeling's `separability_matrix`")


def test_real_agent_prompts_are_documents(real: tuple[list[Conversation], ReadStats]) -> None:
    docs = [c for c in real[0] if "agent_prompts" in c.source]
    assert len(docs) == 4 and all(c.kind == "document" for c in docs)
    assert all(c.text.startswith("You are ") for c in docs)


def test_older_codex_rollout_and_jsonl_under_log_name(tmp_path: Path) -> None:
    lines = [{"id": "s1", "timestamp": "2025-05-01T10:00:00Z", "instructions": "You are Codex."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ls"}]},
             {"record_type": "state"},
             {"type": "function_call", "name": "shell", "arguments": '{"command":["ls"]}', "call_id": "c1"},
             {"type": "function_call_output", "call_id": "c1", "output": {"content": "a.py", "success": True}},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "One file."}]}]
    (tmp_path / "rollout-old.jsonl").write_text("\n".join(json.dumps(r) for r in lines))
    (tmp_path / "server.log").write_text(GOOD + "\n" + GOOD + "\n")
    (tmp_path / "notes.txt").write_text("just words\n")
    convs, stats = read(tmp_path)
    assert stats.formats == {"codex": 1, "jsonl": 1, "text": 1}
    codex = next(c for c in convs if Path(c.source).name.startswith("rollout"))
    assert codex.messages == [
        {"role": "system", "content": "You are Codex."}, {"role": "user", "content": "ls"},
        {"role": "assistant", "content": "", "tool_calls": [call("c1", "shell", '{"command":["ls"]}')]},
        {"role": "tool", "content": "a.py", "tool_call_id": "c1", "name": "shell"},
        {"role": "assistant", "content": "One file."}]
    assert stats.per_file[str(tmp_path / "server.log")] == 2


def test_legacy_function_role_and_leading_systems_merge(tmp_path: Path) -> None:
    rec = {"messages": [{"role": "system", "content": "A."}, {"role": "developer", "content": "B."},
                        {"role": "user", "content": "go"},
                        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
                        {"role": "function", "name": "f", "content": "42"}]}
    (tmp_path / "x.jsonl").write_text(json.dumps(rec))
    [conv], _ = read(tmp_path / "x.jsonl")
    assert conv.messages == [{"role": "system", "content": "A.\n\nB."}, {"role": "user", "content": "go"},
                             {"role": "assistant", "content": "", "tool_calls": [call("call_1", "f", "{}")]},
                             {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": "f"}]
    assert conv.needs_generation_prompt


def test_sample_tool_arguments_are_json_objects() -> None:
    """Templates that iterate ``arguments|items`` (Qwen3.5, Qwen3-Coder) need them as mappings: the
    renderer parses the JSON string, so every reader must produce one that parses to an object."""
    convs, _ = read(SAMPLES)
    calls = [tc for c in convs for m in c.messages for tc in m.get("tool_calls", [])]
    assert len(calls) == 6
    assert all(isinstance(json.loads(tc["function"]["arguments"]), dict) for tc in calls)


def test_unreadable_file_is_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sparkpack.calibrate.readers import detect

    (tmp_path / "a.jsonl").write_text(GOOD + "\n")
    (tmp_path / "b.jsonl").write_text(GOOD + "\n")
    real_detect = detect.detect_file

    def failing(path: Path) -> str:
        if path.name == "a.jsonl":
            raise PermissionError(13, "Permission denied", str(path))
        return real_detect(path)

    monkeypatch.setattr("sparkpack.calibrate.readers.detect_file", failing)
    convs, stats = read(tmp_path)
    assert len(convs) == 1 and stats.skipped == {"unreadable file": 1}
    with pytest.raises(SparkpackError, match=r"a\.jsonl: unreadable file: Permission denied"):
        read(tmp_path, strict=True)


# --- compressed logs ---------------------------------------------------------------------------

@pytest.mark.parametrize("sample", ["claude_code", "codex", "openai_chat.jsonl", "sharegpt.json", "notes.md"])
def test_gzip_and_zstd_logs_read_like_the_plain_file(tmp_path: Path, sample: str) -> None:
    """Rotated logs (``x.jsonl.gz``, ``x.jsonl.zst``) are read through a decompressor and their
    format is that of the name under the compression, not skipped as binary."""
    import gzip

    import zstandard

    src = SAMPLES / sample
    src = next(src.iterdir()) if src.is_dir() else src
    plain, _ = read(src)
    assert plain
    for suffix, pack in ((".gz", gzip.compress), (".zst", zstandard.ZstdCompressor().compress)):
        packed = tmp_path / (src.name + suffix)
        packed.write_bytes(pack(src.read_bytes()))
        convs, stats = read(packed)
        assert stats.skipped == read(src)[1].skipped
        assert [(c.id, c.messages, c.kind) for c in convs] == [(c.id, c.messages, c.kind) for c in plain]


def test_a_damaged_compressed_log_is_counted_or_named(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl.gz").write_bytes(b"not gzip at all")
    (tmp_path / "b.jsonl.zst").write_bytes(b"not zstd either")
    (tmp_path / "c.jsonl").write_text(GOOD + "\n")
    convs, stats = read(tmp_path)
    assert len(convs) == 1 and stats.skipped["unreadable file"] == 2
    with pytest.raises(SparkpackError, match="a.jsonl.gz"):
        read(tmp_path, strict=True)
