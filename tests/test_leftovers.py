"""kill -9 at the worst moment of split, join and calibrate (real processes, real SIGKILL), then
the next run of the same command cleans or restores what was left, saying so in one line."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparkpack.formats.leftovers import clean_folder, clean_leftovers
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


@pytest.mark.slow
def test_split_force_killed_between_renames_is_restored(synth_model, tmp_path):
    """Killed after the old pack was moved aside and before the new one was renamed in: the next
    split restores the old pack first (without --force it then refuses to replace it)."""
    src, out = synth_model("qwen3moe"), tmp_path / "m.sparkpack"
    assert repack("split", src, "-o", out, "--hot-fraction", "1").returncode == 0
    before = (out / "manifest.json").read_bytes()
    pid = kill_at(tmp_path, "os", "rename", 2, "split", src, "-o", out, "--hot-fraction", "0", "--force")
    assert not out.exists() and f".m.sparkpack.sparkpack-old-{pid}" in hidden(tmp_path)
    r = repack("split", src, "-o", out, "--hot-fraction", "0")
    assert r.returncode == 1 and "already exists" in r.stderr
    said = notices(r.stderr)
    assert len(said) == 2 and f"restored {out}" in said[0] and f".m.sparkpack.sparkpack-tmp-{pid}" in said[1], r.stderr
    assert (out / "manifest.json").read_bytes() == before and hidden(tmp_path) == []
    assert Pack.open(out).hot[sorted(Pack.open(out).parts)].all()


@pytest.mark.slow
def test_split_force_killed_after_the_new_pack_is_in(synth_model, tmp_path):
    """Killed after the new pack was renamed in, before the old one was deleted: the next split
    deletes the old one."""
    src, out = synth_model("qwen3moe"), tmp_path / "m.sparkpack"
    assert repack("split", src, "-o", out, "--hot-fraction", "1").returncode == 0
    pid = kill_at(tmp_path, "shutil", "rmtree", 1, "split", src, "-o", out, "--hot-fraction", "0", "--force")
    assert out.exists() and hidden(tmp_path) == [f".m.sparkpack.sparkpack-old-{pid}"]
    r = repack("split", src, "-o", out, "--hot-fraction", "0.5", "--force")
    assert r.returncode == 0, r.stderr
    assert notices(r.stderr) == [f"repack: removed .m.sparkpack.sparkpack-old-{pid}, the previous m.sparkpack kept by a run "
                                 f"that was killed (process {pid})"]
    assert hidden(tmp_path) == []


def test_join_killed_midway_is_cleaned(synth_model, tmp_path):
    src, pack, out = synth_model("qwen3moe"), tmp_path / "m.sparkpack", tmp_path / "back.gguf"
    assert repack("split", src, "-o", pack, "--hot-fraction", "0.5").returncode == 0
    pid = kill_at(tmp_path, "sparkpack.repack.join_cmd", "_write_all", 3, "join", pack, "-o", out)
    assert not out.exists() and hidden(tmp_path) == [f".back.gguf.sparkpack-tmp-{pid}"]
    r = repack("join", pack, "-o", out)
    assert r.returncode == 0, r.stderr
    assert notices(r.stderr) == [f"repack: removed .back.gguf.sparkpack-tmp-{pid}, an unfinished output of a run that was "
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
    assert not prof.exists() and hidden(tmp_path) == [f".m.profile.json.sparkpack-tmp-{pid}"]
    r = repack(*args)
    assert r.returncode == 0, r.stderr
    assert notices(r.stderr) == [f"repack: removed .m.profile.json.sparkpack-tmp-{pid}, an unfinished output of a run that "
                                 f"was killed (process {pid})"]
    assert prof.exists() and hidden(tmp_path) == []


def test_live_process_names_are_left_alone(tmp_path):
    out = tmp_path / "x.gguf"
    mine = tmp_path / f".x.gguf.sparkpack-tmp-{os.getppid()}"  # the parent is alive
    mine.write_bytes(b"partial")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = tmp_path / f".x.gguf.sparkpack-tmp-{int(dead.stdout)}"
    gone.write_bytes(b"partial")
    (tmp_path / ".x.gguf.sparkpack-tmp-notapid").write_bytes(b"")
    (tmp_path / ".y.gguf.sparkpack-tmp-1").write_bytes(b"")
    assert clean_leftovers(out) == [f"removed {gone.name}, an unfinished output of a run that was killed "
                                    f"(process {int(dead.stdout)})"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, ".x.gguf.sparkpack-tmp-notapid", ".y.gguf.sparkpack-tmp-1"])


# --- the whole folder, at the start of every command that writes into it --------------------------

def dead_pid() -> int:
    """The pid of a process that has exited (the names a kill -9 leaves carry such a pid)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def litter(d: Path, dead: int) -> tuple[list[str], list[str]]:
    """What killed writers of three outputs left in ``d`` (a joined GGUF's partial file, a split's
    half-written pack, a pack moved aside by split --force), beside names that are not stale or
    not ours: a live writer's, someone else's folder, no pid. Returns (the lines a command must
    print, the hidden names that must stay)."""
    (d / f".a.gguf.sparkpack-tmp-{dead}").write_bytes(b"partial")
    half = d / f".b.sparkpack.sparkpack-tmp-{dead}"
    (half / "cold" / "L000").mkdir(parents=True)
    (half / "hot.bin").write_bytes(b"hot")
    old = d / f".c.sparkpack.sparkpack-old-{dead}"
    old.mkdir()
    (old / "manifest.json").write_text("{}")
    kept = [f".a.gguf.sparkpack-tmp-{os.getpid()}", f".d.sparkpack-tmp-{dead}", ".e.gguf.sparkpack-tmp-notapid"]
    (d / kept[0]).write_bytes(b"a live writer's")
    (d / kept[1]).mkdir()
    (d / kept[1] / "notes.txt").write_text("not a pack")
    (d / kept[2]).write_bytes(b"")
    said = [f"repack: removed .a.gguf.sparkpack-tmp-{dead}, an unfinished output of a run that was killed (process {dead})",
            f"repack: removed .b.sparkpack.sparkpack-tmp-{dead}, an unfinished output of a run that was killed (process {dead})",
            f"repack: restored {d / 'c.sparkpack'} from .c.sparkpack.sparkpack-old-{dead}, moved aside by a run that was "
            f"killed (process {dead})"]
    return said, kept


