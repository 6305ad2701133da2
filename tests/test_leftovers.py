"""kill -9 at the worst moment of split, join and calibrate (real processes, real SIGKILL), then
the next run of the same command cleans or restores what was left, saying so in one line."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparkpack.formats.leftovers import clean_leftovers
from sparkpack.formats.sparkpack import Pack

REPO = Path(__file__).resolve().parents[1]

# Runs a repack command in a child that stops (and says so through MARKER) at the Nth call of
# MODULE.FUNC, so the test can kill -9 it at exactly that point.
STOPPER = """
import importlib, os, sys, time
module, func, nth, marker = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
mod = importlib.import_module(module)
orig, calls = getattr(mod, func), [0]
def stop_at_nth(*a, **k):
    calls[0] += 1
    if calls[0] == nth:
        open(marker, "w").close()
        time.sleep(600)
    return orig(*a, **k)
setattr(mod, func, stop_at_nth)
from sparkpack.repack.cli import main
sys.argv = ["repack", *sys.argv[5:]]
main()
"""


def kill_at(tmp_path: Path, module: str, func: str, nth: int, *args: object) -> int:
    """Start ``repack ARGS``, wait until it reaches the Nth call of MODULE.FUNC, SIGKILL it;
    returns its pid (the one its temporary names carry)."""
    marker = tmp_path / "reached"
    marker.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", STOPPER, module, func, str(nth), str(marker), *map(str, args)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline, "the child never reached the kill point"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return proc.pid


def repack(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparkpack.repack.cli", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def hidden(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


def notices(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "a run that was killed" in ln]


def test_split_force_killed_between_renames_is_restored(synth_model, tmp_path):
    """Killed after the old pack was moved aside and before the new one was renamed in: the next
    split restores the old pack first (without --force it then refuses to replace it)."""
    src, out = synth_model("qwen3moe"), tmp_path / "m.sparkpack"
    assert repack("split", src, "-o", out, "--hot-fraction", "1").returncode == 0
    before = (out / "manifest.json").read_bytes()
    pid = kill_at(tmp_path, "os", "rename", 2, "split", src, "-o", out, "--hot-fraction", "0", "--force")
    assert not out.exists() and f".m.sparkpack.old-{pid}" in hidden(tmp_path)
    r = repack("split", src, "-o", out, "--hot-fraction", "0")
    assert r.returncode == 1 and "already exists" in r.stderr
    said = notices(r.stderr)
    assert len(said) == 2 and f"restored {out}" in said[0] and f".m.sparkpack.tmp-{pid}" in said[1], r.stderr
    assert (out / "manifest.json").read_bytes() == before and hidden(tmp_path) == []
    assert Pack.open(out).hot[sorted(Pack.open(out).parts)].all()


def test_split_force_killed_after_the_new_pack_is_in(synth_model, tmp_path):
    """Killed after the new pack was renamed in, before the old one was deleted: the next split
    deletes the old one."""
    src, out = synth_model("qwen3moe"), tmp_path / "m.sparkpack"
    assert repack("split", src, "-o", out, "--hot-fraction", "1").returncode == 0
    pid = kill_at(tmp_path, "shutil", "rmtree", 1, "split", src, "-o", out, "--hot-fraction", "0", "--force")
    assert out.exists() and hidden(tmp_path) == [f".m.sparkpack.old-{pid}"]
    r = repack("split", src, "-o", out, "--hot-fraction", "0.5", "--force")
    assert r.returncode == 0, r.stderr
    assert notices(r.stderr) == [f"repack: removed .m.sparkpack.old-{pid}, the previous m.sparkpack kept by a run "
                                 f"that was killed (process {pid})"]
    assert hidden(tmp_path) == []


def test_join_killed_midway_is_cleaned(synth_model, tmp_path):
    src, pack, out = synth_model("qwen3moe"), tmp_path / "m.sparkpack", tmp_path / "back.gguf"
    assert repack("split", src, "-o", pack, "--hot-fraction", "0.5").returncode == 0
    pid = kill_at(tmp_path, "sparkpack.repack.join_cmd", "_write_all", 3, "join", pack, "-o", out)
    assert not out.exists() and hidden(tmp_path) == [f".back.gguf.tmp-{pid}"]
    r = repack("join", pack, "-o", out)
    assert r.returncode == 0, r.stderr
    assert notices(r.stderr) == [f"repack: removed .back.gguf.tmp-{pid}, an unfinished output of a run that was "
                                 f"killed (process {pid})"]
    assert out.read_bytes() == src.read_bytes() and hidden(tmp_path) == []


@pytest.mark.slow
def test_calibrate_killed_before_its_rename_is_cleaned(synth_model, tmp_path):
    src = synth_model("qwen3moe")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"messages": [{"role": "user", "content": "hello there"}]}\n')
    prof = tmp_path / "m.profile.json"
    args = ("calibrate", src, "--corpus", corpus, "-o", prof, "--device", "cpu", "--quiet")
    pid = kill_at(tmp_path, "os", "replace", 1, *args)
    assert not prof.exists() and hidden(tmp_path) == [f".m.profile.json.tmp-{pid}"]
    r = repack(*args)
    assert r.returncode == 0, r.stderr
    assert notices(r.stderr) == [f"repack: removed .m.profile.json.tmp-{pid}, an unfinished output of a run that "
                                 f"was killed (process {pid})"]
    assert prof.exists() and hidden(tmp_path) == []


def test_live_process_names_are_left_alone(tmp_path):
    out = tmp_path / "x.gguf"
    mine = tmp_path / f".x.gguf.tmp-{os.getppid()}"  # the parent is alive
    mine.write_bytes(b"partial")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = tmp_path / f".x.gguf.tmp-{int(dead.stdout)}"
    gone.write_bytes(b"partial")
    (tmp_path / ".x.gguf.tmp-notapid").write_bytes(b"")
    (tmp_path / ".y.gguf.tmp-1").write_bytes(b"")
    assert clean_leftovers(out) == [f"removed {gone.name}, an unfinished output of a run that was killed "
                                    f"(process {int(dead.stdout)})"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, ".x.gguf.tmp-notapid", ".y.gguf.tmp-1"])
