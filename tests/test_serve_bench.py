"""bench/serve_bench.py's pure parts, and a dry run of the whole benchmark on a tiny CPU model
(a real spark-run --serve and a real one-shot spark-run; no llama-server here)."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import serve_bench  # noqa: E402


@pytest.fixture(scope="module")
def bench():
    return serve_bench


def test_arguments_and_sizes(bench, tmp_path):
    args = bench.parse_args(["m.gguf", "--prompts", str(tmp_path), "--n-cpu-moe", "16", "--spark-arg=--hot-fraction=0.6"])
    assert args.vram == "14GiB" and args.turn1_tokens == 17000 and args.turn2_tokens == 300 and args.n_cpu_moe == "16"
    assert args.spark_arg == ["--hot-fraction=0.6"] and bench.placement(args) == ["--vram", "14GiB", "--hot-fraction=0.6"]
    with pytest.raises(SystemExit):
        bench.parse_args(["m.gguf", "--prompts", str(tmp_path), "--n-cpu-moe", "many"])
    assert bench.parse_size("14GiB") == 14 * 1024**3 and bench.parse_size("512MB") == 512 * 1000**2


def test_least_n_cpu_moe_that_fits(bench):
    probed = []

    def fits(n: int) -> bool:  # GPU memory falls as layers move to the CPU; 17 is the first that fits
        probed.append(n)
        return n >= 17

    assert bench.least_that_fits(fits, 40) == 17 and len(probed) <= 6
    assert bench.least_that_fits(lambda n: False, 40) == 40 and bench.least_that_fits(lambda n: True, 40) == 0


def test_turns_are_cut_to_their_token_counts(bench, tmp_path):
    (tmp_path / "a.md").write_text("alpha " * 50)
    (tmp_path / "b.md").write_text("beta " * 70)
    words = lambda text: len(text.split())  # noqa: E731
    cut = lambda text, n: " ".join(text.split()[:n])  # noqa: E731
    turns = bench.build_turns(sorted(tmp_path.glob("*.md")), words, cut, 400, 30)
    assert words(turns.system) + words(turns.user1) == 400 and words(turns.user2) == 30
    assert turns.system.startswith("alpha") and "beta" in turns.system
    messages = turns.turn2("an answer")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]


def test_table(bench):
    side = {"turn1_prompt_tokens": 17012, "turn1_ttft_s": 4.0, "turn1_server_prompt_s": 3.5, "turn2_prompt_tokens": 17400,
            "turn2_cached_tokens": 16896, "turn2_ttft_s": 0.2, "turn2_over_turn1": 0.05, "decode_tok_s": 200.0,
            "gpu_memory_bytes": 13 * 1024**3}
    result = {"model": "m.gguf", "device": "cuda", "vram": "14GiB", "sparkpack": side, "n_cpu_moe": 16,
              "llama": {**side, "turn2_cached_tokens": None, "turn2_over_turn1": 0.9, "decode_tok_s": 90.0},
              "one_shot": {"decode_tok_s": 204.0}}
    table = bench.markdown(result).splitlines()
    assert table[0] == "| m.gguf | sparkpack --serve (14GiB) | llama-server --n-cpu-moe 16 |"
    assert "| turn 2: prompt tokens (cached) | 17400 (16896) | 17400 (-) |" in table
    assert "| decode tok/s, streamed (openai client) | 200.0 | 90.0 |" in table
    assert "| turn 1: the server's prompt time (timings.prompt_ms, s) | 3.500 | 3.500 |" in table
    assert "| turn 2: the server's prompt time (timings.prompt_ms, s) | - | - |" in table
    assert "| decode tok/s, whole requests (N - 1 tokens / time difference) | - | - |" in table
    assert "| served / one-shot decode (target >= 0.97) | 0.980 | |" in table


@pytest.fixture
def prompts(tmp_path, monkeypatch) -> Path:
    """A dry run's prompts folder (one server computing with one thread, no llama-server)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LLAMA_BUILD", str(tmp_path / "no-llama"))
    folder = tmp_path / "prompts"
    folder.mkdir()
    (folder / "agent.md").write_text((REPO / "README.md").read_text())
    return folder


