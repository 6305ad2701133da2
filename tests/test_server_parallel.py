"""``--parallel N``: requests decoded together (runtime.server.parallel). 8 concurrent streaming
clients in bounded loops, some closing their stream midway, against a server decoding up to 4
sequences per step: every request completes or is cancelled cleanly, the server stays up, and
every greedy completion equals the one a one-at-a-time server (``--parallel 1``) gives, bit for
bit (each row of a batched step is its sequence's own step: tests/test_decode_batch.py)."""
from __future__ import annotations

import os
import re
import signal
import threading

import httpx
import openai
import pytest

from tests.marks import quick_first
from tests.procs import SPARK_RUN, error_lines, run
from tests.serve_proc import API_KEY, ServerProcess, streaming_clients

CLIENTS = 8
REQUESTS = 2  # per client
MAX_TOKENS = 12
SYSTEM = "You are a careful assistant. Answer in one short sentence."
QUESTIONS = ["What is a mixture of experts?", "Why is the sky blue?", "Name a prime number.",
             "What does a compiler do?", "How far is the moon?"]


def request(q: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[q]}]


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen35moe", "laguna"])
def test_busy_parallel_server_gives_the_serial_completions(synth_model, arch):
    path = synth_model(arch)
    serial_server = ServerProcess(path, "--ctx", "1024", "--prefill-chunk", "16", "--parallel", "1")
    try:
        serial = {q: client_of(serial_server).chat.completions.create(model="x", messages=request(q),
                                                                      max_tokens=MAX_TOKENS).choices[0].message.content
                  for q in range(len(QUESTIONS))}
    finally:
        assert serial_server.stop(signal.SIGTERM) == 0
    server = ServerProcess(path, "--ctx", "1024", "--prefill-chunk", "16", "--parallel", "4")
    try:
        client = client_of(server)
        results = streaming_clients(client, CLIENTS, REQUESTS,
                                    lambda i, j: ((i + j) % len(QUESTIONS), request((i + j) % len(QUESTIONS))),
                                    MAX_TOKENS)  # (question, text, cancelled)
        assert httpx.get(server.base + "/health").status_code == 200
        assert len(results) == CLIENTS * REQUESTS
        for q, text, cancelled in results:
            if cancelled:
                assert serial[q].startswith(text)
            else:
                assert text == serial[q], (q, text, serial[q])
        metrics = httpx.get(server.base + "/metrics").text
        counts = {m.group(1): float(m.group(2))
                  for m in re.finditer(r'sparkpack_requests_total\{outcome="(\w+)",route="chat"\} (\S+)', metrics)}
        n_cancelled = sum(c for _, _, c in results)
        assert n_cancelled - 2 <= counts.get("cancelled", 0) <= n_cancelled  # (a stream may end first)
        assert sum(counts.values()) == len(results)
        steps = {m.group(1): float(m.group(2))
                 for m in re.finditer(r'sparkpack_batch_size_bucket\{le="([^"]+)"\} (\S+)', metrics)}
        assert list(steps) == ["1.0", "2.0", "3.0", "4.0", "+Inf"], steps  # a bucket per size up to --parallel
        assert steps["1.0"] < steps["4.0"] == steps["+Inf"]  # sequences did decode together, 4 at most
        assert "sparkpack_running_sequences 0.0" in metrics and "sparkpack_requests_waiting 0.0" in metrics
        waits = re.search(r"sparkpack_queue_wait_seconds_count (\S+)", metrics)
        assert waits and float(waits.group(1)) == len(results)  # every request's time in the queue
    finally:
        assert server.stop(signal.SIGINT) == 0


def test_parallel_needs_serve(synth_model):
    res = run([*SPARK_RUN, str(synth_model("qwen3moe")), "-p", "hi", "--parallel", "2"])
    assert res.returncode == 1 and error_lines(res.stderr) == [
        "spark-run: error: --parallel is the number of requests a server decodes together: use it with --serve"]


