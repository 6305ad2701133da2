"""The README's first command ends in `repack demo`: it must run end to end as a real process."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_demo_runs_the_whole_pipeline(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "sparkpack.repack.cli", "demo", "--workdir", str(work)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    # said up front: the text is gibberish, and what to look at instead
    head = r.stdout.split("$ repack synth")[0]
    assert "random weights" in head and "cold-hit rate" in head and "speed" in head
    for step in ("repack synth", "repack calibrate", "repack split", "repack verify", "spark-run"):
        assert f"$ {step}" in r.stdout
    assert (work / "qwen35moe-tiny.profile.json").is_file()
    assert (work / "qwen35moe-tiny.sparkpack" / "manifest.json").is_file()
    assert "OK" in r.stdout  # verify passed
    assert "found beside the model" in r.stderr  # split used the calibration without being told
    assert "replay: 100%" in r.stderr.replace("\r", "\n")
    assert "per token:" in r.stderr  # spark-run reports hits


def test_demo_with_a_missing_corpus_is_one_line(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "sparkpack.repack.cli", "demo", "--workdir", str(tmp_path),
                        "--corpus", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
