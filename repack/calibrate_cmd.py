"""``repack calibrate``: replay a corpus through the model, count expert routings into a profile;
with ``--eval``, measure how often placements from a profile would miss on held-out traffic."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.leftovers import clean_leftovers
from sparkpack.formats.profile import default_profile_path

from .outputs import check_output, reported_as

CHECKPOINT_EVERY = 16  # conversations between checkpoints; each costs one small JSON write


def checkpoint_path(profile_path: Path) -> Path:
    return profile_path.with_name(profile_path.name + ".checkpoint.json")


@click.command("calibrate")
@click.argument("model_path", metavar="MODEL", type=click.Path(path_type=Path))
@click.option("--corpus", type=click.Path(path_type=Path), help="File or folder of traffic to replay.")
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Profile to write [MODEL.profile.json].")
@click.option("--max-tokens", type=click.IntRange(min=1), help="Stop after this many tokens.")
@click.option("--ctx", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Longest window replayed at once; longer conversations are split into windows.")
@click.option("--chunk", type=click.IntRange(min=1), default=512, show_default=True, help="Prefill chunk size.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
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
def calibrate_cmd(model_path: Path, corpus: Path | None, output: Path | None, max_tokens: int | None, ctx: int,
                  chunk: int, device: str, resume: bool, merge: bool, force: bool, decay: float,
                  trace_path: Path | None,
                  strict: bool, eval_path: Path | None, profile_path: Path | None, cache_slots: int, as_json: bool,
                  quiet: bool, stop_after: int | None) -> None:
    """Learn which experts your traffic uses: replay CORPUS through MODEL and count routings.

    \b
    repack calibrate model.gguf --corpus logs/            # -> model.profile.json
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
    if eval_path is not None:
        if corpus is not None:
            raise SparkpackError(None, "give either --corpus (calibrate) or --eval (evaluate), not both")
        run_eval(gguf, spec, identity, eval_path, profile_path or default_profile_path(model_path), ctx, chunk,
                 device, cache_slots, as_json, quiet, strict, max_tokens)
        return
    if corpus is None:
        raise SparkpackError(None, "--corpus is required (a file or folder of traffic to replay), or use --eval")
    output = output or default_profile_path(model_path)
    for line in clean_leftovers(output) + clean_leftovers(checkpoint_path(output)):  # a killed run's temporaries
        click.echo(f"repack: {line}", err=True)
    run_calibrate(gguf, spec, identity, corpus, output, max_tokens, ctx, chunk, device, resume, merge, force, decay,
                  trace_path, strict, quiet, stop_after)


# --- calibration -------------------------------------------------------------------------------

