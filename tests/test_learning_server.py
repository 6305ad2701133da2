"""A real ``spark-run --serve`` learning its placement: the profile beside the model survives
``kill -9`` at any moment, /metrics shows the learning, ``--trace-out`` records every token's
routing in the calibrate trace format (``repack calibrate --eval`` reads it, and it agrees with
what was learned), and ``--bootstrap`` learns from Claude Code and Codex logs before serving or
while idle. CPU processes on a tiny model, the store at half residency."""
from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from sparkpack.calibrate.trace import read_trace
from sparkpack.formats.profile import Profile
from tests.serve_proc import ServerProcess
from tests.commands import calibrate_in_process
from tests.paths import CLAUDE, CODEX, SHARED_CORPORA

pytestmark = pytest.mark.slow  # every test starts real servers (spark-run --serve processes)

STORE = ["--hot-fraction", "0.5", "--cache-slots", "2"]


@pytest.fixture
def model(synth_model, tmp_path) -> Path:
    """A private copy of a tiny model: its profile is written beside it."""
    path = tmp_path / "m.gguf"
    shutil.copy(synth_model("qwen3moe", "Q4_K_M", skew="reference"), path)
    return path


@pytest.fixture
def home(tmp_path) -> Path:
    """A HOME with one Claude Code and one Codex session where the tools keep them."""
    home = tmp_path / "home"
    for src, dst in ((next(CLAUDE.glob("*.jsonl")), home / ".claude" / "projects" / "-work-repo"),
                     (next(CODEX.glob("rollout-*.jsonl")), home / ".codex" / "sessions" / "2025" / "10" / "29")):
        dst.mkdir(parents=True)
        shutil.copy(src, dst / src.name)
    return home


def chat(server: ServerProcess, text: str, n: int = 4):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key=server.api_key or "x", max_retries=0, timeout=120)
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}], max_tokens=n,
                                          temperature=0)


def metric(server: ServerProcess, name: str, labels: str = "") -> float:
    text = httpx.get(server.base + "/metrics").text
    m = re.search(rf"^sparkpack_{name}{re.escape(labels)} (\S+)$", text, re.M)
    assert m is not None, f"{name}{labels} not in /metrics"
    return float(m.group(1))


def learned(server: ServerProcess, requests: int) -> None:
    """Wait until the engine has done its work after ``requests`` requests (the response reaches
    the client before that work)."""
    end = time.monotonic() + 60
    while metric(server, "learned_requests_total") < requests:
        assert time.monotonic() < end
        time.sleep(0.05)


def test_the_profile_always_loads_after_kill_9(model, tmp_path):
    """The server rewrites its profile whenever idle (test hooks, ``--profile-save-every 0``)
    and after every request; killed with SIGKILL at arbitrary moments, it leaves the last
    complete profile (never a torn one; none, if killed before its first write, which follows
    the first request) and at most a temporary file, which the next start removes and names.
    What was learned keeps growing across the kills."""
    prof = tmp_path / "m.profile.json"
    rng = np.random.default_rng(0)
    seen, torn, left = 0.0, 0, []
    for i in range(30):  # until two kills landed in a write (where a kill lands is chance)
        server = ServerProcess(model, *STORE, "--profile-save-every", "0", hooks=tmp_path / "hooks", api_key=None)
        if left:  # the last kill interrupted a write: its temporary file is gone, and said so
            assert not any(t.exists() for t in left)
            assert any("removed .m.profile.json.sparkpack-tmp-" in line for line in server.stderr), "".join(server.stderr)
        chat(server, f"request {i}: what changed in the repository since yesterday?")
        time.sleep(float(rng.uniform(0.05, 0.4)))  # meanwhile the engine rewrites the profile
        assert server.stop(signal.SIGKILL) == -signal.SIGKILL
        left = list(tmp_path.glob(".m.profile.json.sparkpack-tmp-*"))
        torn += bool(left)
        if not prof.exists() and not seen:
            continue  # killed before the first write after the first request: nothing torn, nothing kept yet
        p = Profile.load(prof)  # always a whole profile of this model
        assert p.decay is not None and p.decay.tokens_seen >= seen
        seen = p.decay.tokens_seen
        if torn >= 2 and i >= 4:
            break
    assert torn >= 1, "no kill landed in the middle of a write"
    assert seen > 0


