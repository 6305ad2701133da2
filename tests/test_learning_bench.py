"""bench/learning_bench.py's pure parts, and a dry run of the whole benchmark on a tiny CPU model
(three real spark-run --serve processes and a real repack calibrate on the training half)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import learning_bench as bench  # noqa: E402


def test_the_split_is_by_conversation_and_stable():
    train, test = bench.conversations([REPO / "corpora"], "You are a coding agent.")
    again = bench.conversations([REPO / "corpora"], "You are a coding agent.")
    assert (train, test) == again and train and test
    assert not {json.dumps(m) for m in train} & {json.dumps(m) for m in test}
    for chat in train + test:
        assert chat[0]["role"] == "system" and chat[-1]["role"] != "assistant"


def row(phase: str, index: int, cold: float) -> bench.Row:
    return bench.Row("s", phase, index, 100, 0, 8, cold, cold / 2, 50.0)


def test_verdict_finds_when_the_live_placement_catches_up():
    offline = [row("offline", i, 0.2) for i in range(1, 31)]
    live = [row("live", i, 0.6 if i <= 8 else 0.22) for i in range(1, 26)]
    restart = [row("restart", i, 0.23) for i in range(26, 31)]
    v = bench.verdict(live, restart, offline)
    assert v["reached_at_request"] == 13 and v["within_target"]  # the first window without requests 1-8
    assert abs(v["restart_ratio"] - 1.15) < 1e-9 and v["restart_within_target"]
    slow = bench.verdict([row("live", i, 0.6) for i in range(1, 26)], restart, offline)
    assert slow["reached_at_request"] is None and not slow["within_target"]


@pytest.mark.slow
def test_dry_run_on_a_tiny_model(synth_model, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(synth_model("qwen3moe", "Q4_K_M", skew="reference").read_bytes())
    out = tmp_path / "out"
    result = bench.main([str(model), "--corpus", str(REPO / "corpora"), "--device", "cpu", "--ctx", "2048",
                         "--requests", "1", "--after-restart", "1", "--max-tokens", "2", "--out", str(out),
                         "--spark-arg=--hot-fraction=0.5"])
    assert [r["phase"] for r in result["live"] + result["restart"]] == ["live", "restart"]
    assert [r["index"] for r in result["offline"]] == [1, 2]
    for r in result["live"] + result["restart"] + result["offline"]:
        assert 0 <= r["cold_share"] <= 1 and r["completion_tokens"] >= 1
    assert result["restart"][-1]["experts_moved"] is not None  # the live servers learn and re-place
    assert (out / "live.profile.json").is_file() and (out / "offline.profile.json").is_file()
    assert not (tmp_path / "m.profile.json").exists()  # learning went where --profile said
    table = (out / "learning_bench.md").read_text()
    assert "live / offline" in table and "after the restart" in table
