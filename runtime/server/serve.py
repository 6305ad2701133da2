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
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from sparkpack.formats.errors import SparkpackError

from ..options import LearningFlags, RunOptions, ServeOptions, open_model, open_session
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
                 stopping: Callable[[], bool] = lambda: False) -> Served:
    """The engine and everything routes need around a loaded model. ``stopping``: the server is
    shutting down (a bootstrap before serving stops early)."""
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
    session = open_session(model, opts.session, tok.control_ids, opts.draft)
    if model.device.type == "cuda":  # kernels compiled and graphs captured before /health says ready
        click.echo(f"sparkpack: warmed up in {session.warm_up():.2f} s", err=True)
    learning = (start_learning(model, opts.store.learn, opts.store.generated_weight) if opts.store is not None
                else None)  # (after the warm-up: dummy tokens teach nothing)
    if trace is not None:
        trace.active = True
        click.echo(f"sparkpack: recording every token's routing to {trace.path}", err=True)
    if learning is not None:
        start = model.start_profile
        click.echo(f"sparkpack: learning the placement into {learning.file.path} "
                   + ("(no profile yet: uniform placement)" if start.profile is None else
                      f"({learning.learner.tokens_seen:.0f} tokens learned so far)"), err=True)
        if not os.access(learning.file.path.parent, os.W_OK):
            click.echo(f"warning: cannot write in {learning.file.path.parent}: what is learned is lost at exit "
                       "(--profile PATH learns into a file elsewhere)", err=True)
        if start.profile is not None and learning.replace_all():  # a pack's placement moves to the profile's
            click.echo(f"sparkpack: moved {learning.stats.experts_moved} experts to where the profile says", err=True)
    metrics = ServerMetrics(model, learning.stats if learning is not None else None)
    metrics.draft = session.draft
    if learning is not None:
        start_bootstrap(flags, learning, session, tok, template, metrics, stopping)
        metrics.forget_store_traffic()  # a bootstrap before serving is no served traffic
    on_job = metrics.observe_job
    if trace is not None:
        def on_job(job, outcome) -> None:  # noqa: F811 - the trace made durable after each request too
            metrics.observe_job(job, outcome)  # (reads the store's counts: a deferred step's ids are written)
            trace.sync()
    serve = opts.serve if opts.serve is not None else ServeOptions()
    engine: Engine
    if serve.parallel > 1:
        from .parallel import BatchCollector

        engine = parallel_engine(model, opts, serve, session, tok, on_job, learning, hooks)
        metrics.registry.register(BatchCollector(engine))
    else:
        conversations = open_conversation_cache(session, serve)
        metrics.conversations = conversations
        engine = Engine(session, tok.stop_ids, on_job=on_job, between=learning, conversations=conversations,
                        sampler=hooks.sampler or own_sampler, after_prefill=hooks.after_prefill)
    served = Served(name=model_name(opts.model_path), model=model, tokenizer=tok, template=template,
                    syntax=tool_syntax_for(model.spec.arch, source or ""), ctx=opts.session.ctx, defaults=opts.sampling,
                    engine=engine, metrics=metrics, max_tokens=opts.max_tokens, learning=learning, trace=trace)
    if hooks.loaded is not None:
        hooks.loaded(served)
    return served


def parallel_engine(model, opts: RunOptions, serve: ServeOptions, session, tok, on_job, learning,
                    hooks: ServeHooks):
    """``--parallel N``: N sessions (the warmed-up one and N - 1 more), decoded together."""
    from .parallel import ParallelEngine

    sessions = [session] + [open_session(model, opts.session, tok.control_ids) for _ in range(serve.parallel - 1)]
    click.echo(f"sparkpack: up to {serve.parallel} requests decoded together; the conversation cache is off "
               "(each of them resumes only its own previous sequence)", err=True)
    return ParallelEngine(sessions, tok.stop_ids, on_job=on_job, between=learning,
                          sampler=hooks.sampler or own_sampler, after_prefill=hooks.after_prefill)