def test_the_vram_plan_holds_every_sequence(synth_model, capsys):
    """--parallel N (4 by default with --serve) has the --vram plan hold N KV caches and recurrent
    states at --ctx; a budget that holds one sequence but not N is refused in one line naming
    --parallel, before anything is served."""
    from sparkpack.formats.archs import model_spec
    from sparkpack.formats.errors import SparkpackError
    from sparkpack.formats.gguf_file import GGUFModel
    from sparkpack.formats.memory import kv_cache_bytes, recurrent_state_bytes
    from sparkpack.runtime.models import load_model
    from sparkpack.runtime.options import run_options

    path = synth_model("qwen35moe")
    spec = model_spec(GGUFModel(path))
    assert run_options(path, device="cpu", serve=True).session.sequences == 4
    assert run_options(path, device="cpu", serve=True, parallel=1).session.sequences == 1
    assert run_options(path, device="cpu").session.sequences == 1

    def plan(parallel: int, vram: int):
        opts = run_options(path, device="cpu", serve=True, parallel=parallel, vram=vram, ctx=512, no_learn=True)
        return load_model(path, store=opts.store, session=opts.session).residency

    one, three = plan(1, 2**31), plan(3, 2**31)
    assert one.kv_bytes == kv_cache_bytes(spec, 512, 4, 2048) > 0 and three.kv_bytes == 3 * one.kv_bytes
    assert one.state_bytes == recurrent_state_bytes(spec) > 0 and three.state_bytes == 3 * one.state_bytes
    assert three.expert_budget == one.expert_budget - 2 * (one.kv_bytes + one.state_bytes)
    fits_one = 2**31 - one.expert_budget + 1
    assert plan(1, fits_one).hot_bytes >= 0
    with pytest.raises(SparkpackError) as e:
        plan(3, fits_one)
    assert "for 3 sequences (--parallel 3)" in str(e.value) and "lower --parallel or --ctx" in str(e.value)
    assert "\n" not in str(e.value)
    res = run([*SPARK_RUN, str(path), "--serve", "--port", "0", "--device", "cpu", "--vram", str(fits_one),
               "--ctx", "512", "--parallel", "3", "--no-learn"])
    lines = [ln for ln in error_lines(res.stderr) if not ln.startswith("sparkpack: loading")]
    assert res.returncode == 1 and len(lines) == 1 and "--parallel 3" in lines[0] and "Traceback" not in res.stderr


@pytest.mark.slow
def test_a_short_request_is_answered_during_a_long_one(synth_model, tmp_path):
    """A short request arriving while another streams a long reply gets its whole reply before that
    one ends (one at a time, it would wait for all of it)."""
    server = ServerProcess(synth_model("qwen3moe"), "--ctx", "2048", "--parallel", "2", hooks=tmp_path)
    try:
        client = client_of(server)
        long_text = " ".join(f"word{i}" for i in range(300))
        chunks: list[str] = []
        ended = threading.Event()

        def long_stream() -> None:
            stream = client.chat.completions.create(model="x", messages=request(0), max_tokens=1500, stream=True,
                                                    extra_body={"sparkpack_test_output": long_text})
            for chunk in stream:
                if chunk.choices:
                    chunks.append(chunk.choices[0].delta.content or "")
            ended.set()

        t = threading.Thread(target=long_stream)
        t.start()
        while not chunks and t.is_alive():
            ended.wait(0.01)
        short = client.chat.completions.create(model="x", messages=request(1), max_tokens=4)
        long_still_running = not ended.is_set()
        t.join(600)
        assert short.choices[0].message.content and long_still_running
        assert "".join(chunks).strip() == long_text
    finally:
        assert server.stop(signal.SIGINT) == 0


class Sink:
    """A job's tokens as the engine thread posts them; ``fail_at``: raise on that token (a sink
    gone wrong)."""

    def __init__(self, fail_at: int | None = None):
        self.tokens: list[int] = []
        self.outcome = None
        self.done = threading.Event()
        self.fail_at = fail_at

    def started(self, outcome) -> None:
        pass

    def token(self, token_id: int) -> bool:
        if len(self.tokens) == self.fail_at:
            raise RuntimeError("the sink broke")
        self.tokens.append(token_id)
        return False

    def end(self, outcome) -> None:
        self.outcome = outcome
        self.done.set()


