"""A calibration, start to end: corpus -> routing counts -> profile, resumable; and the routings of
held-out traffic that ``--eval`` judges placements on.

``repack calibrate`` builds the pieces (the runtime's router, the renderer), checks its outputs
and prints; what happens between is here, torch-free, driven through the ``Router`` protocol
(``calibrate.replay``) and a ``Progress`` the command line draws.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from sparkpack.formats.archs import ModelSpec
from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.profile import ModelIdentity, Profile

from .checkpoint import CHECKPOINT_EVERY, checkpoint_path, load_checkpoint, save_checkpoint
from .evaluate import too_few_tokens
from .readers import ReadStats, read_corpus
from .render import ChatRenderer
from .replay import GENERATED, PROMPT, Replayer, ReplayState, Router
from .trace import TraceWriter, check_trace_model, is_trace, read_trace, trace_header


class Progress(Protocol):
    """What a long replay tells the user as it goes (the CLI's progress bars)."""

    def counting(self, n: int) -> None:
        """``n`` more tokens found while the corpus is rendered up front."""
        ...

    def start(self, total: int, initial: int) -> None:
        """Replay begins: ``total`` tokens, ``initial`` of them counted by a resumed checkpoint."""
        ...

    def advance(self, n: int) -> None:
        ...

    def note(self, text: str) -> None:
        """A short status shown beside the bar (conversations done)."""
        ...

    def close(self) -> None:
        ...


@dataclass
class CalibrationJob:
    """What ``repack calibrate --corpus`` was asked to do."""

    corpus: Path
    output: Path
    ctx: int
    prefill_chunk: int
    max_tokens: int | None = None
    trace_path: Path | None = None
    strict: bool = False
    resume: bool = False
    stop_after: int | None = None  # stop as if interrupted after this many conversations (tests --resume)

    @property
    def checkpoint(self) -> Path:
        return checkpoint_path(self.output)

    def run_key(self, identity: ModelIdentity) -> dict[str, Any]:
        """What a checkpoint must share with this run to be resumed by it."""
        return {"identity": identity.to_json(), "corpus": str(self.corpus.resolve()), "ctx": self.ctx,
                "chunk": self.prefill_chunk, "max_tokens": self.max_tokens,
                "trace": str(self.trace_path.resolve()) if self.trace_path else None}


@dataclass
class Calibrated:
    """How a calibration went: its final replay state and the profile saved (None when stopped)."""

    state: ReplayState
    read: ReadStats
    replayed_tokens: int  # by this run (a resumed one continues a checkpoint's)
    seconds: float
    profile: Profile | None


class _Stop(Exception):
    pass


def calibrate(router: Router, renderer: ChatRenderer, identity: ModelIdentity, job: CalibrationJob,
              save: Callable[[Profile], None], progress: Progress, warn: Callable[[str], None],
              base: Profile | None = None, decay: float = 0.5) -> Calibrated:
    """Replay ``job.corpus`` through ``router`` and ``save`` the profile of its routings (merged
    into ``base`` with ``decay`` when given). Checkpoints every ``CHECKPOINT_EVERY`` conversations;
    on Ctrl-C (or SIGTERM) one more checkpoint is saved and the interrupt goes on with a note
    saying how to resume."""
    spec = router.spec
    convs, read = read_corpus(job.corpus, strict=job.strict)
    run_key = job.run_key(identity)
    state = load_checkpoint(job.checkpoint, run_key, (2, spec.n_layer, spec.n_expert)) if job.resume else None
    if job.resume and state is None:
        warn(f"no checkpoint at {job.checkpoint}; starting from the beginning")
    resumed = state is not None
    state = state or ReplayState.empty(spec)
    replayer = Replayer(router, renderer, job.ctx)
    planned, planned_read = read_corpus(job.corpus, strict=job.strict)
    total = replayer.planned_tokens(planned, job.max_tokens, progress.counting)
    if total == 0:
        raise SparkpackError(job.corpus, f"nothing to replay ({planned_read.summary()})")
    if (few := too_few_tokens(total, spec.n_expert, spec.n_expert_used)) is not None:
        warn(f"{job.corpus}: {few}")
    trace = None
    if job.trace_path is not None:
        args = (job.trace_path, *trace_header(spec, identity))
        trace = TraceWriter.reopen(*args, n_tokens=state.trace_tokens) if resumed else TraceWriter(*args)

    progress.start(total, state.total_tokens)
    counted = [0]
    last_good = [state.snapshot()]  # Ctrl-C may land mid-update; the checkpoint takes this snapshot

    def after_each(st: ReplayState) -> None:
        counted[0] += 1
        last_good[0] = st.snapshot()
        progress.note(f"{st.conversations + st.documents} conv")
        stop = job.stop_after is not None and counted[0] >= job.stop_after
        if counted[0] % CHECKPOINT_EVERY == 0 or stop:
            save_checkpoint(job.checkpoint, run_key, last_good[0], trace)
        if stop:
            raise _Stop()

    started, tokens_before = time.perf_counter(), state.total_tokens
    try:
        replayer.replay(convs, state, max_tokens=job.max_tokens, trace=trace, skip=list(state.done),
                        after_each=after_each, on_tokens=progress.advance)
    except _Stop:
        progress.close()
        if trace is not None:
            trace.abandon()
        return Calibrated(state, read, state.total_tokens - tokens_before,
                          time.perf_counter() - started, None)
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (formats.errors.Terminated)
        progress.close()
        save_checkpoint(job.checkpoint, run_key, last_good[0], trace)
        if trace is not None:
            trace.abandon()
        stop.add_note(f"checkpoint saved to {job.checkpoint}; rerun with --resume to continue")
        raise
    progress.close()
    seconds = time.perf_counter() - started
    prof = Profile.new(identity, spec)
    prof.add(prompt=state.counts[PROMPT], generated=state.counts[GENERATED],
             prompt_tokens=state.tokens[PROMPT], generated_tokens=state.tokens[GENERATED])
    if base is not None:
        prof = base.merge(prof, decay)
    save(prof)
    if trace is not None:
        trace.close()
    job.checkpoint.unlink(missing_ok=True)
    return Calibrated(state, read, state.total_tokens - tokens_before, seconds, prof)


class _Recorded:
    """A trace sink in memory."""

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self.generated: list[np.ndarray] = []

    def append(self, ids: np.ndarray, generated: np.ndarray) -> None:
        self.ids.append(ids)
        self.generated.append(generated)


@dataclass
class Heldout:
    """Held-out traffic as ``--eval`` judges placements on it: every token's experts ``[T, n_moe,
    k]`` and side ``[T]`` (True: generated), from a trace file or replayed from a corpus."""

    ids: np.ndarray
    generated: np.ndarray
    source: str  # "trace" | "corpus"


def heldout(path: Path, identity: ModelIdentity, spec: ModelSpec, replay: Callable[[], tuple[np.ndarray, np.ndarray]],
            max_tokens: int | None = None) -> Heldout:
    """``path`` as held-out traffic: a routing trace (recorded on this model) read as it is, any
    other file or folder a corpus that ``replay`` routes (``heldout_routings``)."""
    if not path.exists():
        raise SparkpackError(path, "no such file or folder")
    if path.is_file() and is_trace(path):
        tr = read_trace(path)
        check_trace_model(tr, spec, identity, path)
        out = Heldout(tr.ids[:max_tokens], tr.generated[:max_tokens], "trace")
    else:
        out = Heldout(*replay(), "corpus")
    if len(out.ids) == 0:
        raise SparkpackError(path, "no tokens to evaluate on")
    return out


def heldout_routings(router: Router, renderer: ChatRenderer, corpus: Path, ctx: int, progress: Progress,
                     strict: bool = False, max_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Every token's experts ``[T, n_moe, k]`` and side ``[T]`` (True: generated) of a held-out
    corpus, replayed as calibration replays (``router`` must record)."""
    spec = router.spec
    replayer = Replayer(router, renderer, ctx)
    progress.start(replayer.planned_tokens(read_corpus(corpus, strict=strict)[0], max_tokens, progress.counting), 0)
    sink = _Recorded()
    try:
        replayer.replay(read_corpus(corpus, strict=strict)[0], ReplayState.empty(spec), max_tokens=max_tokens,
                        trace=sink, on_tokens=progress.advance)
    finally:
        progress.close()
    if not sink.ids:
        return np.zeros((0, len(spec.moe_layers), spec.n_expert_used), np.int64), np.zeros(0, bool)
    return np.concatenate(sink.ids), np.concatenate(sink.generated)


def profile_to_judge(path: Path, identity: ModelIdentity, spec: ModelSpec) -> Profile:
    """The profile ``--eval`` judges: it must exist and be this model's."""
    if not path.exists():
        raise SparkpackError(path, "no such profile (give --profile, or calibrate first)")
    prof = Profile.load(path)
    prof.check_model(identity, spec, path)
    return prof