def open_conversation_cache(session, opts: ServeOptions):
    """The conversation cache ``--cache-ram`` and ``--cache-dir`` ask for (None when both are off),
    with one line saying what it holds."""
    from ..conversation_cache import DEFAULT_CACHE_RAM, ConversationCache
    from ..options import default_cache_ram

    ram = opts.cache_ram if opts.cache_ram is not None else default_cache_ram(DEFAULT_CACHE_RAM)
    if ram == 0 and opts.cache_dir is None:
        click.echo("sparkpack: conversation cache off: only the live conversation is resumed", err=True)
        return None
    try:
        cache = ConversationCache(session, ram, opts.cache_dir)
    except OSError as e:
        raise SparkpackError(opts.cache_dir, f"cannot use it as --cache-dir: {e.strerror or e}") from None
    where = [f"{ram / 2**30:.2f} GiB of host RAM ({cache.reserved_bytes / 2**30:.2f} GiB taken now)"] if ram else []
    if opts.cache_dir is not None:
        disk = cache.tier_counts()["disk"][0]
        where.append(f"{opts.cache_dir} ({disk} conversation states there)")
    click.echo("sparkpack: conversation cache: " + " and ".join(where)
               + ("" if opts.cache_ram is not None else " (--cache-ram sets it)"), err=True)
    return cache


def start_bootstrap(flags: LearningFlags, learning, session, tok, template, metrics,
                    stopping: Callable[[], bool]) -> None:
    """``--bootstrap``: replay past sessions now, or hand the replay to the engine's idle time;
    without it, one line when the coding agents' logs are there to learn from."""
    from sparkpack.calibrate.bootstrap import bootstrap_hint
    from sparkpack.calibrate.render import ChatRenderer

    from .bootstrap import BOOTSTRAP_HALF_LIVES, BootstrapReplay, bootstrap_sources, select

    if flags.bootstrap is None:
        hint = bootstrap_hint()
        if hint is not None:
            click.echo(f"sparkpack: {hint}", err=True)
        return
    files = bootstrap_sources(flags.bootstrap, learning.file.path)
    renderer = ChatRenderer(tok, template.render if template is not None else None)
    selected = select(files, renderer, int(BOOTSTRAP_HALF_LIVES * learning.learner.half_life_tokens))
    if not selected.rendered:
        click.echo(f"sparkpack: bootstrap: nothing to replay from {flags.bootstrap}"
                   + (" (no coding agent sessions newer than the profile)" if flags.bootstrap == "auto" else ""), err=True)
        return
    replay = BootstrapReplay(session, selected)
    click.echo(f"sparkpack: bootstrap: replaying {len(selected.rendered)} conversations ({selected.tokens} tokens)"
               + (" while idle" if flags.bootstrap_background else " before serving"), err=True)

    def finish() -> None:
        learning.replace_all()
        learning.save()
        click.echo(f"sparkpack: {replay.summary()}", err=True)

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
               hooks: ServeHooks = ServeHooks()) -> None:
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
    click.echo(f"sparkpack: loading {opts.model_path} (listening on {base}, /health answers 503 until ready)", err=True)

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
            app.state.served = build_served(model, opts, hooks=hooks, stopping=lambda: server.should_exit)
        except BaseException as e:  # reported by the main thread after the server stops
            failure.append(e)
            server.should_exit = True
            return
        click.echo(client_settings(app.state.served.name, base, opts.session.ctx, serve.api_key))
        sys.stdout.flush()

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
            finish_learning(served)
            device = served.model.device
            del served
            release(device)
    if failure:
        raise failure[0]


def finish_learning(served) -> None:
    """At exit: the learned profile written (a second SIGTERM meanwhile is ignored: the write
    is atomic anyway, but it should land) and the trace sealed."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        if served.learning is not None:
            served.learning.close()
            click.echo(f"sparkpack: {served.learning.summary()}", err=True)
        if served.trace is not None:
            click.echo(f"sparkpack: trace {served.trace.close()} ({served.trace.tokens} tokens)", err=True)
    finally:
        signal.signal(signal.SIGTERM, previous)


def release(device) -> None:
    """Give the GPU memory back before the process goes (another server may be waiting for it)."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def serve_from_cli(opts: RunOptions, hooks: ServeHooks = ServeHooks()) -> None:
    """spark-run's --serve branch: the run's sampling options become the requests' defaults, and
    --max-tokens (when given) the output cap of requests that set none."""
    opts.sampling.sampler(0)  # a bad setting is a one-line error now, not a 500 on every request

    from ..run_report import report_residency

    def loaded(model) -> None:
        if model.store is not None:
            report_residency(model)

    check_model_index(opts.model_path)
    run_server(opts, lambda: open_model(opts), loaded, hooks)


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