def run_calibrate(gguf, spec, identity, corpus: Path, output: Path, max_tokens: int | None, ctx: int, chunk: int,
                  device: str, resume: bool, merge: bool, force: bool, decay: float, trace_path: Path | None,
                  strict: bool, quiet: bool, stop_after: int | None) -> None:
    from sparkpack.formats.profile import Profile

    from sparkpack.calibrate.evaluate import top_share, too_few_tokens
    from sparkpack.calibrate.readers import read_corpus
    from sparkpack.calibrate.replay import GENERATED, PROMPT, Replayer, ReplayState
    from sparkpack.calibrate.trace import TraceWriter

    # everything that can refuse is checked before hours of replay, not after
    base = None
    if merge:
        if not output.exists():
            raise SparkpackError(output, "--merge needs an existing profile here (or drop --merge)")
        base = Profile.load(output)
        base.check_model(identity, spec, output)
    check_output(output, force or merge, "use --merge to add this corpus to it, or --force to replace it")
    if trace_path is not None:
        check_output(trace_path, force or resume)
    convs, read_stats = read_corpus(corpus, strict=strict)
    model, renderer = load_for_replay(gguf, device)
    run_key = {"identity": identity.to_json(), "corpus": str(corpus.resolve()), "ctx": ctx, "chunk": chunk,
               "max_tokens": max_tokens, "trace": str(trace_path.resolve()) if trace_path else None}
    ckpt = checkpoint_path(output)
    shape = (2, spec.n_layer, spec.n_expert)
    state = load_checkpoint(ckpt, run_key, shape) if resume else None
    if resume and state is None:
        click.echo(f"no checkpoint at {ckpt}; starting from the beginning", err=True)
    resumed = state is not None
    state = state or ReplayState(counts=_zeros(shape))
    replayer = Replayer(model, renderer, ctx, chunk, record=trace_path is not None)
    planned, planned_stats = read_corpus(corpus, strict=strict)
    with _counter(quiet) as counting:
        total = replayer.planned_tokens(planned, max_tokens, counting.update)
    if total == 0:
        raise SparkpackError(corpus, f"nothing to replay ({planned_stats.summary()})")
    if (few := too_few_tokens(total, spec.n_expert, spec.n_expert_used)) is not None:
        click.echo(f"warning: {corpus}: {few}", err=True)
    trace_meta = {"arch": spec.arch, "identity": identity.to_json()}
    trace = None
    if trace_path is not None:
        args = (trace_path, spec.moe_layers, spec.n_expert_used, spec.n_expert, trace_meta)
        trace = TraceWriter.reopen(*args, n_tokens=state.trace_tokens) if resumed else TraceWriter(*args)

    bar = _progress(quiet, total, state.total_tokens)
    counted = [0]
    last_good = [state.snapshot()]  # Ctrl-C may land mid-update; the checkpoint takes this snapshot

    def after_each(st: ReplayState) -> None:
        counted[0] += 1
        last_good[0] = st.snapshot()
        bar.set_postfix_str(f"{st.conversations + st.documents} conv", refresh=False)
        if counted[0] % CHECKPOINT_EVERY == 0 or (stop_after is not None and counted[0] >= stop_after):
            save_checkpoint(ckpt, run_key, last_good[0], trace)
        if stop_after is not None and counted[0] >= stop_after:
            raise _Stop()

    started, tokens_before = time.perf_counter(), state.total_tokens
    try:
        replayer.replay(convs, state, max_tokens=max_tokens, trace=trace, skip=list(state.done),
                        after_each=after_each, on_tokens=bar.update)
    except _Stop:
        bar.close()
        if trace is not None:
            trace.abandon()
        click.echo(f"stopped after {counted[0]} conversations; checkpoint {ckpt}; rerun with --resume", err=True)
        return
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (formats.errors.Terminated)
        bar.close()
        save_checkpoint(ckpt, run_key, last_good[0], trace)
        if trace is not None:
            trace.abandon()
        stop.add_note(f"checkpoint saved to {ckpt}; rerun with --resume to continue")
        raise
    bar.close()
    seconds = time.perf_counter() - started
    prof = Profile.new(identity, spec)
    prof.add(prompt=state.counts[PROMPT], generated=state.counts[GENERATED],
             prompt_tokens=state.tokens[PROMPT], generated_tokens=state.tokens[GENERATED])
    if base is not None:
        prof = base.merge(prof, decay)
    with reported_as(output):
        prof.save(output)
    if trace is not None:
        trace.close()
    ckpt.unlink(missing_ok=True)

    both = state.counts.sum(0)
    click.echo(f"corpus: {read_stats.summary()}")
    click.echo(f"replayed {state.conversations} conversations and {state.documents} documents: "
               f"{state.tokens[PROMPT]} prompt-side + {state.tokens[GENERATED]} generated-side tokens"
               + (f" ({state.split_windows} longer than --ctx {ctx}, split into windows)" if state.split_windows
                  else "")
               + (" (stopped at --max-tokens)" if state.truncated else ""))
    replayed = state.total_tokens - tokens_before
    click.echo(f"replay: {replayed} tokens in {seconds:.1f} s ({replayed / max(seconds, 1e-9):.0f} tokens/s)")
    if state.skipped:
        click.echo("not replayed: " + ", ".join(f"{n} {why}" for why, n in sorted(state.skipped.items())))
    click.echo(f"top 60% of experts take {top_share(both, spec.moe_layers):.1%} of routings "
               f"(uniform routing would give 60%)")
    click.echo(f"profile: {output}" + (f" (merged, decay {decay})" if base is not None else ""))
    if trace_path is not None:
        click.echo(f"trace: {trace_path} ({state.trace_tokens} tokens)")


class _Stop(Exception):
    pass


def _zeros(shape: tuple[int, int, int]):
    import numpy as np

    return np.zeros(shape, dtype=np.int64)


def load_for_replay(gguf, device: str):
    """The runtime model on the chosen device and a renderer with the model's template/tokenizer."""
    import torch

    from sparkpack.calibrate.render import ChatRenderer
    from sparkpack.runtime.chat_template import ChatTemplate
    from sparkpack.runtime.models import load_model
    from sparkpack.runtime.tokenizer import GGUFTokenizer

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SparkpackError(None, "--device cuda: no CUDA device is available")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cuda":
        # The tiered store keeps experts quantized on the GPU (all of them when they fit in 90% of
        # free memory, else a hot set plus the pinned host tier): the fused kernels run decode and
        # prefill expands one expert at a time, so nothing thrashes a bf16 cache.
        from sparkpack.runtime.residency import StoreOptions

        free = torch.cuda.mem_get_info()[0]
        model = load_model(gguf, device=device, dtype=dtype, store=StoreOptions(vram=int(free * 0.9)))
    else:
        # Experts are dequantized on first use and kept up to half the available memory; beyond
        # that the least recently used are dropped and re-read from the GGUF.
        cache = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
        model = load_model(gguf, device=device, dtype=dtype, expert_cache_bytes=cache)
    tok = GGUFTokenizer.from_metadata(gguf)
    template = gguf.get("tokenizer.chat_template")
    renderer = ChatRenderer(tok, ChatTemplate.from_tokenizer(template, tok).render if template else None)
    return model, renderer


def _progress(quiet: bool, total: int | None, initial: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="tok", unit_scale=True, file=sys.stderr,
                disable=quiet, dynamic_ncols=True, desc="replay")


def _counter(quiet: bool):
    """The tokens being counted before replay (no total yet); erased when done."""
    from tqdm import tqdm

    return tqdm(unit="tok", unit_scale=True, file=sys.stderr, disable=quiet, dynamic_ncols=True, leave=False,
                desc="reading corpus")