@pytest.mark.parametrize("arch", quick_first(["qwen35moe", "laguna", "qwen3moe"]))
def test_engine_in_process(synth_model, arch):
    """In process: greedy and seeded-sampling jobs of different prompts through 3 sessions give the
    serial engine's tokens; a job whose sink fails ends in error and the others go on.
    ``SPARKPACK_TEST_DEVICE=cuda``: on the GPU at 60% residency (zero-copy), where the sequences'
    steps replay the batched step's CUDA graphs (``runtime.graph.BatchGraphs``) and the serial
    engine runs one captured step ahead (``Session.decode``)."""
    import torch

    from sparkpack.runtime.generate import Session
    from sparkpack.runtime.graph import capturable
    from sparkpack.runtime.models import StoreOptions, load_model
    from sparkpack.runtime.options import SamplingOptions
    from sparkpack.runtime.server.engine import Engine, Job
    from sparkpack.runtime.server.parallel import ParallelEngine

    cuda = os.environ.get("SPARKPACK_TEST_DEVICE", "cpu") == "cuda"
    model = load_model(synth_model(arch, "Q4_K_M", skew=1.0), device="cuda", dtype=torch.bfloat16,
                       store=StoreOptions(hot_fraction=0.6, cache_slots=4, miss_mode="zerocopy")) if cuda \
        else load_model(synth_model(arch))
    if cuda and not capturable(model):
        pytest.skip("not every expert layer has fused-kernel quant types")
    prompts = [[3, 14, 15, 92, 65], [7, 1], [46, 26, 43, 38, 32, 79, 50], [5, 9, 2], [88]]
    sampling = [SamplingOptions(temperature=0), SamplingOptions(temperature=0.8, seed=5)]

    def run(engine, fail: int | None = None) -> list[Sink]:
        sinks = [Sink(3 if i == fail else None) for i in range(len(prompts))]
        for i, (ids, sink) in enumerate(zip(prompts, sinks)):
            engine.submit(Job(ids, 6 + i, sampling[i % 2], sink))
        for sink in sinks:
            assert sink.done.wait(300)
        engine.close()
        return sinks

    serial = run(Engine(Session(model), frozenset()))
    engine = ParallelEngine([Session(model) for _ in range(3)], frozenset())
    together = run(engine, fail=1)
    assert max(engine.rows.batch_sizes) == 3  # (the jobs queued while the first one's prompt was computed)
    if cuda:
        assert engine.rows.graphs is not None and engine.rows.graphs.captures > 0 and engine.rows.graphs.replays > 0
    else:
        assert engine.rows.graphs is None  # (the CPU's batched step runs eagerly)
    for i, (s, t) in enumerate(zip(serial, together)):
        if i == 1:
            assert t.outcome.finish == "error" and t.tokens == s.tokens[:3]
        else:
            assert (t.tokens, t.outcome.finish) == (s.tokens, s.outcome.finish) == (s.tokens, "length")


@pytest.mark.parametrize("parallel", [False, True])
def test_a_failing_metrics_callback_does_not_stop_the_engine(synth_model, parallel):
    """``on_job`` (the metrics, with the trace file's sync: a full disk raises there) fails on
    every job: each job still ends with its tokens and the engine thread takes the next one (it
    used to die, and the server to hang)."""
    from sparkpack.runtime.generate import Session
    from sparkpack.runtime.models import load_model
    from sparkpack.runtime.options import SamplingOptions
    from sparkpack.runtime.server.engine import Engine, Job
    from sparkpack.runtime.server.parallel import ParallelEngine

    def broken(job, outcome) -> None:
        raise OSError(28, "No space left on device")

    model = load_model(synth_model("qwen3moe"))
    engine = ParallelEngine([Session(model) for _ in range(2)], frozenset(), on_job=broken) if parallel \
        else Engine(Session(model), frozenset(), on_job=broken)
    sinks = [Sink() for _ in range(3)]
    for i, sink in enumerate(sinks):  # one after the other: each after the previous one's failure
        engine.submit(Job([3, 14, 15 + i], 3, SamplingOptions(temperature=0), sink))
        assert sink.done.wait(60), i
    engine.close()
    assert [(s.outcome.finish, len(s.tokens)) for s in sinks] == [("length", 3)] * 3