def test_trace_metrics_and_restart(model, tmp_path, home):
    """``--trace-out`` while serving: every computed token's routing, by side, exactly the counts
    the placement learned (a half-life long enough to keep them whole); ``repack calibrate
    --eval`` judges the learned profile on it. /metrics carries the learning; SIGTERM writes the
    profile, and the next start begins where it stopped. Agent logs in HOME: one hint line."""
    trace = tmp_path / "live.trace"
    server = ServerProcess(model, *STORE, "--trace-out", str(trace), "--half-life", "1e15", env={"HOME": str(home)})
    try:
        hint = [line for line in server.stderr if "--bootstrap auto" in line]
        assert len(hint) == 1 and "1 Claude Code and 1 Codex sessions" in hint[0]
        for i in range(3):
            chat(server, f"Fix the failing test number {i} in utils.py, then run the whole suite again.", 6)
        learned(server, 3)
        assert metric(server, "learned_tokens_total", '{side="prompt"}') > 0
        assert metric(server, "learned_tokens_total", '{side="generated"}') > 0
        hot = metric(server, "learned_routings_total", '{placement="hot",side="prompt"}')
        cold = metric(server, "learned_routings_total", '{placement="cold",side="prompt"}')
        assert hot > 0 and cold > 0 and 0 <= metric(server, "cold_hit_rate", '{side="generated"}') < 1
        assert metric(server, "replacements_total") >= 1 and metric(server, "replaced_experts_total") >= 1
        assert metric(server, "replaced_bytes_total") > 0 and metric(server, "profile_write_failures_total") == 0
        assert metric(server, "replacement_seconds_total") > 0
        assert metric(server, "expert_routing_share", '{served="missed"}') >= 0
        assert metric(server, "expert_host_bytes") > 0  # the cold half of the experts, in host memory
    finally:
        assert server.stop() == 0
    err = "".join(server.stderr)
    assert re.search(r"trace .*live\.trace \(\d+ tokens\)", err) and "learned from" in err, err
    prof = Profile.load(tmp_path / "m.profile.json")
    tr = read_trace(trace)
    assert tr.n_tokens == round(sum(prof.tokens.values())) and tr.generated.any() and not tr.generated.all()
    for side, mask in (("prompt", ~tr.generated), ("generated", tr.generated)):
        counts = np.zeros_like(prof.counts[side])
        for j, il in enumerate(tr.moe_layers):
            counts[il] = np.bincount(np.asarray(tr.ids[mask, j]).ravel(), minlength=tr.n_expert)
        assert np.allclose(counts, prof.counts[side]), side
    out = calibrate_in_process(model, "--eval", trace, "--profile", tmp_path / "m.profile.json")
    assert "uniform" in out and "profile" in out

    again = ServerProcess(model, *STORE, "--half-life", "1e15")
    try:
        said = "".join(again.stderr)
        assert f"({prof.decay.tokens_seen:.0f} tokens learned so far)" in said and "profile m.profile.json" in said
    finally:
        assert again.stop() == 0


def test_bootstrap_before_serving_and_in_the_background(model, tmp_path, home):
    """``--bootstrap auto`` replays the agent logs through the serving session before /health
    says ready and says what it used; a later start with it replays only sessions newer than
    the profile (none). ``--bootstrap-background`` (a real corpus folder when present) serves
    at once and replays while idle."""
    env = {"HOME": str(home)}
    server = ServerProcess(model, *STORE, "--bootstrap", "auto", env=env)
    try:
        err = "".join(server.stderr)
        m = re.search(r"bootstrap: learned from 2 sessions, (\d+) tokens", err)
        assert m is not None and int(m.group(1)) > 0, err
        assert metric(server, "learned_tokens_total", '{side="generated"}') > 0  # assistant turns, as generated
        chat(server, "hello")
    finally:
        assert server.stop() == 0
    tokens = Profile.load(tmp_path / "m.profile.json").decay.tokens_seen
    assert tokens >= int(m.group(1))
    again = ServerProcess(model, *STORE, "--bootstrap", "auto", env=env)
    try:
        assert "nothing to replay from auto (no coding agent sessions newer than the profile)" in "".join(again.stderr)
    finally:
        assert again.stop() == 0

    corpus = SHARED_CORPORA / "lucebox-hub" / "bench_agent.jsonl"
    source = corpus if corpus.is_file() else next(CODEX.glob("*.jsonl"))
    other = tmp_path / "other" / "m.gguf"
    other.parent.mkdir()
    shutil.copy(model, other)
    background = ServerProcess(other, *STORE, "--bootstrap", str(source), "--bootstrap-background",
                               "--half-life", "400", env=env)
    try:
        assert chat(background, "first").choices  # served while the replay waits for idle time
        end = time.monotonic() + 120
        while not any("bootstrap: learned from" in line for line in background.stderr):
            assert time.monotonic() < end, "".join(background.stderr)
            time.sleep(0.2)
        line = next(line for line in background.stderr if "bootstrap: learned from" in line)
        assert re.search(r"learned from \d+ sessions, \d+ tokens", line)
        if corpus.is_file():  # 5 half-lives of 400 tokens: the newest conversations only
            assert "older sessions or files left out" in line
    finally:
        assert background.stop() == 0
    assert os.path.exists(other.with_name("m.profile.json"))