def save_checkpoint(path: Path, run_key: dict[str, Any], state, trace) -> None:
    """Counts and done conversations, atomically (a second Ctrl-C while the first one's
    checkpoint is written leaves no temp file); the trace is flushed first so the count it
    records is on disk."""
    from sparkpack.formats.atomic_file import write_atomic

    if trace is not None:
        trace.flush()
    write_atomic(path, json.dumps({"run": run_key, "state": state.to_json()}))


def load_checkpoint(path: Path, run_key: dict[str, Any], shape: tuple[int, int, int]):
    from sparkpack.calibrate.replay import ReplayState

    if not path.exists():
        return None
    try:
        d = json.loads(path.read_text())
        if d["run"] != run_key:
            raise SparkpackError(path, "checkpoint is from a different run (model, corpus, --ctx, --chunk, "
                                       "--max-tokens or --trace differ); delete it or run without --resume")
        return ReplayState.from_json(d["state"], shape)
    except SparkpackError:
        raise
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise SparkpackError(path, "checkpoint is corrupt; delete it or run without --resume") from None


# --- evaluation --------------------------------------------------------------------------------

def run_eval(gguf, spec, identity, eval_path: Path, profile_path: Path, ctx: int, chunk: int, device: str,
             slots: int, as_json: bool, quiet: bool, strict: bool, max_tokens: int | None) -> None:
    import numpy as np

    from sparkpack.calibrate.evaluate import evaluate, format_table, rows_json
    from sparkpack.calibrate.trace import is_trace, read_trace
    from sparkpack.formats.experts import expert_nbytes
    from sparkpack.formats.profile import Profile

    if not profile_path.exists():
        raise SparkpackError(profile_path, "no such profile (give --profile, or calibrate first)")
    prof = Profile.load(profile_path)
    prof.check_model(identity, spec, profile_path)
    if not eval_path.exists():
        raise SparkpackError(eval_path, "no such file or folder")
    if eval_path.is_file() and is_trace(eval_path):
        tr = read_trace(eval_path)
        if tr.meta.get("identity") != identity.to_json():
            raise SparkpackError(eval_path, "trace was recorded on another model")
        if tr.moe_layers != spec.moe_layers or tr.n_expert != spec.n_expert:
            raise SparkpackError(eval_path, "trace does not match the model's MoE layers or expert count")
        ids, generated = tr.ids, tr.generated
        if max_tokens is not None:
            ids, generated = ids[:max_tokens], generated[:max_tokens]
        source = "trace"
    else:
        ids, generated = replay_to_memory(gguf, spec, eval_path, ctx, chunk, device, quiet, strict, max_tokens)
        source = "corpus"
    if len(ids) == 0:
        raise SparkpackError(eval_path, "no tokens to evaluate on")
    nbytes = {il: expert_nbytes(gguf, spec, il) for il in spec.moe_layers}
    rows = evaluate(np.asarray(ids), generated, spec.n_expert, spec.moe_layers, prof.counts, prof.tokens, nbytes,
                    slots=slots)
    if as_json:
        click.echo(json.dumps({"model": str(gguf.path), "profile": str(profile_path), "heldout": str(eval_path),
                               "source": source, "tokens": int(len(ids)),
                               "generated_tokens": int(np.asarray(generated).sum()), "cache_slots": slots,
                               "rows": rows_json(rows)}, indent=2))
    else:
        click.echo(format_table(rows, slots, len(ids)))
        click.echo("uniform: expectation over arbitrary sets of the same size per layer"
                   + (" (with LRU: one set drawn with a fixed seed)" if slots else "")
                   + "; profile: the hot set repack split picks for the same bytes")


def replay_to_memory(gguf, spec, corpus: Path, ctx: int, chunk: int, device: str, quiet: bool, strict: bool,
                     max_tokens: int | None):
    import numpy as np

    from sparkpack.calibrate.readers import read_corpus
    from sparkpack.calibrate.replay import Replayer, ReplayState

    convs, _ = read_corpus(corpus, strict=strict)
    model, renderer = load_for_replay(gguf, device)
    sink = _MemorySink()
    replayer = Replayer(model, renderer, ctx, chunk, record=True)
    with _counter(quiet) as counting:
        total = replayer.planned_tokens(read_corpus(corpus, strict=strict)[0], max_tokens, counting.update)
    with _progress(quiet, total, 0) as bar:
        replayer.replay(convs, ReplayState(counts=_zeros((2, spec.n_layer, spec.n_expert))), max_tokens=max_tokens,
                        trace=sink, on_tokens=bar.update)
    if not sink.ids:
        return np.zeros((0, len(spec.moe_layers), spec.n_expert_used), np.int64), np.zeros(0, bool)
    return np.concatenate(sink.ids), np.concatenate(sink.gen)


class _MemorySink:
    def __init__(self) -> None:
        self.ids: list = []
        self.gen: list = []

    def append(self, ids, generated) -> None:
        self.ids.append(ids)
        self.gen.append(generated)
