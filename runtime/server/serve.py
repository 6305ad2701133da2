"""``spark-run MODEL --serve``: bind, load the model while answering /health with 503, serve.

The model's index is read first (a bad file is refused in one line before anything else is
said), then the socket is bound (``--port 0`` picks a free port, which is printed), so clients
and tests can wait on /health while the model loads in a thread. Once loaded, the base URLs and
client settings are printed to stdout. Ctrl-C or SIGTERM cancels the running and queued requests
(their streams end within a token), stops the engine thread, writes the learned profile, frees
the GPU and returns (exit 0).

With the expert store the server learns its placement as it serves (``runtime.learning``): the
engine thread saves the profile and moves experts between requests, and a ``--bootstrap`` replay
runs before serving or in idle time (``runtime.server.bootstrap``).

This module wires; what the server says while it starts and stops is worded in
``runtime.run_report.ServerReport``, which it is handed (the CLI's prints to the terminal).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkpack.formats.errors import SparkpackError

from ..options import LearningFlags, RunOptions, ServeOptions, open_model, open_session
from ..run_report import ServerReport
from .client_settings import client_settings
from .engine import Engine, Job, own_sampler
from .generation import Served

log = logging.getLogger("sparkpack.server")


@dataclass(frozen=True, kw_only=True)
class ServeHooks:
    """What a test, or bench's check of the real agents, injects into a server to force its
    replies (tests/hooked_server.py): no flag of the product sets them. ``sampler`` and
    ``after_prefill`` go to the ``Engine``; ``loaded`` sees the served model before the first
    request."""

    sampler: Callable[[Job], Any] | None = None
    after_prefill: Callable[[Job, Any], None] | None = None
    loaded: Callable[[Served], None] | None = None


def model_name(path: Path) -> str:
    name = path.name
    return name[:-5] if name.endswith(".gguf") else name


def build_served(model, opts: RunOptions, *, hooks: ServeHooks = ServeHooks(),
                 stopping: Callable[[], bool] = lambda: False, report: ServerReport = ServerReport()) -> Served:
    """The engine and everything routes need around a loaded model. ``stopping``: the server is
    shutting down (a bootstrap before serving stops early); ``report`` says what was set up."""
    from ..chat_template import ChatTemplate
    from ..learning import start_learning
    from ..routing_trace import attach_trace
    from ..tokenizer import GGUFTokenizer
    from .metrics import ServerMetrics
    from .output import tool_syntax_for

    tok = GGUFTokenizer.from_metadata(model.gguf)
    source = model.gguf.get("tokenizer.chat_template")
    template = ChatTemplate.from_tokenizer(source, tok) if source else None
    flags = opts.learning
    trace = attach_trace(model, flags.trace_out) if flags.trace_out is not None else None  # before any capture
    serve = opts.serve if opts.serve is not None else ServeOptions()
    sessions = [open_session(model, opts.session, tok.control_ids, opts.draft) for _ in range(serve.parallel)]
    session = sessions[0]
    if model.device.type == "cuda":  # kernels compiled and graphs captured (each session's) before /health says ready
        report.warmed_up(sum(s.warm_up() for s in sessions))
        report.state_checkpoints(len(sessions), sum(s.checkpoint_bytes for s in sessions))
    learning = (start_learning(model, opts.store.learn, opts.store.generated_weight) if opts.store is not None
                else None)  # (after the warm-up: dummy tokens teach nothing)
    if trace is not None:
        trace.active = True
        report.tracing(trace.path)
    if learning is not None:
        start = model.start_profile
        report.learning(learning.file.path, None if start.profile is None else learning.learner.tokens_seen,
                        os.access(learning.file.path.parent, os.W_OK))
        if start.profile is not None and learning.replace_all():  # a pack's placement moves to the profile's
            report.moved_to_profile(learning.stats.experts_moved)
    metrics = ServerMetrics(model, learning.stats if learning is not None else None, sessions)
    metrics.draft = session.draft
    if learning is not None:
        start_bootstrap(flags, learning, session, tok, template, metrics, stopping, report)
        metrics.forget_store_traffic()  # a bootstrap before serving is no served traffic
    on_job = metrics.observe_job
    if trace is not None:
        def on_job(job, outcome) -> None:  # noqa: F811 - the trace made durable after each request too
            metrics.observe_job(job, outcome)  # (reads the store's counts: a deferred step's ids are written)
            trace.sync()
    engine: Engine
    conversations = open_conversation_cache(session, serve, report)
    metrics.conversations = conversations
    if serve.parallel > 1:
        from .parallel import BatchCollector

        engine = parallel_engine(model, opts, serve, sessions, tok, on_job, learning, conversations, hooks, report)
        metrics.registry.register(BatchCollector(engine))
    else:
        engine = Engine(session, tok.stop_ids, on_job=on_job, between=learning, conversations=conversations,
                        sampler=hooks.sampler or own_sampler, after_prefill=hooks.after_prefill)
    served = Served(name=model_name(opts.model_path), model=model, tokenizer=tok, template=template,
                    syntax=tool_syntax_for(model.spec.arch, source or ""), ctx=opts.session.ctx, defaults=opts.sampling,
                    engine=engine, metrics=metrics, max_tokens=opts.max_tokens, learning=learning, trace=trace)
    if hooks.loaded is not None:
        hooks.loaded(served)
    return served


def parallel_engine(model, opts: RunOptions, serve: ServeOptions, sessions, tok, on_job, learning, conversations,
                    hooks: ServeHooks, report: ServerReport):
    """``--parallel N``: N sessions, decoded together."""
    from sparkpack.formats.memory import sequence_bytes

    from ..options import StoreOptions
    from ..residency import memory_target
    from .parallel import ParallelEngine

    store = opts.store if opts.store is not None else StoreOptions()
    target = memory_target(model.device, model.dtype, model.spec, store, opts.session)
    report.parallel(serve.parallel, opts.session.ctx, *sequence_bytes(model.spec, target), model.device.type == "cuda")
    return ParallelEngine(sessions, tok.stop_ids, on_job=on_job, between=learning, conversations=conversations,
                          sampler=hooks.sampler or own_sampler, after_prefill=hooks.after_prefill,
                          step_tokens=serve.step_tokens)


def open_conversation_cache(session, opts: ServeOptions, report: ServerReport):
    """The conversation cache ``--cache-ram`` and ``--cache-dir`` ask for (None when both are off),
    reported with what it holds."""
    from ..conversation_cache import DEFAULT_CACHE_RAM, ConversationCache
    from ..options import default_cache_ram

    ram = opts.cache_ram if opts.cache_ram is not None else default_cache_ram(DEFAULT_CACHE_RAM)
    if ram == 0 and opts.cache_dir is None:
        report.conversation_cache(0, 0, None, 0, opts.cache_ram is not None)
        return None
    try:
        cache = ConversationCache(session, ram, opts.cache_dir)
    except OSError as e:
        raise SparkpackError(opts.cache_dir, f"cannot use it as --cache-dir: {e.strerror or e}") from None
    report.conversation_cache(ram, cache.reserved_bytes, opts.cache_dir, cache.tier_counts()["disk"][0],
                              opts.cache_ram is not None)
    return cache


def start_bootstrap(flags: LearningFlags, learning, session, tok, template, metrics,
                    stopping: Callable[[], bool], report: ServerReport) -> None:
    """``--bootstrap``: replay past sessions now, or hand the replay to the engine's idle time;
    without it, one line when the coding agents' logs are there to learn from."""
    from sparkpack.calibrate.bootstrap import bootstrap_hint
    from sparkpack.calibrate.render import ChatRenderer

    from .bootstrap import BOOTSTRAP_HALF_LIVES, BootstrapReplay, bootstrap_sources, select

    if flags.bootstrap is None:
        hint = bootstrap_hint()
        if hint is not None:
            report.bootstrap_hint(hint)
        return
    files = bootstrap_sources(flags.bootstrap, learning.file.path)
    renderer = ChatRenderer(tok, template.render if template is not None else None)
    selected = select(files, renderer, int(BOOTSTRAP_HALF_LIVES * learning.learner.half_life_tokens))
    if not selected.rendered:
        report.bootstrap_nothing(flags.bootstrap, flags.bootstrap == "auto")
        return
    replay = BootstrapReplay(session, selected)
    report.bootstrap_replaying(len(selected.rendered), selected.tokens, flags.bootstrap_background)

    def finish() -> None:
        learning.replace_all()
        learning.save()
        report.summary(replay.summary())

    if not flags.bootstrap_background:
        replay.run(stopping)
        finish()
        return

    def in_idle_time(busy: Callable[[], bool]) -> bool:
        more = replay.run(busy)
        metrics.forget_store_traffic()
        if not more:
            learning.background = None
            finish()
        return more

    learning.background = in_idle_time


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SparkpackError(f"{host}:{port}", f"cannot listen there: {e.strerror or e}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def run_server(opts: RunOptions, load: Callable[[], object], on_loaded: Callable[[object], None] | None = None,
               hooks: ServeHooks = ServeHooks(), report: ServerReport = ServerReport()) -> None:
    """Serve until Ctrl-C/SIGTERM. ``load`` opens the model (in a thread, while /health says
    503); a load failure ends the server with that error."""
    import uvicorn

    from .app import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    serve = opts.serve if opts.serve is not None else ServeOptions()
    sock = bind(serve.host, serve.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    base = f"http://{shown}:{port}"
    app = create_app(serve)
    report.loading(opts.model_path, base)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # stop generating now: streams end within a token
            super().handle_exit(sig, frame)
            served = app.state.served
            if served is not None:
                served.engine.cancel_all()

    server = Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10, lifespan="off"))
    failure: list[BaseException] = []

    def loader() -> None:
        try:
            model = load()
            if on_loaded is not None:
                on_loaded(model)
            app.state.served = build_served(model, opts, hooks=hooks, stopping=lambda: server.should_exit,
                                            report=report)
        except BaseException as e:  # reported by the main thread after the server stops
            failure.append(e)
            server.should_exit = True
            return
        report.ready(client_settings(app.state.served.name, base, opts.session.ctx, serve.api_key))

    thread = threading.Thread(target=loader, name="sparkpack-load", daemon=True)
    thread.start()
    # uvicorn re-raises a caught SIGINT/SIGTERM into the previous handler once it has stopped;
    # these make that a no-op, so a stop by signal ends normally (exit 0)
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if thread.is_alive() and opts.learning.bootstrap is not None:
            thread.join(60)  # a bootstrap before serving stops at its next step and is saved
        served, app.state.served = app.state.served, None
        if served is not None:
            served.engine.close()
            finish_learning(served, report)
            device = served.model.device
            del served
            release(device)
    if failure:
        raise failure[0]