def test_a_request_failing_before_it_has_a_session_ends_and_a_stopped_engine_refuses(synth_model):
    """The --parallel engine: a failure while it picks a request's session (the conversation
    cache's lookup) ends that request in error and the next one is served (the job was lost and
    its client waited forever); once the engine has stopped, a job is refused with a 503 rather
    than queued for no one."""
    from sparkpack.runtime.conversation_cache import ConversationCache
    from sparkpack.runtime.generate import Session
    from sparkpack.runtime.models import load_model
    from sparkpack.runtime.options import SamplingOptions
    from sparkpack.runtime.server.engine import Job
    from sparkpack.runtime.server.errors import ApiError
    from sparkpack.runtime.server.parallel import ParallelEngine

    class FailingOnce(ConversationCache):
        failed = False

        def keeps(self, ids, session=None) -> int:
            if not self.failed:
                FailingOnce.failed = True
                raise RuntimeError("the index broke")
            return super().keeps(ids, session)

    model = load_model(synth_model("qwen3moe"))
    sessions = [Session(model) for _ in range(2)]
    engine = ParallelEngine(sessions, frozenset(), conversations=FailingOnce(sessions[0], 1 << 26))
    sinks = [Sink() for _ in range(2)]
    for i, sink in enumerate(sinks):
        engine.submit(Job([3, 14, 15 + i], 3, SamplingOptions(temperature=0), sink))
        assert sink.done.wait(60), i
    assert [(s.outcome.finish, len(s.tokens)) for s in sinks] == [("error", 0), ("length", 3)]
    assert "the index broke" in sinks[0].outcome.error and engine.alive
    engine.close()
    assert not engine.alive
    with pytest.raises(ApiError) as refused:
        engine.submit(Job([3, 14], 3, SamplingOptions(temperature=0), Sink()))
    assert refused.value.status == 503


@pytest.mark.parametrize("parallel", [False, True])
def test_the_work_between_requests_follows_their_ends(synth_model, parallel):
    """Both engines: the learner's ``after_request`` runs once after requests end, never at
    start-up (the --parallel engine ran it before any request); idle work runs while none
    waits; the next request's split names the engine's work after the previous one, by step."""
    import time

    from sparkpack.runtime.generate import Session
    from sparkpack.runtime.models import load_model
    from sparkpack.runtime.options import SamplingOptions
    from sparkpack.runtime.server.engine import BetweenRequests, Engine, Job
    from sparkpack.runtime.server.parallel import ParallelEngine

    class Recorder(BetweenRequests):
        def __init__(self) -> None:
            self.calls: list[str] = []

        def after_request(self, busy) -> None:
            self.calls.append("after")

        def idle(self, busy) -> bool:
            self.calls.append("idle")
            return False

    model = load_model(synth_model("qwen3moe"))
    work = Recorder()
    engine = ParallelEngine([Session(model) for _ in range(2)], frozenset(), between=work) if parallel \
        else Engine(Session(model), frozenset(), between=work)
    deadline = time.monotonic() + 30
    while not work.calls and time.monotonic() < deadline:  # the engine's start
        time.sleep(0.01)
    assert work.calls == ["idle"]
    sinks = [Sink() for _ in range(2)]
    for i, sink in enumerate(sinks):  # one after the other
        engine.submit(Job([3, 14, 15 + i], 3, SamplingOptions(temperature=0), sink))
        assert sink.done.wait(60), i
    engine.close()
    assert work.calls.count("after") == 2 and work.calls[1] == "after", work.calls
    after = sinks[1].outcome.split.previous_after
    assert set(after) == {"sink", "cache", "metrics", "between"} and all(s >= 0 for s in after.values()), after


