"""Bootstrap: finding Claude Code and Codex session logs under a (fake) HOME, the one-line hint,
and replaying them (or a real corpus folder) through a serving session into the live learner
(``runtime.server.bootstrap``), which then holds what `repack calibrate` counts."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from sparkpack.calibrate.bootstrap import bootstrap_hint, find_agent_logs
from sparkpack.calibrate.render import ChatRenderer
from sparkpack.formats.placement import GEN_WEIGHT
from sparkpack.runtime.chat_template import ChatTemplate
from sparkpack.runtime.generate import Session
from sparkpack.runtime.learning import LearnOptions, start_learning
from sparkpack.runtime.models import StoreOptions, load_model
from sparkpack.runtime.server.bootstrap import BootstrapReplay, bootstrap_sources, select
from sparkpack.runtime.tokenizer import GGUFTokenizer
from tests.commands import calibrate_in_process
from tests.paths import CLAUDE, CODEX, SHARED_CORPORA

REPO = Path(__file__).resolve().parents[1]
EVERYTHING = 10**9  # a token budget that selects every conversation


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
    assert bootstrap_sources("auto", None, home) == logs.all
    (tmp_path / "logs").mkdir()
    for p in logs.all:
        shutil.copy(p, tmp_path / "logs" / p.name)
    assert sorted(bootstrap_sources(str(tmp_path / "logs"), None, home)) == sorted(tmp_path / "logs" / p.name
                                                                                    for p in logs.all)
    line = bootstrap_hint(home)
    assert "\n" not in line and "1 Claude Code and 1 Codex sessions" in line and "--bootstrap auto" in line
    assert bootstrap_hint(tmp_path / "nobody") is None and not find_agent_logs(tmp_path / "nobody")


def serving(model: Path, tmp_path: Path, half_life: float):
    """What ``spark-run --serve`` bootstraps with on ``model`` (CPU): its learner (learning into
    ``tmp_path``), its session (calibrate's context and call size) and the renderer."""
    learn = LearnOptions(half_life_tokens=half_life)
    m = load_model(model, store=StoreOptions(hot_fraction=0.5, cache_slots=4, profile=tmp_path / "p.profile.json",
                                             learn=learn))
    learning = start_learning(m, learn, GEN_WEIGHT)
    tok = GGUFTokenizer.from_metadata(m.gguf)
    template = ChatTemplate.from_tokenizer(m.gguf.get("tokenizer.chat_template"), tok)
    session = Session(m, ctx=4096, prefill_chunk=2048, breaks=tok.control_ids)
    return learning, session, ChatRenderer(tok, template.render)


def replay(model: Path, tmp_path: Path, files: list[Path], half_life: float, budget: int = EVERYTHING):
    learning, session, renderer = serving(model, tmp_path, half_life)
    run = BootstrapReplay(session, select(files, renderer, budget))
    assert run.run() is False  # nothing left
    return learning, run


@pytest.mark.slow
def test_bootstrap_learns_what_calibrate_counts(home, model, tmp_path):
    """With decay out of the picture (an enormous half-life) the learner holds the counts
    `repack calibrate` gets from the same session files: the same tokens of each side and the
    same routings of each expert."""
    learning, run = replay(model, tmp_path, bootstrap_sources("auto", None, home), 1e15)
    assert run.result.sessions == 2 and run.result.files == 2
    assert "learned from 2 sessions" in run.summary()
    got = learning.profile()
    assert run.result.tokens == got.decay.tokens_seen > 0

    logs = tmp_path / "logs"
    logs.mkdir()
    for p in find_agent_logs(home).all:
        shutil.copy(p, logs / p.name)
    calibrate_in_process(model, "--corpus", logs, "-o", tmp_path / "p.json")
    ref = json.loads((tmp_path / "p.json").read_text())
    assert ref["tokens"]["generated"] > 0  # the sessions' assistant turns count as generated
    for side in ("prompt", "generated"):
        want = np.array(ref["counts"][side])
        assert got.tokens[side] == pytest.approx(ref["tokens"][side], rel=1e-9)
        assert got.counts[side].sum() == pytest.approx(want.sum(), rel=1e-9)
        assert np.allclose(got.counts[side], want, rtol=1e-9, atol=1e-6)


def test_newest_sessions_weigh_most(home, model, tmp_path):
    """Oldest first with decay: learning the same files in the opposite order gives other counts."""
    files = bootstrap_sources("auto", None, home)
    forward, _ = replay(model, tmp_path / "f", files, 500.0)
    backward, _ = replay(model, tmp_path / "b", files[::-1], 500.0)
    assert forward.learner.tokens_seen == backward.learner.tokens_seen
    assert not np.allclose(forward.profile().counts["prompt"], backward.profile().counts["prompt"])


@pytest.mark.slow
def test_bootstrap_from_the_shared_real_corpora(model, tmp_path):
    """Only the newest conversations that fit the budget are replayed, and every token they
    compute routes its top-k experts in every MoE layer into the learner."""
    corpus = SHARED_CORPORA / "lucebox-hub" / "bench_agent.jsonl"
    if not corpus.is_file():
        pytest.skip(f"real-data file {corpus} is absent")
    learning, run = replay(model, tmp_path, bootstrap_sources(str(corpus), None), 1e15, budget=1500)
    assert run.result.sessions >= 1 and run.older >= 1
    spec = learning.store.spec
    got = learning.profile()
    routings = sum(got.tokens.values()) * len(spec.moe_layers) * spec.n_expert_used
    assert sum(got.counts[s].sum() for s in ("prompt", "generated")) == pytest.approx(routings, rel=1e-9)


def test_a_request_stops_the_replay_and_idle_time_goes_on(home, model, tmp_path):
    """A request arriving (``busy``) stops the background replay at the next segment; the rest of
    that conversation is dropped and the next idle time replays the next one."""
    learning, session, renderer = serving(model, tmp_path, 1e15)
    run = BootstrapReplay(session, select(bootstrap_sources("auto", None, home), renderer, EVERYTHING))
    calls = []

    def busy() -> bool:
        calls.append(1)
        return len(calls) > 1  # a request arrives during the first conversation

    assert run.run(busy) is True and run.result.sessions == 1
    first = learning.profile().decay.tokens_seen
    assert 0 < first
    assert run.run() is False and run.result.sessions == 2
    assert learning.profile().decay.tokens_seen > first