@pytest.fixture(scope="module")
def sources(synth_model, tiny_hf_gguf, tmp_path_factory):
    """A model, its pack, a corpus, a profile and a transformers folder, outside the littered folder."""
    from sparkpack.formats.archs import model_spec
    from sparkpack.formats.gguf_file import GGUFModel
    from sparkpack.formats.profile import Profile, model_identity

    root = tmp_path_factory.mktemp("sources")
    model = synth_model("qwen3moe")
    assert repack("split", model, "-o", root / "m.sparkpack", "--hot-fraction", "0.5").returncode == 0
    (root / "c.jsonl").write_text('{"messages": [{"role": "user", "content": "hello there"}]}\n')
    with GGUFModel(model) as m:
        Profile.new(model_identity(m), model_spec(m)).save(root / "m.profile.json")
    return {"model": model, "pack": root / "m.sparkpack", "corpus": root / "c.jsonl",
            "profile": root / "m.profile.json", "hf": tiny_hf_gguf("qwen3moe")[0]}


COMMANDS = {
    "synth": lambda s, d: ("synth", "--arch", "qwen3moe", "--jobs", "1", "-o", d / "new.gguf"),
    "convert-hf": lambda s, d: ("convert-hf", s["hf"], "-o", d / "new.gguf"),
    "split": lambda s, d: ("split", s["model"], "-o", d / "new.sparkpack", "--hot-fraction", "0.5"),
    "join": lambda s, d: ("join", s["pack"], "-o", d / "new.gguf"),
    "calibrate": lambda s, d: ("calibrate", s["model"], "--corpus", s["corpus"], "-o", d / "new.profile.json",
                               "--device", "cpu", "--quiet"),
    "report": lambda s, d: ("report", s["profile"], "-o", d / "new.report.html"),
    "verify": lambda s, d: ("verify", d / "m.sparkpack"),
}


@pytest.mark.parametrize("command", [pytest.param(c, marks=pytest.mark.slow) if c in ("calibrate", "report") else c
                                     for c in sorted(COMMANDS)])
