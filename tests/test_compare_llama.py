"""bench/compare_llama.py pairs our decode_bench rows with llama-bench's JSON rows (issue 7's
side-by-side table): right test per row, ratios, and a failing exit when a row has no partner."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from compare_llama import compare  # noqa: E402


def llama_entry(n_prompt: int, n_gen: int, depth: int, ts: float) -> dict:
    # the fields llama-bench's json printer writes that the comparison reads (plus one it ignores)
    return {"model_filename": "m.gguf", "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": depth,
            "avg_ts": ts, "stddev_ts": ts / 100}


OURS = {"model": "m.gguf",
        "decode": [{"depth": 128, "graph_tok_s": 150.0}, {"depth": 4096, "graph_tok_s": 140.0}],
        "prefill": [{"tokens": 512, "tok_s": 2000.0}]}
LLAMA = [llama_entry(512, 0, 0, 5000.0), llama_entry(512, 0, 4096, 4000.0), llama_entry(0, 128, 0, 250.0),
         llama_entry(0, 128, 128, 240.0), llama_entry(0, 128, 4096, 200.0)]


def test_rows_pair_the_same_test_at_the_same_depth() -> None:
    rows = {r["what"]: r for r in compare(OURS, LLAMA)}
    assert rows["decode at depth 128"]["llama_test"] == "tg128 @ d128"
    assert rows["decode at depth 128"]["ratio"] == 150.0 / 240.0
    assert rows["decode at depth 4096"]["ratio"] == 140.0 / 200.0
    assert rows["prefill 512"]["llama_test"] == "pp512"  # depth 0, not the pp512 @ d4096 row
    assert rows["prefill 512"]["ratio"] == 2000.0 / 5000.0


def test_cli_writes_the_table_and_fails_on_unpaired_rows(tmp_path: Path) -> None:
    ours, llama, md = tmp_path / "ours.json", tmp_path / "llama.json", tmp_path / "t.md"
    ours.write_text(json.dumps(OURS))
    llama.write_text(json.dumps(LLAMA))
    run = [sys.executable, str(ROOT / "bench" / "compare_llama.py"), str(ours), str(llama), "--md", str(md)]
    r = subprocess.run(run, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "| prefill 512 | 2000.0 | pp512 | 5000.0 ± 50.0 | 0.40x |" in md.read_text()
    llama.write_text(json.dumps([e for e in LLAMA if e["n_prompt"] != 512]))  # no pp512 at all
    r = subprocess.run(run, capture_output=True, text=True)
    assert r.returncode == 1 and "no llama.cpp counterpart" in r.stderr and "Traceback" not in r.stderr
