"""Bootstrap: finding Claude Code and Codex session logs under a (fake) HOME, the one-line hint,
and replaying them (or a real corpus folder) into the learner exactly as calibrate counts them."""
from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from sparkpack.calibrate.bootstrap import bootstrap, bootstrap_files, bootstrap_hint, find_agent_logs
from sparkpack.calibrate.render import ChatRenderer
from sparkpack.calibrate.replay import Replayer
from sparkpack.formats.archs import model_spec
from sparkpack.formats.decayed_routing import DecayedRouting
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.profile import Profile, model_identity
from sparkpack.runtime.calibration import open_router
from tests.test_calibrate import SHARED_CORPORA, invoke

REPO = Path(__file__).resolve().parents[1]
CLAUDE = REPO / "corpora" / "claude_code"
CODEX = REPO / "corpora" / "codex"


@pytest.fixture
def home(tmp_path) -> Path:
    """A HOME holding the sample Claude Code and Codex sessions where the tools keep them, plus
    files the discovery must not take (other names, other folders). Codex's is the older one."""
    home = tmp_path / "home"
    claude = home / ".claude" / "projects" / "-work-myrepo"
    codex = home / ".codex" / "sessions" / "2025" / "10" / "29"
    claude.mkdir(parents=True)
    codex.mkdir(parents=True)
    for src, dst in ((next(CLAUDE.glob("*.jsonl")), claude), (next(CODEX.glob("rollout-*.jsonl")), codex)):
        shutil.copy(src, dst / src.name)
    (claude / "notes.txt").write_text("not a session")
    (home / ".codex" / "sessions" / "history.jsonl").write_text("{}\n")
    (home / ".claude" / "settings.jsonl").write_text("{}\n")
    old = next(codex.glob("*.jsonl"))
    os.utime(old, (1_000_000_000, 1_000_000_000))
    return home


@pytest.fixture(scope="module")
def model(synth_model) -> Path:
    return synth_model("qwen3moe", skew="reference")


def test_finds_the_session_logs_oldest_first(home, tmp_path):
    logs = find_agent_logs(home)
    assert [p.name for p in logs.files["Claude Code"]] == [next(CLAUDE.glob("*.jsonl")).name]
    assert [p.parent.name for p in logs.files["Codex"]] == ["29"]
    assert [p.suffix for p in logs.all] == [".jsonl", ".jsonl"] and "codex" in str(logs.all[0])
    assert bootstrap_files("auto", home) == logs.all
    assert bootstrap_files(tmp_path / "logs", home) == [tmp_path / "logs"]
    line = bootstrap_hint(home)
    assert "\n" not in line and "1 Claude Code and 1 Codex sessions" in line and "--bootstrap auto" in line
    assert bootstrap_hint(tmp_path / "nobody") is None and not find_agent_logs(tmp_path / "nobody")


def fresh(model: Path, half_life: float) -> tuple[DecayedRouting, Replayer]:
    g = GGUFModel(model)
    learner = DecayedRouting(Profile.new(model_identity(g), model_spec(g)), half_life)
    router = open_router(model, "cpu", ctx=4096, prefill_chunk=512)
    return learner, Replayer(router, ChatRenderer(router.tokenizer, router.render_chat), ctx=4096)


def test_bootstrap_learns_what_calibrate_counts(home, model, tmp_path):
    """With decay out of the picture (an enormous half-life) the learner holds exactly the counts
    `repack calibrate` gets from the same session files."""
    learner, replayer = fresh(model, 1e15)
    res = bootstrap(learner, replayer, bootstrap_files("auto", home))
    assert res.sessions == 2 and res.files == 2 and not res.stopped
    assert res.tokens == learner.tokens_seen > 0
    assert "learned from 2 sessions" in res.summary()

    logs = tmp_path / "logs"
    logs.mkdir()
    for p in find_agent_logs(home).all:
        shutil.copy(p, logs / p.name)
    invoke(model, "--corpus", logs, "-o", tmp_path / "p.json")
    ref = json.loads((tmp_path / "p.json").read_text())
    got = learner.profile()
    for side in ("prompt", "generated"):
        assert np.allclose(got.counts[side], np.array(ref["counts"][side]), rtol=1e-9)
        assert got.tokens[side] == pytest.approx(ref["tokens"][side], rel=1e-9)
    assert ref["tokens"]["generated"] > 0  # the sessions' assistant turns count as generated


def test_newest_sessions_weigh_most(home, model):
    """Oldest first with decay: learning the same files in the opposite order gives other counts."""
    files = bootstrap_files("auto", home)
    forward, r1 = fresh(model, 500.0)
    backward, r2 = fresh(model, 500.0)
    bootstrap(forward, r1, files)
    bootstrap(backward, r2, files[::-1])
    assert forward.tokens_seen == backward.tokens_seen
    assert not np.allclose(forward.profile().counts["prompt"], backward.profile().counts["prompt"])


def test_bootstrap_from_the_shared_real_corpora(model):
    if not SHARED_CORPORA.is_dir():
        pytest.skip(f"real-data folder {SHARED_CORPORA} is absent")
    learner, replayer = fresh(model, 1e6)
    res = bootstrap(learner, replayer, bootstrap_files(SHARED_CORPORA / "lucebox-hub" / "bench_agent.jsonl"),
                    max_tokens=1500)
    assert res.tokens == 1500 and res.sessions >= 1 and res.stopped
    spec = model_spec(GGUFModel(model))
    routings = 1500 * len(spec.moe_layers) * spec.n_expert_used
    assert learner.profile().counts["prompt"].sum() == pytest.approx(routings, rel=0.01)  # decay: < 0.1%


def test_stop_and_resume_learn_what_one_run_learns(home, model):
    """Stopped after the first session (a request arrived) and resumed later with the same
    replayer: the second call skips what the first consumed, and the learner ends where an
    uninterrupted run does."""
    files = bootstrap_files("auto", home)
    learner, replayer = fresh(model, 1e15)
    stop = threading.Event()
    stop.set()
    first = bootstrap(learner, replayer, files, stop=stop)
    assert first.stopped and first.sessions == 1
    rest = bootstrap(learner, replayer, files, skip=first.done)  # the replayer serves again
    assert rest.sessions == 1 and not rest.stopped and len(rest.done) == 2
    whole, r2 = fresh(model, 1e15)
    bootstrap(whole, r2, files)
    assert learner.tokens_seen == whole.tokens_seen
    for side in ("prompt", "generated"):
        assert np.allclose(learner.profile().counts[side], whole.profile().counts[side], rtol=1e-9)