def test_every_writer_and_verify_clear_the_folder_first(sources, tmp_path, command):
    """Whatever killed writers left in the folder a command writes into (or a verified pack lies
    in) is cleared at its start, whichever output it belonged to, one line each; a live writer's
    temporary, a folder that is not a pack and a name without a pid stay."""
    d = tmp_path / "out"
    d.mkdir()
    if command == "verify":
        shutil.copytree(sources["pack"], d / "m.sparkpack")
    said, kept = litter(d, dead_pid())
    r = repack(*COMMANDS[command](sources, d))
    assert r.returncode == 0, r.stderr
    assert notices(r.stderr) == said, r.stderr
    assert hidden(d) == sorted(kept)
    assert (d / "c.sparkpack" / "manifest.json").read_text() == "{}"  # the moved-aside pack, back in place


def test_a_killed_split_is_cleared_by_the_next_command_in_its_folder(synth_model, tmp_path):
    """kill -9 in the middle of a split's copying, then a join into the same folder: the split's
    half-written pack goes, named in one line."""
    src, pack = synth_model("qwen3moe"), tmp_path / "m.sparkpack"
    assert repack("split", src, "-o", tmp_path / "ok.sparkpack", "--hot-fraction", "0.5").returncode == 0
    pid = kill_at(tmp_path, "sparkpack.formats.pack_writer", "_pwrite_all", 3, "split", src, "-o", pack)
    assert hidden(tmp_path) == [f".m.sparkpack.sparkpack-tmp-{pid}"]
    r = repack("join", tmp_path / "ok.sparkpack", "-o", tmp_path / "back.gguf")
    assert r.returncode == 0, r.stderr
    assert notices(r.stderr) == [f"repack: removed .m.sparkpack.sparkpack-tmp-{pid}, an unfinished output of a run that was "
                                 f"killed (process {pid})"]
    assert hidden(tmp_path) == []


def test_clean_folder_leaves_the_running_process_and_foreign_names(tmp_path):
    said, kept = litter(tmp_path, dead_pid())
    assert ["repack: " + line for line in clean_folder(tmp_path)] == said
    assert hidden(tmp_path) == sorted(kept)
    assert clean_folder(tmp_path) == []


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="making a file another user owns takes root")
def test_another_users_leftover_is_not_ours(tmp_path):
    """In a shared folder (a sticky /tmp, a team's model folder) a stale-looking temporary of
    another user is theirs: it stays, and nothing is said (deleting it would fail in a sticky folder
    and end the command, or, for root, delete what is not ours)."""
    dead = dead_pid()
    theirs = tmp_path / f".their.gguf.sparkpack-tmp-{dead}"
    theirs.write_bytes(b"partial")
    os.chown(theirs, os.geteuid() + 1, -1)  # (any other uid)
    assert clean_folder(tmp_path) == []
    assert hidden(tmp_path) == [theirs.name]


def test_a_symlink_is_not_ours(tmp_path):
    """The writers never make links: a link under a leftover's name is neither restored as the
    output (it would put a link to somewhere else in the output's place) nor removed."""
    dead = dead_pid()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "manifest.json").write_text("{}")
    (tmp_path / f".c.sparkpack.sparkpack-old-{dead}").symlink_to(elsewhere)
    (tmp_path / f".a.gguf.sparkpack-tmp-{dead}").symlink_to(elsewhere / "manifest.json")
    assert clean_folder(tmp_path) == []
    assert hidden(tmp_path) == sorted([f".c.sparkpack.sparkpack-old-{dead}", f".a.gguf.sparkpack-tmp-{dead}"])
    assert not (tmp_path / "c.sparkpack").exists()


def test_the_cleaning_stays_inside_its_folder(tmp_path):
    """A name like ``...sparkpack-tmp-PID`` would stand for an output called ``.``, that is the folder
    itself: nothing outside the folder (the parent's leftovers of the folder's own name) is
    touched, and the name, which no writer makes, stays."""
    dead = dead_pid()
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / f"...sparkpack-tmp-{dead}").write_bytes(b"")
    (folder / f"....sparkpack-tmp-{dead}").write_bytes(b"")
    outside = tmp_path / f".models.sparkpack-tmp-{dead}"
    outside.write_bytes(b"not this folder's")
    assert clean_folder(folder) == []
    assert outside.exists() and hidden(folder) == sorted([f"...sparkpack-tmp-{dead}", f"....sparkpack-tmp-{dead}"])
