"""The live profile file: refusal of other models' profiles, throttled writes, and real processes
killed with SIGKILL mid-write (the profile always loads) or stopped with SIGTERM (it saves)."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from sparkpack.formats.archs import model_spec
from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.atomic_file import temp_name
from sparkpack.formats.profile import Profile, default_profile_path, model_identity
from sparkpack.formats.profile_file import ProfileFile

REPO = Path(__file__).resolve().parents[1]

# Learns random routings into the profile beside MODEL and writes it after every "request"
# (every_s=0), printing the tokens learned after each write; SIGTERM ends it through
# saved_at_exit. The loop spends most of its time inside Profile.save (fsync), so a random kill
# usually lands in the middle of a write.
WRITER = """
import sys
import numpy as np
from sparkpack.formats.archs import model_spec
from sparkpack.formats.decayed_routing import DecayedRouting
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.profile import default_profile_path, model_identity
from sparkpack.formats.profile_file import ProfileFile, saved_at_exit

model, every_s = sys.argv[1], float(sys.argv[2])
g = GGUFModel(model)
spec = model_spec(g)
pf = ProfileFile(default_profile_path(model), model_identity(g), spec, every_s=every_s)
learner = DecayedRouting(pf.load(), half_life_tokens=5000)
rng = np.random.default_rng()
with saved_at_exit(pf, learner.profile):
    while True:
        n = int(rng.integers(1, 64))
        learner.observe(rng.integers(0, 4, size=(spec.n_layer, spec.n_expert)) * n, n, "generated")
        pf.save_if_due(learner.profile)
        print(int(learner.tokens_seen), flush=True)
"""


@pytest.fixture
def model(synth_model, tmp_path) -> Path:
    """A private copy of a tiny synthetic model, so its profile lands in this test's folder."""
    path = tmp_path / "tiny.gguf"
    path.write_bytes(synth_model("qwen3moe", skew="reference").read_bytes())
    return path


def open_file(model: Path, **kw) -> ProfileFile:
    g = GGUFModel(model)
    return ProfileFile(default_profile_path(model), model_identity(g), model_spec(g), **kw)


def start_writer(model: Path, every_s: float) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", WRITER, str(model), str(every_s)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)


def test_missing_own_and_other_profiles(model, synth_model, tmp_path):
    pf = open_file(model)
    fresh = pf.load()
    assert sum(fresh.tokens.values()) == 0 and fresh.identity == pf.identity
    fresh.add(generated=np.ones((fresh.n_layer, fresh.n_expert)), generated_tokens=1)
    pf.save(fresh)
    assert pf.load().tokens["generated"] == 1

    other = GGUFModel(synth_model("qwen3moe", skew="reference", seed=1))  # same shapes, another model
    theirs = Profile.new(model_identity(other), model_spec(other))
    theirs.add(prompt=np.full((theirs.n_layer, theirs.n_expert), 5.0), prompt_tokens=9)
    theirs.save(pf.path)
    before = pf.path.read_bytes()
    with pytest.raises(SparkpackError) as e:
        pf.load()
    line = str(e.value)
    assert "\n" not in line and str(pf.path) in line and "another model" in line and "--force" in line
    with pytest.raises(SparkpackError, match="another model"):
        pf.save(theirs)
    assert pf.path.read_bytes() == before  # refused: untouched

    pf.path.write_text("{half a profile")
    with pytest.raises(SparkpackError, match="not a profile.*not overwriting"):
        pf.load()

    forced = open_file(model, force=True)
    assert sum(forced.load().tokens.values()) == 0
    forced.save(fresh)
    assert Profile.load(pf.path).identity == pf.identity


def test_writes_are_throttled(model):
    now = [100.0]
    pf = open_file(model, every_s=30.0, clock=lambda: now[0])
    prof = pf.load()
    assert pf.save_if_due(lambda: prof)  # the first request always writes
    now[0] += 29.0
    assert not pf.save_if_due(lambda: prof)
    now[0] += 1.0
    assert pf.save_if_due(lambda: prof) and pf.saves == 2


def test_temp_files_of_dead_writers_are_removed(model):
    pf = open_file(model)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale, live = temp_name(pf.path, int(dead.stdout)), temp_name(pf.path, os.getpid())
    stale.write_text("{")
    live.write_text("{")
    pf.load()
    assert not stale.exists() and live.exists()


@pytest.mark.slow
def test_kill_9_at_random_moments_always_leaves_a_loadable_profile(model):
    """Writers killed with SIGKILL at random moments, each starting from what the last one left:
    the profile always loads, belongs to the model and never loses more than the writes that
    had not finished; some kills landed mid-write (they left a temporary file behind)."""
    rnd = random.Random(0)
    pf = open_file(model)
    seen, mid_write = 0.0, 0
    for _ in range(12):
        proc = start_writer(model, every_s=0.0)
        first = proc.stdout.readline()
        assert first.strip().isdigit(), proc.stderr.read()
        time.sleep(rnd.uniform(0.0, 0.15))
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        mid_write += temp_name(pf.path, proc.pid).exists()
        prof = Profile.load(pf.path)
        prof.check_model(pf.identity, pf.spec, pf.path)
        assert prof.decay.tokens_seen >= max(seen, int(first))  # learning carried over between processes
        seen = prof.decay.tokens_seen
    assert mid_write >= 1
    pf.load()
    assert not list(pf.path.parent.glob(f".{pf.path.name}.sparkpack-tmp-*"))


def test_sigterm_saves_what_was_learned(model):
    """No periodic write in this run (every_s is huge beyond the first request): the profile
    holds the last tokens only because SIGTERM ended the process through its exit save."""
    proc = start_writer(model, every_s=1e9)
    lines = [proc.stdout.readline() for _ in range(50)]
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    last = int((lines + out.split())[-1])
    saved = json.loads(default_profile_path(model).read_text())
    assert saved["decay"]["tokens_seen"] >= last > int(lines[0])