def finish_learning(served, report: ServerReport) -> None:
    """At exit: the learned profile written (a second SIGTERM meanwhile is ignored: the write
    is atomic anyway, but it should land) and the trace sealed."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        if served.learning is not None:
            served.learning.close()
            report.summary(served.learning.summary())
        if served.trace is not None:
            report.trace_sealed(served.trace.close(), served.trace.tokens)
    finally:
        signal.signal(signal.SIGTERM, previous)


def release(device) -> None:
    """Give the GPU memory back before the process goes (another server may be waiting for it)."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def serve_from_cli(opts: RunOptions, hooks: ServeHooks = ServeHooks(), report: ServerReport = ServerReport()) -> None:
    """spark-run's --serve branch: the run's sampling options become the requests' defaults, and
    --max-tokens (when given) the output cap of requests that set none."""
    opts.sampling.sampler(0)  # a bad setting is a one-line error now, not a 500 on every request

    from ..run_report import report_residency

    def loaded(model) -> None:
        if model.store is not None:
            report_residency(model)

    check_model_index(opts.model_path)
    run_server(opts, lambda: open_model(opts), loaded, hooks, report)


def check_model_index(path: Path) -> None:
    """Read the model's index (a GGUF's header, tensor map included, or a pack's manifest) and
    its spec before the port is taken: a file every load would refuse is refused in its one line,
    before the server says it is loading. A fraction of a second, against the minutes of a load."""
    from sparkpack.formats.archs import model_spec
    from sparkpack.formats.gguf_file import GGUFModel
    from sparkpack.formats.sparkpack import Pack, is_pack

    if is_pack(path):
        Pack.open(path)
        return
    with GGUFModel(path) as model:
        model_spec(model)
