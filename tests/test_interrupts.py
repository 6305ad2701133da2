"""SIGTERM (timeout, docker stop, systemd, CI) behaves like Ctrl-C for every command: real
processes, real signals in the middle of the work; temp outputs are removed, calibrate
checkpoints, the exit status is 143 (130 for Ctrl-C) and the message one line."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.procs import REPACK, error_lines, run, signal_mid_work

EXIT = {signal.SIGTERM: 143, signal.SIGINT: 130}
MESSAGE = {signal.SIGTERM: "repack: terminated (SIGTERM)", signal.SIGINT: "repack: interrupted"}


def temp_of(out: Path) -> list[Path]:
    """Anything hidden that a writer of ``out`` made beside it."""
    return list(out.parent.glob(f".{out.name}.*"))


def writing(out: Path, pattern: str):
    """True once the command's own temp output (not just any hidden file) exists."""
    return lambda: any(out.parent.glob(pattern.format(name=out.name)))


def assert_stopped(stopped, sig: int, out: Path) -> None:
    assert stopped.returncode == EXIT[sig], stopped.stderr
    lines = error_lines(stopped.stderr)  # split prints its plan first: the report is the last line
    assert lines[-1].startswith(MESSAGE[sig]) and "Traceback" not in stopped.stderr, stopped.stderr
    assert not out.exists() and temp_of(out) == [], list(out.parent.iterdir())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_split_removes_its_temp_pack(slow_model, tmp_path, sig):
    out = tmp_path / "m.sparkpack"
    stopped = signal_mid_work([*REPACK, "split", str(slow_model), "-o", str(out), "--hot-fraction", "0", "--compress"],
                              writing(out, ".{name}.sparkpack-tmp-*"), sig)
    assert_stopped(stopped, sig, out)


@pytest.mark.slow
def test_join_removes_its_temp_gguf(slow_model, tmp_path):
    pack = tmp_path / "m.sparkpack"
    assert run([*REPACK, "split", str(slow_model), "-o", str(pack), "--hot-fraction", "0"]).returncode == 0
    out = tmp_path / "back.gguf"
    assert_stopped(signal_mid_work([*REPACK, "join", str(pack), "-o", str(out)], writing(out, ".{name}.sparkpack-tmp-*")),
                   signal.SIGTERM, out)


def test_synth_removes_its_temp_gguf(tmp_path):
    out = tmp_path / "m.gguf"
    argv = [*REPACK, "synth", "--arch", "qwen35moe", "--quant", "F32", "-o", str(out), "--jobs", "1"]
    assert_stopped(signal_mid_work(argv, writing(out, ".{name}.sparkpack-tmp-*")), signal.SIGTERM, out)


@pytest.mark.slow
def test_convert_hf_removes_its_temp_gguf(tmp_path):
    from tests.hf_tiny import make_tiny_hf

    # wide enough that writing the file takes a moment
    hf_dir = make_tiny_hf("qwen3moe", tmp_path / "hf", hidden_size=512, moe_intermediate_size=512, num_experts=16)
    out = tmp_path / "m.gguf"
    assert_stopped(signal_mid_work([*REPACK, "convert-hf", str(hf_dir), "-o", str(out)],
                                   writing(out, ".{name}.sparkpack-tmp-*")),
                   signal.SIGTERM, out)


@pytest.mark.slow
def test_calibrate_checkpoints_on_sigterm_and_resumes(synth_model, tmp_path):
    model = synth_model("qwen3moe", skew="reference")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"prompt": f"question number {i} about item {i * 7}"}) + "\n"
                              for i in range(24)))
    out = tmp_path / "p.json"
    ckpt = tmp_path / "p.json.checkpoint.json"
    calibrate = [*REPACK, "calibrate", str(model), "--corpus", str(corpus), "--quiet", "--device", "cpu"]
    argv = [*calibrate, "-o", str(out)]
    stopped = signal_mid_work(argv, ckpt.exists)  # the first checkpoint: 16 conversations in
    assert stopped.returncode == 143, stopped.stderr
    lines = error_lines(stopped.stderr)
    assert len(lines) == 1 and "terminated (SIGTERM)" in lines[0] and "--resume" in lines[0], stopped.stderr
    assert not out.exists() and len(json.loads(ckpt.read_text())["state"]["done"]) >= 16
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

    resumed = run([*argv, "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    from click.testing import CliRunner

    from sparkpack.repack.calibrate_cmd import calibrate_cmd

    whole = CliRunner().invoke(calibrate_cmd, [*calibrate[4:], "-o", str(tmp_path / "whole.json")])
    assert whole.exit_code == 0, whole.output
    a, b = json.loads(out.read_text()), json.loads((tmp_path / "whole.json").read_text())
    assert a["counts"] == b["counts"] and a["tokens"] == b["tokens"]
    assert not ckpt.exists()