@pytest.mark.parametrize("batched", [False, True], ids=["plain", "batched-ahead"])
@pytest.mark.parametrize("arch", quick_first(["qwen35moe", "laguna", "qwen3moe"]))
def test_steps_launched_before_their_tokens_are_read_change_no_token(synth_model, arch, batched):
    """A --parallel engine launches the step that feeds a token before it reads the token, as the
    serial engine does: a sequence decoding alone its own step, several their batched step
    (``batched``: the batched step as on a GPU, here uncaptured; else each row's plain step). Read
    back first, the host's work on every token left the GPU idle (the one-user case lost a
    quarter of its decode speed to it). The serial engine's tokens: greedy and seeded sampling,
    one request after another, a request joining another midway (which then goes on alone, its
    steps launched ahead again), a stop token read in a batched step; a stop token read after its
    step was launched stays fed, as the serial engine leaves it. On the CPU a captured step's
    stand-in (``EagerStep``) takes a lone sequence's launches."""
    from sparkpack.runtime.generate import Session
    from sparkpack.runtime.graph import BatchGraphs
    from sparkpack.runtime.models import load_model
    from sparkpack.runtime.options import SamplingOptions
    from sparkpack.runtime.server.engine import Engine, Job
    from sparkpack.runtime.server.parallel import ParallelEngine
    from tests.decode_steps import EagerStep

    model = load_model(synth_model(arch))
    greedy, sampled = SamplingOptions(temperature=0), SamplingOptions(temperature=0.8, seed=5)

    class Joiner(Sink):
        """Submits ``job`` to ``engine`` from the engine thread at its ``at``-th token."""

        def __init__(self, at: int, engine, job):
            super().__init__()
            self.at, self.engine, self.job = at, engine, job

        def token(self, token_id: int) -> bool:
            if len(self.tokens) == self.at:
                self.engine.submit(self.job)
            return super().token(token_id)

    def run(engine, first_job: tuple, second_job: tuple, at: int) -> list[Sink]:
        """Four replies one after the other, then ``first_job`` joined by ``second_job`` at its ``at``-th token."""
        sinks = []
        for ids, n, sampling in (([3, 14, 15, 92], 9, greedy), ([7, 1], 8, sampled), ([46, 26, 43], 1, greedy),
                                 ([5, 9, 2, 6, 5], 12, greedy)):
            sinks.append(Sink())
            engine.submit(Job(ids, n, sampling, sinks[-1]))
            assert sinks[-1].done.wait(120)
        second = Sink()
        joiner = Joiner(at, engine, Job(*second_job, second))
        engine.submit(Job(*first_job, joiner))
        assert joiner.done.wait(120) and second.done.wait(120)
        engine.close()
        return [*sinks, joiner, second]

    def parallel(stop_ids: frozenset[int]) -> tuple[ParallelEngine, list[Session]]:
        sessions = [Session(model) for _ in range(2)]
        for s in sessions:
            s.graph = EagerStep(s, room=1 << 20)
        engine = ParallelEngine(sessions, stop_ids)
        if batched:
            engine.rows.graphs = BatchGraphs(model, capture=False)
        return engine, sessions

    # a reply of 16 tokens joined at its 3rd by one of 6: together, then the first alone again
    long, short = ([61, 62, 63], 16, greedy), ([88, 4], 6, sampled)
    serial = run(Engine(Session(model), frozenset()), long, short, at=2)
    engine, sessions = parallel(frozenset())
    together = run(engine, long, short, at=2)
    for s, t in zip(serial, together):
        assert (t.tokens, t.outcome.finish) == (s.tokens, s.outcome.finish) == (s.tokens, "length"), (s.tokens, t.tokens)
    assert engine.rows.batch_sizes[2] > 0 and sum(s.timing.ahead_steps for s in sessions) > 0
    alone_again = next(s for s in sessions if s.fed[:3] == [61, 62, 63])
    assert 3 + 14 in alone_again.graph.positions  # its 15th token's step, after the other reply ended

    # the first reply stops at a token first seen mid-reply, read in a step decoded together with another's
    first = serial[0].tokens
    stop = next(t for i, t in enumerate(first) if i >= 3 and t not in first[:i])
    cut = first.index(stop)
    stopping, other = ([3, 14, 15, 92], 9, greedy), ([5, 9, 2, 6, 5], 12, greedy)
    serial = run(Engine(Session(model), frozenset([stop])), stopping, other, at=0)
    engine, sessions = parallel(frozenset([stop]))
    together = run(engine, stopping, other, at=0)
    for s, t in zip(serial, together):
        assert (t.tokens, t.outcome.finish) == (s.tokens, s.outcome.finish), (s.tokens, t.tokens)
    assert together[4].tokens == first[:cut] and together[4].outcome.finish == "stop"
    fed = next(s for s in sessions if s.fed[:4] == [3, 14, 15, 92]).fed
    # launched before it was read in a batched step ahead; else fed only by the plain step that read it
    assert fed == [3, 14, 15, 92, *first[:cut], stop] if batched else fed == [3, 14, 15, 92, *first[:cut]]


