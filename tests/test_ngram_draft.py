"""The prompt-lookup drafter against a brute-force scan of the sequence, and its edge cases."""
from __future__ import annotations

import random

import pytest

from sparkpack.runtime.ngram_draft import NgramIndex, accepted_prefix


def brute(ids: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The definition: the longest suffix (max_n down to min_n tokens) that occurred earlier with
    at least one token after it, at its latest such occurrence; what followed it there."""
    for n in range(min(max_n, len(ids)), min_n - 1, -1):
        suffix = ids[len(ids) - n:]
        for j in range(len(ids) - n - 1, -1, -1):
            if ids[j:j + n] == suffix:
                return ids[j + n:j + n + k]
    return []


@pytest.mark.parametrize("vocab, max_n, min_n", [(3, 4, 1), (5, 3, 2), (8, 6, 3), (2, 2, 2)])
def test_matches_the_brute_force_scan_at_every_step(vocab: int, max_n: int, min_n: int) -> None:
    rng = random.Random(vocab * 100 + max_n)
    for _ in range(20):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        d = NgramIndex(max_n, min_n)
        for i, tok in enumerate(ids):
            d.extend([tok])
            for k in (1, 3, 8):
                assert d.propose(k) == brute(ids[:i + 1], k, max_n, min_n), (ids[:i + 1], k)


def test_longest_then_most_recent_match_wins() -> None:
    d = NgramIndex(max_ngram=3, min_ngram=1)
    #          0  1  2  3  4  5  6  7  8  9
    d.extend([1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3])
    assert d.propose(2) == [9, 5]  # "1 2 3" (3 tokens) beats the later "2 3" -> 7
    d = NgramIndex(max_ngram=3, min_ngram=1)
    d.extend([2, 3, 9, 4, 2, 3, 7, 5, 2, 3])
    assert d.propose(2) == [7, 5]  # no 3-gram match: the latest "2 3"


def test_extend_in_pieces_equals_at_once_and_reset_forgets() -> None:
    rng = random.Random(1)
    ids = [rng.randrange(4) for _ in range(200)]
    whole, pieces = NgramIndex(), NgramIndex()
    whole.extend(ids)
    at = 0
    while at < len(ids):
        step = rng.randrange(1, 9)
        pieces.extend(ids[at:at + step])
        at += step
    assert pieces.ids == whole.ids and pieces.propose(5) == whole.propose(5)
    whole.reset()
    assert whole.propose(5) == [] and whole.ids == []
    whole.extend([7, 8])
    assert whole.propose(3) == []


def test_no_match_short_context_and_bad_settings() -> None:
    d = NgramIndex(max_ngram=4, min_ngram=2)
    assert d.propose(4) == []
    d.extend([1, 2, 3, 4])
    assert d.propose(4) == [] and d.propose(0) == []
    d.extend([1, 2])
    assert d.propose(10) == [3, 4, 1, 2]  # runs to the end of the context, no further
    with pytest.raises(ValueError, match="n-gram lengths"):
        NgramIndex(max_ngram=2, min_ngram=3)


def test_accepted_prefix() -> None:
    assert accepted_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert accepted_prefix([1, 2], [1, 2, 3]) == 2
    assert accepted_prefix([], [1]) == 0 and accepted_prefix([5], [1]) == 0


def test_bench_replays_real_assistant_turns(synth_model) -> None:
    """bench/ngram_acceptance.py on the repo's agent sessions (and lucebox-hub's agent prompts with
    their SWE-bench gold patches, when ../shared has them): the runtime's drafting loop replayed on
    fixed text. Every token after a target's first is one plain step's or one verify's (its kept
    drafts and its own token); drafts are at most ``--draft-tokens`` long; at equal step costs the
    speed-up is the tokens per step."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    lucebox = repo.parent / "shared" / "corpora" / "lucebox-hub"
    args = [sys.executable, str(repo / "bench" / "ngram_acceptance.py"), str(synth_model("qwen35moe")),
            "--corpus", str(repo / "corpora"), "--draft-tokens", "1", "4", "--ngram", "1:3", "2:4",
            "--step-ms", "flat=1,1,1,1,1", "--step-ms", "dear=1,9,9,9,9", "--json"]
    sources = 1
    if (lucebox / "bench_agent.jsonl").is_file():
        args += ["--lucebox", str(lucebox)]
        sources += 2  # the fixes as diffs and as edit calls
    out = json.loads(subprocess.run(args, capture_output=True, text=True, check=True, timeout=600).stdout)
    assert out["synthetic_tokenizer"] is True
    rows = out["rows"]
    assert {r["draft_tokens"] for r in rows} == {1, 4} and len({r["source"] for r in rows}) == sources
    assert len(rows) == sources * 4
    for r in rows:
        verifies = {int(d): c for d, c in r["verifies"].items()}
        assert r["targets"] > 0 and r["tokens"] > r["targets"]
        assert max(verifies, default=0) <= r["draft_tokens"]
        assert r["drafted"] == sum(d * c for d, c in verifies.items()) and r["accepted"] <= r["drafted"]
        steps = r["plain_steps"] + sum(verifies.values())
        assert r["tokens"] == r["targets"] + steps + r["accepted"]
        assert r["speedup"]["flat"] == pytest.approx(r["tokens_per_step"])
        assert r["speedup"]["dear"] <= 1.0  # a verify dearer than any run of drafts never pays
        if verifies:
            took = r["tokens"] - r["targets"] - r["plain_steps"]  # the tokens the verifies gave
            assert r["break_even"] == pytest.approx(took / sum(verifies.values()))
    by = {(r["source"], r["ngram"], r["draft_tokens"]): r for r in rows}
    for source in {r["source"] for r in rows}:  # the same text whatever the drafting
        assert len({by[source, n, k]["tokens"] for n in ("1:3", "2:4") for k in (1, 4)}) == 1


def test_a_fix_as_edit_calls_quotes_what_it_replaces() -> None:
    """The bench's second form of a gold patch: one Edit call a hunk, old string = context and
    removed lines, new string = context and added lines, a hunk as long as its header says (a
    removed SQL comment reads like a file header), the file from the last ``+++`` header."""
    import json

    from bench.ngram_acceptance import patch_as_edits

    patch = "\n".join([
        "diff --git a/pkg/mod.py b/pkg/mod.py", "index 1..2 100644", "--- a/pkg/mod.py", "+++ b/pkg/mod.py",
        "@@ -1,3 +1,3 @@", " def f(x):", "-    return x", "+    return x + 1", " ",
        "@@ -9 +9,2 @@", " a = 1", "+b = 2", "\\ No newline at end of file",
        "diff --git a/db/q.sql b/db/q.sql", "--- a/db/q.sql", "+++ b/db/q.sql",
        "@@ -1,2 +1,2 @@", "--- old comment", "+++ new comment", " select 1;", ""])
    calls = patch_as_edits(patch).split("\n</tool_call>")
    args = [json.loads(c.split("<tool_call>\n")[1])["arguments"] for c in calls if c.strip()]
    assert args == [{"file_path": "pkg/mod.py", "old_string": "def f(x):\n    return x\n",
                     "new_string": "def f(x):\n    return x + 1\n"},
                    {"file_path": "pkg/mod.py", "old_string": "a = 1", "new_string": "a = 1\nb = 2"},
                    {"file_path": "db/q.sql", "old_string": "-- old comment\nselect 1;",
                     "new_string": "++ new comment\nselect 1;"}]