@pytest.mark.slow
def test_dry_run_on_a_tiny_model(bench, synth_model, tmp_path, prompts):
    out = tmp_path / "out"
    result = bench.main([str(synth_model("qwen3moe")), "--prompts", str(prompts), "--device", "cpu",
                         "--turn1-tokens", "150", "--turn2-tokens", "20", "--answer-tokens", "4",
                         "--decode-tokens", "6", "--spark-arg=--prefill-chunk=16", "--out", str(out)])
    s = result["sparkpack"]
    assert s["exit"] == 0 and 140 <= s["turn1_prompt_tokens"] <= 170 and s["turn2_cached_tokens"] >= 128
    assert s["decode_tokens"] == 6 and s["decode_tok_s"] > 0 and s["decode_tok_s_whole"] > 0
    # the server's prompt time (its timings) is inside the time to first token the client saw
    assert 0 < s["turn1_server_prompt_s"] < s["turn1_ttft_s"] and 0 < s["turn2_server_prompt_s"] < s["turn2_ttft_s"]
    assert result["one_shot"]["decode_tok_s"] > 0
    assert "llama" not in result and json.loads((out / "serve_bench.json").read_text()) == result
    assert (out / "serve_bench.md").read_text().startswith("| qwen3moe")


@pytest.mark.slow
def test_conversations_dry_run_on_a_tiny_model(synth_model, tmp_path, prompts):
    """bench/conversations_bench.py end to end: a real spark-run --serve, restarted over its
    --cache-dir for A6 (no llama-server here), and its table."""
    import conversations_bench as cb

    out = tmp_path / "out"
    result = cb.main([str(synth_model("qwen35moe")), "--prompts", str(prompts), "--device", "cpu", "--ctx", "4096",
                      "--conv-tokens", "700", "--shared-tokens", "400", "--turn-tokens", "30",
                      "--spark-arg=--prefill-chunk=32", "--spark-arg=--parallel=1", "--out", str(out)])
    s = result["sparkpack"]
    assert s["exit"] == 0 and "llama" not in result
    by = {r["name"]: r for r in s["requests"]}
    assert [r["name"] for r in s["requests"]] == cb.SEQUENCE
    for name, before in (("A2", "A1"), ("A3", "A2"), ("A4", "A3"), ("A5", "A4"), ("B2", "B1")):
        # each main turn resumes its own conversation: all of its previous prompt but the last call's tail
        assert by[name]["cached_tokens"] >= by[before]["prompt_tokens"] - 40, (name, by[name])
    assert 400 - 32 <= by["B1"]["cached_tokens"] < by["B1"]["prompt_tokens"] - 200  # the shared system prompt only
    assert s["restart"]["cached_tokens"] >= by["A5"]["prompt_tokens"] - 40  # from the folder
    assert s["cache_host_bytes"] > 0 and s["rss_bytes"] > 0 and s["expert_host_bytes"] == 0  # (all experts loaded)
    assert s["checkpoint_host_bytes"] > 0  # (a qwen35moe session's DeltaNet state copies)
    assert json.loads((out / "conversations_bench.json").read_text()) == result
    table = (out / "conversations_bench.md").read_text()
    assert table.startswith("| qwen35moe") and "| worst main turn after a switch / A2 (target <= 1.5) |" in table
    # where each request's time went, from the server's timings: its parts add up to less than the client's wall
    for r in s["requests"] + [s["restart"]]:
        sp = r["split"]
        inside = sp["queue_ms"] + sp["resume_ms"] + sp["prompt_ms"] + sp["first_token_ms"] + sp["rest_ms"]
        assert 0 < sp["prompt_ms"] < inside <= r["seconds"] * 1e3, r
    assert by["A3"]["split"]["resume_ms"] > 0 and "| request | client | queue | resume | prompt |" in table
    # what the engine spent on the previous request's snapshot, by phase: none before the first request
    assert by["A1"]["split"]["previous_keep_ms"] == {}
    kept = by["A2"]["split"]["previous_keep_ms"]
    assert set(kept) == {"state", "lock", "slots", "wait", "copies", "index"} and sum(kept.values()) > 0, kept
    after = by["A2"]["split"]["previous_after_ms"]  # (the bench runs --no-learn: no work between requests)
    assert set(after) == {"sink", "cache", "metrics"} and after["cache"] >= sum(kept.values()), (after, kept)
    assert "previous snapshot |" in table
    a2 = next(line for line in table.splitlines() if line.startswith("| A2 |") and " state " in line)
    assert re.search(r"\| sink [\d.]+ cache [\d.]+ metrics [\d.]+ \| state [\d.]+ lock [\d.]+ slots [\d.]+ "
                     r"wait [\d.]+ copies [\d.]+ index [\d.]+ \|$", a2), a2