def test_every_step_launched_ahead_is_in_the_batch_histogram(synth_model):
    """/metrics' batch-size histogram counts each step that ran, the one launched ahead with a stop
    token fed included (the batched step launched ahead counted it, a lone sequence's did not)."""
    from sparkpack.runtime.generate import Session
    from sparkpack.runtime.models import load_model
    from sparkpack.runtime.options import SamplingOptions
    from sparkpack.runtime.server.engine import Engine, Job
    from sparkpack.runtime.server.parallel import ParallelEngine
    from tests.decode_steps import EagerStep

    model = load_model(synth_model("qwen3moe"))
    prompt, greedy = [3, 14, 15, 92], SamplingOptions(temperature=0)
    free = Sink()
    serial = Engine(Session(model), frozenset())
    serial.submit(Job(prompt, 9, greedy, free))
    assert free.done.wait(60)
    serial.close()
    stop = free.tokens[4]  # (a token first seen mid-reply stops it there)
    assert stop not in free.tokens[:4]
    session = Session(model)
    session.graph = EagerStep(session, room=1 << 20)
    engine = ParallelEngine([session], frozenset([stop]))
    sink = Sink()
    engine.submit(Job(prompt, 9, greedy, sink))
    assert sink.done.wait(60)
    engine.close()
    assert sink.tokens == free.tokens[:4] and sink.outcome.finish == "stop"
    assert session.timing.ahead_steps == 5 and dict(engine.rows.batch_sizes) == {1: 5}


def test_a_prompt_fed_over_several_steps_with_nothing_decoding_runs_no_empty_step(synth_model, caplog):
    """While a prompt is fed a few calls a step and no sequence decodes, a step has no rows: the
    batched step launched ahead must not run (it failed on an empty batch and logged a traceback
    per call of every long prompt on the GPU). The reply is the serial engine's."""
    import logging

    from sparkpack.runtime.generate import Session
    from sparkpack.runtime.graph import BatchGraphs
    from sparkpack.runtime.models import load_model
    from sparkpack.runtime.options import SamplingOptions
    from sparkpack.runtime.server.engine import Engine, Job
    from sparkpack.runtime.server.parallel import ParallelEngine

    model = load_model(synth_model("qwen3moe"))
    prompt = list(range(40, 70))

    def reply(engine) -> Sink:
        sink = Sink()
        engine.submit(Job(prompt, 5, SamplingOptions(temperature=0), sink))
        assert sink.done.wait(120)
        engine.close()
        return sink

    serial = reply(Engine(Session(model, prefill_chunk=4), frozenset()))
    engine = ParallelEngine([Session(model, prefill_chunk=4) for _ in range(2)], frozenset(), step_tokens=4)
    engine.rows.graphs = BatchGraphs(model, capture=False)
    with caplog.at_level(logging.ERROR, logger="sparkpack.server"):
        together = reply(engine)
    assert together.tokens == serial.tokens and together.outcome.finish == "length"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
