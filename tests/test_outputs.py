"""One rule for every output (split, join, synth, convert-hf, calibrate -o): an existing one is
refused without --force (calibrate: --merge or --force), the location is tried before the long
work, and errors name the user's -o path, never the hidden temp name."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.procs import REPACK, error_lines, mid_work, run


def one_error(res, *needles: str) -> str:
    lines = error_lines(res.stderr)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert lines[-1].startswith("repack: error: "), res.stderr
    assert len([ln for ln in lines if ln.startswith("repack: error")]) == 1
    for n in needles:
        assert n in lines[-1], lines[-1]
    return lines[-1]


def command(name: str, synth_model, tiny_hf_gguf, tmp_path: Path) -> list[str]:
    """The arguments of command ``name`` before its ``-o`` (inputs made only for that one)."""
    if name == "synth":
        return ["synth", "--arch", "qwen3moe"]
    if name == "convert-hf":
        return ["convert-hf", str(tiny_hf_gguf("qwen3moe")[0])]
    model = str(synth_model("qwen3moe"))
    if name == "calibrate":
        corpus = tmp_path / "c.jsonl"
        corpus.write_text(json.dumps({"prompt": "hello"}) + "\n")
        return ["calibrate", model, "--corpus", str(corpus), "--quiet"]
    if name == "split":
        return ["split", model]
    pack = tmp_path / "m.sparkpack"
    assert run([*REPACK, "split", model, "-o", str(pack)]).returncode == 0
    return ["join", str(pack)]


@pytest.mark.parametrize("name", ["synth", "convert-hf", "calibrate", "split", "join"])
def test_an_existing_output_is_refused_without_force(name, synth_model, tiny_hf_gguf, tmp_path):
    out = tmp_path / ("old.sparkpack" if name == "split" else "old.out")
    out.mkdir() if name == "split" else out.write_text("precious")
    argv = command(name, synth_model, tiny_hf_gguf, tmp_path)
    line = one_error(run([*REPACK, *argv, "-o", str(out)]), str(out), "already exists", "--force")
    if name == "calibrate":
        assert "--merge" in line
    assert out.is_dir() if name == "split" else out.read_text() == "precious"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_calibrate_force_replaces(synth_model, tmp_path):
    """(--merge onto an existing profile: tests/test_calibrate.py::test_merge_applies_decay.)"""
    from click.testing import CliRunner

    from sparkpack.repack.calibrate_cmd import calibrate_cmd

    out = tmp_path / "p.json"
    out.write_text("precious")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"prompt": f"item {i}"}) + "\n" for i in range(3)))
    args = [str(synth_model("qwen3moe")), "--corpus", str(corpus), "-o", str(out), "--quiet", "--force"]
    assert CliRunner().invoke(calibrate_cmd, args).exit_code == 0
    assert json.loads(out.read_text())["format"] == "sparkpack-profile"


def test_calibrate_checks_its_output_before_reading_anything(synth_model, tmp_path):
    """The output is tried first: with a missing folder and an empty corpus, the folder is what
    gets reported (a replay of hours would otherwise run before the save fails)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "missing" / "p.json"
    one_error(run([*REPACK, "calibrate", str(synth_model("qwen3moe")), "--corpus", str(empty), "-o", str(out)]),
              str(out), "does not exist")
    blocker = tmp_path / "file"
    blocker.write_text("")
    one_error(run([*REPACK, "calibrate", str(synth_model("qwen3moe")), "--corpus", str(empty), "-o",
                   str(blocker / "p.json")]), str(blocker / "p.json"), "not a folder")


@pytest.mark.parametrize("name", ["synth", "convert-hf", "split", "join"])
def test_an_unwritable_location_is_reported_by_its_path(name, synth_model, tiny_hf_gguf, tmp_path):
    out = tmp_path / "nowhere" / "m.out"
    argv = command(name, synth_model, tiny_hf_gguf, tmp_path)
    one_error(run([*REPACK, *argv, "-o", str(out)]), str(out), "does not exist")


def test_a_failure_inside_the_temp_pack_names_the_output(slow_model, tmp_path):
    """The hidden temp directory disappears half-way (another process, a cleanup script): the
    error names the pack the user asked for, and nothing is left behind."""
    out = tmp_path / "m.sparkpack"

    def temps() -> list[Path]:
        return list(tmp_path.glob(".m.sparkpack.sparkpack-tmp-*"))

    stopped = mid_work([*REPACK, "split", str(slow_model), "-o", str(out), "--hot-fraction", "0"],
                       lambda: bool(temps()), lambda proc: [shutil.rmtree(t) for t in temps()])
    lines = error_lines(stopped.stderr)
    assert stopped.returncode == 1 and "Traceback" not in stopped.stderr, stopped.stderr
    assert lines[-1].startswith(f"repack: error: {out}: cannot write"), stopped.stderr
    assert ".sparkpack-tmp-" not in stopped.stderr
    assert not out.exists() and temps() == []