def test_conversations_llama_server_column(tmp_path):
    """conversations_bench.py's llama-server: its default slots (no ``-np``), ``--cache-ram`` only
    when asked, and its column in the table beside sparkpack's, request by request."""
    import conversations_bench as cb

    args = cb.parse_args([str(tmp_path / "m.gguf"), "--prompts", str(tmp_path), "--llama-server", "/bin/true",
                          "--llama-cache-ram", "4096"])
    cmd = serve_bench.llama_server(args, 17, slots=None).cmd
    assert "-np" not in cmd and cmd[cmd.index("--n-cpu-moe") + 1] == "17"
    assert "-np" in serve_bench.llama_server(args, 17).cmd  # (serve_bench's one slot, as before)

    def run(scale: float, cached: int | None) -> dict:
        return {"requests": [{"name": n, "seconds": scale * (i + 1), "prompt_tokens": 100 + i,
                              "cached_tokens": cached} for i, n in enumerate(cb.SEQUENCE)],
                "rss_bytes": 2**30, "cache_host_bytes": 2**29}

    result = {"model": "m.gguf", "device": "cuda", "vram": "14GiB", "shared_tokens": 50, "n_cpu_moe": 17,
              "sparkpack": run(0.1, 90), "llama": run(1.0, None)}
    table = cb.markdown(result).splitlines()
    assert "llama-server --n-cpu-moe 17" in table[0]
    row = next(line for line in table if line.startswith("| A4 |"))
    assert row == "| A4 | 105 (90), 0.600 | 105 (None), 6.000 |"


@pytest.mark.slow
def test_parallel_dry_run_on_a_tiny_model(synth_model, tmp_path, prompts):
    """bench/parallel_bench.py end to end: a real spark-run --serve --parallel 2, one and two
    streams at once, a short request during a long reply and during a long prompt's prefill, and
    its tables."""
    import parallel_bench as pb

    out = tmp_path / "out"
    result = pb.main([str(synth_model("qwen3moe")), "--prompts", str(prompts), "--device", "cpu", "--vram", "all",
                      "--ctx", "2048", "--parallel", "2", "--streams", "1", "2", "--decode-tokens", "12",
                      "--prompt-tokens", "60", "--long-prompt-tokens", "400", "--out", str(out)])
    (spark,) = result["results"]
    assert spark["server"] == "sparkpack --parallel 2"
    assert [r["streams"] for r in spark["rows"]] == [1, 2] and all(sum(r["tokens"]) > 0 for r in spark["rows"])
    assert spark["idle_first_token_s"] > 0 and spark["busy_first_token_s"] > 0
    assert spark["long_prompt_tokens"] > 300 and spark["short_during_prefill_s"] > 0
    assert spark["long_prompt_first_token_s"] > 0 and spark["running_stream_longest_gap_s"] > 0
    assert json.loads((out / "parallel_bench.json").read_text()) == result["results"]
    table = (out / "parallel_bench.md").read_text()
    assert "| sparkpack --parallel 2 | 2 |" in table and f"| sparkpack --parallel 2 | {spark['long_prompt_tokens']} |" in table
