"""``repack calibrate``: replay a corpus through the model, count expert routings into a profile;
with ``--eval``, measure how often placements from a profile would miss on held-out traffic.

This command is the composition root of the calibrate stage: it parses options, checks where it
will write, connects the stage (``sparkpack.calibrate``: corpus, replay, checkpoints, traces,
evaluation; torch-free) to the model (``sparkpack.runtime.calibration``: the router that runs
token ids on the runtime's prefill path) and prints. That import of the runtime is the only one,
and it is here: calibrate/ never imports the runtime, and the runtime never imports repack.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.memory import PREFILL_CHUNK
from sparkpack.formats.profile import default_profile_path
from sparkpack.formats.units import SizeParam

from .outputs import check_output, reported_as

if TYPE_CHECKING:
    from sparkpack.calibrate.job import CalibrationJob
    from sparkpack.runtime.options import RunOptions
    from sparkpack.formats.archs import ModelSpec
    from sparkpack.formats.gguf_file import GGUFModel
    from sparkpack.formats.profile import ModelIdentity
    from sparkpack.runtime.calibration import ModelRouter


@click.command("calibrate")
@click.argument("model_path", metavar="MODEL", type=click.Path(path_type=Path))
@click.option("--corpus", type=click.Path(path_type=Path), help="File or folder of traffic to replay.")
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Profile to write [MODEL.profile.json].")
@click.option("--max-tokens", type=click.IntRange(min=1), help="Stop after this many tokens.")
@click.option("--ctx", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Longest window replayed at once; longer conversations are split into windows.")
@click.option("--prefill-chunk", "--chunk", "prefill_chunk", type=click.IntRange(min=1), default=PREFILL_CHUNK,
              show_default=True, help="Tokens per forward call, as spark-run's --prefill-chunk.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--vram", type=SizeParam(), help="GPU memory budget: replay through the expert store on a GPU that "
              "cannot hold the model (hot experts sized to fit, the rest read from RAM).")
@click.option("--host-ram", type=SizeParam(), help="Pinned host memory for cold experts [80% of available]; "
              "less than they need reads them from disk.")
@click.option("--hot-fraction", type=click.FloatRange(0, 1), help="Share of expert bytes kept on the GPU.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run from its checkpoint.")
@click.option("--merge", is_flag=True, help="Merge into the existing profile at the output path.")
@click.option("--force", is_flag=True, help="Replace an existing profile (and --trace file) instead of refusing.")
@click.option("--decay", type=click.FloatRange(0.0, 1.0), default=0.5, show_default=True,
              help="With --merge: weight of the existing profile's counts.")
@click.option("--trace", "trace_path", type=click.Path(path_type=Path),
              help="Also save every token's expert ids (for --eval).")
@click.option("--strict", is_flag=True, help="Malformed corpus records are errors, not skips.")
@click.option("--eval", "eval_path", type=click.Path(path_type=Path),
              help="Evaluate placements on this held-out corpus or trace instead of calibrating.")
@click.option("--profile", "profile_path", type=click.Path(path_type=Path), help="With --eval: the profile to judge.")
@click.option("--cache-slots", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --eval: cache slots per layer in front of the cold tier (LRU, LFU and the store's frequency-aware policy).")
@click.option("--json", "as_json", is_flag=True, help="With --eval: print JSON instead of a table.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--stop-after", type=click.IntRange(min=1), hidden=True,
              help="Stop as if interrupted after N conversations (tests --resume).")
def calibrate_cmd(model_path: Path, **flags: Any) -> None:
    """Learn which experts your traffic uses: replay CORPUS through MODEL and count routings.

    \b
    repack calibrate model.gguf --corpus logs/            # -> model.profile.json
    repack calibrate model.gguf --corpus logs/ --vram 14GiB   # on a GPU that cannot hold it
    repack calibrate model.gguf --corpus new/ --merge     # add new traffic to it
    repack calibrate model.gguf --corpus held/ --trace held.trace
    repack calibrate model.gguf --eval held.trace --profile model.profile.json --cache-slots 8
    """
    from sparkpack.formats.archs import model_spec
    from sparkpack.formats.gguf_file import GGUFModel
    from sparkpack.formats.profile import model_identity

    gguf = GGUFModel(model_path)
    spec = model_spec(gguf)
    identity = model_identity(gguf)
    opts = calibrate_options(model_path, **flags)

    def router(record: bool) -> "ModelRouter":
        """The model, opened to route (the one place the runtime is reached)."""
        from sparkpack.runtime.calibration import open_router

        r = open_router(opts.router.run_options(opts.model_path), record)
        warm = r.warm_up()
        if warm is not None:
            click.echo(f"warmed up in {warm:.2f} s", err=True)
        return r

    if opts.evaluation is not None:
        run_eval(gguf, spec, identity, opts, lambda: router(True))
        return
    assert opts.job is not None
    run_calibrate(opts, spec, identity, lambda: router(opts.job.trace_path is not None))


@dataclass(frozen=True, kw_only=True)
class RouterOptions:
    """How the model is opened to route windows, in spark-run's flags of those names; translated
    by ``runtime.options.run_options`` when it is opened (an ``--eval`` of a trace never is)."""

    device: str = "auto"
    ctx: int = 4096
    prefill_chunk: int = PREFILL_CHUNK
    vram: int | None = None
    host_ram: int | None = None
    hot_fraction: float | None = None

    def run_options(self, model_path: Path) -> "RunOptions":
        """Learning off: calibration writes its own profile."""
        from sparkpack.runtime.options import run_options

        return run_options(model_path, **asdict(self), no_learn=True)


@dataclass(frozen=True, kw_only=True)
class EvalOptions:
    """``--eval``: the held-out traffic, the profile judged, and how the result is shown."""

    heldout: Path
    profile: Path
    cache_slots: int = 0
    as_json: bool = False
    strict: bool = False
    max_tokens: int | None = None


@dataclass(frozen=True, kw_only=True)
class CalibrateOptions:
    """What ``repack calibrate`` was asked, translated once from its flags (``calibrate_options``):
    the model and how it is opened to route, and either the replay (``job``, calibrate's own) or
    the evaluation."""

    model_path: Path
    router: RouterOptions
    job: CalibrationJob | None = None  # --corpus
    merge: bool = False  # ... into the existing profile, its counts weighted by decay
    decay: float = 0.5
    force: bool = False
    evaluation: EvalOptions | None = None  # --eval
    quiet: bool = False


def calibrate_options(model_path: Path, *, corpus: Path | None = None, output: Path | None = None,
                      max_tokens: int | None = None, ctx: int = 4096, prefill_chunk: int = PREFILL_CHUNK,
                      device: str = "auto", vram: int | None = None, host_ram: int | None = None,
                      hot_fraction: float | None = None, resume: bool = False, merge: bool = False,
                      force: bool = False, decay: float = 0.5, trace_path: Path | None = None, strict: bool = False,
                      eval_path: Path | None = None, profile_path: Path | None = None, cache_slots: int = 0,
                      as_json: bool = False, quiet: bool = False, stop_after: int | None = None) -> CalibrateOptions:
    """The command's flags (as click names them) as one ``CalibrateOptions``."""
    from sparkpack.calibrate.job import CalibrationJob

    if eval_path is not None and corpus is not None:
        raise SparkpackError(None, "give either --corpus (calibrate) or --eval (evaluate), not both")
    if eval_path is None and corpus is None:
        raise SparkpackError(None, "--corpus is required (a file or folder of traffic to replay), or use --eval")
    router = RouterOptions(device=device, ctx=ctx, prefill_chunk=prefill_chunk, vram=vram, host_ram=host_ram,
                           hot_fraction=hot_fraction)
    job = evaluation = None
    if eval_path is not None:
        evaluation = EvalOptions(heldout=eval_path, profile=profile_path or default_profile_path(model_path),
                                 cache_slots=cache_slots, as_json=as_json, strict=strict, max_tokens=max_tokens)
    else:
        job = CalibrationJob(corpus=corpus, output=output or default_profile_path(model_path), ctx=ctx,
                             prefill_chunk=prefill_chunk, max_tokens=max_tokens, trace_path=trace_path, strict=strict,
                             resume=resume, stop_after=stop_after)
    return CalibrateOptions(model_path=model_path, router=router, job=job, evaluation=evaluation, merge=merge, force=force, decay=decay,
                            quiet=quiet)


def run_calibrate(opts: CalibrateOptions, spec: "ModelSpec", identity: "ModelIdentity",
                  connect: Callable[[], "ModelRouter"]) -> None:
    from sparkpack.calibrate.evaluate import top_share
    from sparkpack.calibrate.job import calibrate
    from sparkpack.calibrate.render import ChatRenderer
    from sparkpack.calibrate.replay import GENERATED, PROMPT
    from sparkpack.formats.profile import Profile

    job, merge, force, decay = opts.job, opts.merge, opts.force, opts.decay
    assert job is not None
    # everything that can refuse is checked before hours of replay, not after
    base = None
    if merge:
        if not job.output.exists():
            raise SparkpackError(job.output, "--merge needs an existing profile here (or drop --merge)")
        base = Profile.load(job.output)
        base.check_model(identity, spec, job.output)
    check_output(job.output, force or merge, "use --merge to add this corpus to it, or --force to replace it")
    if job.trace_path is not None:
        check_output(job.trace_path, force or job.resume)
    check_corpus(job)
    router = connect()  # after every check: loading a model takes a while

    def save(prof: Profile) -> None:
        with reported_as(job.output):
            prof.save(job.output)

    done = calibrate(router, ChatRenderer(router.tokenizer, router.render_chat), identity, job, save,
                     _Bars(opts.quiet), lambda line: click.echo(f"warning: {line}", err=True), base, decay)
    state = done.state
    if done.profile is None:
        click.echo(f"stopped after {job.stop_after} conversations; checkpoint {job.checkpoint}; rerun with --resume",
                   err=True)
        return
    click.echo(f"corpus: {done.read.summary()}")
    click.echo(f"replayed {state.conversations} conversations and {state.documents} documents: "
               f"{state.tokens[PROMPT]} prompt-side + {state.tokens[GENERATED]} generated-side tokens"
               + (f" ({state.split_windows} longer than --ctx {job.ctx}, split into windows)" if state.split_windows
                  else "")
               + (" (stopped at --max-tokens)" if state.truncated else ""))
    click.echo(f"replay: {done.replayed_tokens} tokens in {done.seconds:.1f} s "
               f"({done.replayed_tokens / max(done.seconds, 1e-9):.0f} tokens/s)")
    if state.skipped:
        click.echo("not replayed: " + ", ".join(f"{n} {why}" for why, n in sorted(state.skipped.items())))
    click.echo(f"top 60% of experts take {top_share(state.counts.sum(0), spec.moe_layers):.1%} of routings "
               f"(uniform routing would give 60%)")
    click.echo(f"profile: {job.output}" + (f" (merged, decay {decay})" if base is not None else ""))
    if job.trace_path is not None:
        click.echo(f"trace: {job.trace_path} ({state.trace_tokens} tokens)")


def check_corpus(job: "CalibrationJob") -> None:
    """A corpus that is missing or holds no conversation at all is refused before the model is
    loaded (on a GPU that takes a minute), not after; reads only up to its first conversation."""
    from sparkpack.calibrate.readers import read_corpus

    convs, read = read_corpus(job.corpus, strict=job.strict)
    try:
        if next(convs, None) is None:
            raise SparkpackError(job.corpus, f"nothing to replay ({read.summary()})")
    finally:
        convs.close()  # (the file it stopped in)


def run_eval(gguf: "GGUFModel", spec: "ModelSpec", identity: "ModelIdentity", opts: CalibrateOptions,
             connect: Callable[[], "ModelRouter"]) -> None:
    from sparkpack.calibrate.evaluate import evaluate, format_table, rows_json
    from sparkpack.calibrate.job import heldout, heldout_routings, profile_to_judge
    from sparkpack.calibrate.render import ChatRenderer
    from sparkpack.formats.experts import expert_nbytes

    ev = opts.evaluation
    assert ev is not None
    eval_path, profile_path, slots, max_tokens = ev.heldout, ev.profile, ev.cache_slots, ev.max_tokens
    prof = profile_to_judge(profile_path, identity, spec)

    def replay():
        router = connect()
        return heldout_routings(router, ChatRenderer(router.tokenizer, router.render_chat), eval_path,
                                opts.router.ctx, _Bars(opts.quiet), ev.strict, max_tokens)

    held = heldout(eval_path, identity, spec, replay, max_tokens)
    nbytes = {il: expert_nbytes(gguf, spec, il) for il in spec.moe_layers}
    rows = evaluate(held.ids, held.generated, spec.n_expert, spec.moe_layers, prof.counts, prof.tokens, nbytes,
                    slots=slots)
    if ev.as_json:
        click.echo(json.dumps({"model": str(gguf.path), "profile": str(profile_path), "heldout": str(eval_path),
                               "source": held.source, "tokens": int(len(held.ids)),
                               "generated_tokens": int(held.generated.sum()), "cache_slots": slots,
                               "rows": rows_json(rows)}, indent=2))
    else:
        click.echo(format_table(rows, slots, len(held.ids)))
        click.echo("uniform: expectation over arbitrary sets of the same size per layer"
                   + (" (with LRU: one set drawn with a fixed seed)" if slots else "")
                   + "; profile: the hot set repack split picks for the same bytes")


class _Bars:
    """``calibrate.job.Progress`` as tqdm bars on stderr: the tokens found while the corpus is
    rendered (erased when done), then the replay with a total and an ETA."""

    def __init__(self, quiet: bool):
        from tqdm import tqdm

        self.quiet = quiet
        self.bar = tqdm(unit="tok", unit_scale=True, file=sys.stderr, disable=quiet, dynamic_ncols=True, leave=False,
                        desc="reading corpus")

    def counting(self, n: int) -> None:
        self.bar.update(n)

    def start(self, total: int, initial: int) -> None:
        from tqdm import tqdm

        self.bar.close()
        self.bar = tqdm(total=total, initial=initial, unit="tok", unit_scale=True, file=sys.stderr,
                        disable=self.quiet, dynamic_ncols=True, desc="replay")

    def advance(self, n: int) -> None:
        self.bar.update(n)

    def note(self, text: str) -> None:
        self.bar.set_postfix_str(text, refresh=False)

    def close(self) -> None:
        self.bar.close()
