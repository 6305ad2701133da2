"""A GGUF whose tensors overlap (issue 43): one tensor moved onto another's bytes made spark-run
write all-NaN logits with exit 0. The header reader checks the tensor map as a whole, so every
command that reads a GGUF refuses it in one line naming both tensors: spark-run, the server's
model load (before it takes its port), inspect, split and calibrate, each a real process on a
synthetic model."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from sparkpack.formats.errors import FormatError
from sparkpack.formats.gguf_header import check_tensor_map
from tests.gguf_edit import OVERLAPS, move_tensor
from tests.marks import quick_first
from tests.procs import ENV, REPACK, REPO, SPARK_RUN

# (tensor moved, tensor whose bytes it lands on) for each way of overlapping; the first is the
# issue's reproducer, "same offset" puts a tensor on one of its own size (the very same range)
MOVES = {"onto": ("blk.1.ffn_norm.weight", "blk.1.attn_output.weight"),
         "same offset": ("blk.1.attn_q.weight", "blk.1.attn_output.weight"),
         "partial": ("blk.1.ffn_norm.weight", "blk.1.attn_output.weight"),
         "inside the header": ("blk.1.ffn_norm.weight", "blk.1.attn_output.weight")}


def commands(bad: Path, d: Path) -> dict[str, list[str]]:
    corpus = d / "c.jsonl"
    corpus.write_text('{"messages": [{"role": "user", "content": "hello"}]}\n')
    return {
        "spark-run": [*SPARK_RUN, str(bad), "--device", "cpu", "--prompt-ids", "1,2,3", "--logits-out",
                      str(d / "x.npy")],
        "serve": [*SPARK_RUN, str(bad), "--serve", "--port", "0", "--device", "cpu", "--api-key", "k"],
        "inspect": [*REPACK, "inspect", str(bad)],
        "split": [*REPACK, "split", str(bad), "-o", str(d / "m.sparkpack")],
        "calibrate": [*REPACK, "calibrate", str(bad), "--corpus", str(corpus), "-o", str(d / "p.json"),
                      "--device", "cpu", "--quiet"],
    }


@pytest.fixture(scope="module")
def bad_models(synth_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("overlap")
    out = {}
    for how in OVERLAPS:
        path = root / f"{how.replace(' ', '-')}.gguf"
        shutil.copy(synth_model("qwen3moe"), path)
        move_tensor(path, *MOVES[how], how)
        out[how] = path
    return out


@pytest.mark.parametrize("how", quick_first(OVERLAPS))
@pytest.mark.parametrize("command", ["spark-run", pytest.param("serve", marks=pytest.mark.slow), "inspect", "split", "calibrate"])
def test_overlapping_tensors_are_refused_in_one_line(bad_models, tmp_path, command, how):
    bad = bad_models[how]
    argv = commands(bad, tmp_path)[command]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=ENV, timeout=300)
    prog = "spark-run" if argv[:len(SPARK_RUN)] == SPARK_RUN else "repack"
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1, r.stderr  # the server too: refused before it binds and says it is loading
    mover, target = MOVES[how]
    line = lines[0]
    assert line.startswith(f"{prog}: error: {bad}: ") and mover in line, line
    if how == "inside the header":
        assert "inside the header" in line, line
    else:
        assert target in line and "overlap" in line, line
    assert not (tmp_path / "m.sparkpack").exists() and not (tmp_path / "p.json").exists()
    assert not (tmp_path / "x.npy").exists()


def test_map_check_sorts_and_names_both():
    """Out of index order, an overlap with a tensor that is not the previous one (a long tensor
    spanning several later ones), touching ranges, empty tensors and the section's edges."""
    fine = [("c", 300, 100), ("a", 100, 100), ("b", 200, 100), ("empty", 250, 0)]
    check_tensor_map("f", fine, 100, 400)
    with pytest.raises(FormatError, match=r"tensors long \(bytes 100\.\.400\) and b \(bytes 300\.\.310\) overlap"):
        check_tensor_map("f", [("b", 300, 10), ("long", 100, 300), ("a", 400, 10)], 100, 500)
    with pytest.raises(FormatError, match="tensor a starts at byte 50, inside the header"):
        check_tensor_map("f", [("a", 50, 10)], 100, 500)
    with pytest.raises(FormatError, match="tensor a ends at byte 510, past the end"):
        check_tensor_map("f", [("a", 500, 10)], 100, 500)

